"""Export a cmhsa model to one self-contained ONNX file, and check it in onnxruntime.

The file has one input ``pixel_values`` (batch_size, C, H, W), dynamic in batch_size, and one
output ``logits`` (batch_size, num_classes). Both exporters work: ``dynamo`` (torch.export, the
default of ``torch.onnx.export``) and ``legacy`` (TorchScript tracing).

Attention is exported in one of two forms, both the same function as
:class:`~convit_convert.attention.RelPosAttention` written out as MatMul / Softmax with the
relative-position bias gathered once into a constant (sink column included):

- ``fused`` (the default): :class:`~convit_convert.deploy.FusedRelPosAttention`'s portable form,
  W_V·W_O folded into one product per head (and W_Q·W_K when qk_dim >= d/2): fewer MACs per token;
- ``trained``: :class:`~convit_convert.deploy.ExportAttention`, the projections as trained.

Either keeps the bias and sink constants in the file, and sidesteps exporting
``scaled_dot_product_attention`` with a gathered mask, which the dynamo exporter has been reported
to fail on. Conv models have one form.

The check is the careful exporter's, failing where others warn: ``onnx.checker.check_model(
full_check=True)``, the input and output names and dynamic batch axis, then onnxruntime on
batch 1 and batch 3 against the PyTorch model (with its own attention forward) on the same images.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from ..deploy import fuse_attention, prepare_for_export
from ..errors import CmhsaError
from ..io.timm_folder import preprocessing
from ..model import VisionTransformer
from ..text import json_text
from ..verify import relative_error
from .load import ort_session

INPUT_NAME, OUTPUT_NAME, BATCH_AXIS = "pixel_values", "logits", "batch_size"
CHECK_BATCHES = (1, 3)
_PROTOBUF_LIMIT = 2**31 - 1


@contextlib.contextmanager
def _silenced() -> Iterator[None]:
    """Swallow everything written to stdout and stderr, Python's and the C++ libraries' alike."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = []
    with tempfile.TemporaryFile() as sink:
        try:
            for fd in (1, 2):
                saved.append((fd, os.dup(fd)))
                os.dup2(sink.fileno(), fd)
        except OSError:  # no real file descriptors (embedded interpreters): Python-level only
            pass
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                yield
        finally:
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)


def export_model(model: VisionTransformer, *, exporter: str = "dynamo", opset: int | None = None) -> Any:
    """The ONNX ModelProto of ``model`` (float32, eval), with the names and dynamic batch above
    (options checked by the operation, ``api.export``)."""
    import onnx

    cfg = model.cfg
    example = torch.randn(2, cfg.in_chans, *cfg.img_size)  # batch 2: torch.export specialises 1
    kwargs: dict[str, Any] = {
        "input_names": [INPUT_NAME],
        "output_names": [OUTPUT_NAME],
        "opset_version": opset,
        "dynamo": exporter == "dynamo",
    }
    if exporter == "dynamo":
        kwargs["dynamic_shapes"] = {"x": {0: torch.export.Dim(BATCH_AXIS)}}
        kwargs["verbose"] = False
    else:
        kwargs["dynamic_axes"] = {INPUT_NAME: {0: BATCH_AXIS}, OUTPUT_NAME: {0: BATCH_AXIS}}
    # both exporters narrate, warn about tracing, log fallbacks with tracebacks and (legacy) dump
    # graphs from C++; a failure becomes one line below, and the check after export is what counts
    with warnings.catch_warnings(), _silenced(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            if exporter == "dynamo":
                program = torch.onnx.export(model, (example,), **kwargs)
                proto = program.model_proto
            else:
                buf = io.BytesIO()
                torch.onnx.export(model, (example,), buf, **kwargs)
                proto = onnx.load_from_string(buf.getvalue())
        except Exception as e:  # the exporters raise many types; a failed export is one line
            first = next((s for s in str(e).splitlines() if s.strip()), type(e).__name__)
            raise CmhsaError(
                f"torch.onnx.export ({exporter}, opset {opset or 'default'}) failed: {first}"
            ) from None
    if proto.ByteSize() > _PROTOBUF_LIMIT:
        raise CmhsaError("the model is over protobuf's 2 GB limit; cmhsa export writes single files only")
    return proto


@dataclass
class BatchCheck:
    batch: int
    output_shape: list[int]
    max_abs: float
    ref_max: float
    rel: float
    passed: bool


@dataclass
class ExportCheck:
    passed: bool
    tol: float
    providers: list[str]
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    batches: list[BatchCheck] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def worst(self) -> BatchCheck:
        return max(self.batches, key=lambda b: b.rel)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def reference_outputs(model: VisionTransformer, seed: int = 0) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Images for each check batch size and the PyTorch model's logits on them (float32, CPU)."""
    cfg = model.cfg
    gen = torch.Generator().manual_seed(seed)
    refs = {}
    with torch.no_grad():
        for b in CHECK_BATCHES:
            x = torch.randn(b, cfg.in_chans, *cfg.img_size, generator=gen)
            refs[b] = (x.numpy(), model(x).numpy())
    return refs


def _io(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
        out.append({"name": v.name, "shape": dims})
    return out


def check_export(
    proto: Any,
    refs: dict[int, tuple[np.ndarray, np.ndarray]],
    num_classes: int,
    *,
    tol: float,
    providers: list[str],
    path: Any,
) -> ExportCheck:
    """Checker, names and dynamic batch, then onnxruntime against the PyTorch logits."""
    import onnx

    try:
        onnx.checker.check_model(proto, full_check=True)
    except Exception as e:
        opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), "?")
        raise CmhsaError(
            f"the exported model (opset {opset}) fails onnx.checker.check_model(full_check=True): {e}; "
            "try another `opset` or `exporter`",
            path,
        ) from None
    session = ort_session(proto, path, providers, batch=max(CHECK_BATCHES))
    result = ExportCheck(
        passed=True,
        tol=tol,
        providers=session.get_providers(),
        inputs=_io(proto.graph.input),
        outputs=_io(proto.graph.output),
    )
    names = ([i["name"] for i in result.inputs], [o["name"] for o in result.outputs])
    if names != ([INPUT_NAME], [OUTPUT_NAME]):
        result.problems.append(
            f"inputs {names[0]} / outputs {names[1]}, expected [{INPUT_NAME}] / [{OUTPUT_NAME}]"
        )
    elif not isinstance(result.inputs[0]["shape"][0], str):
        result.problems.append(f"{INPUT_NAME} has a fixed batch size {result.inputs[0]['shape'][0]}")
    for b, (x, ref) in refs.items():
        (out,) = session.run([OUTPUT_NAME], {INPUT_NAME: x})
        shape_ok = list(out.shape) == [b, num_classes]
        max_abs = float(np.abs(out - ref).max()) if shape_ok else math.inf
        ref_max = float(np.abs(ref).max())
        rel = relative_error(max_abs, ref_max)
        result.batches.append(BatchCheck(b, list(out.shape), max_abs, ref_max, rel, shape_ok and rel <= tol))
        if not shape_ok:
            result.problems.append(
                f"batch {b}: logits of shape {list(out.shape)}, expected {[b, num_classes]}"
            )
    result.passed = not result.problems and all(bc.passed for bc in result.batches)
    return result


