"""``cmhsa predict``: a model's most probable classes for image files, from a checkpoint, a timm
folder or an ONNX file (onnxruntime, with the preprocessing its ``metadata_props`` record), each
image prepared as ``cmhsa eval`` prepares its own (timm's evaluation transform), classes by the
names the model records."""

from __future__ import annotations

import math
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import folders_once, is_image_name
from ..deploy import for_inference
from ..errors import CmhsaError
from ..io.atomic import atomic_text
from ..io.images import read_image
from ..io.outputs import Target
from ..io.paths import stat_input
from ..labels import name_of
from ..loaders import build_transform, image_mode
from ..options.operations import PredictOptions
from ..options.values import EVAL_CROP_PCT
from ..resources import sized_by
from ..text import csv_text, json_text
from .common import cpu_threads, load_checkpoint, pick_device

MAX_IMAGES = 10**6  # images one predict reads (a folder's walk stops there, with an error)
MAX_FOLDERS = 10**5


@dataclass
class Prediction:
    """One image's ``top`` classes, most probable first: (class name, output index, probability)."""

    image: str
    top: list[tuple[str, int, float]]


@dataclass
class PredictReport:
    model: str
    source: str  # "checkpoint", "timm folder" or "onnx"
    names_from: str  # "model" (the file records class names) or "numbers"
    top_k: int
    predictions: list[Prediction] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["predictions"] = [
            {"image": p.image, "top": [{"class": n, "index": i, "probability": q} for n, i, q in p.top]}
            for p in self.predictions
        ]
        return {"command": "predict", **doc}

    def csv_text(self) -> str:
        """One row per image and rank: image, rank, class, index, probability (foreign text as
        :func:`text.csv_text` writes it: never a formula, no control character)."""
        rows: list[list[object]] = [["image", "rank", "class", "index", "probability"]]
        for p in self.predictions:
            for rank, (name, index, prob) in enumerate(p.top, 1):
                rows.append([p.image, rank, name, index, prob])
        return csv_text(rows, number_format=".6g")


def image_files(inputs: Sequence[str | Path]) -> list[Path]:
    """The images ``inputs`` name: a file as given; a folder's image files (by name), walked in
    name order, following links to folders but each folder once, at most MAX_IMAGES in all."""
    found: list[Path] = []
    seen: set[tuple[int, int]] = set()
    for item in inputs:
        path = Path(item)
        if stat.S_ISDIR(stat_input(path, "no such file or folder").st_mode):
            found += _walk(path, seen)
        else:
            found.append(path)
        if len(found) > MAX_IMAGES:
            raise CmhsaError(f"more than {MAX_IMAGES:,} images; predict reads at most that many", path)
    if not found:
        raise CmhsaError("no image files (by name: .png, .jpg, ...) in the folders given")
    return found


def _walk(root: Path, seen: set[tuple[int, int]]) -> Iterator[Path]:
    for count, (_, entries) in enumerate(folders_once(root, seen), 1):
        if count > MAX_FOLDERS:
            raise CmhsaError(f"holds more than {MAX_FOLDERS:,} folders; predict walks at most that", root)
        yield from (Path(e.path) for e in entries if not e.is_dir() and is_image_name(e.name))


def predict_files(
    model: str | Path,
    images: Sequence[str | Path],
    options: PredictOptions | None = None,
    progress: Callable[[int], None] | None = None,
) -> PredictReport:
    """The ``options.top_k`` most probable classes of each image ``images`` name (files, or folders
    of them: :func:`image_files`); ``model`` as :func:`predict_images` takes it."""
    return predict_images(model, image_files(images), options, progress)


def predict_images(
    model: str | Path,
    files: list[Path],
    options: PredictOptions | None = None,
    progress: Callable[[int], None] | None = None,
) -> PredictReport:
    """The ``options.top_k`` most probable classes of each image file ``files`` (as
    :func:`image_files` lists them); ``model`` a checkpoint, a timm folder (its model.safetensors,
    its config.json checked as cmhsa writes it) or an ONNX file. ``progress(n)`` is told of each
    batch of n images done."""
    o = options or PredictOptions()
    with cpu_threads(o.threads) as threads:
        return _predict(Path(model), files, o, threads, progress)


