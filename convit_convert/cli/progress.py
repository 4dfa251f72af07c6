"""Progress on the console: a training run's (rich bars for epochs, steps and validation, and the
run's messages) and a count of work (eval's batches, predict's images: :func:`counted`); plain
lines (train/progress.py's) where the output is not a terminal."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as Bars

from ..train.progress import Paced, Progress, epoch_line, step_info
from .common import as_flags, console


class RichProgress(Progress):
    def __init__(self, console: Console) -> None:
        # the library names parameters in backquotes (`warmup_epochs`); the CLI's name is --warmup-epochs
        super().__init__(lambda m: console.print(escape(as_flags(m)), soft_wrap=True))
        self.console = console
        self.bars: Bars | None = None

    def open(self, epochs: int, log_every: int) -> None:
        super().open(epochs, log_every)
        if self.console.is_terminal and self.bars is None:
            self.bars = Bars(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                TimeRemainingColumn(),
                console=self.console,
            )
            self.bars.start()
            self.epoch_task = self.bars.add_task("epochs", total=epochs, info="")
            self.step_task = self.bars.add_task("steps", total=1, info="")

    def start_epoch(self, epoch: int, steps: int, done: int = 0) -> None:
        super().start_epoch(epoch, steps, done)
        if self.bars is not None:
            self.bars.update(self.epoch_task, total=self.epochs, completed=epoch)
            self.bars.reset(self.step_task, total=steps, completed=done, description=f"epoch {epoch + 1}")

    def step(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        if self.bars is None:
            return super().step(epoch, step, loss, lr, img_per_s)
        self.glance(epoch, step, loss, lr, img_per_s)

    def glance(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        if self.bars is None:
            return super().glance(epoch, step, loss, lr, img_per_s)
        info = f"{step_info(loss, lr, img_per_s)}  {self.timing(step)}"
        self.bars.update(self.step_task, completed=step + 1, info=info)

    def advance(self, steps_done: int) -> None:
        if self.bars is not None:  # the bar moves with each step; its line waits for a read-out
            self.bars.update(self.step_task, completed=steps_done)

    def counting(self, what: str, total: int, unit: str = "batches") -> Callable[[int], None]:
        if self.bars is None:
            return super().counting(what, total, unit)
        bars, task = self.bars, self.bars.add_task(as_flags(what), total=total, info=unit)
        done = [0]

        def count(n: int) -> None:
            done[0] += n
            if done[0] < total:
                bars.update(task, completed=done[0])
            elif task in bars.task_ids:
                bars.remove_task(task)  # done: the bar leaves with the evaluation

        return count

    def end_epoch(self, row: dict[str, Any], label: str = "") -> None:
        if self.bars is not None:
            self.bars.update(self.epoch_task, completed=row["epoch"])
        self.console.print(epoch_line(row, self.epochs, label), soft_wrap=True)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None


@contextlib.contextmanager
def counted(what: str, total: int, unit: str, quick: int = 0) -> Iterator[Callable[[int], None]]:
    """What counts ``total`` ``unit`` of work done: on a terminal a bar that leaves when it is done
    (none for ``quick`` work or less); in a log, a line each PROGRESS_SECONDS it lasts."""
    if not console.is_terminal:
        yield Paced(what, total, lambda m: console.print(escape(m), soft_wrap=True), unit)
        return
    columns = (TextColumn(what), BarColumn(), MofNCompleteColumn(), TextColumn(unit), TimeRemainingColumn())
    with Bars(*columns, console=console, transient=True, disable=total <= quick) as bars:
        task = bars.add_task(what, total=total)
        yield lambda n: bars.advance(task, n)
