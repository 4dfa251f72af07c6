"""The training loop of both phases: DeiT's recipe through timm, DDP, AMP, EMA, exact resume.

    run(TrainConfig(phase="phase1", data="digits", ...))

One epoch: seed every RNG from (seed, epoch, rank); for each batch, Mixup/CutMix, forward under
autocast, one all-reduce that carries the loss and any stop request (so every rank agrees to stop
before the backward pass), backward, step, EMA, scheduler; then evaluation on the val split,
``metrics.csv`` and ``checkpoint-last.pt``. Ctrl-C / SIGTERM finish the current step, save and
stop; a non-finite loss stops before it reaches the weights and keeps the last good checkpoint.
"""

from __future__ import annotations

import contextlib
import csv
import io
import json
import math
import random
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from convit_convert.atomic import atomic_write_text, check_writable
from convit_convert.checkpoint import save_checkpoint
from convit_convert.config import ViTConfig
from convit_convert.errors import CmhsaError
from convit_convert.models import build_model

from . import checkpointing
from .config import RUNTIME_FIELDS, TrainConfig
from .data import build_data, build_loader, build_transform, sample_seed
from .distributed import Context, all_reduce_sum, barrier, setup, teardown
from .phases import PhaseModel, TrainingError, build_phase_model
from .progress import Reporter

METRICS = ("epoch", "train_loss", "val_loss", "top1", "top5", "lr", "epoch_seconds", "images_per_s")
EMA_METRICS = ("ema_val_loss", "ema_top1", "ema_top5")
OUTPUT = {"phase1": "conv.safetensors", "phase2": "vit.safetensors"}
AMP = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}
RESUMABLE = ("epochs", "lr")  # flags a --resume may change; the schedule is then rebuilt


@dataclass
class RunResult:
    out: Path
    rows: list[dict[str, Any]] = field(default_factory=list)
    stopped: str | None = None  # "SIGINT" / "SIGTERM" / "limit" when stopped before the end
    model_path: Path | None = None


class StopRequest:
    """SIGINT/SIGTERM set a flag the loop reads after each step; a second Ctrl-C aborts at once."""

    def __init__(self) -> None:
        self.signal: str | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

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


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def scaled_lrs(cfg: TrainConfig, world: int) -> tuple[float, float, float]:
    """DeiT's linear scaling: every learning rate × global batch / lr_base_batch."""
    scale = cfg.batch_size * world / cfg.lr_base_batch
    return cfg.peak_lr * scale, cfg.min_lr * scale, cfg.warmup_lr * scale


