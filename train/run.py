"""A training run: build it (data, model, recipe, resumed state), loop over epochs, write the model.

    run(TrainConfig.from_flags(phase="phase1", data="digits", ...))

After every epoch: ``metrics.csv`` and ``checkpoint-last.pt`` (:mod:`.state`). Ctrl-C / SIGTERM
finish the current step, save and stop; a non-finite loss stops before it reaches the weights and
keeps the last good checkpoint. The epoch itself is :mod:`.loop`; several seeds at once, :mod:`.stacked`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .. import signals
from ..api.common import amp_dtype
from ..api.export import ExportReport, export_checkpoint
from ..config import ViTConfig
from ..data import (
    NEEDS_DIR,
    DataSpec,
    build_data,
    build_loader,
    build_transform,
    channel_stats,
    default_threads,
    default_workers,
    epoch_sampler,
    image_mode,
    validation_split,
)
from ..errors import CmhsaError
from ..io.checkpoint import Checkpoint, save_model
from ..io.folder import Folder, make_folder, remove_made
from ..io.lock import LOCK_NAME, locked_folder
from ..io.outputs import Target
from ..io.paths import parse_json
from ..io.timm_folder import FILES, WEIGHTS
from ..labels import to_metadata
from ..model import VisionTransformer
from ..options.training import RUNTIME_FIELDS, TrainConfig
from ..options.values import DATASETS, EVAL_CROP_PCT, EVAL_INTERPOLATION
from .augment import augment_spec, check_supported
from .distributed import Context, barrier, setup, teardown
from .held import HeldEvalLoader, HeldLoader, eval_view, hold, holdable
from .loop import Loop, Stepper, seed_everything, train_one_epoch
from .phases import PhaseModel, build_phase_model, check_trainable, freeze_attention
from .progress import EMA_METRICS, METRICS, Progress

if TYPE_CHECKING:
    from ..timm import TimmFolderReport
from ..text import csv_text, json_text
from .recipe import (
    build_recipe,
    build_scheduler,
    check_recipe,
    scaled_lrs,
)
from .state import LAST, NUMBERED, RunState, environment, environment_changes, plain_records, read_checkpoint
from .step import CompiledStep, whole_step_refusal

OUTPUT = {"phase1": "conv.safetensors", "phase2": "vit.safetensors"}
TIMM_FOLDER = "timm"  # `export_timm`'s folder in the run's
# `overwrite`: the previous run's files still to remove, committed with the new run's first
# checkpoint and removed once they are gone; `resume` finishes an interrupted removal
PENDING_REMOVAL = "overwrite-pending.json"
RESUMABLE = ("epochs", "lr")  # what a resume may change; the schedule is then rebuilt


@dataclass
class RunResult:
    out: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # "SIGINT" / "SIGTERM" / "limit" when stopped before the end
    model_path: Path | None = None
    export: ExportReport | None = None  # `export_onnx`'s result (rank 0, a finished run)
    timm: TimmFolderReport | None = None  # `export_timm`'s, likewise


class StopRequest:
    """SIGINT/SIGTERM set a flag the loop reads after each step; a second Ctrl-C aborts at once.
    ``also``, when set, is called after a signal is noted (a test session ends itself there on a
    signal from outside, which a run would otherwise take as its own stop)."""

    also: ClassVar[Callable[[int], None] | None] = None

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        signals.note(signum)
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
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
    import os

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


def resumed_config(cfg: TrainConfig, saved: dict[str, Any], out: Path, log: Any) -> tuple[TrainConfig, bool]:
    """The saved run's config with this invocation's runtime fields and any RESUMABLE change
    (as timm's train.py allows); whether the schedule must be rebuilt for it."""
    try:
        # how this invocation runs (threads, workers, device, loader...) is this machine's choice:
        # only what defines the run is held to the saved one
        here = {name: cfg.flag(name) for name in RUNTIME_FIELDS}
        old = TrainConfig.from_dict({**saved["config"], **here})  # checked as made, as the flags are
        check_recipe(old)
        ViTConfig.from_dict(saved["model_config"], saved["kind"], out / LAST)
    except (TypeError, ValueError) as e:
        raise CmhsaError(f"`resume`: {LAST} holds a config cmhsa cannot use ({e})", out) from None
    except CmhsaError as e:
        raise CmhsaError(f"`resume`: {LAST} holds a config cmhsa cannot use ({e.message})", out) from None
    if old.phase != cfg.phase:
        raise CmhsaError(f"holds a {old.phase} run; resume it with `cmhsa train {old.phase} --resume`", out)
    changed = old.training_differences(cfg)
    for name in RESUMABLE:
        if name in changed:
            before, new = old.flag(name), cfg.flag(name)
            if name == "epochs" and new < saved["epoch"] + (saved["step"] > 0):
                raise CmhsaError(f"`epochs` {new}: the run has already trained {saved['epoch']} epochs", out)
            old = old.replace(**{name: new})
            log(
                f"resuming with `{name}` {new} instead of {before}: the schedule is rebuilt for it, "
                "so the result is no longer that of one uninterrupted run"
                if name == "lr"
                else f"extending the run from {before} to {new} epochs; the schedule is "
                f"rebuilt for {new} epochs"
            )
    refused = [n for n in changed if n not in RESUMABLE]
    if refused:
        n = refused[0]
        raise CmhsaError(
            f"`{n}` {cfg.flag(n)!r} differs from the run's {old.flag(n)!r} (only "
            f"{', '.join(f'`{r}`' for r in RESUMABLE)} may change on `resume`); drop it or start a new run",
            out,
        )
    return old, any(n in changed for n in RESUMABLE)


def unmeant_choices(cfg: TrainConfig) -> list[str]:
    """Choices that change the experiment and may not be what was meant, one line each (parameters in
    backquotes, which the CLI prints as flags, as it does errors): phase 2
    without a typed ``--init`` (``given`` empty means every flag was meant: the Python API), and a
    warm-up that never reaches the peak learning rate."""
    lines = []
    if cfg.phase == "phase2" and cfg.given and "init" not in cfg.given:
        lines.append(
            f"`init` not given: phase 2 starts from {cfg.start.init} weights, with no conv checkpoint (the "
            "'phase 2 only' arms of EXPERIMENTS.md, not two-phase training); for the paper's two phases pass "
            "`init` PHASE1_RUN/conv.safetensors"
        )
    r = cfg.recipe
    if r.warmup_epochs >= r.epochs:
        lines.append(
            f"warning: `warmup_epochs` {r.warmup_epochs} >= `epochs` {r.epochs}: the "
            "learning rate never reaches "
            f"its peak ({cfg.peak_lr:g} at batch {r.lr_base_batch}); lower `warmup_epochs` or train longer"
        )
    return lines


def _run(
    cfg: TrainConfig, ctx: Context, progress: Progress | None, stop_after_steps: int | None
) -> RunResult:
    cfg = resolved_config(cfg)
    torch.set_num_threads(cfg.runtime.threads)
    reporter = (progress or Progress()) if ctx.is_main else Progress(None)  # one per run: open() sets it up
    wrote: list[Path] = []  # what this run has saved into `out` (train() adds to it)
    try:
        with run_folder(cfg, ctx, wrote) as folder:
            loop, replaces = prepared(cfg, ctx, folder, reporter)
            return train(loop, folder, stop_after_steps, replaces, wrote)
    finally:
        reporter.close()


def resolved_config(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` checked as a run starts (the data it names, its folder, its recipe), with this
    machine's defaults for the workers and threads resolved in a copy."""
    if cfg.given and "data" not in cfg.given and cfg.data.dir is None and cfg.data.name in NEEDS_DIR:
        raise CmhsaError(  # the default dataset needs a folder: say so, not "--data cifar100 needs ..."
            f"`data` not given: the default, {cfg.data.name}, needs `data_dir`; name a dataset with `data` "
            f"({', '.join(DATASETS)}) and, for cifar10, cifar100 and imagefolder, its folder with `data_dir`"
        )
    if not str(cfg.runtime.out).strip():  # Path("") is the current folder: never meant
        raise CmhsaError("`out` is empty: give the run folder")
    out = Path(cfg.runtime.out).expanduser()
    check_recipe(cfg)
    try:
        if out.exists() and not out.is_dir():
            raise CmhsaError("`out` names an existing file; give a folder for the run", out)
    except OSError as e:
        raise CmhsaError(f"cannot check the run folder ({e.strerror})", out) from None
    return cfg.replace(  # this run's defaults, resolved in its own copy
        workers=default_workers() if cfg.runtime.workers is None else cfg.runtime.workers,
        threads=default_threads() if cfg.runtime.threads is None else cfg.runtime.threads,
    )


@contextlib.contextmanager
def run_folder(
    cfg: TrainConfig, ctx: Context, wrote: list[Path], parent: Folder | None = None
) -> Iterator[Folder]:
    """The run folder, made if missing, held open and locked (one process at a time writes a run
    folder: a second one is refused) while the run is in it. If the run fails before it saved
    anything (``wrote`` empty), the folder is left as it was: no folder it made, no lock.
    ``parent``: the held folder the run folder's name is cmhsa's choice in (a `seeds` run's seed
    folder), entered by that name, never through a link and only if it is this user's folder;
    without it, the path the user gave (links in it followed: it is the user's)."""
    out = Path(cfg.runtime.out).expanduser()
    created: list[Path] = []
    folder, had_lock = None, True
    try:
        if parent is not None:
            made = parent.lstat(out.name) is None
            folder = parent.enter(out.name, create=True)
            created = [out] if made else []
            if not os.access(out, os.W_OK | os.X_OK):
                raise CmhsaError("the run folder is not writable", out)
        else:
            if ctx.is_main:
                created = make_folder(out, "run folder")
                if not os.access(out, os.W_OK | os.X_OK):
                    raise CmhsaError("the run folder is not writable", out)
            barrier(ctx)
            folder = Folder.open(out)  # held for the whole run: every file below it is touched by name
        had_lock = folder.exists(LOCK_NAME)
        with locked_folder(folder) if ctx.is_main else contextlib.nullcontext():
            yield folder
    except BaseException:
        if ctx.is_main and not wrote:
            # it wrote nothing: leave the folder as it was, and no folder it made
            if created:
                remove_made(created, keep=(LOCK_NAME,))
            elif folder is not None and not had_lock:
                with contextlib.suppress(OSError, CmhsaError):
                    folder.remove_all([LOCK_NAME])
        raise
    finally:
        if folder is not None:
            folder.close()


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
    reporter.open(cfg.recipe.epochs, cfg.runtime.log_every)
    for line in [] if saved else unmeant_choices(cfg):
        reporter.log(line)
    return build(cfg, ctx, out, saved, reschedule, reporter), replaces


def run_files(phases: tuple[str, ...] = tuple(OUTPUT)) -> list[str]:
    """The names a run of ``phases`` writes in its folder (relative; numbered checkpoints apart)."""
    models = [OUTPUT[p] for p in phases]
    names = [LAST, "metrics.csv", "config.json", PENDING_REMOVAL, *models]
    names += [n.replace(".safetensors", s) for n in models for s in ("-ema.safetensors", ".onnx")]
    names += [n.replace(".safetensors", ".onnx.report.json") for n in models]
    return names + [f"{TIMM_FOLDER}/{n}" for n in FILES]


def run_outputs(folder: Folder) -> list[str]:
    """What a run writes into its folder (any phase), as far as it is there: exact names, never a
    pattern a user's file could match."""
    found = [n for n in run_files() if folder.lstat_below(n) is not None]
    return found + [n for n in folder.names() if NUMBERED.fullmatch(n)]


def check_run_names(folder: Folder) -> None:
    """Every name a run writes, replaces or removes in its folder (its outputs, the numbered copies,
    the timm folder) is absent or what cmhsa writes there: a regular file of this user's with one
    name, ``timm`` a real folder. Anything else (a link, a folder where a file belongs, a hard link,
    another user's file) is refused here (``Folder.check_all``), naming it, before anything is read,
    written or removed."""
    folder.check_all([*run_files(), *(n for n in folder.names() if NUMBERED.fullmatch(n))])


def check_init_kept(folder: Folder, phase: str, init: str | None) -> None:
    """The file `init` names is never replaced by the run that starts from it: refused when it is
    one this run writes (its model, checkpoints, exports)."""
    if not init:
        return
    written = run_files((phase,)) + [n for n in folder.names() if NUMBERED.fullmatch(n)]
    if any(is_init(folder, n, init) for n in written):
        raise CmhsaError(
            f"`init` {init} is a file this run writes (its model or a checkpoint) and would be "
            "replaced by the trained model; copy it out of `out` first, or choose another `out`",
            folder.path,
        )


def is_init(folder: Folder, name: str, init: str | None) -> bool:
    """Whether the run folder's ``name`` is the file `init` names (the same device and inode)."""
    if not init:
        return False
    path = Path(init).expanduser()
    try:
        source = os.stat(path / WEIGHTS if path.is_dir() else path)  # a timm folder: its weights
    except OSError:
        return False
    st = folder.lstat_below(name)
    return st is not None and (st.st_dev, st.st_ino) == (source.st_dev, source.st_ino)


def previous_run(folder: Folder, overwrite: bool, init: str | None = None) -> list[str]:
    """A new run in ``folder``: refused while another run's outputs are there (its metrics and model
    would be silently replaced, or mixed with this run's), unless ``overwrite``. Returns what the
    new run replaces (names), removed only once it has written its first checkpoint
    (:func:`train`), and never the file ``init`` names, which the new run starts from."""
    previous = run_outputs(folder)
    if not previous:
        return []
    if not overwrite:
        what = "a previous run (checkpoint-last.pt)" if previous[0] == LAST else "another run's outputs"
        names = ", ".join(previous[:4]) + (" ..." if len(previous) > 4 else "")
        raise CmhsaError(
            f"holds {what}: {names}; pass `resume` to continue it, `overwrite` to replace it, "
            "or choose another `out`",
            folder.path,
        )
    return [n for n in previous if not is_init(folder, n, init)]


def remove_replaced(folder: Folder, names: list[str]) -> None:
    """`overwrite`: remove the previous run's files ``names``, then the list of them
    (:data:`PENDING_REMOVAL`) and a timm folder left empty; every name checked before the first is
    removed (``Folder.remove_all``)."""
    try:
        folder.remove_all([*names, PENDING_REMOVAL])
    except CmhsaError as e:
        raise CmhsaError(f"`overwrite`: {e}") from None


def removable(name: object) -> bool:
    """Whether ``name`` (from a run folder's :data:`PENDING_REMOVAL`, which anyone may have written)
    is a previous run's file that `overwrite` removes: a run output other than the three every save
    writes, or a numbered checkpoint; never a path out of the folder."""
    kept = (LAST, "metrics.csv", "config.json", PENDING_REMOVAL)
    return isinstance(name, str) and (
        (name in run_files() and name not in kept) or NUMBERED.fullmatch(name) is not None
    )


def finish_removal(folder: Folder) -> None:
    """`resume` of a run whose `overwrite` was cut short after its first checkpoint: remove what
    :data:`PENDING_REMOVAL` still lists (names checked by :func:`removable`; the file is bounded)."""
    if not folder.exists(PENDING_REMOVAL):
        return
    path = folder.show(PENDING_REMOVAL)
    data = folder.read_bytes(PENDING_REMOVAL, 64 * 2**10, PENDING_REMOVAL)
    names = parse_json(data, path, PENDING_REMOVAL, max_depth=2)
    if not isinstance(names, list) or not all(removable(n) for n in names):
        raise CmhsaError(
            f"is not a list of a previous run's files that `overwrite` removes; delete {PENDING_REMOVAL} "
            "to resume without it",
            path,
        )
    remove_replaced(folder, names)


def build(
    cfg: TrainConfig,
    ctx: Context,
    out: Path,
    saved: dict[str, Any] | None,
    reschedule: bool,
    reporter: Progress,
) -> Loop:
    """Data, model, recipe and run state (restored from ``saved`` when resuming), and the step that
    trains them; the config.json text the run writes."""
    device, dtype = ctx.device, amp_dtype(cfg.recipe.amp, ctx.device)
    seed_everything(cfg.seed + ctx.rank)
    dataset, pm = data_and_model(cfg, ctx, out, saved, reporter)
    if cfg.recipe.freeze_attention:
        freeze_attention(pm.model)
    model = pm.model.to(device).train()
    loader, why = choose_loader(cfg, dataset, pm.config.in_chans)
    if why:
        reporter.log(f"loader workers: {why}")
    loaders = build_loaders(cfg, dataset, pm.config, ctx, loader)
    steps_per_epoch = len(loaders[0].sampler) // cfg.recipe.batch_size
    fwd: nn.Module = model
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer, scheduler, mixup, criterion = build_recipe(
        cfg, model, dataset.num_classes, ctx.world, steps_per_epoch
    )
    ema = None
    if cfg.recipe.model_ema:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=cfg.recipe.model_ema_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    state = RunState(cfg, pm.config, pm.init, model, optimizer, scheduler, scaler, ema)
    here = environment(device, ctx.world)
    state.environments = [{"epoch": 0, "step": 0, **here}]
    if saved is not None:
        resume_state(state, saved, here, cfg, ctx, out, steps_per_epoch, reschedule, reporter)
    if ctx.is_main:
        describe_run(cfg, ctx, pm, dataset, dtype, steps_per_epoch, loader, reporter)
    probe = next(iter(loaders[1]))[0][:64].to(device) if pm.config.kind == "attn" else None
    prepare = loaders[0].prepare if isinstance(loaders[0], HeldLoader) else None  # augments on the device
    compiled = None
    if cfg.runtime.compile:
        why_not = whole_step_refusal(ctx, scaler.is_enabled())
        if why_not is None:
            compiled = CompiledStep(
                model=fwd, criterion=criterion, dtype=dtype, ctx=ctx, prepare=prepare, mixup=mixup
            )
        else:
            reporter.log(f"compile: the model's forward only, not the whole step ({why_not})")
            fwd = torch.compile(fwd)
        if ctx.is_main:
            reporter.log(
                "compile: torch.compile builds the step's kernels during the first steps, before any "
                "progress shows (on a CPU about a minute the first time, seconds once torch has cached "
                "them: BENCHMARKS.md, 'Training on a CPU'; on CPU it pays back only over long runs)"
            )
    return Loop(
        cfg=cfg,
        ctx=ctx,
        out=out,
        state=state,
        train_loader=loaders[0],
        val_loader=loaders[1],
        steps_per_epoch=steps_per_epoch,
        reporter=reporter,
        forward=fwd,
        criterion=criterion,
        dtype=dtype,
        prepare=prepare,
        mixup=mixup,
        compiled=compiled,
        probe=probe,
        config_json=config_doc(cfg, ctx, pm, state, loader, dataset.classes),
        classes=dataset.classes,
    )


def data_and_model(
    cfg: TrainConfig, ctx: Context, out: Path, saved: dict[str, Any] | None, reporter: Progress
) -> tuple[DataSpec, PhaseModel]:
    """The run's data and its model (a resumed run's model as saved; its weights load later), at one
    image size, the model's (which --init or a resumed run may set): synthetic images are made at
    it, and every loader's transform resizes to it."""

    def load_data(img_size: tuple[int, int] | None) -> DataSpec:
        def read(download: bool) -> DataSpec:
            return build_data(
                cfg.data.name,
                cfg.data.dir,
                img_size,
                download=download,
                num_classes=cfg.data.num_classes,
                seed=cfg.seed,
                train_samples=cfg.data.train_samples,
                val_samples=cfg.data.val_samples,
                holdout=cfg.data.holdout,
                crop_pct=cfg.recipe.crop_pct,
            )

        dataset = read(cfg.data.download) if ctx.is_main else None
        barrier(ctx)  # rank 0 downloads (if asked); the others then read
        return dataset if dataset is not None else read(False)

    def model_for(num_classes: int, data_chans: int | None = None) -> PhaseModel:
        if saved is None:
            return build_phase_model(cfg, num_classes, reporter.log, data_chans)
        mcfg = ViTConfig.from_dict(saved["model_config"], saved["kind"], out / LAST)  # weights: loaded below
        check_trainable(cfg, mcfg)  # as a fresh run would, before anything of that size is made
        model = VisionTransformer(mcfg, cfg.model.drop_path, conv_form=cfg.runtime.conv_form)  # type: ignore[arg-type]
        return PhaseModel(model, mcfg, saved["init"])

    if cfg.data.name == "synthetic":
        pm = model_for(cfg.data.num_classes)
        return load_data(pm.config.img_size), pm
    dataset = load_data(None)
    return dataset, model_for(dataset.num_classes, dataset.in_chans)


def resume_state(
    state: RunState,
    saved: dict[str, Any],
    here: dict[str, Any],
    cfg: TrainConfig,
    ctx: Context,
    out: Path,
    steps_per_epoch: int,
    reschedule: bool,
    reporter: Progress,
) -> None:
    """``state`` as ``saved`` left it (a fresh schedule where --epochs or --lr changed), and the
    environments it ran in; a move to another environment than ``here`` is said, and refused under
    `deterministic`."""
    history = saved.get("environments")
    changes = environment_changes(history, here)
    if changes and cfg.runtime.deterministic:
        raise CmhsaError(
            f"`deterministic`: the run was saved elsewhere ({'; '.join(changes)}), so resuming it here "
            "cannot give an uninterrupted run's bits; resume with the saved "
            "settings, or without `deterministic`",
            out / LAST,
        )
    if changes:
        reporter.log(
            f"resuming in another environment ({'; '.join(changes)}): from here the weights differ "
            "in the last bits from an uninterrupted run's "
            "(docs/training.md, 'When two runs are bit-identical')"
        )

    def fresh_schedule(opt: Any) -> Any:  # --epochs / --lr changed: a schedule from the new values
        lr, min_lr, warmup_lr = scaled_lrs(cfg, ctx.world)
        for group in opt.param_groups:
            group["initial_lr"] = group["lr"] = lr
        return build_scheduler(cfg, opt, lr, min_lr, warmup_lr, steps_per_epoch)

    state.load(saved, fresh_schedule if reschedule else None, steps_per_epoch)
    if plain_records(history):
        state.environments = list(history)
    # a record at every resume (cmhsa plot marks them), flagged apart from the run's first one
    state.environments.append({"epoch": state.epoch, "step": state.step, "resumed": True, **here})
    reporter.log(f"resumed {out / LAST} at epoch {state.epoch + 1}, step {state.step}")


def describe_run(
    cfg: TrainConfig,
    ctx: Context,
    pm: PhaseModel,
    dataset: DataSpec,
    dtype: torch.dtype | None,
    steps_per_epoch: int,
    loader: str,
    reporter: Progress,
) -> None:
    """The run's first log line (model, data, processes, precision, loader), and a note for grey
    images given 3 channels."""
    kind, n_params = pm.config.kind, sum(p.numel() for p in pm.model.parameters())
    reporter.log(
        f"{cfg.phase}: {kind} model, {n_params / 1e6:.2f} M parameters, {pm.config.in_chans} input "
        f"channel{'s' if pm.config.in_chans > 1 else ''}, {dataset.num_classes} classes; "
        f"{len(dataset.train)} train / {len(dataset.val)} val images; "
        f"{ctx.world} process(es) on {ctx.device}, "
        f"amp {str(dtype).removeprefix('torch.') if dtype else 'none'}; {steps_per_epoch} steps/epoch; "
        f"loader {loader}"
        + (f" ({cfg.runtime.workers} workers)" if loader == "workers" else "")
        + f", {cfg.runtime.threads} threads"
    )
    # from a checkpoint, phases.load_start's note says what the channels are
    if dataset.in_chans == 1 and pm.config.in_chans == 3 and not cfg.from_checkpoint:
        reporter.log(
            f"note: the {cfg.data.name} images are grey: with 3 input channels the "
            "model sees each one three "
            "times over (--in-chans 1: the same information, a third of the input)"
        )


def config_doc(
    cfg: TrainConfig,
    ctx: Context,
    pm: PhaseModel,
    state: RunState,
    loader: str,
    classes: tuple[str, ...] | None = None,
) -> str:
    """config.json: the flags, the model's config, how the run started and where it ran, and the
    names of the model's outputs where the data names them."""
    doc = {**cfg.to_dict(), "model": pm.config.to_dict(), "kind": pm.config.kind, "init_info": pm.init}
    doc["classes"] = None if classes is None else list(classes)
    doc["world_size"], doc["backend"] = ctx.world, ctx.backend
    doc["loader_used"], doc["threads_used"] = loader, cfg.runtime.threads
    doc["environments"] = state.environments  # threads, CPU code path, versions; one per (re)start
    doc["scaled_lr"] = dict(zip(("lr", "min_lr", "warmup_lr"), scaled_lrs(cfg, ctx.world), strict=True))
    return json_text(doc) + "\n"


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


def choose_loader(cfg: TrainConfig, dataset: DataSpec, in_chans: int) -> tuple[str, str]:
    """The loader ``cfg.data.loader`` resolves to, and why ``auto`` fell back to workers ('' if not).
    The one place that asks whether the data can be held: ``loader`` device is refused here when not."""
    if cfg.data.loader == "workers":
        return "workers", ""
    try:
        check_supported(cfg.recipe.aa, cfg.recipe.interpolation, cfg.recipe.remode)
    except CmhsaError as e:
        if cfg.data.loader == "device":
            raise
        return "workers", str(e).split(";")[0]
    why = holdable(dataset.train, in_chans) or holdable(dataset.val, in_chans)
    if why and cfg.data.loader == "device":
        raise CmhsaError(f"cannot hold the data on the device: {why}; use `loader` workers")
    return ("workers", why) if why else ("device", "")


def build_loaders(
    cfg: TrainConfig, dataset: DataSpec, mcfg: ViTConfig, ctx: Context, loader: str
) -> list[Any]:
    """Training and validation loaders of ``loader`` kind for a model of ``mcfg``."""
    img, chans, device = mcfg.img_size, mcfg.in_chans, ctx.device
    image_mode(chans)  # RGB or grey: what both loaders convert every image to
    if loader == "workers":
        return [
            build_loader(
                split,
                build_transform(img, training, cfg.recipe, chans),
                training=training,
                batch_size=cfg.recipe.batch_size,
                seed=cfg.seed,
                rank=ctx.rank,
                world=ctx.world,
                workers=cfg.runtime.workers,
                pin_memory=device.type == "cuda",
                in_chans=chans,
            )
            for split, training in ((dataset.train, True), (dataset.val, False))
        ]
    mean, std = channel_stats(chans)
    sampler = epoch_sampler(
        len(dataset.train),
        training=True,
        batch_size=cfg.recipe.batch_size,
        seed=cfg.seed,  # type: ignore[arg-type]
        rank=ctx.rank,
        world=ctx.world,
    )
    x, y = hold(dataset.train, chans, device)
    vx, vy = hold(dataset.val, chans, device)
    vx = eval_view(vx, img, cfg.recipe.crop_pct, cfg.recipe.interpolation)
    return [
        HeldLoader(x, y, sampler, augment_spec(cfg.recipe, img, mean, std), cfg.seed),
        HeldEvalLoader(vx, vy, cfg.recipe.batch_size, mean, std, ctx.rank, ctx.world),
    ]


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

    def save(self) -> None:
        loop, st, ctx = self.loop, self.loop.state, self.loop.ctx
        if ctx.is_main:  # checkpoint, metrics and config land together or not at all (state.save)
            also = {"metrics.csv": metrics_text(st.metrics), "config.json": loop.config_json}
            if (
                self.pending
            ):  # what is still to remove lands with them: `resume` finishes an interrupted removal
                also[PENDING_REMOVAL] = json_text(self.pending, indent=None) + "\n"

            def committed() -> None:
                self.wrote.append(loop.out / LAST)
                if self.pending:
                    remove_replaced(self.folder, self.pending)
                    self.pending.clear()

            st.save(self.folder, loop.cfg.runtime.keep, also, committed)
        barrier(ctx)

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

    def finished(self) -> RunResult:
        """The trained model (and its EMA) as safetensors, and the exports asked for."""
        loop, result = self.loop, self.result
        cfg, ctx, st = loop.cfg, loop.ctx, loop.state
        if ctx.is_main:
            result.model_path = loop.out / OUTPUT[cfg.phase]
            last = st.metrics[-1] if st.metrics else {}
            figures = {k: last[k] for k in ("epoch", "top1", "top5", "val_loss") if k in last}
            split = (cfg.data.name, cfg.data.holdout, cfg.data.val_samples)
            subset = {"train_samples": cfg.data.train_samples} if cfg.data.train_samples else {}
            meta = {
                "cmhsa.trained": f"{cfg.phase} {cfg.data.name}, {cfg.recipe.epochs} epochs",
                "cmhsa.init": json_text(st.init, indent=None),
                "cmhsa.result": json_text(  # the model card's figures, and where they were measured
                    {"data": cfg.data.name, "split": validation_split(*split), **subset, **figures},
                    indent=None,
                ),
                **to_metadata(loop.classes),
            }
            # into the folder this run holds, by name: never through a path its tree could redirect
            model = Target(self.folder, OUTPUT[cfg.phase])
            sha = save_model(model, st.model_config, st.model.state_dict(), meta)
            size = self.folder.lstat(model.name)
            saved = {"path": str(model.show()), "bytes": size.st_size if size else None, "sha256": sha}
            if st.ema is not None:
                ema = Target(self.folder, Path(model.name).stem + "-ema.safetensors")
                save_model(ema, st.model_config, st.ema.module.state_dict(), meta)
            loop.reporter.log(f"wrote {result.model_path}, metrics.csv, config.json")
            if isinstance(
                loop.val_loader, HeldEvalLoader
            ):  # measured: digits demo, 84.40 here, 84.68 in eval
                loop.reporter.log(
                    "note: this run's top-1 is on validation images the device loader resized with torch; "
                    "`cmhsa eval` resizes them with PIL, as timm does, so its top-1 can differ by an image "
                    "or two (the loss agrees to about 4 digits); `loader` workers measures as eval does"
                )
            if cfg.runtime.export_onnx or cfg.runtime.export_timm:
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
    stop = StopRequest()
    with stop.installed(), worker_deaths_at_fetch():
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
    return [f.finished() for f in files]
