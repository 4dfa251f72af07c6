"""``cmhsa eval``: top-1 / top-5 of any checkpoint on a dataset's validation split."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from convit_convert.checkpoint import load_checkpoint
from convit_convert.errors import CmhsaError
from convit_convert.models import model_from_checkpoint

from .config import TrainConfig
from .data import build_data, build_loader, build_transform, image_mode
from .distributed import pick_device
from .engine import amp_dtype, evaluate


def evaluate_checkpoint(
    path: str | Path,
    *,
    data: str,
    data_dir: str | None = None,
    download: bool = False,
    batch_size: int = 128,
    device: str = "auto",
    amp: str = "none",
    workers: int = 2,
    crop_pct: float = 0.875,
    seed: int = 0,
    console: Console | None = None,
) -> dict[str, Any]:
    console = console or Console(highlight=False)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    if batch_size < 1:
        raise CmhsaError(f"--batch-size must be positive, got {batch_size}")
    spec = build_data(data, data_dir, cfg.img_size, download=download, num_classes=cfg.num_classes, seed=seed)
    if spec.num_classes != cfg.num_classes:
        raise CmhsaError(f"has {cfg.num_classes} classes but --data {data} has {spec.num_classes}", ckpt.path)
    dev = pick_device(device)
    dtype = amp_dtype(TrainConfig(amp=amp), dev)
    image_mode(cfg.in_chans, ckpt.path)  # RGB or grey: the loader converts every image to it
    tf = build_transform(
        cfg.img_size, False, SimpleNamespace(interpolation="bicubic", crop_pct=crop_pct), cfg.in_chans
    )
    loader = build_loader(
        spec.val,
        tf,
        training=False,
        batch_size=batch_size,
        seed=seed,
        workers=workers,
        pin_memory=dev.type == "cuda",
        in_chans=cfg.in_chans,
    )
    model = model_from_checkpoint(ckpt, dtype=torch.float32).to(dev)
    metrics = evaluate(model, loader, dev, dtype)
    table = Table(title=f"{escape(str(path))} on {data} (val, {len(spec.val)} images)")
    for col in ("kind", "top-1 %", "top-5 %", "loss"):
        table.add_column(col, justify="right")
    table.add_row(ckpt.kind, f"{metrics['top1']:.2f}", f"{metrics['top5']:.2f}", f"{metrics['val_loss']:.4f}")
    console.print(table)
    return {**metrics, "images": len(spec.val)}
