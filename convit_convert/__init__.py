"""cmhsa: exact conversion of convolutional ViTs into self-attention ViTs, and two-phase training.

Importing the package is cheap (no torch): the CLI's --help and `heads` stay fast. The public API
is imported lazily on first use::

    from convit_convert import ConversionSpec, VisionTransformer, ViTConfig
    from convit_convert import convert_state_dict, load_checkpoint
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import sys
from pathlib import Path
from typing import Any

from .version import __version__

# The facade: names imported from their modules on first use (tests/test_architecture.py reads these
# strings as imports, which puts this package above the api layer)

_EXPORTS = {
    "config": "ViTConfig",
    "options.conversion": "ConversionSpec ConversionPlan",
    "errors": "CmhsaError CheckFailed",
    "model": "VisionTransformer",
    "construct": "convert_state_dict output_projection",
    "verify": "verify_models",
    "theory": "head_count",
    "io.checkpoint": "Checkpoint",
    "api": "load_checkpoint save_checkpoint convert_checkpoint convert_file verify_files export_file",
}
_LAZY = {name: module for module, names in _EXPORTS.items() for name in names.split()}
__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _checkout_train() -> None:
    """A checkout used without installing (``PYTHONPATH=.``, on a machine without pip): import its
    train/ folder as ``convit_convert.train``, as the install's package_dir mapping does."""
    name, folder = f"{__name__}.train", Path(__file__).resolve().parent.parent / "train"
    if (
        name in sys.modules
        or importlib.util.find_spec(name)
        or not (folder.parent / "pyproject.toml").is_file()
    ):
        return
    spec = importlib.util.spec_from_file_location(
        name, folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    sys.modules[name] = module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]


_checkout_train()

# onnxruntime's telemetry (its Linux and macOS builds keep a device id and an event database under
# ~/.cache/Microsoft and upload them) is off unless the user set the variable: onnxruntime reads it
# once, when it is first imported, which cmhsa does only after this package.
os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")


def _stopped_early(signum: int, frame: object) -> None:
    os._exit(128 + signum)  # nothing is written yet: nothing to unwind, and no traceback


def main() -> None:
    """The ``cmhsa`` program. SIGINT or SIGTERM while it starts (its imports, before the CLI's error
    boundary takes the signals over) ends it at once with 130 / 143 and nothing printed."""
    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, _stopped_early)
    from .cli import main as run

    run()
