"""A training run's progress as events (epoch started, step done, epoch finished, a message). The
default writes plain log lines (CI, nohup, SLURM logs) with ``write``; the CLI passes its subclass
that also draws rich bars on a terminal (``cli/progress.py``), so nothing here renders. Ranks other
than the main one get a silent one (``Progress(None)``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..text import terminal_safe

# metrics.csv's columns, one row per finished epoch (written by run.py, read by plot.py)
METRICS = ("epoch", "train_loss", "val_loss", "top1", "top5", "lr", "epoch_seconds", "images_per_s")
EMA_METRICS = ("ema_val_loss", "ema_top1", "ema_top5")


class Progress:
    """Plain log lines through ``write`` (``None``: silent). :func:`convit_convert.train.run.run`
    calls :meth:`open` once the run's epochs are known (a resumed run's own), then the events."""

    def __init__(self, write: Callable[[str], None] | None = print) -> None:
        self.write = write
        self.epochs, self.log_every, self.steps = 0, 1, 0
        self.t_epoch, self.first_step = time.monotonic(), 0

    def open(self, epochs: int, log_every: int) -> None:
        self.epochs, self.log_every = epochs, max(1, log_every)

    def log(self, message: str) -> None:
        if self.write is not None:  # messages name paths the user gave: never raw escape sequences
            self.write(terminal_safe(message))

    def start_epoch(self, epoch: int, steps: int, done: int = 0) -> None:
        self.steps = steps
        self.t_epoch, self.first_step = time.monotonic(), done  # a resumed epoch starts at `done`

    def timing(self, step: int) -> str:
        """The epoch's time so far and, from its pace, the expected rest (evaluation aside)."""
        elapsed = time.monotonic() - self.t_epoch
        done = step + 1 - self.first_step
        rest = elapsed / max(done, 1) * max(self.steps - step - 1, 0)
        return epoch_time(elapsed, rest)

    def step(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        if (step + 1) % self.log_every == 0 or step + 1 == self.steps:
            self.log(
                f"epoch {epoch + 1}/{self.epochs} step {step + 1}/{self.steps}  "
                f"{step_info(loss, lr, img_per_s)}  {self.timing(step)}"
            )

    def end_epoch(self, row: dict[str, Any], label: str = "") -> None:
        """``label``: whose epoch (a stacked run's seed), said before the line."""
        self.log(epoch_line(row, self.epochs, label))

    def close(self) -> None:
        pass


def epoch_time(elapsed: float, rest: float) -> str:
    """``12 s in this epoch, about 40 s to go``; minutes past 90 s."""

    def shown(seconds: float) -> str:
        return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"

    return f"{shown(elapsed)} in this epoch, about {shown(rest)} to go"


def step_info(loss: float, lr: float, img_per_s: float) -> str:
    return f"loss {loss:.4f}  lr {lr:.2e}  {img_per_s:.1f} img/s"


def epoch_line(row: dict[str, Any], epochs: int, label: str = "") -> str:
    """One finished epoch: losses, accuracies, time and speed (after ``label``, when given)."""
    parts = [(f"{label}: " if label else "") + f"epoch {row['epoch']}/{epochs}"]
    parts += [f"{k} {row[k]:.4g}" for k in ("train_loss", "val_loss", "top1", "top5") if k in row]
    if "ema_top1" in row:
        parts.append(f"ema_top1 {row['ema_top1']:.4g}")
    parts.append(f"{row['epoch_seconds']:.1f} s, {row['images_per_s']:.1f} img/s")
    return "  ".join(parts)
