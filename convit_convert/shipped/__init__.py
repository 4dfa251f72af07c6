"""Code that travels with what cmhsa exports, run where cmhsa is not installed: each module here
imports nothing of cmhsa's (``modeling_cmhsa``: the model for transformers, copied into every timm
folder; tests/test_hub_code.py holds it to cmhsa's own model and checks its imports)."""
