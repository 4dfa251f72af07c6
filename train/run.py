"""A training run: build it (:mod:`.build`) in its held folder (:mod:`.run_folder`), loop over
epochs, write the model.

    run(TrainConfig.from_flags(phase="phase1", data="digits", ...))

After every epoch: ``metrics.csv`` and ``checkpoint-last.pt`` (:mod:`.state`). Ctrl-C / SIGTERM
finish the current step, save and stop; a non-finite loss stops before it reaches the weights and
keeps the last good checkpoint. The epoch itself is :mod:`.loop`; several seeds at once, :mod:`.stacked`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .. import signals
from ..api.export import ExportReport, export_checkpoint
from ..data import validation_split
from ..io.checkpoint import Checkpoint, save_model, write_checkpoint
from ..io.folder import Folder
from ..io.outputs import Target
from ..io.paths import parse_json
from ..labels import to_metadata
from ..loaders import cpus, default_threads
from ..options.training import TrainConfig
from ..options.values import EVAL_CROP_PCT, EVAL_INTERPOLATION
from ..text import csv_text, json_text, terminal_safe
from .build import build, resolved_config, resumed_config, unmeant_choices
from .distributed import Context, barrier, setup, teardown
from .held import HeldEvalLoader
from .loop import Loop, Stepper, train_one_epoch
from .names import BEST, LAST, OUTPUT, PENDING_REMOVAL, TIMM_FOLDER
from .progress import EMA_METRICS, METRICS, Progress
from .run_folder import (
    check_init_kept,
    check_run_names,
    finish_removal,
    previous_run,
    remove_replaced,
    run_folder,
)
from .state import plain_records, read_checkpoint

if TYPE_CHECKING:
    from ..timm import TimmFolderReport


@dataclass
class RunResult:
    out: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # "SIGINT" / "SIGTERM" / "limit" when stopped before the end
    model_path: Path | None = None
    export: ExportReport | None = None  # `export_onnx`'s result (rank 0, a finished run)
    timm: TimmFolderReport | None = None  # `export_timm`'s, likewise


class StopRequest:
    """SIGINT/SIGTERM: the first asks the run to stop, said at once in one line on stderr; the loop
    acts on it after the current step (a validation, after its current batch), saves and stops,
    resumable. A second SIGINT abandons the run at once, its line saying what that leaves
    (``abandons()``). Where there is nothing to save (``finishing``: the model written, its
    exports under way) the first SIGINT stops at once and says what is kept. ``also``, when set, is
    called after a signal is noted (a test session ends itself there on a signal from outside,
    which a run would otherwise take as its own stop)."""

    also: ClassVar[Callable[[int], None] | None] = None

    def __init__(self, abandons: Callable[[], str] = lambda: "the run is abandoned") -> None:
        self.signal: str | None = None
        self.abandons = abandons
        self.finishing: str | None = None  # what is kept, once the model is written
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        signals.note(signum)
        name = signal.Signals(signum).name
        if self.finishing is not None:
            say_now(f"{name}: stopped while exporting; {self.finishing}")
            raise KeyboardInterrupt
        if self.signal is not None and signum == signal.SIGINT:
            say_now(f"second {name}: {self.abandons()}")
            raise KeyboardInterrupt
        if self.signal is None:
            say_now(
                f"{name}: stopping after the current step (a validation: after its current batch), then "
                "saving the run to resume; Ctrl-C again abandons it"
            )
        self.signal = name
        if StopRequest.also is not None:
            StopRequest.also(signum)

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        if threading.current_thread() is not threading.main_thread():
            yield self  # signals only reach the main thread
            return
        for s in (signal.SIGINT, signal.SIGTERM):
            self._old[s] = signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, h in self._old.items():
                signal.signal(s, h)


def say_now(line: str) -> None:
    """One line on stderr from a signal handler, whatever the main thread was writing (a write of
    its own cut short: then straight to the file descriptor)."""
    text = terminal_safe(line) + "\n"
    try:
        sys.stderr.write(text)
        sys.stderr.flush()
    except (RuntimeError, OSError, ValueError):  # a reentrant call into the stream, or it is closed
        with contextlib.suppress(OSError):
            os.write(2, text.encode("utf-8", "backslashreplace"))


def metrics_text(rows: list[dict[str, Any]]) -> str:
    """metrics.csv: one row per finished epoch."""
    keys = {k: None for r in rows for k in r}  # every row's, in order (`eval_every`: some rows lack them)
    cols = list(METRICS) + [c for c in EMA_METRICS if c in keys]
    cols += [c for c in keys if c.startswith("attn")]
    return csv_text([cols, *([r.get(c) for c in cols] for r in rows)], number_format=".6g")


def run(
    cfg: TrainConfig, *, progress: Progress | None = None, stop_after_steps: int | None = None
) -> RunResult:
    """Train one phase as ``cfg`` says, reporting to ``progress`` (default: plain lines on stdout;
    the CLI passes rich bars). ``stop_after_steps`` stops (and saves) like a SIGTERM would after
    that many optimizer steps in total: tests use it to interrupt a run."""
    ctx, threads = setup(cfg.runtime.device), torch.get_num_threads()
    try:
        with deterministic_kernels(cfg.runtime.deterministic):
            return _run(cfg, ctx, progress, stop_after_steps)
    finally:
        torch.set_num_threads(threads)  # `threads` is this run's, not the caller's
        teardown(ctx)


@contextlib.contextmanager
def deterministic_kernels(on: bool) -> Iterator[None]:
    """``--deterministic``: CUDA kernels without atomics-order effects (cuDNN, cuBLAS, index_add),
    restored afterwards. cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it starts, so it is set here,
    before the model reaches the GPU."""
    if not on:
        yield
        return

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    old = (
        torch.are_deterministic_algorithms_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = old[1], old[2]


def _run(
    cfg: TrainConfig, ctx: Context, progress: Progress | None, stop_after_steps: int | None
) -> RunResult:
    cfg = resolved_config(cfg)
    reporter = (progress or Progress()) if ctx.is_main else Progress(None)  # one per run: open() sets it up
    wrote: list[Path] = []  # what this run has saved into `out` (train() adds to it)
    try:
        with run_folder(cfg, ctx, wrote) as folder:
            loop, replaces = prepared(cfg, ctx, folder, reporter)
            return train(loop, folder, stop_after_steps, replaces, wrote)
    finally:
        reporter.close()


def prepared(cfg: TrainConfig, ctx: Context, folder: Folder, reporter: Progress) -> tuple[Loop, list[str]]:
    """The run in its locked ``folder``, built (resumed from its checkpoint with `resume`), and
    the previous run's files it replaces (`overwrite`)."""
    saved, reschedule, replaces = None, False, []
    out = folder.path
    init = cfg.start.init if cfg.from_checkpoint else None
    check_run_names(folder)  # before anything is read, written or removed
    check_init_kept(folder, cfg.phase, init)
    if cfg.runtime.resume:
        saved = read_checkpoint(folder)
        cfg, reschedule = resumed_config(cfg, saved, out, reporter.log)
        finish_removal(folder)
    else:
        replaces = previous_run(folder, cfg.runtime.overwrite, init)
    cfg = cfg.replace(threads=run_threads(cfg, saved))
    torch.set_num_threads(cfg.runtime.threads)  # type: ignore[arg-type]
    reporter.open(cfg.recipe.epochs, cfg.runtime.log_every)
    for line in [] if saved else unmeant_choices(cfg):
        reporter.log(line)
    loop = build(cfg, ctx, out, saved, reschedule, reporter)
    if cfg.runtime.report_to == "tensorboard" and ctx.is_main:
        from .tensorboard import Board

        # a session start after the saved step: what an earlier file holds beyond it is dropped
        loop.board = Board(folder, loop.state.global_step + (saved is not None), loop.config_json)
    return loop, replaces


