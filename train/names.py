"""The names of what a run writes in its folder: its checkpoints, models and seeds' folders.

Kept apart from the code that writes them, and free of torch, so that what only reads a run's
files (an experiment's report, the launcher of its arms) starts without importing torch."""

from __future__ import annotations

import re
from pathlib import Path

LAST = "checkpoint-last.pt"
NUMBERED = re.compile(r"checkpoint-epoch\d{4,9}\.pt")
OUTPUT = {"phase1": "conv.safetensors", "phase2": "vit.safetensors"}
TIMM_FOLDER = "timm"  # `export_timm`'s folder in the run's
BEST = "best.safetensors"  # the model at the epoch of the best validation top-1
# `overwrite`: the previous run's files still to remove, committed with the new run's first
# checkpoint and removed once they are gone; `resume` finishes an interrupted removal
PENDING_REMOVAL = "overwrite-pending.json"


SEED_FOLDER = re.compile(r"seed[0-9]{1,10}")  # what seed_folder names, as a reader matches it


def seed_folder(out: str | Path, seed: int) -> Path:
    """Seed ``seed``'s run folder in a stacked run's ``out``."""
    return Path(out) / f"seed{seed}"
