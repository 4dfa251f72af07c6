"""cmhsa's version (pyproject.toml states the same; tests/test_cli.py holds them equal)."""

__version__ = "0.2.0"
