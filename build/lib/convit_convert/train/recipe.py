"""DeiT's recipe through timm: flags checked against what timm accepts, then the optimizer,
scheduler, Mixup/CutMix, loss and mixed precision."""

from __future__ import annotations

import math
import os
from typing import Any

import torch
from torch import nn

from ..data import build_transform
from ..errors import CmhsaError
from ..model import ATTENTION_PARAMS
from ..starts import check_start
from .augment import check_supported
from .config import INIT_STARTS, LOADERS, TrainConfig


def scaled_lrs(cfg: TrainConfig, world: int) -> tuple[float, float, float]:
    """DeiT's linear scaling: every learning rate × global batch / lr_base_batch."""
    scale = cfg.batch_size * world / cfg.lr_base_batch
    return cfg.peak_lr * scale, cfg.min_lr * scale, cfg.warmup_lr * scale


def cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers() -> int:
    """Workers of the workers loader when `workers` is not given: up to 4, never more than the CPUs
    this process may use (PyTorch warns above that). On 2 CPUs, 0, 1 and 2 workers ran the same
    in-memory data within this VM's run-to-run spread (BENCHMARKS.md, 'Small-data training')."""
    return min(4, cpus())


def default_threads() -> int:
    """torch CPU threads when `threads` is not given: every CPU this process may use (BENCHMARKS.md,
    'Small-data training': on 2 cores, 2 threads trained 1.3x (phase 1) and 1.7x (phase 2) faster
    than 1 with the device loader)."""
    return cpus()


def check_recipe(cfg: TrainConfig) -> None:
    """Every recipe flag against what timm actually accepts (its optimizer registry, scheduler
    factory and transform parsers) and the numbers against their ranges, before anything is read or
    created: bad input is one line (CmhsaError) naming the flag."""
    from timm.optim import list_optimizers

    numbers = [
        ("`lr`", cfg.lr, cfg.lr is None or cfg.lr > 0, "> 0"),
        ("`min_lr`", cfg.min_lr, cfg.min_lr >= 0, ">= 0"),
        ("`warmup_lr`", cfg.warmup_lr, cfg.warmup_lr >= 0, ">= 0"),
        ("`warmup_epochs`", cfg.warmup_epochs, cfg.warmup_epochs >= 0, ">= 0"),
        ("`weight_decay`", cfg.weight_decay, cfg.weight_decay >= 0, ">= 0"),
        (
            "`workers`",
            cfg.workers,
            cfg.workers is None or 0 <= cfg.workers <= 4 * cpus(),
            f"in 0..{4 * cpus()}",
        ),
        (
            "`threads`",
            cfg.threads,
            cfg.threads is None or 1 <= cfg.threads <= 4 * cpus(),
            f"in 1..{4 * cpus()}",
        ),
        ("`drop_path`", cfg.drop_path, 0 <= cfg.drop_path < 1, "in [0, 1)"),
        ("`smoothing`", cfg.smoothing, 0 <= cfg.smoothing < 1, "in [0, 1)"),
        ("`reprob`", cfg.reprob, 0 <= cfg.reprob <= 1, "in [0, 1]"),
        ("`hflip`", cfg.hflip, 0 <= cfg.hflip <= 1, "in [0, 1]"),
        ("`scale`", cfg.scale, 0 < cfg.scale[0] <= cfg.scale[1] <= 1, "0 < min <= max <= 1"),
        ("`mixup`", cfg.mixup, cfg.mixup >= 0, ">= 0"),
        ("`cutmix`", cfg.cutmix, cfg.cutmix >= 0, ">= 0"),
        ("`attn_lr_mult`", cfg.attn_lr_mult, cfg.attn_lr_mult is None or cfg.attn_lr_mult > 0, "> 0"),
        ("`mimetic_alpha`", cfg.mimetic_alpha, cfg.mimetic_alpha >= 0, ">= 0"),
        ("`mimetic_beta`", cfg.mimetic_beta, cfg.mimetic_beta >= 0, ">= 0"),
    ]
    for flag, value, ok, want in numbers:
        if not ok or (isinstance(value, float) and not math.isfinite(value)):
            raise CmhsaError(f"{flag} must be {want}, got {value}")
    if cfg.batch_size < 1 or cfg.epochs < 1:
        raise CmhsaError(f"`batch_size` and `epochs` must be positive (got {cfg.batch_size}, {cfg.epochs})")
    if cfg.loader not in LOADERS:
        raise CmhsaError(f"`loader` must be one of {', '.join(LOADERS)}, got {cfg.loader!r}")
    if cfg.loader == "device":
        check_supported(cfg.aa, cfg.interpolation, cfg.remode)
    if cfg.pinning not in (None, "hard", "gated"):
        raise CmhsaError(f"`pinning` must be hard or gated, got {cfg.pinning!r}")
    if cfg.phase == "phase2" and cfg.init in INIT_STARTS:
        check_start(cfg.init, cfg.pinning_used, cfg.impulse_offsets)
    if (cfg.mixup > 0 or cfg.cutmix > 0) and cfg.batch_size % 2:
        raise CmhsaError(f"Mixup/CutMix need an even `batch_size`, got {cfg.batch_size}")
    known = list_optimizers()
    if cfg.opt.lower() not in known:
        raise CmhsaError(
            f"`opt` {cfg.opt!r} is not one of timm's {len(known)} optimizers (timm.optim.list_optimizers())"
        )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        build_scheduler(cfg, probe, 1.0, 0.0, 0.0, 1)
    except Exception as e:
        raise CmhsaError(f"`sched` {cfg.sched!r}: timm's scheduler factory refuses it ({e})") from None
    size = (cfg.img_size, cfg.img_size)
    checks = (
        (False, f"`interpolation` {cfg.interpolation!r}"),
        (True, f"`aa` / `interpolation` / `remode` ({cfg.aa!r}, {cfg.interpolation!r}, {cfg.remode!r})"),
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


def param_groups(cfg: TrainConfig, model: nn.Module) -> Any:
    """timm's weight-decay groups (model.no_weight_decay(), biases and norms undecayed); with
    an attention learning-rate scale != 1 (``attn_lr_mult``; default 10 from a checkpoint) the attention parameters (W_Q, W_K, gates, biases, sinks) get their own
    groups, whose ``lr_scale`` timm's schedulers apply."""
    from timm.optim import param_groups_weight_decay

    groups = param_groups_weight_decay(model, cfg.weight_decay, no_weight_decay_list=model.no_weight_decay())
    if cfg.attn_lr_scale == 1.0:
        return groups
    attention = {id(p) for n, p in model.named_parameters() if n.endswith(ATTENTION_PARAMS)}
    split = []
    for g in groups:
        for scaled in (False, True):
            params = [p for p in g["params"] if (id(p) in attention) == scaled]
            if params:
                split.append({**g, "params": params, **({"lr_scale": cfg.attn_lr_scale} if scaled else {})})
    return split


def build_recipe(cfg: TrainConfig, model: nn.Module, num_classes: int, world: int, steps_per_epoch: int):
    """Optimizer, scheduler, Mixup/CutMix and loss, all timm's, with DeiT's settings."""
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2

    lr, min_lr, warmup_lr = scaled_lrs(cfg, world)
    optimizer = create_optimizer_v2(
        param_groups(cfg, model), opt=cfg.opt, lr=lr, weight_decay=cfg.weight_decay, eps=cfg.opt_eps,
        betas=tuple(cfg.opt_betas),
    )  # fmt: skip
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
