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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import CmhsaError, first_line, one_line
from ..io.journal import check_settled
from ..io.paths import check_input_file
from ..resources import check_fits
from .shapes import shape_known

# element types cmhsa reads weights and images in (onnx.TensorProto.FLOAT / DOUBLE)
FLOAT, DOUBLE = 1, 11


def _tensors(graph: Any) -> Iterator[Any]:
    """Every TensorProto a graph holds: initializers, sparse initializers, and those of its nodes
    (:func:`_node_tensors`)."""
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


def _node_tensors(nodes: Any) -> Iterator[Any]:
    """Every TensorProto in ``nodes``' attributes: Constant values dense and sparse, tensor lists,
    and those of subgraphs (If/Loop bodies), recursively."""
    for node in nodes:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [attr.sparse_tensor] * attr.HasField("sparse_tensor") + list(attr.sparse_tensors):
                yield sparse.values
                yield sparse.indices
            if attr.HasField("g"):
                yield from _tensors(attr.g)
            for g in attr.graphs:
                yield from _tensors(g)


def model_tensors(model: Any) -> Iterator[Any]:
    """Every TensorProto of every part of a model: its graph and its local functions' nodes."""
    yield from _tensors(model.graph)
    for function in model.functions:
        yield from _node_tensors(function.node)