@dataclass
class Exported:
    data: bytes  # the .onnx file
    check: ExportCheck
    exporter: str
    form: str | None  # the attention's form; None for a conv model
    opsets: dict[str, int]
    ir_version: int
    timings: dict[str, float]


def describe(proto: Any, cfg: Any, classes: tuple[str, ...] | None = None) -> None:
    """The file says how to prepare its input and what its outputs are: ``metadata_props`` holds the
    preprocessing (io/timm_folder.preprocessing: size, resize, crop, mean and std, channels) and,
    where known, the class names (``classes``: a JSON list, output i the i-th), ``doc_string`` a
    sentence naming them; onnxruntime shows both (``session.get_modelmeta()``)."""
    import onnx

    props = preprocessing(cfg)
    if classes is not None:
        props["classes"] = json_text(list(classes), indent=None)
    onnx.helper.set_model_props(proto, props)
    proto.doc_string = (
        f"cmhsa {cfg.kind} model, {cfg.num_classes} classes. Input pixel_values "
        f"(batch, {props['input_size']}): "
        f"an image as {props['channels']}, its shorter side resized to {props['resize_shorter_to']} "
        f"({props['interpolation']}), centre-cropped, scaled by 1/255, normalised with mean {props['mean']} "
        f"and std {props['std']} (metadata_props)."
    )


def export_and_check(
    model: VisionTransformer,
    *,
    exporter: str = "dynamo",
    opset: int | None = None,
    tol: float = 1e-4,
    providers: list[str] | None = None,
    seed: int = 0,
    path: Any = None,
    form: str = "fused",
    classes: tuple[str, ...] | None = None,
) -> Exported:
    """Export ``model`` (as float32; its attention is swapped for the ``form``'s, in place) and
    check the result against the model as it was; ``classes``: the outputs' names, recorded in the
    file. The options were checked when made (``options.operations.ExportOptions``), before any
    work."""
    model = model.float().eval()
    refs = reference_outputs(model, seed)  # before the swap: the reference is the model as trained
    t = time.perf_counter()
    deployed = fuse_attention(model, portable=True) if form == "fused" else prepare_for_export(model)
    proto = export_model(deployed, exporter=exporter, opset=opset)
    export_s = time.perf_counter() - t
    t = time.perf_counter()
    check = check_export(
        proto,
        refs,
        model.cfg.num_classes,
        tol=tol,
        providers=providers or ["CPUExecutionProvider"],
        path=path,
    )
    check_s = time.perf_counter() - t
    describe(proto, model.cfg, classes)
    return Exported(
        data=proto.SerializeToString(),
        check=check,
        exporter=exporter,
        form=form if model.kind == "attn" else None,
        opsets={o.domain or "ai.onnx": o.version for o in proto.opset_import},
        ir_version=proto.ir_version,
        timings={"export_s": export_s, "check_s": check_s},
    )
