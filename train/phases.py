"""The model each phase trains, and where its weights come from.

Phase 1: a randomly initialised ConvViT. Phase 2: an attention ViT from ``--init``, which is
- a conv-phase checkpoint: converted in memory (Theorem 1) and verified against the conv model
  before the first step; a conversion that is not exact within ``verify_tol`` aborts the run;
- an attention checkpoint: loaded as it is;
- ``random``: the paper's "2nd phase only" baseline.
With a checkpoint, the architecture is the checkpoint's; model flags given explicitly must agree.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from convit_convert.checkpoint import load_checkpoint
from convit_convert.config import ViTConfig
from convit_convert.convert import convert_state_dict
from convit_convert.errors import CmhsaError
from convit_convert.models import build_model, model_from_checkpoint
from convit_convert.theory import head_count
from convit_convert.vit import VisionTransformer

from .config import TrainConfig
from .data import image_mode


class TrainingError(Exception):
    """A run that cannot go on (exit 1): the message says why, in one line."""


@dataclass
class PhaseModel:
    model: VisionTransformer
    kind: str  # "conv" or "attn"
    config: ViTConfig
    init: dict[str, Any] = field(default_factory=dict)  # where the weights came from, for config.json


def flag_config(cfg: TrainConfig, num_classes: int) -> ViTConfig:
    """The conv config the model flags describe."""
    return ViTConfig.build(
        img_size=cfg.img_size,
        patch_size=cfg.patch_size,
        in_chans=cfg.in_chans,
        hidden_chans=cfg.hidden_chans,
        depth=cfg.depth,
        mlp_ratio=cfg.mlp_ratio,
        num_classes=num_classes,
        kernel_size=cfg.kernel_size,
        dilation=cfg.dilation,
    )


def model_flags(mcfg: ViTConfig) -> dict[str, Any]:
    """The model flags (TrainConfig fields) that describe ``mcfg``; img_size is (H, W) if not square."""
    h, w = mcfg.img_size
    flags: dict[str, Any] = {
        "img_size": h if h == w else (h, w),
        "in_chans": mcfg.in_chans,
        "patch_size": mcfg.patch_size,
        "hidden_chans": mcfg.hidden_chans,
        "depth": mcfg.depth,
        "mlp_ratio": mcfg.mlp_hidden_dim / mcfg.embed_dim,
        "kernel_size": mcfg.kernel_size,
        "dilation": mcfg.dilation,
    }
    if mcfg.num_heads is not None:
        flags.update(heads=mcfg.num_heads, qk_dim=mcfg.qk_dim, sink=bool(mcfg.sink))
    return flags


def _check_explicit(cfg: TrainConfig, ckpt_cfg: ViTConfig, num_classes: int, path: object) -> None:
    """Model flags the user typed must match the checkpoint they also gave."""
    have = model_flags(ckpt_cfg)
    for name in cfg.extra.get("explicit", []):
        if name in have and getattr(cfg, name) != have[name]:
            flag = "--" + name.replace("_", "-")
            raise CmhsaError(
                f"{flag} {getattr(cfg, name)} disagrees with the checkpoint's {have[name]}", path
            )
    if ckpt_cfg.num_classes != num_classes:
        raise CmhsaError(f"has {ckpt_cfg.num_classes} classes but --data {cfg.data} has {num_classes}", path)
    image_mode(ckpt_cfg.in_chans, path)  # 1 or 3: the loader converts every image to it


def sync_model_flags(cfg: TrainConfig, mcfg: ViTConfig) -> None:
    """Record the architecture actually trained in the run's config (for config.json); a
    non-square img_size stays in the model config only (the flag is one integer)."""
    for name, value in model_flags(mcfg).items():
        if not isinstance(value, tuple):
            setattr(cfg, name, value)


def build_phase_model(cfg: TrainConfig, num_classes: int, log: Any = print) -> PhaseModel:
    if cfg.phase == "phase1":
        mcfg = flag_config(cfg, num_classes)
        return PhaseModel(build_model("conv", mcfg, cfg.drop_path), "conv", mcfg, {"init": "random"})
    if cfg.init == "random":
        conv_cfg = flag_config(cfg, num_classes)
        heads = (
            cfg.heads or head_count(conv_cfg.kernel_size, conv_cfg.patch_size, conv_cfg.dilation).patch_heads
        )
        mcfg = conv_cfg.with_attention(heads, cfg.qk_dim, None, cfg.sink)
        mcfg.validate("attn")
        return PhaseModel(build_model("attn", mcfg, cfg.drop_path), "attn", mcfg, {"init": "random"})

    ckpt = load_checkpoint(cfg.init)
    _check_explicit(cfg, ckpt.config, num_classes, ckpt.path)
    tensors = {k: v.float() for k, v in ckpt.tensors.items()}
    if ckpt.kind == "attn":
        model = build_model("attn", ckpt.config, cfg.drop_path)
        model.load_state_dict(tensors)
        sync_model_flags(cfg, ckpt.config)
        return PhaseModel(model, "attn", ckpt.config, {"init": str(cfg.init), "init_kind": "attn"})

    from convit_convert.verify import verify_models

    sd, mcfg = convert_state_dict(
        tensors,
        ckpt.config,
        num_heads=cfg.heads,
        qk_dim=cfg.qk_dim,
        sink=cfg.sink,
        qk_init_std=cfg.qk_init_std,
        margin=cfg.margin,
        seed=cfg.seed,
        path=ckpt.path,
    )
    model = build_model("attn", mcfg, cfg.drop_path)
    model.load_state_dict(sd)
    conv_model = model_from_checkpoint(ckpt, dtype=torch.float32)
    result = verify_models(conv_model, model, batch=4, seed=cfg.seed, dtype=torch.float32, tol=cfg.verify_tol)
    worst = result.worst
    log(
        f"converted {cfg.init}: {mcfg.num_heads} heads, qk_dim {mcfg.qk_dim}, sink {'on' if mcfg.sink else 'off'}; "
        f"verified: worst relative error {worst.rel:.2e} ({worst.tensor}, {worst.region}), tol {cfg.verify_tol:g}"
    )
    if not result.passed:
        raise TrainingError(
            f"{cfg.init}: the converted model is not exact: relative error {worst.rel:.2e} at {worst.tensor} "
            f"({worst.region}) > --verify-tol {cfg.verify_tol:g}; not training from it"
        )
    model.train()
    sync_model_flags(cfg, mcfg)
    return PhaseModel(
        model,
        "attn",
        mcfg,
        {
            "init": str(cfg.init),
            "init_kind": "conv",
            "verify_worst_rel": worst.rel,
            "verify_tol": cfg.verify_tol,
            "verify_criterion": result.criterion,
        },
    )