def default_workers() -> int:
    """Data-loading workers when --workers is not given: up to 4, never more than the CPUs this
    process may use (PyTorch warns above that)."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(4, cpus)


def check_recipe(cfg: TrainConfig) -> None:
    """Every recipe flag against what timm actually accepts (its optimizer registry, scheduler
    factory and transform parsers) and the numbers against their ranges, before anything is read or
    created: bad input is one line (CmhsaError) naming the flag."""
    from timm.optim import list_optimizers

    numbers = [
        ("--lr", cfg.lr, cfg.lr is None or cfg.lr > 0, "> 0"),
        ("--min-lr", cfg.min_lr, cfg.min_lr >= 0, ">= 0"),
        ("--warmup-lr", cfg.warmup_lr, cfg.warmup_lr >= 0, ">= 0"),
        ("--warmup-epochs", cfg.warmup_epochs, cfg.warmup_epochs >= 0, ">= 0"),
        ("--weight-decay", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0"),
        ("--workers", cfg.workers, cfg.workers is None or cfg.workers >= 0, ">= 0"),
        ("--drop-path", cfg.drop_path, 0 <= cfg.drop_path < 1, "in [0, 1)"),
        ("--smoothing", cfg.smoothing, 0 <= cfg.smoothing < 1, "in [0, 1)"),
        ("--reprob", cfg.reprob, 0 <= cfg.reprob <= 1, "in [0, 1]"),
        ("--hflip", cfg.hflip, 0 <= cfg.hflip <= 1, "in [0, 1]"),
        ("--scale", cfg.scale, 0 < cfg.scale[0] <= cfg.scale[1] <= 1, "0 < min <= max <= 1"),
        ("--mixup", cfg.mixup, cfg.mixup >= 0, ">= 0"),
        ("--cutmix", cfg.cutmix, cfg.cutmix >= 0, ">= 0"),
    ]
    for flag, value, ok, want in numbers:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise CmhsaError(f"{flag} must be {want}, got {value}")
    if cfg.batch_size < 1 or cfg.epochs < 1:
        raise CmhsaError(f"--batch-size and --epochs must be positive (got {cfg.batch_size}, {cfg.epochs})")
    if (cfg.mixup > 0 or cfg.cutmix > 0) and cfg.batch_size % 2:
        raise CmhsaError(f"Mixup/CutMix need an even --batch-size, got {cfg.batch_size}")
    known = list_optimizers()
    if cfg.opt.lower() not in known:
        raise CmhsaError(
            f"--opt {cfg.opt!r} is not one of timm's {len(known)} optimizers (timm.optim.list_optimizers())"
        )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        build_scheduler(cfg, probe, 1.0, 0.0, 0.0, 1)
    except Exception as e:
        raise CmhsaError(f"--sched {cfg.sched!r}: timm's scheduler factory refuses it ({e})") from None
    from .data import build_transform

    size = (cfg.img_size, cfg.img_size)
    checks = (
        (False, f"--interpolation {cfg.interpolation!r}"),
        (True, f"--aa / --interpolation / --remode ({cfg.aa!r}, {cfg.interpolation!r}, {cfg.remode!r})"),
    )
    for training, flags in checks:
        try:
            build_transform(size, training, cfg, 3)
        except CmhsaError:
            raise
        except Exception as e:
            raise CmhsaError(
                f"{flags}: timm's create_transform refuses it ({type(e).__name__}: {e})"
            ) from None


def build_scheduler(
    cfg: TrainConfig, optimizer: Any, lr: float, min_lr: float, warmup_lr: float, steps_per_epoch: int
):
    """timm's scheduler for ``cfg.epochs`` epochs, stepped per epoch (DeiT's)."""
    from timm.scheduler import create_scheduler_v2

    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=cfg.sched,
        num_epochs=cfg.epochs,
        min_lr=min_lr,
        warmup_lr=warmup_lr,
        warmup_epochs=cfg.warmup_epochs,
        step_on_epochs=True,
        updates_per_epoch=steps_per_epoch,
    )
    if scheduler is None:
        raise ValueError(f"no scheduler named {cfg.sched!r}")
    return scheduler


def build_recipe(cfg: TrainConfig, model: nn.Module, num_classes: int, world: int, steps_per_epoch: int):
    """Optimizer, scheduler, Mixup/CutMix and loss, all timm's, with DeiT's settings."""
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2

    lr, min_lr, warmup_lr = scaled_lrs(cfg, world)
    optimizer = create_optimizer_v2(
        model, opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, eps=cfg.opt_eps, betas=tuple(cfg.opt_betas)
    )  # reads model.no_weight_decay(); biases and norms get no decay either
    scheduler = build_scheduler(cfg, optimizer, lr, min_lr, warmup_lr, steps_per_epoch)
    mixup = None
    if cfg.mixup > 0 or cfg.cutmix > 0:
        mixup = Mixup(
            mixup_alpha=cfg.mixup,
            cutmix_alpha=cfg.cutmix,
            prob=cfg.mixup_prob,
            switch_prob=cfg.mixup_switch_prob,
            mode="batch",
            label_smoothing=cfg.smoothing,
            num_classes=num_classes,
        )
        criterion: nn.Module = SoftTargetCrossEntropy()  # smoothing is folded into the mixed targets
    elif cfg.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=cfg.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    return optimizer, scheduler, mixup, criterion


def amp_dtype(cfg: TrainConfig, device: torch.device) -> torch.dtype | None:
    name = cfg.amp if cfg.amp != "auto" else ("bf16" if device.type == "cuda" else "none")
    if name not in AMP:
        raise CmhsaError(f"--amp must be auto, bf16, fp16 or none, got {cfg.amp!r}")
    if name == "fp16" and device.type != "cuda":
        raise CmhsaError("--amp fp16 needs CUDA (use bf16 or none on CPU)")
    return AMP[name]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: Any, device: torch.device, dtype: torch.dtype | None, ctx: Context | None = None
) -> dict[str, float]:
    """Cross-entropy, top-1 and top-5 (%) over the whole loader, summed over all ranks."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, dtype):
            logits = model(x)
        logits = logits.float()
        k = min(5, logits.shape[1])
        top = logits.topk(k, dim=1).indices
        hit = top == y[:, None]
        sums += torch.stack(
            [
                F.cross_entropy(logits, y, reduction="sum").double(),
                hit[:, 0].sum().double(),
                hit.any(dim=1).sum().double(),
                torch.tensor(float(len(y)), dtype=torch.float64, device=device),
            ]
        )
    if ctx is not None:
        all_reduce_sum(sums, ctx)
    model.train(was_training)
    n = max(sums[3].item(), 1.0)
    return {
        "val_loss": sums[0].item() / n,
        "top1": 100 * sums[1].item() / n,
        "top5": 100 * sums[2].item() / n,
    }


