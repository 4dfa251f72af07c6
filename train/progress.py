"""A training run's progress: the numbers every progress line shows, computed in one place from one
clock (:class:`Pace`, :class:`StepLine`), and the events the loop reports (:class:`Progress`),
written by a display: plain lines for a log (CI, nohup, SLURM), here, or rich bars on a terminal
(``cli/progress.py``'s). A ``--seeds`` run's seeds share one display, each seed a labelled view of
the run's Progress (:meth:`Progress.for_seed`). Nothing here reads the device."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..text import terminal_safe

# the longest a log goes without a line while a run steps or evaluates: the loop's time-based
# glance (one device read at most this often) and an evaluation's count of images
PROGRESS_SECONDS = 10.0


def clock() -> float:
    """Every time the loop and its progress read: the monotonic clock (tests put their own here)."""
    return time.monotonic()


# metrics.csv's columns, one row per finished epoch (written by run.py, read by plot.py)
METRICS = ("epoch", "train_loss", "val_loss", "top1", "top5", "lr", "epoch_seconds", "images_per_s")
EMA_METRICS = ("ema_val_loss", "ema_top1", "ema_top5")


def duration(seconds: float) -> str:
    """``12 s``, ``4.2 min``, ``3.1 h``, ``2.5 days``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 48 * 3600 else f"{seconds / 86400:.1f} days"


@dataclass(frozen=True)
class Estimate:
    """Where a run is in time: seconds in this epoch so far, and the expected rest of the epoch and
    of the run (None before any step is timed), each validation in them timed by the last one
    (``validations`` False: none has run yet, so the rest leaves them out and says so)."""

    elapsed: float
    epoch_left: float | None
    run_left: float | None
    validations: bool

    def text(self) -> str:
        """``12 s in this epoch, about 40 s to go; the run about 12 min``."""
        said = f"{duration(self.elapsed)} in this epoch"
        if self.epoch_left is None or self.run_left is None:
            return said
        said += f", about {duration(self.epoch_left)} to go; the run about {duration(self.run_left)}"
        return said if self.validations else said + " and its validations"


@dataclass
class Pace:
    """The run's time as the loop sees it, on :func:`clock`: when this epoch's stepping began and at
    which step, each step's time (this epoch's, else the last epoch's), and the last validation's
    time; :meth:`estimate` is the one computation of the rest of the epoch and of the run."""

    epochs: int
    steps: int  # per epoch
    evaluates: Callable[[int], bool]  # whether the epoch of this (0-based) index ends with a validation
    epoch: int = 0
    first: int = 0  # the step this process began the epoch at
    started: float = field(default_factory=clock)
    step_seconds: float | None = None  # the last epoch's time per step
    validation_seconds: float | None = None

    def start_epoch(self, epoch: int, first: int) -> None:
        self.epoch, self.first, self.started = epoch, first, clock()

    def end_steps(self, done: int) -> None:
        """The epoch's steps are done: its time per step is the next epoch's first estimate."""
        if done > self.first:
            self.step_seconds = (clock() - self.started) / (done - self.first)

    def validated(self, seconds: float) -> None:
        self.validation_seconds = seconds

    def estimate(self, done: int) -> Estimate:
        """With ``done`` steps of the epoch done."""
        elapsed = clock() - self.started
        per_step = elapsed / (done - self.first) if done > self.first else self.step_seconds
        if per_step is None:
            return Estimate(elapsed, None, None, self.validation_seconds is not None)
        validation = self.validation_seconds or 0.0
        epoch_left = per_step * max(self.steps - done, 0) + (
            validation if self.evaluates(self.epoch) else 0.0
        )
        later = range(self.epoch + 1, self.epochs)
        run_left = epoch_left + per_step * self.steps * len(later)
        run_left += validation * sum(1 for e in later if self.evaluates(e))
        return Estimate(elapsed, epoch_left, run_left, self.validation_seconds is not None)


@dataclass(frozen=True)
class StepLine:
    """One progress line's numbers: after ``step`` of ``steps`` steps of epoch ``epoch`` (0-based)
    of ``epochs``, the mean loss and the images/s since the last line, the learning rate, and the
    time (:class:`Estimate`)."""

    epoch: int
    epochs: int
    step: int
    steps: int
    loss: float
    lr: float
    images_per_s: float
    estimate: Estimate

    def numbers(self) -> str:
        return f"loss {self.loss:.4f}  lr {self.lr:.2e}  {self.images_per_s:.1f} img/s"

    def text(self) -> str:
        where = f"epoch {self.epoch + 1}/{self.epochs} step {self.step}/{self.steps}"
        return f"{where}  {self.numbers()}  {self.estimate.text()}"


def epoch_line(row: dict[str, Any], epochs: int, label: str = "") -> str:
    """One finished epoch: losses, accuracies, time and speed (after ``label``, when given)."""
    parts = [(f"{label}: " if label else "") + f"epoch {row['epoch']}/{epochs}"]
    parts += [f"{k} {row[k]:.4g}" for k in ("train_loss", "val_loss", "top1", "top5") if k in row]
    if "ema_top1" in row:
        parts.append(f"ema_top1 {row['ema_top1']:.4g}")
    parts.append(f"{row['epoch_seconds']:.1f} s, {row['images_per_s']:.1f} img/s")
    return "  ".join(parts)


