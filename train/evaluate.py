"""``cmhsa eval``: top-1 / top-5 of any checkpoint on a dataset's validation split."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from ..api import load_checkpoint
from ..errors import CmhsaError
from .data import build_data, build_loader, build_transform, image_mode
from .distributed import pick_device
from .epoch import evaluate
from .recipe import amp_dtype


@dataclass
class EvalReport:
    kind: str
    images: int
    top1: float
    top5: float
    val_loss: float


def evaluate_checkpoint(
    path: str | Path, *, data: str, data_dir: str | None = None, download: bool = False,
    batch_size: int = 128, device: str = "auto", amp: str = "none", workers: int = 2, crop_pct: float = 0.875,
    seed: int = 0,
) -> EvalReport:  # fmt: skip
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    if batch_size < 1:
        raise CmhsaError(f"`batch_size` must be positive, got {batch_size}")
    spec = build_data(data, data_dir, cfg.img_size, download=download, num_classes=cfg.num_classes, seed=seed)
    if spec.num_classes != cfg.num_classes:
        raise CmhsaError(f"has {cfg.num_classes} classes but `data` {data} has {spec.num_classes}", ckpt.path)
    dev = pick_device(device)
    dtype = amp_dtype(amp, dev)
    image_mode(cfg.in_chans, ckpt.path)  # RGB or grey: the loader converts every image to it
    tf = build_transform(cfg.img_size, False, None, cfg.in_chans, crop_pct=crop_pct)
    loader = build_loader(
        spec.val, tf, training=False, batch_size=batch_size, seed=seed, workers=workers,
        pin_memory=dev.type == "cuda", in_chans=cfg.in_chans,
    )  # fmt: skip
    metrics = evaluate(ckpt.model(dtype=torch.float32).to(dev), loader, dev, dtype)
    return EvalReport(ckpt.kind, len(spec.val), metrics["top1"], metrics["top5"], metrics["val_loss"])