def non_finite_message(loss: float, epoch: int, step: int, out: Path) -> str:
    """What a user can do after a non-finite loss: the advice depends on whether a checkpoint exists."""
    head = f"non-finite loss ({loss}) at epoch {epoch + 1}, step {step + 1}: stopped before it reached the weights; "
    last = out / checkpointing.LAST
    if last.exists():
        return head + (
            f"the last good checkpoint is {last}: continue from it with --resume and a lower --lr (the schedule "
            "is rebuilt, so the run is no longer one uninterrupted run), or start a new --out with a lower --lr, "
            "--amp none or --clip-grad"
        )
    return head + "no checkpoint was saved yet: start again with a lower --lr, --amp none or --clip-grad"


def write_metrics(path: Path, rows: list[dict[str, Any]]) -> None:
    cols = list(METRICS) + [c for c in EMA_METRICS if rows and c in rows[0]]
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=cols, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    atomic_write_text(path, buf.getvalue())


def run(cfg: TrainConfig, *, console: Any = None, stop_after_steps: int | None = None) -> RunResult:
    """Train one phase as ``cfg`` says. ``stop_after_steps`` stops (and saves) like a SIGTERM
    would after that many optimizer steps in total: tests use it to interrupt a run."""
    ctx = setup(cfg.device)
    try:
        with deterministic_kernels(cfg.deterministic):
            return _run(cfg, ctx, console, stop_after_steps)
    finally:
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


def _resume_state(cfg: TrainConfig, out: Path, log: Any) -> tuple[TrainConfig, dict[str, Any] | None]:
    if not cfg.resume:
        if (out / checkpointing.LAST).exists():
            raise CmhsaError(
                "holds a previous run (checkpoint-last.pt): pass --resume to continue it, or choose another --out",
                out,
            )
        return cfg, None
    state = checkpointing.load(out / checkpointing.LAST)
    saved = TrainConfig.from_dict(state["config"])
    changed = saved.training_differences(cfg)
    for name in RESUMABLE:  # what a resumed run may change, as timm's train.py allows
        if name in changed:
            old, new = getattr(saved, name), getattr(cfg, name)
            if name == "epochs" and new < state["epoch"] + (state["step"] > 0):
                raise CmhsaError(f"--epochs {new}: the run has already trained {state['epoch']} epochs", out)
            setattr(saved, name, new)
            log(
                f"resuming with --{name.replace('_', '-')} {new} instead of {old}: the schedule is rebuilt for it, "
                "so the result is no longer that of one uninterrupted run"
                if name == "lr"
                else f"extending the run from {old} to {new} epochs; the schedule is rebuilt for {new} epochs"
            )
    ignored = [n for n in changed if n not in RESUMABLE]
    if ignored:
        log(f"resuming with the saved run's settings; ignoring changed flag(s): {', '.join(ignored)}")
    for name in RUNTIME_FIELDS:  # how this invocation runs (resume included), not what it computes
        if name != "extra":
            setattr(saved, name, getattr(cfg, name))
    saved.extra["rescheduled"] = any(n in changed for n in RESUMABLE)
    return saved, state


def _run(cfg: TrainConfig, ctx: Context, console: Any, stop_after_steps: int | None) -> RunResult:
    out = Path(cfg.out).expanduser()
    check_recipe(cfg)
    if cfg.workers is None:
        cfg.workers = default_workers()
    if out.exists() and not out.is_dir():
        raise CmhsaError("--out names an existing file; give a folder for the run", out)
    created = not out.exists()
    if ctx.is_main:
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise CmhsaError(f"cannot create the run folder ({e.strerror})", out) from None
        check_writable(out / "config.json")
    barrier(ctx)
    reporter = Reporter(ctx.is_main, cfg.epochs, cfg.log_every, console)
    try:
        cfg, state = _resume_state(cfg, out, reporter.log)
        reporter.epochs = cfg.epochs
        return _train(cfg, ctx, out, state, reporter, stop_after_steps)
    except (CmhsaError, TrainingError):
        if created and ctx.is_main:  # refused before writing anything: leave no empty run folder
            with contextlib.suppress(OSError):
                out.rmdir()
        raise
    finally:
        reporter.close()