class Lines:
    """The log's display: every line through ``write`` (None: silent), counts as :class:`Paced`
    lines. ``cli/progress.py``'s Bars draws the same events on a terminal."""

    def __init__(self, write: Callable[[str], None] | None = print) -> None:
        self.write = write

    def say(self, text: str) -> None:
        if self.write is not None:  # lines name paths the user gave: never raw escape sequences
            self.write(terminal_safe(text))

    def open(self, epochs: int) -> None:
        pass

    def start_epoch(self, epoch: int, steps: int, done: int, estimate: Estimate) -> None:
        pass

    def step(self, line: StepLine, said: bool) -> None:
        """A step line: printed where ``said`` (a read-out every `log_every` steps, the epoch's
        last, or a glance)."""
        if said:
            self.say(line.text())

    def moved(self, done: int, estimate: Estimate) -> None:
        """``done`` steps of the epoch are done (the host's count): a log waits for its next line."""

    def count(self, what: str, total: int, unit: str) -> Callable[[int], None]:
        return Paced(what, total, self.say, unit)

    def close(self) -> None:
        pass


class Progress:
    """A run's events, in the loop's order: :meth:`open` once its epochs are known (a resumed
    run's own), then :meth:`start_epoch`, :meth:`step` at read-outs and glances, :meth:`moved` after
    each step, :meth:`counting` for a validation, :meth:`end_epoch`, and :meth:`log` for anything
    to say. ``display``: a :class:`Lines` or a terminal's bars; a function is a Lines writing
    through it; None is silent (ranks other than the main one)."""

    def __init__(
        self,
        display: Lines | Callable[[str], None] | None = print,
        seed: int | None = None,
        lead: bool = True,
        notes: dict[str, set[int]] | None = None,
    ) -> None:
        self.display = display if isinstance(display, Lines) else Lines(display)
        self.seed, self.lead = seed, lead
        self.label = "" if seed is None else f"seed {seed}"
        self.epochs, self.log_every, self.steps = 0, 1, 0
        self.notes = notes  # a --seeds run's notes, by text: the seeds that gave each

    def for_seed(self, seed: int, lead: bool) -> Progress:
        """Seed ``seed``'s view of a ``--seeds`` run's progress: its lines labelled with it, its
        notes kept to be said once where every seed gives them (:meth:`flush_notes`), its steps
        shown only if it is the ``lead`` seed."""
        self.notes = {} if self.notes is None else self.notes
        return Progress(self.display, seed, lead, self.notes)

    def flush_notes(self, seeds: int) -> None:
        """Each note the seeds gave: once, unlabelled, where all ``seeds`` gave it, else per seed."""
        for note, givers in (self.notes or {}).items():
            if len(givers) == seeds:
                self.display.say(note)
            else:
                for seed in sorted(givers):
                    self.display.say(f"seed {seed}: {note}")
        if self.notes is not None:
            self.notes.clear()

    def open(self, epochs: int, log_every: int) -> None:
        self.epochs, self.log_every = epochs, max(1, log_every)
        if self.lead:
            self.display.open(epochs)

    def log(self, message: str) -> None:
        if self.notes is not None and self.seed is not None and message.startswith("note: "):
            self.notes.setdefault(message, set()).add(self.seed)
        else:
            self.display.say(f"{self.label}: {message}" if self.label else message)

    def start_epoch(self, epoch: int, steps: int, done: int, estimate: Estimate) -> None:
        self.steps = steps
        if self.lead:
            self.display.start_epoch(epoch, steps, done, estimate)

    def step(self, line: StepLine, glance: bool = False) -> None:
        """A read-out's line (or a ``glance``'s): a log prints it every ``log_every`` steps, at the
        epoch's last, and at every glance; a terminal shows each."""
        if self.lead:
            said = glance or line.step % self.log_every == 0 or line.step == self.steps
            self.display.step(line, said)

    def moved(self, done: int, estimate: Estimate) -> None:
        if self.lead:
            self.display.moved(done, estimate)

    def counting(self, what: str, total: int, unit: str = "batches") -> Callable[[int], None]:
        """A count of the ``total`` ``unit`` that ``what`` works through (an evaluation): call it
        with each one's count; a line at most every PROGRESS_SECONDS while it lasts, none if quick."""
        return self.display.count(f"{self.label}: {what}" if self.label else what, total, unit)

    def end_epoch(self, row: dict[str, Any]) -> None:
        self.display.say(epoch_line(row, self.epochs, self.label))

    def close(self) -> None:
        self.display.close()


class Paced:
    """Images counted as they are done, and a line through ``write`` each time PROGRESS_SECONDS
    have passed since the count began or since its last line: how many, how fast, the expected
    rest. Nothing for work that ends sooner."""

    def __init__(self, what: str, total: int, write: Callable[[str], None], unit: str = "images") -> None:
        self.what, self.total, self.write, self.unit = what, total, write, unit
        self.done, self.began = 0, clock()
        self.last_line = self.began

    def __call__(self, n: int) -> None:
        self.done += n
        now = clock()
        if now - self.last_line >= PROGRESS_SECONDS and self.done < self.total:
            self.last_line = now
            self.write(paced_line(self.what, self.done, self.total, now - self.began, self.unit))


def paced_line(what: str, done: int, total: int, elapsed: float, unit: str = "images") -> str:
    """``validating: 3,072/10,000 images, 301.2 images/s, about 23 s to go``."""
    rate = done / max(elapsed, 1e-9)
    rest = (total - done) / max(rate, 1e-9)
    return f"{what}: {done:,}/{total:,} {unit}, {rate:.1f} {unit}/s, about {duration(rest)} to go"