def run_threads(cfg: TrainConfig, saved: dict[str, Any] | None) -> int:
    """The run's torch CPU threads: `threads` where given; a resumed run's own (its last
    environment's: results depend on the count, and a resume that kept it repeats the run bit for
    bit); else this machine's default now (:func:`convit_convert.loaders.default_threads`)."""
    if cfg.runtime.threads is not None:
        return cfg.runtime.threads
    history = (saved or {}).get("environments")
    last = history[-1].get("threads") if plain_records(history) and history else None
    if isinstance(last, int) and not isinstance(last, bool) and 1 <= last <= 4 * cpus():
        return last
    return default_threads()


def export_trained(
    loop: Loop, result: RunResult, meta: dict[str, str], folder: Folder, saved: dict[str, Any]
) -> None:
    """`export_onnx` / `export_timm`: the trained model, from memory as saved (no second read of the
    file just written: ``saved`` is its path, bytes and sha256), into ``result``."""
    cfg, st, out = loop.cfg, loop.state, loop.out
    tensors = {k: v.detach().float().cpu() for k, v in st.model.state_dict().items()}
    ckpt = Checkpoint(result.model_path, st.model_config, tensors, meta)  # type: ignore[arg-type]
    r = cfg.recipe
    if (r.interpolation, r.crop_pct) != (EVAL_INTERPOLATION, EVAL_CROP_PCT):
        loop.reporter.log(
            f"note: the exported preprocessing is cmhsa eval's ({EVAL_INTERPOLATION}, crop {EVAL_CROP_PCT}), "
            f"not this run's `interpolation` {r.interpolation} and `crop_pct` {r.crop_pct}"
        )
    if cfg.runtime.export_onnx:
        onnx = Target(folder, Path(OUTPUT[cfg.phase]).with_suffix(".onnx").name)
        loop.reporter.log(f"exporting {onnx.show()} and checking it in onnxruntime")
        report = Target(folder, onnx.name + ".report.json")
        result.export = export_checkpoint(ckpt, onnx, report, input_facts=saved)
    if cfg.runtime.export_timm:
        from ..timm import export_timm_folder  # timm's registry: loaded only for this

        loop.reporter.log(f"writing timm's folder {out / TIMM_FOLDER} and loading it with timm")
        with folder.enter(TIMM_FOLDER, create=True) as timm_folder:
            result.timm = export_timm_folder(ckpt, timm_folder)