def _train(
    cfg: TrainConfig,
    ctx: Context,
    out: Path,
    state: dict[str, Any] | None,
    reporter: Reporter,
    stop_after_steps: int | None,
) -> RunResult:
    device = ctx.device
    dtype = amp_dtype(cfg, device)
    seed_everything(cfg.seed + ctx.rank)

    def data(download: bool):
        img = (cfg.img_size, cfg.img_size)
        return build_data(
            cfg.data, cfg.data_dir, img, download=download, num_classes=cfg.num_classes, seed=cfg.seed
        )

    if ctx.is_main:
        spec = data(cfg.download)
    barrier(ctx)  # rank 0 downloads (if asked); the others then read
    if not ctx.is_main:
        spec = data(False)

    if state is None:
        pm = build_phase_model(cfg, spec.num_classes, reporter.log)
    else:
        mcfg = ViTConfig.from_dict(state["model_config"], state["kind"])
        pm = PhaseModel(build_model(state["kind"], mcfg, cfg.drop_path), state["kind"], mcfg, state["init"])
        pm.model.load_state_dict(state["model"])
    model = pm.model.to(device).train()
    img = pm.config.img_size

    pin = device.type == "cuda"
    chans = pm.config.in_chans
    train_loader = build_loader(
        spec.train, build_transform(img, True, cfg, chans), training=True, batch_size=cfg.batch_size,
        seed=cfg.seed, rank=ctx.rank, world=ctx.world, workers=cfg.workers, pin_memory=pin, in_chans=chans,
    )  # fmt: skip
    val_loader = build_loader(
        spec.val, build_transform(img, False, cfg, chans), training=False, batch_size=cfg.batch_size,
        seed=cfg.seed, rank=ctx.rank, world=ctx.world, workers=cfg.workers, pin_memory=pin, in_chans=chans,
    )  # fmt: skip
    steps_per_epoch = len(train_loader.sampler) // cfg.batch_size

    fwd: nn.Module = model
    if ctx.distributed:
        from torch.nn.parallel import DistributedDataParallel

        fwd = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if cfg.compile:
        fwd = torch.compile(fwd)
    optimizer, scheduler, mixup, criterion = build_recipe(
        cfg, model, spec.num_classes, ctx.world, steps_per_epoch
    )
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    ema = None
    if cfg.model_ema:
        from timm.utils import ModelEmaV3

        ema = ModelEmaV3(model, decay=cfg.model_ema_decay)

    start_epoch, start_step, global_step, rows = 0, 0, 0, []
    partial = {"loss_sum": 0.0, "seconds": 0.0, "images": 0}
    if state is not None:
        optimizer.load_state_dict(state["optimizer"])
        if cfg.extra.get("rescheduled"):  # --epochs / --lr changed: a fresh schedule from the new values
            lr, min_lr, warmup_lr = scaled_lrs(cfg, ctx.world)
            for group in optimizer.param_groups:
                group["initial_lr"] = group["lr"] = lr
            scheduler = build_scheduler(cfg, optimizer, lr, min_lr, warmup_lr, steps_per_epoch)
            scheduler.step(state["epoch"])
        else:
            scheduler.load_state_dict(state["scheduler"])
        scaler.load_state_dict(state["scaler"])
        if ema is not None and state.get("ema") is not None:
            ema.load_state_dict(state["ema"])
        start_epoch, start_step, global_step = state["epoch"], state["step"], state["global_step"]
        rows, partial = list(state["metrics"]), dict(state["partial"])
        reporter.log(f"resumed {out / checkpointing.LAST} at epoch {start_epoch + 1}, step {start_step}")
    if ctx.is_main:
        doc = {**cfg.to_dict(), "model": pm.config.to_dict(pm.kind), "kind": pm.kind, "init_info": pm.init}
        doc["world_size"] = ctx.world
        doc["backend"] = ctx.backend
        doc["scaled_lr"] = dict(zip(("lr", "min_lr", "warmup_lr"), scaled_lrs(cfg, ctx.world), strict=True))
        atomic_write_text(out / "config.json", json.dumps(doc, indent=2) + "\n")
        n_params = sum(p.numel() for p in model.parameters())
        reporter.log(
            f"{cfg.phase}: {pm.kind} model, {n_params / 1e6:.2f} M parameters, {spec.num_classes} classes; "
            f"{len(spec.train)} train / {len(spec.val)} val images; {ctx.world} process(es) on {device}, "
            f"amp {str(dtype).removeprefix('torch.') if dtype else 'none'}; {steps_per_epoch} steps/epoch"
        )

    def snapshot(epoch: int, step: int) -> dict[str, Any]:
        return {
            "model": model.state_dict(),
            "model_config": pm.config.to_dict(pm.kind),
            "kind": pm.kind,
            "init": pm.init,
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "scaler": scaler.state_dict(),
            "ema": None if ema is None else ema.state_dict(),
            "epoch": epoch,  # epochs finished
            "step": step,  # steps done in the unfinished epoch (0 at an epoch's end)
            "global_step": global_step,
            "rng": checkpointing.rng_state(),
            "config": cfg.to_dict(),
            "metrics": rows,
            "partial": partial,
        }

    def save(epoch: int, step: int) -> None:
        if ctx.is_main:
            checkpointing.save(out, snapshot(epoch, step), cfg.keep)
        barrier(ctx)

    result = RunResult(out, rows)
    stop = StopRequest()
    with stop.installed():
        for epoch in range(start_epoch, cfg.epochs):
            if epoch == start_epoch and start_step > 0:
                checkpointing.set_rng_state(state["rng"])  # type: ignore[index]
            else:
                seed_everything(sample_seed(cfg.seed, epoch, 10_000 + ctx.rank))
                partial = {"loss_sum": 0.0, "seconds": 0.0, "images": 0}
            first = start_step if epoch == start_epoch else 0
            train_loader.sampler.set_epoch(epoch, first)
            reporter.start_epoch(epoch, steps_per_epoch, first)
            lr = optimizer.param_groups[0]["lr"]
            t_last = time.perf_counter()
            for step, (x, y) in enumerate(train_loader, start=first):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if mixup is not None:
                    x, y = mixup(x, y)
                with autocast(device, dtype):
                    loss = criterion(fwd(x), y)
                limit = stop_after_steps is not None and global_step + 1 >= stop_after_steps
                flags = torch.stack(
                    [loss.detach().float(), torch.tensor(float(stop.signal is not None), device=device)]
                )
                all_reduce_sum(flags, ctx)
                mean_loss = flags[0].item() / ctx.world
                if not math.isfinite(mean_loss):
                    raise TrainingError(non_finite_message(mean_loss, epoch, step, out))
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                if cfg.clip_grad is not None:
                    scaler.unscale_(optimizer)
                    nn.utils.clip_grad_norm_(model.parameters(), cfg.clip_grad)
                scaler.step(optimizer)
                scaler.update()
                global_step += 1
                if ema is not None:
                    ema.update(model, step=global_step)
                scheduler.step_update(num_updates=global_step)
                now = time.perf_counter()
                partial["loss_sum"] += mean_loss
                partial["seconds"] += now - t_last
                partial["images"] += len(x) * ctx.world
                reporter.step(epoch, step, mean_loss, lr, len(x) * ctx.world / max(now - t_last, 1e-9))
                t_last = now
                if flags[1].item() > 0 or limit:
                    result.stopped = stop.signal or "limit"
                    save(epoch, step + 1)
                    reporter.log(
                        f"stopped ({result.stopped}) at epoch {epoch + 1}, step {step + 1}; saved "
                        f"{out / checkpointing.LAST}; continue with the same command and --resume"
                    )
                    return result
            scheduler.step(epoch + 1)
            metrics = evaluate(model, val_loader, device, dtype, ctx)
            row: dict[str, Any] = {
                "epoch": epoch + 1,
                "train_loss": partial["loss_sum"] / max(steps_per_epoch, 1),
                **metrics,
                "lr": lr,
                "epoch_seconds": partial["seconds"],
                "images_per_s": partial["images"] / max(partial["seconds"], 1e-9),
            }
            if ema is not None:
                em = evaluate(ema.module, val_loader, device, dtype, ctx)
                row.update(ema_val_loss=em["val_loss"], ema_top1=em["top1"], ema_top5=em["top5"])
            rows.append(row)
            reporter.end_epoch(row)
            if ctx.is_main:
                write_metrics(out / "metrics.csv", rows)
            save(epoch + 1, 0)

    if ctx.is_main:
        result.model_path = out / OUTPUT[cfg.phase]
        meta = {"cmhsa.trained": f"{cfg.phase} {cfg.data}, {cfg.epochs} epochs"}
        save_checkpoint(result.model_path, pm.kind, pm.config, model.state_dict(), meta)
        if ema is not None:
            ema_path = result.model_path.with_name(result.model_path.stem + "-ema.safetensors")
            save_checkpoint(ema_path, pm.kind, pm.config, ema.module.state_dict(), meta)
        reporter.log(f"wrote {result.model_path}, metrics.csv, config.json")
    barrier(ctx)
    return result