def _external_file(location: str, folder: Path, path: Path) -> Path:
    """The file ``location`` names, if it lies inside ``folder``; else CmhsaError."""
    if not location:
        raise CmhsaError("external data with an empty location", path)
    if location.startswith(("/", "\\")) or os.path.isabs(location) or re.match(r"^[A-Za-z]:", location):
        raise CmhsaError(
            f"external data location {location!r} is an absolute path; only files "
            "inside the model's folder are read",
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


def _external_parts(model: Any, path: Path) -> list[tuple[Any, Path, int, int]]:
    """Every external tensor with the file, offset and length it names, each checked against the
    file it names (inside the model's folder, within its end, the length its shape needs) without
    reading any of it; every tensor, inline or not, at most MAX_TENSOR_ELEMENTS."""
    from onnx import TensorProto, helper
    from onnx.external_data_helper import ExternalDataInfo

    parts = []
    for tensor in model_tensors(model):
        if math.prod(tensor.dims) > MAX_TENSOR_ELEMENTS:
            raise CmhsaError(
                f"tensor {tensor.name!r} holds {math.prod(tensor.dims):,} elements, more than cmhsa "
                f"runs ({MAX_TENSOR_ELEMENTS:,})",
                path,
            )
        if tensor.data_location != TensorProto.EXTERNAL:
            continue
        try:  # the entries are untrusted strings: offset "x", length "-1", data type 999
            info = ExternalDataInfo(tensor)
            file = _external_file(info.location, path.parent, path)
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
        parts.append((tensor, file, offset, length))
    return parts


# The most copies of an ONNX file's bytes held at once while cmhsa checks and runs it: the parsed
# proto, onnx's checker and shape inference (each a serialized copy and its C++ parse), the copies
# a conv graph's import makes, onnxruntime's, and the model rebuilt from it. Measured on this
# project's exports: `inspect` of a 113 MB conv graph peaked 0.91 GB above a small one's (8.0x);
# `predict` of a graph holding 512 MiB of weights, inline or external, 3.0 GiB above (6.0x).
HELD_COPIES = 8


def _check_held(path: Path, nbytes: int) -> None:
    """The memory checking and running ``nbytes`` of ONNX file takes, held to what is available
    before any of it is read."""
    check_fits(
        HELD_COPIES * nbytes,
        f"reading the ONNX file ({nbytes:,} bytes of graph and weights, held about "
        f"{HELD_COPIES} times while it is checked and run)",
        path,
    )


def _densified(model: Any, path: Path) -> int:
    """The bytes onnxruntime makes of the graph's sparse initializers, each made dense (a few bytes
    of values can claim any shape): each at most MAX_TENSOR_ELEMENTS."""
    from onnx import helper

    total = 0
    for sparse in model.graph.sparse_initializer:
        n = math.prod(sparse.dims)
        if n > MAX_TENSOR_ELEMENTS:
            raise CmhsaError(
                f"sparse tensor {sparse.values.name!r} is {n:,} elements dense, more than cmhsa runs "
                f"({MAX_TENSOR_ELEMENTS:,})",
                path,
            )
        try:
            total += n * helper.tensor_dtype_to_np_dtype(sparse.values.data_type).itemsize
        except (KeyError, TypeError, ValueError):
            total += 8 * n
    return total


def _parse(path: Path) -> Any:
    """The ONNX file's protobuf without its external data, its size held to memory first."""
    import onnx

    _check_held(path, path.stat().st_size)
    return onnx.load_model(str(path), load_external_data=False)


def _load_external_data(model: Any, path: Path) -> None:
    """Read every external tensor's bytes into the model, checking where each comes from, and
    holding the file and all its external data to the memory available before any is read."""
    from onnx import TensorProto

    parts = _external_parts(model, path)
    _check_held(path, path.stat().st_size + sum(length for *_, length in parts) + _densified(model, path))
    for tensor, file, offset, length in parts:
        with open(file, "rb") as f:
            f.seek(offset)
            tensor.raw_data = f.read(length)
        tensor.data_location = TensorProto.DEFAULT
        del tensor.external_data[:]


def data_files(path: str | Path) -> list[Path]:
    """The external data files an ONNX file names inside its folder (what reading it reads besides
    the file itself), from the proto alone; [] for anything unreadable (the reader says what)."""
    from onnx import TensorProto
    from onnx.external_data_helper import ExternalDataInfo

    path = Path(path)
    try:
        model = _parse(path)
        locations = {
            ExternalDataInfo(t).location
            for t in model_tensors(model)
            if t.data_location == TensorProto.EXTERNAL
        }
    except Exception:  # the reader (load_onnx) reports a file it cannot read, in one line
        return []
    found = []
    for location in sorted(locations):
        try:
            found.append(_external_file(location, path.parent, path))
        except CmhsaError:
            continue
    return found


def load_onnx(path: str | Path) -> Any:
    """Parse, bring in external data (from inside the model's folder only) and fully check an ONNX
    file. Returns the ``onnx.ModelProto``; raises CmhsaError on anything wrong with it."""
    import onnx
    from google.protobuf.message import DecodeError

    path = Path(path)
    check_input_file(path, "model file")
    check_settled(path)
    try:
        model = _parse(path)
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


# What onnxruntime may be asked to run. A conv-phase ViT export has no control flow (every control
# flow op holds a subgraph), local functions or other domains' ops, so none is run: a Loop of 10^12
# trips would run for ever.
MAX_TENSOR_ELEMENTS = 2**28  # any one tensor of the graph at the batch it is run at (1 GiB of float32)
RUN_SECONDS = 600.0  # one onnxruntime run of a graph; a ViT within the flags' limits takes seconds


def check_runnable(model: Any, path: Path, batch: int) -> int:
    """Before onnxruntime sees the graph: only standard ops, no control flow, subgraphs or local
    functions, and every dimension of every node's output fixed by shape inference from the declared
    input's shape at ``batch`` (``shapes.shape_known``: a Reshape to a shape computed from the
    input's shape, or an Expand to a constant one, is sized): a number. Decided by the graph, not
    by a list of ops: any op whose output size comes from the input's values (NonZero, an Expand or
    HannWindow sized by a pixel) leaves a dimension inference cannot fix, and is refused naming its
    node. Every tensor holds at most MAX_TENSOR_ELEMENTS at ``batch``. Returns the bytes of every
    node's outputs together, for the caller to hold against the memory available."""
    import onnx
    from onnx import helper

    graph = model.graph
    if len(model.functions):
        raise CmhsaError("defines local functions; cmhsa runs only graphs of standard ONNX ops", path)
    for node in graph.node:
        if node.domain not in ("", "ai.onnx"):
            raise CmhsaError(
                f"node {node.name!r} is a {node.domain}.{node.op_type}, not a standard ONNX op", path
            )
        if any(a.HasField("g") or len(a.graphs) for a in node.attribute):
            raise CmhsaError(
                f"node {node.name!r} is a {node.op_type} with a subgraph; a ViT's graph has no control flow",
                path,
            )
    try:
        inferred = onnx.shape_inference.infer_shapes(
            shape_known(model, batch), strict_mode=True, data_prop=True
        )
    except Exception as e:  # onnx raises several types
        raise CmhsaError(f"shape inference fails on the graph: {_first_line(e)}", path) from None
    types = {
        v.name: v.type for v in [*inferred.graph.value_info, *inferred.graph.output, *inferred.graph.input]
    }
    total = 0
    for node in graph.node:
        for name in filter(None, node.output):
            t = types.get(name)
            if t is None or not t.HasField("tensor_type") or not t.tensor_type.HasField("shape"):
                raise CmhsaError(
                    f"node {node.name or node.op_type!r} ({node.op_type}) makes tensor {name!r}, whose shape "
                    "is not known before running the graph; cmhsa runs only graphs whose sizes follow from "
                    "the input's shape",
                    path,
                )
            count = 1
            for axis, d in enumerate(t.tensor_type.shape.dim):
                if d.HasField("dim_value") and d.dim_value >= 0:
                    count *= d.dim_value
                else:  # a size shape inference cannot fix from the input's shape: from its values
                    raise CmhsaError(
                        f"node {node.name or node.op_type!r} ({node.op_type}) makes tensor {name!r} whose "
                        f"dimension {axis} does not follow from the input's shape (it depends on the "
                        "input's values); cmhsa runs only graphs whose sizes follow from the input's shape",
                        path,
                    )
            if count > MAX_TENSOR_ELEMENTS:
                raise CmhsaError(
                    f"tensor {name!r} ({node.op_type}) would hold {count:,} elements at batch "
                    f"{batch}, more than "
                    f"cmhsa runs ({MAX_TENSOR_ELEMENTS:,})",
                    path,
                )
            try:
                itemsize = helper.tensor_dtype_to_np_dtype(t.tensor_type.elem_type).itemsize
            except (KeyError, TypeError, ValueError):
                itemsize = 8
            total += count * itemsize
    return total


def _first_line(e: BaseException) -> str:
    lines = [s.strip() for s in str(e).splitlines() if s.strip()]
    return lines[0] if lines else type(e).__name__


def _ort_message(e: BaseException) -> str:
    """onnxruntime's errors carry C++ source locations; keep the part a user can act on."""
    msg = one_line(str(e))
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
    model: Any,
    path: str | Path,
    providers: list[str] | None = None,
    threads: int = 0,
    optimize: bool = True,
    *,
    batch: int,
    kept: int = 1,
) -> Any:
    """An onnxruntime InferenceSession for a checked ModelProto (``path`` names it in errors), the
    one way cmhsa makes one: only for a graph :func:`check_runnable` sizes at ``batch`` whose node
    outputs together (times ``kept``: a caller that fetches every intermediate holds them all)
    fit in the memory available now, a one-line CmhsaError otherwise. ``threads`` 0 lets
    onnxruntime choose; ``optimize=False`` runs the graph as written."""
    import onnxruntime as ort

    need = kept * check_runnable(model, path, batch)  # type: ignore[arg-type]  (path: for messages)
    check_fits(need, f"running the graph at batch {batch} (every node's outputs together)", path)

    ort.set_default_logger_severity(4)  # its log lines (colour escapes) never reach stderr: errors raise
    opts = ort.SessionOptions()
    opts.log_severity_level = 4
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


