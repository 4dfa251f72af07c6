"""A run built from its config: the config checked and resolved (a resume's own, with what it may
change), then the data, the model, the recipe and the run state a resume restores, the loaders,
the run's first line and its config.json."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api.common import amp_dtype
from ..config import ViTConfig
from ..data import NEEDS_DIR, DataSpec, build_data
from ..errors import CmhsaError
from ..loaders import (
    build_loader,
    build_transform,
    channel_stats,
    cpus,
    default_workers,
    epoch_sampler,
    image_mode,
)
from ..model import VisionTransformer
from ..options.training import RUNTIME_FIELDS, TrainConfig
from ..options.values import DATASETS
from ..text import json_text
from .augment import augment_spec, check_supported
from .distributed import Context, barrier
from .held import HeldEvalLoader, HeldLoader, eval_view, held_side, hold, holdable
from .loop import Loop, seed_everything
from .names import LAST
from .phases import PhaseModel, build_phase_model, check_trainable, freeze_attention, training_bytes
from .progress import PROGRESS_SECONDS, Progress, duration
from .recipe import (
    build_recipe,
    build_scheduler,
    check_recipe,
    scaled_lrs,
)
from .state import RunState, environment, environment_changes, plain_records
from .step import CompiledStep, probe_seconds, whole_step_refusal

RESUMABLE = ("epochs", "lr")  # what a resume may change; the schedule is then rebuilt


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
    if cfg.runtime.report_to == "tensorboard":
        from .tensorboard import check_installed

        check_installed()
    try:
        if out.exists() and not out.is_dir():
            raise CmhsaError("`out` names an existing file; give a folder for the run", out)
    except OSError as e:
        raise CmhsaError(f"cannot check the run folder ({e.strerror})", out) from None
    # this run's default workers, resolved in its own copy (its threads once a resume's are known:
    # run.run_threads)
    return cfg.replace(workers=default_workers() if cfg.runtime.workers is None else cfg.runtime.workers)


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
    loader, why = choose_loader(cfg, dataset, pm.config.in_chans, pm.config.img_size)
    if why:
        reporter.log(f"loader workers: {why}")
    loaders = build_loaders(cfg, dataset, pm.config, ctx, loader, reporter)
    steps_per_epoch = len(loaders[0].sampler) // cfg.update_batch  # optimizer updates
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
        if device.type == "cpu" and not cfg.runtime.compile and state.step == 0 and saved is None:
            said_slow(cfg, pm, steps_per_epoch, reporter)
    probe = next(iter(loaders[1]))[0][:64].to(device) if pm.config.kind == "attn" else None
    prepare = loaders[0].prepare if isinstance(loaders[0], HeldLoader) else None  # augments on the device
    compiled = None
    if cfg.runtime.compile:
        why_not = whole_step_refusal(ctx, scaler.is_enabled(), cfg.recipe.grad_accum_steps > 1)
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
        + f", {threads_said(cfg)}"
    )
    # from a checkpoint, phases.load_start's note says what the channels are
    if dataset.in_chans == 1 and pm.config.in_chans == 3 and not cfg.from_checkpoint:
        reporter.log(
            f"note: the {cfg.data.name} images are grey: with 3 input channels the "
            "model sees each one three "
            "times over (--in-chans 1: the same information, a third of the input)"
        )


def said_slow(cfg: TrainConfig, pm: PhaseModel, steps_per_epoch: int, reporter: Progress) -> None:
    """On a CPU, before the first step: a step that would outlast PROGRESS_SECONDS (the paper's model
    takes about a minute at its batch) is said, with the run's time and memory and what to do."""
    mcfg, batch, epochs = pm.config, cfg.recipe.batch_size, cfg.recipe.epochs
    step = probe_seconds(pm.model, (mcfg.in_chans, *mcfg.img_size), batch)
    if step <= PROGRESS_SECONDS:
        return
    memory = training_bytes(cfg, mcfg)[0]
    reporter.log(
        f"note: on this CPU a step of this model ({mcfg.num_params() / 1e6:.1f} M parameters, batch {batch}) "
        f"takes about {duration(step)}: an epoch of {steps_per_epoch} steps about "
        f"{duration(step * steps_per_epoch)}, the run's {epochs} epochs about "
        f"{duration(step * steps_per_epoch * epochs)}, in about {memory / 2**30:.1f} GiB; `preset` cpu "
        "trains a model sized for a CPU (28 px, d 48, 2 blocks: docs/training.md), a GPU this one"
    )


def threads_said(cfg: TrainConfig) -> str:
    """``2 threads``; where the default took fewer than the CPUs this process may use, why."""
    n, free = cfg.runtime.threads, cpus()
    said = f"{n} thread{'s' * (n != 1)}"  # type: ignore[operator]
    given = (cfg.given and "threads" in cfg.given) or os.environ.get("OMP_NUM_THREADS")
    if n < free and not given and not cfg.runtime.resume:  # type: ignore[operator]
        said += f" (of {free} CPUs: other work kept the rest busy as the run began; `threads` sets them)"
    return said


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


def choose_loader(
    cfg: TrainConfig, dataset: DataSpec, in_chans: int, img_size: tuple[int, int]
) -> tuple[str, str]:
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
    side = held_side(img_size, cfg.recipe.crop_pct, cfg.recipe.scale[0])
    why = holdable(dataset.train, in_chans, side) or holdable(dataset.val, in_chans, side)
    if why and cfg.data.loader == "device":
        raise CmhsaError(f"cannot hold the data on the device: {why}; use `loader` workers")
    return ("workers", why) if why else ("device", "")


def build_loaders(
    cfg: TrainConfig, dataset: DataSpec, mcfg: ViTConfig, ctx: Context, loader: str, reporter: Progress
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
                batch_size=cfg.update_batch if training else cfg.recipe.batch_size,
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
        batch_size=cfg.update_batch,  # an update's images; the step splits them into micro-batches
        seed=cfg.seed,  # type: ignore[arg-type]
        rank=ctx.rank,
        world=ctx.world,
    )
    side = held_side(img, cfg.recipe.crop_pct, cfg.recipe.scale[0])
    counts = [
        reporter.counting(f"loading the {what} images", len(split), "images")
        for what, split in (("training", dataset.train), ("validation", dataset.val))
    ]
    x, y = hold(dataset.train, chans, device, side, counts[0])
    vx, vy = hold(dataset.val, chans, device, side, counts[1])
    vx = eval_view(vx, img, cfg.recipe.crop_pct, cfg.recipe.interpolation)
    return [
        HeldLoader(x, y, sampler, augment_spec(cfg.recipe, img, mean, std), cfg.seed),
        HeldEvalLoader(vx, vy, cfg.recipe.batch_size, mean, std, ctx.rank, ctx.world),
    ]
