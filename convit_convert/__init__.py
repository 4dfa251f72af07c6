"""cmhsa: exact conversion of convolutional ViTs into self-attention ViTs, and two-phase training.

Importing the package is cheap (no torch): the CLI's --help and `heads` stay fast. The public API
is imported lazily on first use::

    from convit_convert import ConvViT, AttnViT, ViTConfig, convert_state_dict, load_checkpoint
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "ViTConfig": "config",
    "CmhsaError": "errors",
    "ConvViT": "conv_vit",
    "AttnViT": "attn_vit",
    "build_model": "models",
    "model_from_checkpoint": "models",
    "convert_state_dict": "convert",
    "output_projection": "convert",
    "Checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "save_checkpoint": "checkpoint",
    "verify_models": "verify",
    "head_count": "theory",
}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