@contextlib.contextmanager
def worker_deaths_at_fetch() -> Iterator[None]:
    """While training, a loader worker's death is found where the loader fetches a batch (it checks
    its workers while it waits), never raised by torch's SIGCHLD handler wherever the main thread
    happens to be. A SIGTERM to the process group ends the workers too; raised asynchronously, that
    would cut a checkpoint's write short or skip the save a stop makes. (torch installs the handler
    once per process, with its first worker loader: this marks it installed. Private, so guarded.)"""
    try:
        from torch.utils.data._utils import signal_handling
    except ImportError:  # a torch that moved it: its workers' deaths are reported as they are
        signal_handling = None
    before = getattr(signal_handling, "_SIGCHLD_handler_set", None)
    if before is None:
        yield
        return
    signal_handling._SIGCHLD_handler_set = True
    try:
        yield
    finally:
        signal_handling._SIGCHLD_handler_set = before


class RunFiles:
    """What a run writes into its held folder: after each epoch (and at a stop) the checkpoint with
    metrics.csv and config.json, all or none; at the end the trained model (and its exports).
    ``replaces``: a previous run's files (`overwrite`), removed once the first save has committed;
    ``wrote`` gets each file saved."""

    def __init__(self, loop: Loop, folder: Folder, replaces: list[str] | None, wrote: list[Path]) -> None:
        self.loop, self.folder, self.wrote = loop, folder, wrote
        self.result = RunResult(loop.out, loop.state.metrics)
        # the previous run's files the first save does not replace (timm/config.json is not config.json)
        kept = (LAST, "metrics.csv", "config.json", PENDING_REMOVAL)
        self.pending = [n for n in replaces or [] if n not in kept]
        self.saved_at: tuple[int, int] | None = None  # (epoch, step) of the last checkpoint this run saved

    def save(self) -> None:
        loop, st, ctx = self.loop, self.loop.state, self.loop.ctx
        if ctx.is_main:  # checkpoint, metrics, config (and a new best) land together or not at all
            best = best_epoch(st.metrics)
            also: dict[str, Any] = {
                "metrics.csv": metrics_text(st.metrics),
                "config.json": with_best(loop.config_json, best),
            }
            if best is not None and best is st.metrics[-1] and st.step == 0:  # this epoch is the best
                also[BEST] = lambda tmp: write_checkpoint(
                    tmp, st.model_config, st.model.state_dict(), self.metadata(best), self.folder.show(BEST)
                )
            if (
                self.pending
            ):  # what is still to remove lands with them: `resume` finishes an interrupted removal
                also[PENDING_REMOVAL] = json_text(self.pending, indent=None) + "\n"

            if loop.board is not None and st.step == 0 and st.metrics:  # an epoch's end: its row
                row = st.metrics[-1]
                loop.board.scalars(st.global_step, {f"epoch/{k}": v for k, v in row.items() if k != "epoch"})

            def committed() -> None:
                self.wrote.append(loop.out / LAST)
                self.saved_at = (st.epoch, st.step)
                if self.pending:
                    remove_replaced(self.folder, self.pending)
                    self.pending.clear()

            st.save(self.folder, loop.cfg.runtime.keep, also, committed)
        barrier(ctx)

    def metadata(self, row: dict[str, Any]) -> dict[str, str]:
        """A model file's metadata: how it was trained, its start, and the figures of ``row`` (the
        epoch it holds: the last, or the best) with where they were measured (the model card's)."""
        cfg, st = self.loop.cfg, self.loop.state
        figures = {k: row[k] for k in ("epoch", "top1", "top5", "val_loss") if k in row}
        split = (cfg.data.name, cfg.data.holdout, cfg.data.val_samples)
        subset = {"train_samples": cfg.data.train_samples} if cfg.data.train_samples else {}
        return {
            "cmhsa.trained": f"{cfg.phase} {cfg.data.name}, {cfg.recipe.epochs} epochs",
            "cmhsa.init": json_text(st.init, indent=None),
            "cmhsa.result": json_text(
                {"data": cfg.data.name, "split": validation_split(*split), **subset, **figures}, indent=None
            ),
            **to_metadata(self.loop.classes),
        }

    def stopped(self, how: str) -> RunResult:
        """The run stopped early (a signal, or the step limit): saved where it is, to resume."""
        st = self.loop.state
        self.result.stopped = how
        self.save()
        self.loop.reporter.log(
            f"stopped ({how}) at epoch {st.epoch + 1}, step {st.step}; saved "
            f"{self.loop.out / LAST}; continue with the same command and `resume`"
        )
        return self.result

    def finished(self, stop: StopRequest | None = None) -> RunResult:
        """The trained model (and its EMA) as safetensors, and the exports asked for (a ``stop``
        request during them stops at once: the model is written)."""
        loop, result = self.loop, self.result
        cfg, ctx, st = loop.cfg, loop.ctx, loop.state
        if ctx.is_main:
            result.model_path = loop.out / OUTPUT[cfg.phase]
            meta = self.metadata(st.metrics[-1] if st.metrics else {})
            # into the folder this run holds, by name: never through a path its tree could redirect
            model = Target(self.folder, OUTPUT[cfg.phase])
            sha = save_model(model, st.model_config, st.model.state_dict(), meta)
            size = self.folder.lstat(model.name)
            saved = {"path": str(model.show()), "bytes": size.st_size if size else None, "sha256": sha}
            if st.ema is not None:
                ema = Target(self.folder, Path(model.name).stem + "-ema.safetensors")
                save_model(ema, st.model_config, st.ema.module.state_dict(), meta)
            best = best_epoch(st.metrics)
            kept = (
                ""
                if best is None
                else f"; {loop.out / BEST}: epoch {best['epoch']}, top-1 {best['top1']:.2f}, the best"
            )
            loop.reporter.log(f"wrote {result.model_path}, metrics.csv, config.json{kept}")
            if isinstance(
                loop.val_loader, HeldEvalLoader
            ):  # measured: digits demo, 84.40 here, 84.68 in eval
                loop.reporter.log(
                    "note: this run's top-1 is on validation images the device loader resized with torch; "
                    "`cmhsa eval` resizes them with PIL, as timm does, so its top-1 can differ by an image "
                    "or two (the loss agrees to about 4 digits); `loader` workers measures as eval does"
                )
            if cfg.runtime.export_onnx or cfg.runtime.export_timm:
                if stop is not None:
                    stop.finishing = f"{result.model_path} is written; export it with `cmhsa export`"
                export_trained(loop, result, meta, self.folder, saved)
        barrier(ctx)
        return result


