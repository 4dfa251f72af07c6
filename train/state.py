"""A run's state, which saves and loads itself: the one definition of what ``checkpoint-last.pt``
holds, everything a stopped run needs to continue exactly where it stopped.

Written atomically (temp file in the run folder, then rename), so a crash while saving keeps the
previous checkpoint. ``--keep N`` also keeps the last N end-of-epoch copies. Read back with
``weights_only=True``, like every other file cmhsa reads.
"""

from __future__ import annotations

import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import ViTConfig
from ..errors import CmhsaError
from ..io.atomic import atomic_write
from .config import TrainConfig

LAST = "checkpoint-last.pt"
_EPOCH = re.compile(r"^checkpoint-epoch(\d+)\.pt$")


def rng_state() -> dict[str, Any]:
    """Every global RNG the training loop uses, as tensors and plain values (loadable with weights_only)."""
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


def read_checkpoint(path: Path) -> dict[str, Any]:
    """A saved run state as a dict (its config and model config tell what to build before :meth:`RunState.load`)."""
    if not path.is_file():
        raise CmhsaError("no checkpoint to resume from (run without `resume` first)", path)
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CmhsaError(f"cannot read the training checkpoint ({type(e).__name__}: {e})", path) from None
    if not isinstance(saved, dict) or "model" not in saved or "config" not in saved:
        raise CmhsaError("is not a cmhsa training checkpoint", path)
    return saved


@dataclass
class RunState:
    """The objects a run trains and the counters that say how far it got."""

    config: TrainConfig
    model_config: ViTConfig
    init: dict[str, Any]  # where the weights came from
    model: nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    ema: Any = None
    epoch: int = 0  # epochs finished
    step: int = 0  # steps done in the unfinished epoch (0 at an epoch's end)
    global_step: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)  # one row per finished epoch
    partial: dict[str, float] = field(default_factory=lambda: {"loss_sum": 0.0, "seconds": 0.0, "images": 0})
    rng: dict[str, Any] | None = None  # the RNGs at a mid-epoch save, restored when that epoch resumes

    def to_dict(self) -> dict[str, Any]:
        objects = ("model", "optimizer", "scheduler", "scaler")  # saved through their state_dict()
        counters = ("init", "epoch", "step", "global_step", "metrics", "partial")
        return {
            **{name: getattr(self, name).state_dict() for name in objects},
            **{name: getattr(self, name) for name in counters},
            "ema": None if self.ema is None else self.ema.state_dict(),
            "model_config": self.model_config.to_dict(),
            "kind": self.model_config.kind,
            "config": self.config.to_dict(),
            "rng": rng_state(),
        }

    def load(self, saved: dict[str, Any], reschedule: Any = None) -> None:
        """Restore from :func:`read_checkpoint`'s dict. ``reschedule(optimizer)``, when given, builds
        a fresh scheduler instead of loading the saved one (a resume that changed epochs or lr)."""
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if reschedule is None:
            self.scheduler.load_state_dict(saved["scheduler"])
        else:
            self.scheduler = reschedule(self.optimizer)
            self.scheduler.step(saved["epoch"])
        self.scaler.load_state_dict(saved["scaler"])
        if self.ema is not None and saved.get("ema") is not None:
            self.ema.load_state_dict(saved["ema"])
        self.epoch, self.step, self.global_step = saved["epoch"], saved["step"], saved["global_step"]
        self.metrics, self.partial = list(saved["metrics"]), dict(saved["partial"])
        self.rng = saved["rng"] if self.step > 0 else None

    def save(self, run_dir: Path, keep: int) -> Path:
        """Write ``checkpoint-last.pt``; at an epoch's end with ``keep`` > 0 also a numbered copy,
        pruning all but the newest ``keep`` copies."""
        path = run_dir / LAST
        state = self.to_dict()
        atomic_write(path, lambda tmp: torch.save(state, tmp))
        if keep > 0 and self.step == 0:
            numbered = run_dir / f"checkpoint-epoch{self.epoch:04d}.pt"
            atomic_write(numbered, lambda tmp: shutil.copyfile(path, tmp))  # copy the bytes, don't re-pickle
            old = sorted(p for p in run_dir.iterdir() if _EPOCH.match(p.name))
            for p in old[:-keep]:
                p.unlink(missing_ok=True)
        return path
