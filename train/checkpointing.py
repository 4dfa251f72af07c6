"""``checkpoint-last.pt``: everything a stopped run needs to continue exactly where it stopped.

Written atomically (temp file in the run folder, then rename), so a crash while saving keeps the
previous checkpoint. ``--keep N`` also keeps the last N end-of-epoch copies.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from convit_convert.atomic import atomic_write
from convit_convert.errors import CmhsaError

LAST = "checkpoint-last.pt"
_EPOCH = re.compile(r"^checkpoint-epoch(\d+)\.pt$")


def rng_state() -> dict[str, Any]:
    """Every RNG the training loop uses, as tensors and plain values (loadable with weights_only)."""
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(run_dir: Path, state: dict[str, Any], keep: int) -> Path:
    """Write ``checkpoint-last.pt``; at an epoch's end with ``keep`` > 0 also a numbered copy,
    pruning all but the newest ``keep`` copies."""
    path = run_dir / LAST
    atomic_write(path, lambda tmp: torch.save(state, tmp))
    if keep > 0 and state["step"] == 0:
        numbered = run_dir / f"checkpoint-epoch{state['epoch']:04d}.pt"
        atomic_write(numbered, lambda tmp: shutil.copyfile(path, tmp))  # copy the bytes, don't re-pickle
        old = sorted(p for p in run_dir.iterdir() if _EPOCH.match(p.name))
        for p in old[:-keep]:
            p.unlink(missing_ok=True)
    return path


def load(path: Path) -> dict[str, Any]:
    """Read a training checkpoint, with ``weights_only=True`` like every other file we read."""
    if not path.is_file():
        raise CmhsaError("no checkpoint to resume from (run without --resume first)", path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CmhsaError(f"cannot read the training checkpoint ({type(e).__name__}: {e})", path) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise CmhsaError("is not a cmhsa training checkpoint", path)
    return state
