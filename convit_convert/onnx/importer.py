"""``import_onnx``: a conv-phase ONNX file in, an ordinary conv :class:`Checkpoint` out, proved
against onnxruntime (the rebuilt PyTorch model and the graph must agree within a tolerance)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CmhsaError
from ..io.checkpoint import Checkpoint, validate_tensors
from ..labels import KEY, from_metadata
from ..options.values import DEFAULT_TOL
from ..verify import relative_error
from .layout import to_checkpoint
from .load import load_onnx, ort_session, run_session
from .read import random_input, read_structure, without_initializer_inputs


def check_import(
    model: Any, ckpt: Checkpoint, path: Path, tol: float, batch: int, seed: int = 1
) -> dict[str, Any]:
    """Run the ONNX file in onnxruntime and the rebuilt PyTorch model on the same ``batch`` random
    images; CmhsaError unless max|Δ| / max|onnxruntime| <= tol. Returns what was measured."""
    session = ort_session(model, path, batch=batch)
    x = random_input(model, batch, seed)
    ref = run_session(session, None, {model.graph.input[0].name: x}, path)[0]
    with torch.no_grad():
        out = ckpt.model()(torch.from_numpy(x)).numpy()
    if out.shape != ref.shape:
        raise CmhsaError(
            f"onnxruntime returns shape {list(ref.shape)}, the rebuilt model {list(out.shape)}", path
        )
    max_abs = float(np.abs(out - ref).max())
    ref_max = float(np.abs(ref).max())
    rel = relative_error(max_abs, ref_max)
    result = dict(
        passed=rel <= tol,
        batch=batch,
        seed=seed,
        max_abs=max_abs,
        ref_max=ref_max,
        rel=rel,
        tol=tol,
        providers=session.get_providers(),
    )
    if not result["passed"]:
        raise CmhsaError(
            "the PyTorch model rebuilt from the graph disagrees with onnxruntime "
            f"(relative error {rel:.2e} > "
            f"tol {tol:g}); the graph is not a conv-phase ViT cmhsa reads correctly",
            path,
        )
    return result


def import_onnx(path: str | Path, tol: float = DEFAULT_TOL, seed: int = 0, model: Any = None) -> Checkpoint:
    """Load, read and prove a conv-phase ONNX model; the result is an ordinary conv Checkpoint
    whose ``import_report`` records how it was read and the onnxruntime agreement. ``model``: the
    file as ``load_onnx`` already returned it (a caller that read it to decide), else it is read."""
    import onnx

    path = Path(path)
    model = without_initializer_inputs(load_onnx(path) if model is None else model)
    structure = read_structure(model, path, seed)
    cfg, tensors, layout = to_checkpoint(structure, path)
    validate_tensors(cfg, tensors, path)
    props = {p.key: p.value for p in model.metadata_props}  # held to memory with the file by load_onnx
    named = {KEY: props["classes"]} if "classes" in props else {}  # cmhsa export's record of the names
    from_metadata(named, cfg.num_classes, path)
    ckpt = Checkpoint(path, cfg, tensors, named, "onnx")
    # the batch the graph was traced at: its static batch, if it has one
    check = check_import(model, ckpt, path, tol, batch=structure.residual_shape[0], seed=seed + 1)
    ckpt.import_report = {
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "onnx": onnx.__version__,
        "read": {**structure.forms, "token layout": [layout]},
        "onnxruntime_check": check,
    }
    return ckpt
