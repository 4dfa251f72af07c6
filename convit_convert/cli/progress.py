"""Progress on the console: a training run's, and a count of work (eval's batches, predict's
images: :func:`counted`), drawn by one display: rich bars on a terminal (:class:`Bars`), the plain
lines of train/progress.py where the output is not one (a log, a pipe)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn
from rich.progress import Progress as RichBars
from rich.table import Column

from ..train.progress import Estimate, Lines, Progress, StepLine, duration
from .common import as_flags, console

BAR_CELLS = 24  # every bar's width, whatever its text: the text is cut, never the bar


class Bars(Lines):
    """A terminal's display of a run: a bar of the run's epochs (the rest of the run after it), a
    bar of this epoch's steps (the last read-out's loss, learning rate and images/s, then the rest
    of the epoch, refreshed with every step), a bar for each validation while it lasts; the run's
    lines printed above them. The bars leave the screen when the run ends."""

    def __init__(self, console: Console) -> None:
        # the library names parameters in backquotes (`warmup_epochs`); the CLI's name is --warmup-epochs
        super().__init__(lambda m: console.print(escape(as_flags(m)), soft_wrap=True))
        self.console = console
        self.bars: RichBars | None = None
        self.numbers = ""  # the step bar's last read-out, kept while its time is refreshed

    def open(self, epochs: int) -> None:
        if self.bars is None:
            self.bars = bars(self.console, transient=True)
            self.bars.start()
            self.run_task = self.bars.add_task("epochs", total=epochs, info="")
            self.step_task = self.bars.add_task("steps", total=1, info="")

    def start_epoch(self, epoch: int, steps: int, done: int, estimate: Estimate) -> None:
        if self.bars is not None:
            self.numbers = ""
            self.bars.update(self.run_task, completed=epoch, info=run_left(estimate))
            self.bars.reset(self.step_task, total=steps, completed=done, description=f"epoch {epoch + 1}")
            self.moved(done, estimate)

    def step(self, line: StepLine, said: bool) -> None:
        self.numbers = line.numbers()
        self.moved(line.step, line.estimate)

    def moved(self, done: int, estimate: Estimate) -> None:
        if self.bars is not None:
            left = "" if estimate.epoch_left is None else f"about {duration(estimate.epoch_left)} to go"
            self.bars.update(
                self.step_task, completed=done, info="  ".join(t for t in (self.numbers, left) if t)
            )
            self.bars.update(self.run_task, info=run_left(estimate))

    def count(self, what: str, total: int, unit: str) -> Callable[[int], None]:
        if self.bars is None:
            return super().count(what, total, unit)
        shown, task = self.bars, self.bars.add_task(as_flags(what), total=total, info=unit)
        done = [0]

        def count(n: int) -> None:
            done[0] += n
            if done[0] < total:
                shown.update(task, completed=done[0])
            elif task in shown.task_ids:
                shown.remove_task(task)  # done: the bar leaves with the evaluation

        return count

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None


def run_left(estimate: Estimate) -> str:
    if estimate.run_left is None:
        return ""
    said = f"the run: about {duration(estimate.run_left)} to go"
    return said if estimate.validations else said + " and its validations"


def bars(console: Console, transient: bool, disable: bool = False) -> RichBars:
    """rich's bars as every display of cmhsa's draws them: the description, a bar of BAR_CELLS,
    done/total, then the text, cut at the line's end."""
    return RichBars(
        TextColumn("{task.description}", table_column=Column(no_wrap=True, min_width=8)),
        BarColumn(bar_width=BAR_CELLS),
        MofNCompleteColumn(),
        TextColumn("{task.fields[info]}", table_column=Column(no_wrap=True, overflow="ellipsis")),
        console=console,
        transient=transient,
        disable=disable,
    )


def run_progress(console: Console = console) -> Progress:
    """A training run's progress on ``console``: bars on a terminal, lines elsewhere."""
    if console.is_terminal:
        return Progress(Bars(console))
    return Progress(lambda m: console.print(escape(as_flags(m)), soft_wrap=True))


@contextlib.contextmanager
def counted(what: str, total: int, unit: str, quick: int = 0) -> Iterator[Callable[[int], None]]:
    """What counts ``total`` ``unit`` of work done: on a terminal a bar that leaves when it is done
    (none for ``quick`` work or less); in a log, a line each PROGRESS_SECONDS it lasts."""
    if not console.is_terminal:
        yield Lines(lambda m: console.print(escape(m), soft_wrap=True)).count(what, total, unit)
        return
    display = Bars(console)
    with bars(console, transient=True, disable=total <= quick) as display.bars:
        yield display.count(what, total, unit)