def train(
    loop: Loop,
    folder: Folder,
    stop_after_steps: int | None = None,
    replaces: list[str] | None = None,
    wrote: list[Path] | None = None,
) -> RunResult:
    """Epochs until ``cfg.recipe.epochs``, saving after each into the run's held ``folder``; then
    the trained model as safetensors (:class:`RunFiles`)."""
    files = RunFiles(loop, folder, replaces, [] if wrote is None else wrote)
    (result,) = train_epochs(loop, [files], stop_after_steps)
    return result


def train_epochs(
    stepper: Stepper, files: list[RunFiles], stop_after_steps: int | None = None
) -> list[RunResult]:
    """Epochs of every seed of ``stepper`` (a run's Loop, or a stack) until the run's last, each
    seed saved into its own folder after each (``files[i]``, under its own RNGs, which its
    checkpoint keeps); then every seed's trained model. At a stop, each seed saved where it is."""
    lead = stepper.loops[0]
    stop = StopRequest(lambda: abandoned(files))
    with stop.installed(), worker_deaths_at_fetch(), boards_closed(stepper.loops):
        while lead.state.epoch < lead.cfg.recipe.epochs:
            finished = train_one_epoch(stepper, stop, stop_after_steps)
            stepper.settle()
            if not finished:
                results = []
                for i, f in enumerate(files):
                    with stepper.stream(i):
                        results.append(f.stopped(stop.signal or "limit"))
                return results
            for i, (loop, f) in enumerate(zip(stepper.loops, files, strict=True)):
                loop.reporter.end_epoch(loop.state.metrics[-1])
                with stepper.stream(i):
                    f.save()
        return [f.finished(stop) for f in files]


