"""Progress on the main process: rich bars on a terminal, plain log lines otherwise (CI, nohup,
SLURM logs). Other ranks stay silent."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


class Reporter:
    def __init__(self, enabled: bool, epochs: int, log_every: int, console: Console | None = None) -> None:
        self.enabled, self.epochs, self.log_every = enabled, epochs, max(1, log_every)
        self.console = console or Console(highlight=False)
        self.bars: Progress | None = None
        if enabled and self.console.is_terminal:
            self.bars = Progress(
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

    def log(self, message: str) -> None:
        if self.enabled:
            self.console.print(escape(message), soft_wrap=True)

    def start_epoch(self, epoch: int, steps: int, done: int = 0) -> None:
        self.steps = steps
        if self.bars is not None:  # epochs may have changed since __init__ (a resumed run's own)
            self.bars.update(self.epoch_task, total=self.epochs, completed=epoch)
            self.bars.reset(self.step_task, total=steps, completed=done, description=f"epoch {epoch + 1}")

    def step(self, epoch: int, step: int, loss: float, lr: float, img_per_s: float) -> None:
        if not self.enabled:
            return
        info = f"loss {loss:.4f}  lr {lr:.2e}  {img_per_s:.1f} img/s"
        if self.bars is not None:
            self.bars.update(self.step_task, completed=step + 1, info=info)
        elif (step + 1) % self.log_every == 0 or step + 1 == self.steps:
            self.console.print(
                f"epoch {epoch + 1}/{self.epochs} step {step + 1}/{self.steps}  {info}", soft_wrap=True
            )

    def end_epoch(self, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self.bars is not None:
            self.bars.update(self.epoch_task, completed=row["epoch"])
        parts = [f"epoch {row['epoch']}/{self.epochs}"]
        parts += [f"{k} {row[k]:.4g}" for k in ("train_loss", "val_loss", "top1", "top5") if k in row]
        if "ema_top1" in row:
            parts.append(f"ema_top1 {row['ema_top1']:.4g}")
        parts.append(f"{row['epoch_seconds']:.1f} s, {row['images_per_s']:.1f} img/s")
        self.console.print("  ".join(parts), soft_wrap=True)

    def close(self) -> None:
        if self.bars is not None:
            self.bars.stop()
            self.bars = None
