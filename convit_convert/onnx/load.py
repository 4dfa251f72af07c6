"""Reading untrusted ONNX files, and running them in onnxruntime.

An ONNX file is a protobuf that may point at *external data* files by relative path. cmhsa reads
external data only from inside the model's own folder: a location that is absolute, climbs out
with ``..``, or resolves (through a link) to anywhere outside that folder is refused, as is one
whose offset and length do not fit the file. Then ``onnx.checker.check_model(full_check=True)``
(structure plus strict shape inference), then onnxruntime must agree to load it (IR version and
opsets it can run). Every problem is a :class:`CmhsaError` naming the file.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CmhsaError, first_line
from ..io.paths import check_input_file

# element types cmhsa reads weights and images in (onnx.TensorProto.FLOAT / DOUBLE)
FLOAT, DOUBLE = 1, 11


def _tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto a graph holds: initializers, sparse initializers, Constant values, and
    those of subgraphs (If/Loop bodies), recursively."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


def _external_file(location: str, folder: Path, path: Path) -> Path:
    """The file ``location`` names, if it lies inside ``folder``; else CmhsaError."""
    if not location:
        raise CmhsaError("external data with an empty location", path)
    if location.startswith(("/", "\\")) or os.path.isabs(location) or re.match(r"^[A-Za-z]:", location):
        raise CmhsaError(
            f"external data location {location!r} is an absolute path; only files inside the model's folder are read",
            path,
        )
    if ".." in Path(location.replace("\\", "/")).parts:
        raise CmhsaError(f"external data location {location!r} leaves the model's folder", path)
    target = folder / location
    real_folder = folder.resolve()
    try:
        real = target.resolve(strict=True)
    except (OSError, RuntimeError):
        raise CmhsaError(f"external data file {location!r} does not exist", path) from None
    if real != real_folder and real_folder not in real.parents:
        raise CmhsaError(f"external data file {location!r} links outside the model's folder", path)
    if not real.is_file():
        raise CmhsaError(f"external data {location!r} is not a regular file", path)
    return real


def _load_external_data(model: Any, path: Path) -> None:
    """Read every external tensor's bytes into the model, checking where each comes from."""
    from onnx import TensorProto, helper
    from onnx.external_data_helper import ExternalDataInfo

    folder = path.parent
    for tensor in _tensors(model.graph):
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        try:  # the entries are untrusted strings: offset "x", length "-1", data type 999
            info = ExternalDataInfo(tensor)
            file = _external_file(info.location, folder, path)
            size = file.stat().st_size
            offset = int(info.offset or 0)
            itemsize = helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
            expected = math.prod(tensor.dims) * itemsize
            length = int(info.length) if info.length else size - offset
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CmhsaError(
                f"external data for tensor {tensor.name!r} is malformed ({type(e).__name__}: {e})", path
            ) from None
        if offset < 0 or length < 0 or offset + length > size:
            raise CmhsaError(
                f"external data for tensor {tensor.name!r}: offset {offset} + length {length} "
                f"is past the end of {info.location!r} ({size} bytes)",
                path,
            )
        if length != expected:
            raise CmhsaError(
                f"external data for tensor {tensor.name!r}: {length} bytes, its shape {list(tensor.dims)} "
                f"needs {expected}",
                path,
            )
        with open(file, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


def load_onnx(path: str | Path) -> Any:
    """Parse, bring in external data (from inside the model's folder only) and fully check an ONNX
    file. Returns the ``onnx.ModelProto``; raises CmhsaError on anything wrong with it."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    check_input_file(path, "model file")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeWarning) as e:
        raise CmhsaError(f"not a readable ONNX file (truncated or not ONNX: {e})", path) from None
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    if not model.HasField("graph") or not model.graph.node:
        raise CmhsaError("not an ONNX model (no graph; truncated or another kind of file?)", path)
    _load_external_data(model, path)
    try:
        onnx.checker.check_model(model, full_check=True)
    except Exception as e:  # checker and shape inference raise several types
        raise CmhsaError(f"fails onnx.checker.check_model(full_check=True): {_first_line(e)}", path) from None
    return model


def _first_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


def _ort_message(e: BaseException) -> str:
    """onnxruntime's errors carry C++ source locations; keep the part a user can act on."""
    msg = " ".join(str(e).split())
    for marker in ("Unsupported", "ONNX Runtime only", "Load model", "This is an invalid model"):
        i = msg.find(marker)
        if i >= 0:
            return msg[i:]
    return msg


def providers_for(device: str) -> list[Any]:
    """onnxruntime execution providers for ``device`` ('cpu', 'cuda', 'cuda:N' or 'auto'); CPU
    always last."""
    import onnxruntime as ort

    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if "CUDAExecutionProvider" in available:
        index = device.partition(":")[2]
        cuda = ("CUDAExecutionProvider", {"device_id": int(index)}) if index else "CUDAExecutionProvider"
        return [cuda, "CPUExecutionProvider"]
    if device.startswith("cuda"):
        raise CmhsaError(
            "onnxruntime has no CUDAExecutionProvider here (install onnxruntime-gpu, the gpu extra, "
            f"instead of onnxruntime); available: {', '.join(available)}"
        )
    return ["CPUExecutionProvider"]


def ort_session(
    model: Any, path: str | Path, providers: list[str] | None = None, threads: int = 0, optimize: bool = True,
) -> Any:  # fmt: skip
    """An onnxruntime InferenceSession for a checked ModelProto (``path`` names it in errors).
    ``threads`` 0 lets onnxruntime choose; ``optimize=False`` runs the graph as written."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3  # errors only: its warnings are about graph rewrites
    if threads:
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
    if not optimize:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        return ort.InferenceSession(
            model.SerializeToString(), opts, providers=providers or ["CPUExecutionProvider"]
        )
    except Exception as e:  # onnxruntime raises its own pybind error types
        raise CmhsaError(f"onnxruntime {ort.__version__} cannot run it: {_ort_message(e)}", path) from None


def run_session(session: Any, outputs: list[str] | None, feeds: dict[str, Any], path: Path) -> list[Any]:
    """``session.run``, with onnxruntime's failure (a graph that passed the checker but does not
    run) as one CmhsaError naming the file."""
    try:
        return session.run(outputs, feeds)  # type: ignore[no-any-return]
    except Exception as e:  # onnxruntime raises its own pybind error types
        raise CmhsaError(
            f"onnxruntime cannot run the graph ({type(e).__name__}: {first_line(e)})", path
        ) from None