@contextlib.contextmanager
def boards_closed(loops: list[Loop]) -> Iterator[None]:
    """Every seed's TensorBoard file closed when the run ends, however it ends."""
    try:
        yield
    finally:
        for loop in loops:
            if loop.board is not None:
                loop.board.close()


def best_epoch(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The metrics row of the evaluated epoch with the best validation top-1 (the first of equals),
    or None before any evaluation."""
    evaluated = [r for r in rows if r.get("top1") is not None]
    return max(evaluated, key=lambda r: r["top1"]) if evaluated else None


def with_best(config_json: str, best: dict[str, Any] | None) -> str:
    """config.json's text with the best epoch named (``best``: its file, epoch and top-1, and that
    the file holds the model's weights, not the EMA's)."""
    if best is None:
        return config_json
    doc = parse_json(config_json, None, "config.json")
    doc["best"] = {"file": BEST, "epoch": best["epoch"], "top1": best["top1"], "weights": "model"}
    return json_text(doc) + "\n"


def abandoned(files: list[RunFiles]) -> str:
    """What abandoning the run now leaves: each seed's last checkpoint, or nothing where none was saved."""
    saved = [f for f in files if f.saved_at is not None]
    if not saved:
        return (
            "the run is abandoned before its first checkpoint: nothing of it is saved, and the run "
            "folder is left as it was before the run"
        )
    f = saved[0]
    epoch, step = f.saved_at  # type: ignore[misc]
    at = f"after epoch {epoch}" if step == 0 else f"at epoch {epoch + 1}, step {step}"
    others = f" (and {len(saved) - 1} other seeds')" if len(saved) > 1 else ""
    return (
        f"the run is abandoned without a save: its last checkpoint, {f.result.out / LAST}{others} {at}, "
        "stays; continue from it with the same command and `resume`"
    )