def run_session(
    session: Any, outputs: list[str] | None, feeds: dict[str, Any], path: Path, seconds: float = RUN_SECONDS
) -> list[Any]:
    """``session.run``, bounded in time and interruptible: it runs in a thread while this one
    waits, so SIGINT/SIGTERM handlers run, and onnxruntime is told to stop (``RunOptions.terminate``)
    when one raises or after ``seconds``. onnxruntime's failure (a graph that passed the checker but
    does not run) is one CmhsaError naming the file."""
    import onnxruntime as ort

    opts = ort.RunOptions()
    opts.log_severity_level = 4
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["out"] = session.run(outputs, feeds, opts)
        except Exception as e:  # onnxruntime raises its own pybind error types
            box["error"] = e

    worker = threading.Thread(target=work, name="onnxruntime", daemon=True)
    deadline = time.monotonic() + seconds
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.1)
            if time.monotonic() > deadline:
                raise CmhsaError(f"onnxruntime ran the graph for more than {seconds:g} s; stopped", path)
    except BaseException:  # the deadline, or Ctrl-C / SIGTERM unwinding: stop onnxruntime first
        opts.terminate = True
        worker.join(30)
        raise
    if "error" in box:
        e = box["error"]
        raise CmhsaError(f"onnxruntime cannot run the graph ({type(e).__name__}: {first_line(e)})", path)
    return box["out"]  # type: ignore[no-any-return]
