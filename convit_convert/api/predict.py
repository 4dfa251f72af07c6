"""``cmhsa predict``: a model's most probable classes for image files, from a checkpoint, a timm
folder or an ONNX file (onnxruntime, with the preprocessing its ``metadata_props`` record), each
image prepared as ``cmhsa eval`` prepares its own (timm's evaluation transform), classes by the
names the model records."""

from __future__ import annotations

import csv
import io
import json
import math
import stat
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..data import build_transform, folders_once, image_mode, is_image_name, open_image
from ..deploy import for_inference
from ..errors import CmhsaError
from ..io.atomic import atomic_write_text
from ..io.paths import stat_input
from ..io.timm_folder import WEIGHTS, folder_config
from ..labels import check_class_names, name_of
from ..options.operations import PredictOptions
from ..options.values import EVAL_CROP_PCT
from .common import load_checkpoint, pick_device

MAX_IMAGES = 10**6  # images one predict reads (a folder's walk stops there, with an error)
MAX_FOLDERS = 10**5
PIL_FILTERS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")


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
        """One row per image and rank: image, rank, class, index, probability."""
        buf = io.StringIO()
        w = csv.writer(buf, lineterminator="\n")
        w.writerow(["image", "rank", "class", "index", "probability"])
        for p in self.predictions:
            for rank, (name, index, prob) in enumerate(p.top, 1):
                w.writerow([p.image, rank, name, index, f"{prob:.6g}"])
        return buf.getvalue()


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
    path = Path(model)
    if path.is_dir():
        if folder_config(path) is None:
            raise CmhsaError("is a timm folder of another architecture than cmhsa's", path)
        ckpt = load_checkpoint(path / WEIGHTS)
        return _with_torch(ckpt, files, o, progress, str(path), "timm folder")
    if path.suffix.lower() == ".onnx":
        return _with_onnxruntime(path, files, o, progress)
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
    mode = image_mode(cfg.in_chans)
    report = PredictReport(where, source, "model" if names else "numbers", min(o.top_k, cfg.num_classes))
    for chunk in _batches(files, o.batch_size):
        xs = []
        for f in chunk:
            with open_image(f) as im:
                xs.append(tf(im.convert(mode)))
        with torch.inference_mode():
            probs = model(torch.stack(xs).to(dev)).float().softmax(-1).cpu().numpy()
        for f, top in zip(chunk, _top(probs, report.top_k, names), strict=True):
            report.predictions.append(Prediction(str(f), top))
        if progress is not None:
            progress(len(chunk))
    return report


def onnx_preprocessing(props: dict[str, str], path: Path) -> dict[str, Any]:
    """An ONNX file's recorded preprocessing (cmhsa export's ``metadata_props``), read as untrusted
    input: every field present and of its kind, or one CmhsaError naming it."""

    def field_(key: str) -> Any:
        if key not in props:
            raise CmhsaError(
                f"metadata_props has no {key!r}: not a file `cmhsa export` wrote, so its preprocessing is "
                "unknown",
                path,
            )
        return props[key]

    try:
        c, h, w = (int(v) for v in json.loads(field_("input_size")))
        side = int(field_("resize_shorter_to"))
        mean = [float(v) for v in json.loads(field_("mean"))]
        std = [float(v) for v in json.loads(field_("std"))]
    except (ValueError, TypeError):
        raise CmhsaError(
            "metadata_props' input_size, resize_shorter_to, mean or std is malformed", path
        ) from None
    channels, interp = field_("channels"), field_("interpolation")
    ok = (
        channels in ("L", "RGB")
        and c == (1 if channels == "L" else 3)
        and 0 < h <= 4096
        and 0 < w <= 4096
        and min(h, w) <= side <= 10 * max(h, w)
        and interp in PIL_FILTERS
        and len(mean) == len(std) == c
        and all(math.isfinite(v) for v in mean + std)
        and all(v > 0 for v in std)
    )
    if not ok:
        raise CmhsaError("metadata_props' preprocessing is not one cmhsa export writes", path)
    return {
        "c": c,
        "h": h,
        "w": w,
        "side": side,
        "channels": channels,
        "interp": interp,
        "mean": mean,
        "std": std,
    }


def onnx_input(image: Any, p: dict[str, Any]) -> np.ndarray:
    """One PIL image as the ONNX model's (C, H, W) float32 input, as its metadata_props say (the
    steps of docs/sharing.md's snippet: timm's evaluation transform)."""
    from PIL import Image

    image = image.convert(p["channels"])
    side, (iw, ih) = p["side"], image.size
    size = (side, int(side * ih / iw)) if iw <= ih else (int(side * iw / ih), side)
    image = image.resize(size, Image.Resampling[p["interp"].upper()])
    left, top = round((image.width - p["w"]) / 2), round((image.height - p["h"]) / 2)
    crop = image.crop((left, top, left + p["w"], top + p["h"]))
    x = np.asarray(crop, dtype=np.float32).reshape(p["h"], p["w"], p["c"]) / 255
    mean, std = np.array(p["mean"], dtype=np.float32), np.array(p["std"], dtype=np.float32)
    return ((x - mean) / std).transpose(2, 0, 1)


def _with_onnxruntime(path: Path, files: list[Path], o: PredictOptions, progress: Any) -> PredictReport:
    from ..onnx.load import check_runnable, load_onnx, ort_session, run_session

    model = load_onnx(path)
    props = {p.key: p.value for p in model.metadata_props}
    pre = onnx_preprocessing(props, path)
    inp = model.graph.input[0]
    first = inp.type.tensor_type.shape.dim[0]
    batch = o.batch_size if not first.HasField("dim_value") else first.dim_value
    check_runnable(model, path, batch)
    session = ort_session(model, path)
    out_name = model.graph.output[0].name
    report = PredictReport(str(path), "onnx", "numbers", o.top_k)
    names = None
    for chunk in _batches(files, batch):
        xs = []
        for f in chunk:
            with open_image(f) as im:
                xs.append(onnx_input(im, pre))
        x = np.stack(xs)
        if len(chunk) < batch and first.HasField("dim_value"):  # a static batch: pad, then drop
            x = np.concatenate([x, np.zeros((batch - len(chunk), *x.shape[1:]), np.float32)])
        logits = run_session(session, [out_name], {inp.name: x}, path)[0][: len(chunk)]
        if names is None and "classes" in props:
            names = check_class_names(json.loads(props["classes"]), logits.shape[1], path)
            report.names_from = "model"
        report.top_k = min(o.top_k, logits.shape[1])
        z = logits - logits.max(axis=1, keepdims=True)
        probs = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
        for f, top in zip(chunk, _top(probs, report.top_k, names), strict=True):
            report.predictions.append(Prediction(str(f), top))
        if progress is not None:
            progress(len(chunk))
    return report


def write_predictions(report: PredictReport, output: Path) -> None:
    """``output`` (.csv: a row per image and rank; .json: the report) written whole or not at all."""
    if output.suffix.lower() == ".csv":
        atomic_write_text(output, report.csv_text())
    elif output.suffix.lower() == ".json":
        atomic_write_text(output, json.dumps(report.to_dict(), indent=2, ensure_ascii=False) + "\n")
    else:
        raise CmhsaError("the predictions' file must end in .csv or .json", output)
