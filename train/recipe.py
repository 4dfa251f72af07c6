"""DeiT's recipe through timm: flags checked against what timm accepts, then the optimizer,
scheduler, Mixup/CutMix, loss and mixed precision."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import CmhsaError
from ..loaders import build_transform
from ..model import ATTENTION_PARAMS
from ..options.training import INIT_STARTS, TrainConfig
from ..starts import check_start
from .augment import check_aa_numbers, check_supported
from .step import fusable


def scaled_lrs(cfg: TrainConfig, world: int) -> tuple[float, float, float]:
    """DeiT's linear scaling: every learning rate × global batch / lr_base_batch (the batch of an
    update: `grad_accum_steps` micro-batches of `batch_size` on each process)."""
    scale = cfg.update_batch * world / cfg.recipe.lr_base_batch
    return cfg.peak_lr * scale, cfg.recipe.min_lr * scale, cfg.recipe.warmup_lr * scale


def check_recipe(cfg: TrainConfig) -> None:
    """Every recipe flag against what timm actually accepts (its optimizer registry, scheduler
    factory and transform parsers), before anything is read or
    created: bad input is one line (CmhsaError) naming the flag."""
    from timm.optim import get_optimizer_info, list_optimizers

    r = cfg.recipe  # its types, ranges and fixed choices were checked when cfg was made
    check_aa_numbers(r.aa)
    if cfg.data.loader == "device":
        check_supported(r.aa, r.interpolation, r.remode)
    if cfg.phase == "phase2" and cfg.start.init in INIT_STARTS:
        check_start(cfg.start.init, cfg.conversion.pinning, cfg.start.impulse_offsets)
    if (r.mixup > 0 or r.cutmix > 0) and cfg.update_batch % 2:
        what = "`batch_size`" if r.grad_accum_steps == 1 else "batch (`batch_size` × `grad_accum_steps`)"
        raise CmhsaError(f"Mixup/CutMix need an even {what}, got {cfg.update_batch}")
    known = list_optimizers()
    if r.opt.lower() not in known:
        raise CmhsaError(
            f"`opt` {r.opt!r} is not one of timm's {len(known)} optimizers (timm.optim.list_optimizers())"
        )
    if get_optimizer_info(r.opt.lower()).second_order:  # the loop's backward builds no graph of the grads
        raise CmhsaError(
            f"`opt` {r.opt!r} is second-order (it needs the gradients' own graph, which cmhsa's training "
            "step does not build); choose a first-order optimizer such as adamw"
        )
    probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    try:
        build_scheduler(cfg, probe, 1.0, 0.0, 0.0, 1)
    except Exception as e:
        raise CmhsaError(f"`sched` {r.sched!r}: timm's scheduler factory refuses it ({e})") from None
    size = (cfg.model.img_size, cfg.model.img_size)
    checks = (
        (False, f"`interpolation` {r.interpolation!r}"),
        (True, f"`aa` / `interpolation` / `remode` ({r.aa!r}, {r.interpolation!r}, {r.remode!r})"),
    )
    for training, flags in checks:
        try:
            build_transform(size, training, cfg.recipe, 3)
        except CmhsaError:
            raise
        except Exception as e:
            raise CmhsaError(
                f"{flags}: timm's create_transform refuses it ({type(e).__name__}: {e})"
            ) from None


def build_scheduler(
    cfg: TrainConfig, optimizer: Any, lr: float, min_lr: float, warmup_lr: float, steps_per_epoch: int
):
    """timm's scheduler for ``cfg.recipe.epochs`` epochs, stepped per epoch (DeiT's)."""
    r = cfg.recipe
    from timm.scheduler import create_scheduler_v2

    scheduler, _ = create_scheduler_v2(
        optimizer,
        sched=r.sched,
        num_epochs=r.epochs,
        min_lr=min_lr,
        warmup_lr=warmup_lr,
        warmup_epochs=r.warmup_epochs,
        step_on_epochs=True,
        updates_per_epoch=steps_per_epoch,
    )
    if scheduler is None:
        raise ValueError(f"no scheduler named {r.sched!r}")
    return scheduler


def param_groups(cfg: TrainConfig, model: nn.Module) -> Any:
    """timm's weight-decay groups (model.no_weight_decay(), biases and norms undecayed); with
    an attention learning-rate scale != 1 (``attn_lr_mult``; default 10 from a checkpoint) the
    attention parameters (W_Q, W_K, gates, biases, sinks) get their own groups, whose ``lr_scale``
    timm's schedulers apply."""
    from timm.optim import param_groups_weight_decay

    groups = param_groups_weight_decay(
        model, cfg.recipe.weight_decay, no_weight_decay_list=model.no_weight_decay()
    )
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
    r = cfg.recipe
    from timm.data import Mixup
    from timm.loss import LabelSmoothingCrossEntropy, SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2, get_optimizer_info

    lr, min_lr, warmup_lr = scaled_lrs(cfg, world)
    # torch's fused kernel where it has one: one op per step for all parameters, and it can skip a
    # non-finite step on the device (train/step.py)
    fused = {"fused": True} if fusable(get_optimizer_info(r.opt.lower()).opt_class) else {}
    optimizer = create_optimizer_v2(
        param_groups(cfg, model),
        opt=r.opt,
        lr=lr,
        weight_decay=r.weight_decay,
        eps=r.opt_eps,
        betas=tuple(r.opt_betas),
        **fused,
    )
    scheduler = build_scheduler(cfg, optimizer, lr, min_lr, warmup_lr, steps_per_epoch)
    mixup = None
    if r.mixup > 0 or r.cutmix > 0:
        mixup = Mixup(
            mixup_alpha=r.mixup,
            cutmix_alpha=r.cutmix,
            prob=r.mixup_prob,
            switch_prob=r.mixup_switch_prob,
            mode="batch",
            label_smoothing=r.smoothing,
            num_classes=num_classes,
        )
        criterion: nn.Module = SoftTargetCrossEntropy()  # smoothing is folded into the mixed targets
    elif r.smoothing > 0:
        criterion = LabelSmoothingCrossEntropy(smoothing=r.smoothing)
    else:
        criterion = nn.CrossEntropyLoss()
    return optimizer, scheduler, mixup, criterion
