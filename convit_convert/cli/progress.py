"""Training progress on the terminal: rich bars for epochs and steps, and the run's messages; plain
lines (train/progress.py's) where the output is not a terminal."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as Bars

from ..train.progress import Progress, epoch_line, step_info
from .common import as_flags


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
        info = f"{step_info(loss, lr, img_per_s)}  {self.timing(step)}"
        self.bars.update(self.step_task, completed=step + 1, info=info)

    def end_epoch(self, row: dict[str, Any], label: str = "") -> None:
        if self.bars is not None:
            self.bars.update(self.epoch_task, completed=row["epoch"])
        self.console.print(epoch_line(row, self.epochs, label), soft_wrap=True)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None
