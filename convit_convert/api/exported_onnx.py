"""An ONNX file ``cmhsa export`` wrote, run as shipped: onnxruntime with the preprocessing its
``metadata_props`` record (:func:`onnx_preprocessing`), a static batch padded, class names from
its ``classes``. ``cmhsa predict`` and ``cmhsa eval`` both run a shipped file through this."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CmhsaError
from ..io.paths import parse_json
from ..labels import check_class_names
from ..resources import sized_by

PREPROCESSING_KEY = "input_size"  # a metadata_props key every cmhsa export writes
PIL_FILTERS = ("nearest", "bilinear", "bicubic", "lanczos", "box", "hamming")

# what a cmhsa export's normalisation may be: images scaled to 0..1, then (x - mean) / std
MEAN_RANGE, STD_RANGE = (0.0, 1.0), (1e-3, 10.0)
MAX_CROP_RATIO = 10  # crop_pct >= 0.1: the resize is at most 10x the model's input


def onnx_preprocessing(
    props: dict[str, str], path: Path, input_dims: tuple[int | None, ...]
) -> dict[str, Any]:
    """An ONNX file's recorded preprocessing (cmhsa export's ``metadata_props``), read as untrusted
    input: every field present and of its kind, the input size the graph's own (``input_dims``: its
    declared C, H, W), the resize within 10x of it, mean and std what normalising 0..1 pixels takes;
    or one CmhsaError naming it."""

    def field_(key: str) -> Any:
        if key not in props:
            raise CmhsaError(
                f"metadata_props has no {key!r}: not a file `cmhsa export` wrote, so its preprocessing is "
                "unknown",
                path,
            )
        return props[key]

    try:
        c, h, w = (int(v) for v in parse_json(field_("input_size"), path, "metadata_props' input_size"))
        side = int(field_("resize_shorter_to"))
        mean = [float(v) for v in parse_json(field_("mean"), path, "metadata_props' mean")]
        std = [float(v) for v in parse_json(field_("std"), path, "metadata_props' std")]
    except (ValueError, TypeError, OverflowError, CmhsaError):
        raise CmhsaError(
            "metadata_props' input_size, resize_shorter_to, mean or std is malformed", path
        ) from None
    if (c, h, w) != tuple(input_dims):
        shown = "x".join("?" if d is None else str(d) for d in input_dims)
        raise CmhsaError(
            f"metadata_props' input_size {c}x{h}x{w} is not the graph's input {shown}: not a file `cmhsa "
            "export` wrote",
            path,
        )
    channels, interp = field_("channels"), field_("interpolation")
    ok = (
        channels in ("L", "RGB")
        and c == (1 if channels == "L" else 3)
        and min(h, w) <= side <= MAX_CROP_RATIO * min(h, w)
        and interp in PIL_FILTERS
        and len(mean) == len(std) == c
        and all(MEAN_RANGE[0] <= v <= MEAN_RANGE[1] for v in mean)
        and all(STD_RANGE[0] <= v <= STD_RANGE[1] for v in std)
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


def is_exported(model: Any) -> bool:
    """Whether an ONNX model (as ``onnx.load.load_onnx`` returns it) records cmhsa export's
    preprocessing (else it is read as a conv-phase graph: ``onnx.importer``)."""
    return any(p.key == PREPROCESSING_KEY for p in model.metadata_props)


@dataclass
class ExportedOnnx:
    """A checked, runnable exported ONNX file. ``batch``: the graph's static batch, or the batch
    the caller asked for where the graph's is dynamic."""

    path: Path
    pre: dict[str, Any]  # onnx_preprocessing's fields: c, h, w, side, channels, mean, std, ...
    batch: int
    static_batch: bool
    session: Any
    input_name: str
    output_name: str
    props: dict[str, str]
    names: tuple[str, ...] | None = None
    named: bool = False  # whether names were read (once the class count is known)

    @property
    def provider(self) -> str:
        return self.session.get_providers()[0]

    def logits(self, x: np.ndarray) -> np.ndarray:
        """(n, C, H, W) float32 inputs, n at most ``batch`` → (n, classes) float32 logits; the class
        names are read and checked against the class count on the first call."""
        from ..onnx.load import run_session

        n = len(x)
        if n < self.batch and self.static_batch:  # a static batch: pad, then drop
            x = np.concatenate([x, np.zeros((self.batch - n, *x.shape[1:]), np.float32)])
        with sized_by(f"for running {self.path} in onnxruntime at batch {self.batch}"):
            out = run_session(self.session, [self.output_name], {self.input_name: x}, self.path)[0][:n]
        if not self.named and "classes" in self.props:
            classes = parse_json(self.props["classes"], self.path, "metadata_props' classes")
            where = f"{self.path} (metadata_props' classes)"
            self.names = check_class_names(classes, out.shape[1], where)
        self.named = True
        return out


def open_exported(
    path: Path, batch_size: int, device: str = "cpu", model: Any = None, threads: int = 0
) -> ExportedOnnx:
    """``path`` loaded (bounded; ``model``: as ``load_onnx`` already returned it), its preprocessing
    read as untrusted input, its graph checked as runnable at the batch it will run, and an
    onnxruntime session on ``device``'s provider (``onnx.load.providers_for``: CUDA where
    onnxruntime-gpu is installed)."""
    from ..onnx.load import load_onnx, ort_session, providers_for
    from ..options.checked import check_device_name

    check_device_name(device)
    model = load_onnx(path) if model is None else model
    props = {p.key: p.value for p in model.metadata_props}
    inp = model.graph.input[0]
    dims = inp.type.tensor_type.shape.dim
    pre = onnx_preprocessing(
        props, path, tuple(d.dim_value if d.HasField("dim_value") else None for d in dims[1:])
    )
    static = dims[0].HasField("dim_value")
    batch = dims[0].dim_value if static else batch_size
    session = ort_session(model, path, providers_for(device), threads, batch=batch)  # sized, held to memory
    return ExportedOnnx(path, pre, batch, static, session, inp.name, model.graph.output[0].name, props)


class OnnxModule(torch.nn.Module):
    """An :class:`ExportedOnnx` as a module (CPU tensors in and out), so eval's metric loop
    (``on_data.evaluate``) measures the shipped file as it measures a checkpoint. Non-finite outputs
    are an error, never a metric."""

    def __init__(self, exported: ExportedOnnx) -> None:
        super().__init__()
        self.exported = exported

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.exported.logits(x.detach().cpu().numpy().astype(np.float32, copy=False))
        if not np.isfinite(out).all():
            raise CmhsaError("the model's outputs are not finite (NaN or infinity)", self.exported.path)
        return torch.from_numpy(out)


def onnx_tensor(image: Any, pre: dict[str, Any]) -> torch.Tensor:
    """:func:`onnx_input` as a tensor: a data loader's transform for an exported file."""
    return torch.from_numpy(onnx_input(image, pre))
