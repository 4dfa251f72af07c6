"""A training run's progress as events (epoch started, step done, epoch finished, a message). The
default writes plain log lines (CI, nohup, SLURM logs) with ``write``; the CLI passes its subclass
that also draws rich bars on a terminal (``cli/progress.py``), so nothing here renders. Ranks other
than the main one get a silent one (``Progress(None)``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..text import terminal_safe

# the longest a log goes without a line while a run steps or evaluates: the loop's time-based
# glance (one device read at most this often) and an evaluation's count of images
PROGRESS_SECONDS = 10.0


def clock() -> float:
    """Every progress time: the monotonic clock (the tests put one of their own in ``time``)."""
    return time.monotonic()


# metrics.csv's columns, one row per finished epoch (written by run.py, read by plot.py)
METRICS = ("epoch", "train_loss", "val_loss", "top1", "top5", "lr", "epoch_seconds", "images_per_s")
EMA_METRICS = ("ema_val_loss", "ema_top1", "ema_top5")


class Progress:
    """Plain log lines through ``write`` (``None``: silent). :func:`convit_convert.train.run.run`
    calls :meth:`open` once the run's epochs are known (a resumed run's own), then the events."""

    def __init__(self, write: Callable[[str], None] | None = print) -> None:
        self.write = write
        self.epochs, self.log_every, self.steps = 0, 1, 0
        self.t_epoch, self.first_step = clock(), 0

    def open(self, epochs: int, log_every: int) -> None:
        self.epochs, self.log_every = epochs, max(1, log_every)

    def log(self, message: str) -> None:
        if self.write is not None:  # messages name paths the user gave: never raw escape sequences
            self.write(terminal_safe(message))

    def start_epoch(self, epoch: int, steps: int, done: int = 0) -> None:
        self.steps = steps
        self.t_epoch, self.first_step = clock(), done  # a resumed epoch starts at `done`

    def timing(self, step: int) -> str:
        """The epoch's time so far and, from its pace, the expected rest (evaluation aside)."""
        elapsed = clock() - self.t_epoch
        done = step + 1 - self.first_step
        rest = elapsed / max(done, 1) * max(self.steps - step - 1, 0)
        return epoch_time(elapsed, rest)

    def step(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        """A read-out: its line every ``log_every`` steps and at the epoch's last."""
        if (step + 1) % self.log_every == 0 or step + 1 == self.steps:
            self.glance(epoch, step, loss, lr, img_per_s)

    def glance(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        """The step line now (the loop's time-based look between read-outs, ``loss`` the mean of
        the steps since the last read-out)."""
        self.log(
            f"epoch {epoch + 1}/{self.epochs} step {step + 1}/{self.steps}  "
            f"{step_info(loss, lr, img_per_s)}  {self.timing(step)}"
        )

    def advance(self, steps_done: int) -> None:
        """``steps_done`` steps of the epoch are done (the host's count, no device read): a
        terminal's bar moves; a log waits for the next line."""

    def counting(self, what: str, total: int, unit: str = "batches") -> Callable[[int], None]:
        """A count of the ``total`` ``unit`` that ``what`` works through (an evaluation): call it
        with each one's count; a line at most every PROGRESS_SECONDS while it lasts, none if quick."""
        return Paced(what, total, self.log, unit)

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


class Paced:
    """Images counted as they are done, and a line through ``write`` each time PROGRESS_SECONDS
    have passed since the count began or since its last line: how many, how fast, the expected
    rest. Nothing for work that ends sooner."""

    def __init__(self, what: str, total: int, write: Callable[[str], None], unit: str = "images") -> None:
        self.what, self.total, self.write, self.unit = what, total, write, unit
        self.done, self.t0 = 0, clock()
        self.shown = self.t0

    def __call__(self, n: int) -> None:
        self.done += n
        now = clock()
        if now - self.shown >= PROGRESS_SECONDS and self.done < self.total:
            self.shown = now
            self.write(paced_line(self.what, self.done, self.total, now - self.t0, self.unit))


def paced_line(what: str, done: int, total: int, elapsed: float, unit: str = "images") -> str:
    """``validating: 3,072/10,000 images, 301.2 images/s, about 23 s to go``."""
    rate = done / max(elapsed, 1e-9)
    rest = (total - done) / max(rate, 1e-9)
    shown = f"{rest:.0f} s" if rest < 90 else f"{rest / 60:.1f} min"
    return f"{what}: {done:,}/{total:,} {unit}, {rate:.1f} {unit}/s, about {shown} to go"
