"""What every operation shares: the one checkpoint loader (any format), the device, dtype and
autocast choices, and the checks made on inputs and outputs before any work."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import ViTConfig
from ..errors import CmhsaError
from ..io.checkpoint import Checkpoint, check_geometry, load_tensor_checkpoint, save_model
from ..io.outputs import held_outputs
from ..options.checked import check_device_name
from ..options.operations import Geometry
from ..options.values import DEFAULT_TOL, DEVICE_NAME

AMP = {"bf16": torch.bfloat16, "fp16": torch.float16, "none": None}


def load_checkpoint(
    path: str | Path,
    geometry: Geometry | None = None,
    *,
    onnx_tol: float = DEFAULT_TOL,
    onnx_model: Any = None,
) -> Checkpoint:
    """Any model file: cmhsa safetensors, a bare conv-phase state dict (given ``geometry``'s
    ``img_size`` and ``patch_size``), a conv-phase ONNX graph, read by its structure and checked
    against onnxruntime within ``onnx_tol`` (:mod:`convit_convert.onnx.importer`; ``onnx_model``: that
    file as ``onnx.load.load_onnx`` already read it), or a timm folder cmhsa wrote (its config.json
    checked as cmhsa writes it, then its model.safetensors), local or a Hub model's
    (``hf-hub:ORG/NAME[@REVISION]``, through huggingface_hub's cache: io/hub.py)."""
    from ..io.hub import hub_folder, is_hub_name

    if is_hub_name(str(path)):  # timm's name for a Hub model: its folder in huggingface_hub's cache
        path = hub_folder(str(path))[0]
    path = Path(path)
    if path.is_dir():
        from ..io.timm_folder import CONFIG, WEIGHTS, read_folder

        if not (path / CONFIG).exists():
            raise CmhsaError(f"is a directory, not a model file nor a timm folder (no {CONFIG})", path)
        folder = read_folder(path)
        ckpt = load_tensor_checkpoint(path / WEIGHTS, geometry, described=folder.config)
        ckpt.metadata = {**folder.metadata, **ckpt.metadata}
        return ckpt
    if path.suffix.lower() != ".onnx":
        return load_tensor_checkpoint(path, geometry)
    from ..onnx.importer import import_onnx

    ckpt = import_onnx(path, tol=onnx_tol, model=onnx_model)
    g = geometry or Geometry()
    check_geometry(ckpt.config, g.img_size, g.patch_size, path, "graph")
    return ckpt


def resolve_device(name: str) -> str:
    """'auto' is CUDA when present; anything but cpu, cuda, cuda:N, or a GPU that is not there, is
    bad input."""
    check_device_name(name)
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    m = DEVICE_NAME.fullmatch(name) if name.startswith("cuda") else None
    if m is not None and not torch.cuda.is_available():
        raise CmhsaError(f"`device` {name}: CUDA is not available here (use `device` cpu or auto)")
    if m is not None and m.group(1) is not None and int(m.group(1)) >= torch.cuda.device_count():
        raise CmhsaError(f"`device` {name}: this machine has {torch.cuda.device_count()} GPU(s)")
    return name


def resolve_dtype(name: str) -> torch.dtype:
    """float32 or float64 (a :class:`~convit_convert.options.operations.Verification`'s ``dtype``)."""
    return getattr(torch, name)


def read_paths(path: str | Path) -> list[Path]:
    """What reading the model file ``path`` reads: the file, and an ONNX file's external data files
    (an output may be none of them: ``io.outputs.held_outputs``' ``reads``)."""
    path = Path(path)
    if path.suffix.lower() != ".onnx":
        return [path]
    from ..onnx.load import data_files

    return [path, *data_files(path)]


def check_suffix(output: Path, suffix: str, what: str) -> None:
    """The output's suffix says what is written."""
    if output.suffix.lower() != suffix:
        raise CmhsaError(f"writes {what}: give the output the suffix {suffix}", output)


def save_checkpoint(
    path: str | Path,
    cfg: ViTConfig,
    tensors: Mapping[str, torch.Tensor],
    extra_metadata: dict[str, str] | None = None,
) -> str:
    """Write a model of ``cfg`` to the file ``path`` (its folder held while it is written: the
    Python API's door, as a command's); return its sha256."""
    with held_outputs(path) as (target,):
        return save_model(target, cfg, tensors, extra_metadata)


@contextlib.contextmanager
def cpu_threads(threads: int | None) -> Iterator[int]:
    """torch's CPU threads set to ``threads`` (None: :func:`convit_convert.loaders.default_threads`,
    the CPUs other work leaves free) while an operation runs, as many as it gets; restored after."""
    from ..loaders import default_threads

    before = torch.get_num_threads()
    n = default_threads() if threads is None else threads
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(before)


def pick_device(name: str, local_rank: int = 0) -> torch.device:
    """``auto`` is CUDA when present, else CPU; ``cuda`` means this process's GPU (the names
    checked by :func:`resolve_device`)."""
    name = resolve_device(name)
    return torch.device(f"cuda:{local_rank}" if name == "cuda" else name)


def amp_dtype(amp: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype ``amp`` names on ``device`` ('auto': bf16 on CUDA, none on CPU)."""
    name = amp if amp != "auto" else ("bf16" if device.type == "cuda" else "none")
    if name not in AMP:
        raise CmhsaError(f"`amp` must be auto, bf16, fp16 or none, got {amp!r}")
    if name == "fp16" and device.type != "cuda":
        raise CmhsaError("`amp` fp16 needs CUDA (use bf16 or none on CPU)")
    return AMP[name]


def autocast(device: torch.device, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def as_float32(ckpt: Checkpoint) -> Checkpoint:
    return dataclasses.replace(ckpt, tensors={k: v.float() for k, v in ckpt.tensors.items()})