def _predict(
    path: Path, files: list[Path], o: PredictOptions, threads: int, progress: Callable[[int], None] | None
) -> PredictReport:
    if path.is_dir():  # a timm folder cmhsa wrote, checked as it writes one
        return _with_torch(load_checkpoint(path), files, o, progress, str(path), "timm folder")
    if path.suffix.lower() == ".onnx":
        return _with_onnxruntime(path, files, o, progress, threads)
    return _with_torch(load_checkpoint(path), files, o, progress, str(path), "checkpoint")


def _batches(files: list[Path], size: int) -> Iterator[list[Path]]:
    for i in range(0, len(files), size):
        yield files[i : i + size]


def _top(probs: np.ndarray, k: int, names: tuple[str, ...] | None) -> list[list[tuple[str, int, float]]]:
    order = np.argsort(-probs, axis=1, kind="stable")[:, :k]
    return [
        [(name_of(names, int(i)), int(i), float(row[i])) for i in idx]
        for row, idx in zip(probs, order, strict=True)
    ]


def _with_torch(
    ckpt: Any, files: list[Path], o: PredictOptions, progress: Any, where: str, source: str
) -> PredictReport:
    cfg, dev = ckpt.config, pick_device(o.device)
    names = ckpt.classes
    model, _ = for_inference(ckpt.model(torch.float32).to(dev))  # eval's form: fused where exact
    model.eval()
    tf = build_transform(cfg.img_size, False, None, cfg.in_chans, crop_pct=EVAL_CROP_PCT)
    mode, side = image_mode(cfg.in_chans), math.floor(max(cfg.img_size) / EVAL_CROP_PCT)
    report = PredictReport(where, source, "model" if names else "numbers", min(o.top_k, cfg.num_classes))
    for chunk in _batches(files, o.batch_size):
        xs = []
        for f in chunk:
            with sized_by(f"for the image {f} (decoded, then resized to {side} px on its shorter side)"):
                xs.append(tf(read_image(f, mode, resize_to=side)))
        with torch.inference_mode():
            logits = model(torch.stack(xs).to(dev)).float().cpu().numpy()
        finite_outputs(logits, chunk, where)
        probs = torch.from_numpy(logits).softmax(-1).numpy()
        for f, top in zip(chunk, _top(probs, report.top_k, names), strict=True):
            report.predictions.append(Prediction(str(f), top))
        if progress is not None:
            progress(len(chunk))
    return report


def finite_outputs(logits: np.ndarray, chunk: list[Path], where: object) -> None:
    """A model's outputs must be numbers: a NaN or infinite logit is an error naming the first image
    it came from, never a table of ``nan%``."""
    bad = ~np.isfinite(logits).all(axis=1)
    if bad.any():
        image = chunk[int(np.argmax(bad))]
        raise CmhsaError(f"the model's outputs for {image} are not finite (NaN or infinity)", where)


def _with_onnxruntime(
    path: Path, files: list[Path], o: PredictOptions, progress: Any, threads: int = 0
) -> PredictReport:
    from .exported_onnx import onnx_input, open_exported

    exported = open_exported(path, o.batch_size, o.device, threads=threads)
    pre = exported.pre
    report = PredictReport(str(path), "onnx", "numbers", o.top_k)
    for chunk in _batches(files, exported.batch):
        xs = []
        for f in chunk:
            with sized_by(f"for the image {f} (decoded, then resized as {path}'s metadata_props say)"):
                xs.append(onnx_input(read_image(f, pre["channels"], resize_to=pre["side"]), pre))
        logits = exported.logits(np.stack(xs))
        finite_outputs(logits, chunk, path)
        if exported.names is not None:
            report.names_from = "model"
        report.top_k = min(o.top_k, logits.shape[1])
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        for f, top in zip(chunk, _top(probs, report.top_k, exported.names), strict=True):
            report.predictions.append(Prediction(str(f), top))
        if progress is not None:
            progress(len(chunk))
    return report


PREDICTION_SUFFIXES = (".csv", ".json")


def check_predictions_path(output: Path) -> None:
    """A predictions file says what it holds by its suffix: .csv or .json."""
    if output.suffix.lower() not in PREDICTION_SUFFIXES:
        raise CmhsaError("the predictions' file must end in .csv or .json", output)


def write_predictions(report: PredictReport, output: Target) -> None:
    """``output`` (.csv: a row per image and rank; .json: the report) written whole or not at all,
    in its held folder."""
    check_predictions_path(Path(output.name))
    if output.name.lower().endswith(".csv"):
        atomic_text((output, report.csv_text()))
    else:
        atomic_text((output, json_text(report.to_dict()) + "\n"))
