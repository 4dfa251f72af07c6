"""Checkpoints on a dataset's images: ``cmhsa eval`` (top-1 / top-5), ``cmhsa attention`` (what
each head attends to), and calibration images for an approximate conversion."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Subset

from ..analysis import AttentionReport, attention_stats
from ..approximate import Calibration
from ..config import ViTConfig
from ..data import DataSpec, build_data
from ..deploy import for_inference
from ..errors import CmhsaError
from ..io.checkpoint import Checkpoint
from ..labels import name_of
from ..loaders import build_loader, build_transform, default_workers, image_mode
from ..options.operations import AttentionOptions, CalibrationSource, EvalOptions
from ..options.values import EVAL_CROP_PCT
from .common import amp_dtype, autocast, cpu_threads, load_checkpoint, pick_device


@dataclass
class ClassRow:
    """One class of the validation split: its images and the share the model got right."""

    name: str
    images: int
    top1: float


@dataclass
class Confusion:
    """Images of class ``true`` the model called ``predicted``."""

    true: str
    predicted: str
    images: int


@dataclass
class EvalReport:
    kind: str
    images: int
    top1: float
    top5: float
    val_loss: float
    form: str  # the form that ran: "fused" (attention, exact to 1e-5), "trained", or "conv"
    classes: list[ClassRow] = field(default_factory=list)  # per class, output 0 first
    confused: list[Confusion] = field(default_factory=list)  # the most frequent mistakes, most first
    names_from: str = "numbers"  # where the class names came from: "model", "data" or "numbers"
    data_names_differ: bool = False  # the model and the data both name classes, differently

    def to_dict(self) -> dict[str, Any]:
        return {"command": "eval", **asdict(self)}


MOST_CONFUSED = 5  # pairs eval reports


def per_class(
    confusion: torch.Tensor, names: tuple[str, ...] | None
) -> tuple[list[ClassRow], list[Confusion]]:
    """Per-class top-1 and the most frequent (true, predicted) mistakes from a confusion matrix
    (rows: true class, columns: predicted)."""
    m = confusion.cpu().long()
    rows = [
        ClassRow(name_of(names, i), int(m[i].sum()), 100.0 * int(m[i, i]) / max(int(m[i].sum()), 1))
        for i in range(m.shape[0])
    ]
    off = m.clone()
    off.fill_diagonal_(0)
    counts, flat = off.flatten().sort(descending=True)
    pairs = [
        Confusion(name_of(names, int(f) // m.shape[0]), name_of(names, int(f) % m.shape[0]), int(c))
        for c, f in zip(counts[:MOST_CONFUSED].tolist(), flat[:MOST_CONFUSED].tolist(), strict=True)
        if c > 0
    ]
    return rows, pairs


def validation_totals(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """One batch's validation totals: (..., B, classes) logits of the (B,) ``labels`` -> (..., 4)
    float64 (summed cross-entropy, top-1 hits, top-5 hits, count); any leading axes (stacked
    seeds' logits of the same images) keep their own totals."""
    logits = logits.float()
    lead, (b, classes) = logits.shape[:-2], logits.shape[-2:]
    hit = logits.topk(min(5, classes), dim=-1).indices == labels[:, None]  # (..., B, k)
    # cross-entropy summed per leading index, as F.cross_entropy(reduction="sum") sums one batch
    loss = F.cross_entropy(logits.reshape(-1, classes), labels.repeat(math.prod(lead)), reduction="none")
    count = torch.full(lead, float(b), dtype=torch.float64, device=logits.device)
    return torch.stack(
        [
            loss.view(*lead, b).sum(-1).double(),
            hit[..., 0].sum(-1).double(),
            hit.any(-1).sum(-1).double(),
            count,
        ],
        dim=-1,
    )


def validation_metrics(sums: torch.Tensor) -> dict[str, float]:
    """(4,) totals of :func:`validation_totals` over a validation split -> its mean cross-entropy,
    top-1 and top-5 (%), as metrics.csv and ``cmhsa eval`` report them."""
    loss, top1, top5, count = sums.tolist()
    n = max(count, 1.0)
    return {"val_loss": loss / n, "top1": 100 * top1 / n, "top5": 100 * top5 / n}


def evaluate(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype | None,
    reduce: Callable[[torch.Tensor], None] | None = None,
    confusion: torch.Tensor | None = None,
    progress: Callable[[int], None] | None = None,
) -> dict[str, float]:
    """Cross-entropy, top-1 and top-5 (%) over ``batches`` of (images, labels); ``reduce`` sums
    the (loss, top-1, top-5, count) totals across processes in place (training's all-reduce);
    ``confusion`` (classes × classes, int64 on ``device``), when given, counts (true, predicted);
    ``progress`` is called with 1 after each batch (the host's count: no device read)."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # loss, top1, top5, count
    try:  # a count may end the evaluation (a training run's stop request): the mode comes back
        with torch.no_grad():
            for x, y in batches:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                with autocast(device, dtype):
                    logits = model(x).float()
                if confusion is not None:
                    c = confusion.shape[0]
                    confusion.view(-1).add_(torch.bincount(y * c + logits.argmax(1), minlength=c * c))
                sums += validation_totals(logits, y)
                if progress is not None:
                    progress(1)
    finally:
        model.train(was_training)
    if reduce is not None:
        reduce(sums)
    return validation_metrics(sums)


def _dataset(
    cfg: ViTConfig,
    data: str,
    data_dir: str | None,
    *,
    download: bool = False,
    crop_pct: float,
    seed: int,
    path: object = None,
    param: str = "data",
    val_only: bool = False,
) -> tuple[DataSpec, Any]:
    """``data`` (the value of library parameter ``param``) for a model of ``cfg``, and the evaluation
    transform for it; a dataset whose classes or images do not fit the model is refused."""
    spec = _fitting_data(
        data,
        data_dir,
        (cfg.img_size, cfg.num_classes, cfg.in_chans),
        download=download,
        crop_pct=crop_pct,
        seed=seed,
        path=path,
        param=param,
        val_only=val_only,
    )
    return spec, build_transform(cfg.img_size, False, None, cfg.in_chans, crop_pct=crop_pct)


def _fitting_data(
    data: str,
    data_dir: str | None,
    model: tuple[tuple[int, int], int, int],
    *,
    download: bool,
    crop_pct: float,
    seed: int,
    path: object = None,
    param: str = "data",
    val_only: bool = False,
) -> DataSpec:
    """``data``'s splits for a model taking ``model`` = (image size, classes, channels): a dataset
    whose classes or images do not fit it is refused, naming ``path`` (the model) and ``param``."""
    img_size, num_classes, in_chans = model
    spec = build_data(
        data,
        data_dir,
        img_size,
        download=download,
        num_classes=num_classes,
        seed=seed,
        val_only=val_only,
        crop_pct=crop_pct,
    )
    if spec.num_classes != num_classes:
        msg = f"has {num_classes} classes but `{param}` {data} has {spec.num_classes}"
        raise CmhsaError(msg if path else f"the model {msg}", path)
    image_mode(in_chans, path)  # RGB or grey: the loader converts every image to it
    return spec


def _val_loader(
    ckpt: Checkpoint,
    data: str,
    data_dir: str | None,
    download: bool,
    batch_size: int,
    dev: torch.device,
    workers: int,
    crop_pct: float,
    seed: int,
) -> tuple[DataLoader, int, tuple[str, ...] | None]:
    """The validation loader of ``data`` preprocessed for ``ckpt``'s model, the split's size, and
    the data's class names where it has them."""
    cfg = ckpt.config
    spec, tf = _dataset(
        cfg, data, data_dir, download=download, crop_pct=crop_pct, seed=seed, path=ckpt.path, val_only=True
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
    return loader, len(spec.val), spec.classes


Counting = Callable[[int], Callable[[int], None]]  # total batches -> called with 1 after each


def evaluate_checkpoint(
    path: str | Path, options: EvalOptions, counting: Counting | None = None
) -> EvalReport:
    """``cmhsa eval``: top-1 / top-5 and loss on ``options.data``'s validation split of a checkpoint,
    a timm folder cmhsa wrote, or an ONNX file: one cmhsa exported runs as shipped (onnxruntime, the
    preprocessing it records: :func:`evaluate_exported`), any other is read as a conv-phase graph.
    ``counting``, given the number of batches, returns what each batch done is counted with."""
    with cpu_threads(options.threads) as threads:
        return _evaluate_checkpoint(path, options, threads, counting)


def _evaluate_checkpoint(
    path: str | Path, options: EvalOptions, threads: int, counting: Counting | None = None
) -> EvalReport:
    o = options
    onnx_model = None
    if Path(path).suffix.lower() == ".onnx":  # read once: run as shipped, or imported as a conv graph
        from ..onnx.load import load_onnx
        from .exported_onnx import is_exported

        onnx_model = load_onnx(path)
        if is_exported(onnx_model):
            return evaluate_exported(Path(path), o, onnx_model, counting, threads)
    ckpt = load_checkpoint(path, onnx_model=onnx_model)
    workers = default_workers() if o.workers is None else o.workers
    dev = pick_device(o.device)
    dtype = amp_dtype(o.amp, dev)
    loader, n, data_names = _val_loader(
        ckpt, o.data, o.data_dir, o.download, o.batch_size, dev, workers, o.crop_pct, o.seed
    )
    model, form = for_inference(ckpt.model(dtype=torch.float32).to(dev))  # fused where exact to 1e-5
    c = ckpt.config.num_classes
    confusion = torch.zeros(c, c, dtype=torch.int64, device=dev)
    progress = None if counting is None else counting(len(loader))
    metrics = evaluate(model, loader, dev, dtype, confusion=confusion, progress=progress)
    model_names = ckpt.classes  # the outputs are the model's: its names first
    rows, pairs = per_class(confusion, model_names or data_names)
    return EvalReport(
        ckpt.kind,
        n,
        metrics["top1"],
        metrics["top5"],
        metrics["val_loss"],
        form,
        rows,
        pairs,
        "model" if model_names else "data" if data_names else "numbers",
        bool(model_names and data_names and model_names != data_names),
    )


def attention_on_data(path: str | Path, options: AttentionOptions) -> AttentionReport:
    """``cmhsa attention``: :func:`convit_convert.analysis.attention_stats` over the first
    ``options.images`` validation images."""
    o = options
    ckpt = load_checkpoint(path)
    if ckpt.kind != "attn":
        raise CmhsaError("is a conv checkpoint; attention statistics need an attn checkpoint", ckpt.path)
    dev = pick_device(o.device)
    loader, _, _ = _val_loader(
        ckpt, o.data, o.data_dir, False, o.batch_size, dev, o.workers, o.crop_pct, o.seed
    )

    def batches():  # the first `images` validation images
        left = o.images
        for x, _ in loader:
            if left <= 0:
                return
            yield x[:left]
            left -= len(x)

    return attention_stats(ckpt.model(dtype=torch.float32).to(dev), batches())


def calibration_from_data(
    cfg: ViTConfig, source: CalibrationSource, crop_pct: float = EVAL_CROP_PCT
) -> Calibration:
    """Calibration images for ``cmhsa convert --approximate`` / ``cmhsa heads --checkpoint``: a
    seeded random ``source.calib_images`` of ``source.calib``'s training split, and the first
    ``source.heldout_images`` validation images with their labels, preprocessed as ``cmhsa eval``
    does."""
    data, seed = source.calib, source.seed
    if data is None:
        raise CmhsaError("`calib` names no dataset: noise images need no data (make_calibration)")
    spec, tf = _dataset(cfg, data, source.data_dir, crop_pct=crop_pct, seed=seed, param="calib")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(len(spec.train), generator=g)[: min(source.calib_images, len(spec.train))].tolist()

    def load(ds: Any, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        loader = build_loader(
            Subset(ds, idx), tf, training=False, batch_size=256, seed=seed, in_chans=cfg.in_chans
        )
        xs, ys = zip(*loader, strict=True)
        return torch.cat(xs), torch.cat(ys)

    x, _ = load(spec.train, pick)
    hx, hy = load(spec.val, list(range(min(source.heldout_images, len(spec.val)))))
    return Calibration(x, hx, hy, f"{data}: {len(x)} training images; held out: {len(hx)} validation images")


def evaluate_exported(
    path: Path, options: EvalOptions, model: Any = None, counting: Counting | None = None, threads: int = 0
) -> EvalReport:
    """An ONNX file ``cmhsa export`` wrote (``model``: as ``load_onnx`` already read it), measured as
    shipped: onnxruntime on ``options.device``'s provider, each validation image prepared as its
    ``metadata_props`` say (the steps of ``predict``), so ``crop_pct`` and ``amp`` are the file's own
    (float32): another value given is refused. The same metrics, per-class table and confusions as a
    checkpoint's."""
    from functools import partial

    from .exported_onnx import OnnxModule, onnx_tensor, open_exported

    o = options
    if o.crop_pct != EVAL_CROP_PCT or o.amp not in ("none", "auto"):
        raise CmhsaError(
            "an ONNX file carries its own preprocessing and precision: `crop_pct` and `amp` apply to "
            "checkpoints and timm folders",
            path,
        )
    exported = open_exported(path, o.batch_size, o.device, model, threads)
    pre = exported.pre
    n_classes, channels = _onnx_classes(exported), pre["c"]
    spec = _fitting_data(
        o.data,
        o.data_dir,
        ((pre["h"], pre["w"]), n_classes, channels),
        download=o.download,
        crop_pct=min(pre["h"], pre["w"]) / pre["side"],
        seed=o.seed,
        path=path,
        val_only=True,
    )
    workers = default_workers() if o.workers is None else o.workers
    loader = build_loader(
        spec.val,
        partial(onnx_tensor, pre=pre),
        training=False,
        batch_size=exported.batch,
        seed=o.seed,
        workers=workers,
        in_chans=channels,
    )
    confusion = torch.zeros(n_classes, n_classes, dtype=torch.int64)
    progress = None if counting is None else counting(len(loader))
    metrics = evaluate(
        OnnxModule(exported), loader, torch.device("cpu"), None, confusion=confusion, progress=progress
    )
    rows, pairs = per_class(confusion, exported.names or spec.classes)
    return EvalReport(
        "onnx",
        len(spec.val),
        metrics["top1"],
        metrics["top5"],
        metrics["val_loss"],
        f"onnxruntime, {exported.provider}",
        rows,
        pairs,
        "model" if exported.names else "data" if spec.classes else "numbers",
        bool(exported.names and spec.classes and exported.names != spec.classes),
    )


def _onnx_classes(exported: Any) -> int:
    """The class count of an exported graph: its output's second dimension (one run on zeros where
    the graph leaves it open), class names read and checked with it."""
    import numpy as np

    pre = exported.pre
    return int(exported.logits(np.zeros((1, pre["c"], pre["h"], pre["w"]), np.float32)).shape[1])
