"""An ONNX graph runs only if every dimension of every tensor follows from the declared input's
shape (onnx/shapes.py folds what is computed from shapes and constants; shape inference does the
rest): decided by the graph, not by a list of ops. Each op below makes a tensor sized by the input's
*values* (a pixel scaled by 10^5); every one is refused before onnxruntime sees the graph, naming
its node: HannWindow, HammingWindow, BlackmanWindow, MelWeightMatrix, DFT, STFT, Squeeze,
Unsqueeze and ReduceSum with computed axes among them (a 219-byte HannWindow can claim 3.86 GB)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from onnx import TensorProto, helper

from conftest import invoke, one_error_line
from convit_convert.errors import CmhsaError
from convit_convert.onnx.load import check_runnable

F, I64 = TensorProto.FLOAT, TensorProto.INT64

# op -> (its nodes, reading the value-derived int64 scalar "n", vectors "n1" = [n], "n2", "n4",
# "n8", and the float image "x"; the tested node is named "op" and its first output is "out")
OPS: dict[str, list] = {
    "Reshape": [helper.make_node("Reshape", ["x", "n1"], ["out"], name="op")],
    "Expand": [helper.make_node("Expand", ["onef", "n2"], ["out"], name="op")],
    "Tile": [helper.make_node("Tile", ["x", "n4"], ["out"], name="op")],
    "ConstantOfShape": [helper.make_node("ConstantOfShape", ["n1"], ["out"], name="op")],
    "Range": [helper.make_node("Range", ["zero", "n", "onei"], ["out"], name="op")],
    "Resize": [helper.make_node("Resize", ["x", "", "", "n4"], ["out"], name="op")],
    "Pad": [helper.make_node("Pad", ["x", "n8"], ["out"], name="op")],
    "OneHot": [helper.make_node("OneHot", ["idx", "n", "onoff"], ["out"], name="op")],
    "Slice": [helper.make_node("Slice", ["x", "zero1", "n1", "three1"], ["out"], name="op")],
    "TopK": [helper.make_node("TopK", ["x", "n1"], ["out", "topi"], name="op")],
    "Split": [helper.make_node("Split", ["x", "n2"], ["out", "rest"], axis=3, name="op")],
    "NonZero": [helper.make_node("NonZero", ["x"], ["out"], name="op")],
    "Unique": [helper.make_node("Unique", ["x"], ["out"], name="op")],
    "Compress": [
        helper.make_node("Greater", ["flat", "zerof"], ["keep"]),
        helper.make_node("Compress", ["flat", "keep"], ["out"], name="op"),
    ],
    "NonMaxSuppression": [
        helper.make_node("NonMaxSuppression", ["boxes", "scores", "n1"], ["out"], name="op"),
    ],
    "CenterCropPad": [
        helper.make_node(
            "CenterCropPad",
            [
                "x",
                "n2",
            ],
            ["out"],
            axes=[2, 3],
            name="op",
        )
    ],
    "Col2Im": [helper.make_node("Col2Im", ["cols", "n2", "two2"], ["out"], name="op")],
    "HannWindow": [helper.make_node("HannWindow", ["n"], ["out"], name="op")],
    "HammingWindow": [helper.make_node("HammingWindow", ["n"], ["out"], name="op")],
    "BlackmanWindow": [helper.make_node("BlackmanWindow", ["n"], ["out"], name="op")],
    "MelWeightMatrix": [
        helper.make_node("MelWeightMatrix", ["n", "n", "n", "zerof", "onef0"], ["out"], name="op"),
    ],
    "DFT": [helper.make_node("DFT", ["signal", "n"], ["out"], name="op")],
    "STFT": [helper.make_node("STFT", ["signal", "onei", "", "n"], ["out"], name="op")],
    "Squeeze": [helper.make_node("Squeeze", ["x", "axes"], ["out"], name="op")],
    "Unsqueeze": [helper.make_node("Unsqueeze", ["x", "axes"], ["out"], name="op")],
    "ReduceSum": [helper.make_node("ReduceSum", ["x", "axes"], ["out"], name="op")],
}


def graph_with(op: str, path: Path, batch: object = 1, scale: float = 1e5) -> Path:
    """A tiny graph: x (batch, 3, 8, 8) -> a value n from its pixels -> OPS[op] -> y = x + sum(out)."""
    x = helper.make_tensor_value_info("x", F, [batch, 3, 8, 8])
    y = helper.make_tensor_value_info("y", F, [batch, 3, 8, 8])
    value = [
        helper.make_node("ReduceMax", ["x"], ["m"], keepdims=0),
        helper.make_node("Mul", ["m", "big"], ["mb"]),
        helper.make_node("Cast", ["mb"], ["n"], to=I64),
        helper.make_node("Reshape", ["n", "one_shape"], ["n1"]),
        helper.make_node("Concat", ["n1", "n1"], ["n2"], axis=0),
        helper.make_node("Concat", ["n2", "n2"], ["n4"], axis=0),
        helper.make_node("Concat", ["n4", "n4"], ["n8"], axis=0),
        helper.make_node("Reshape", ["x", "flat_shape"], ["flat"]),
        helper.make_node("Mod", ["n1", "four1"], ["axes"]),
        helper.make_node("Reshape", ["x", "signal_shape"], ["signal"]),
        helper.make_node("Reshape", ["x", "cols_shape"], ["cols"]),
        helper.make_node("Reshape", ["x", "boxes_shape"], ["boxes"]),
        helper.make_node("Reshape", ["flat", "scores_shape"], ["scores_all"]),
        helper.make_node("Slice", ["scores_all", "zero1", "forty8"], ["scores"]),
    ]
    tail = [
        helper.make_node("Cast", ["out"], ["outf"], to=F),
        helper.make_node("ReduceSum", ["outf"], ["s"], keepdims=0),
        helper.make_node("Add", ["x", "s"], ["y"]),
    ]
    t = helper.make_tensor
    inits = [
        t("big", F, [], [scale]),
        t("one_shape", I64, [1], [1]),
        t("onef", F, [1], [1.0]),
        t("onef0", F, [], [1.0]),
        t("zerof", F, [], [0.0]),
        t("zero", I64, [], [0]),
        t("onei", I64, [], [1]),
        t("zero1", I64, [1], [0]),
        t("three1", I64, [1], [3]),
        t("four1", I64, [1], [4]),
        t("idx", I64, [2], [0, 1]),
        t("onoff", F, [2], [0.0, 1.0]),
        t("two2", I64, [2], [2, 2]),
        t("flat_shape", I64, [1], [-1]),
        t("signal_shape", I64, [3], [1, -1, 1]),
        t("cols_shape", I64, [3], [1, 12, -1]),
        t("boxes_shape", I64, [3], [1, -1, 4]),
        t("scores_shape", I64, [3], [1, 1, -1]),
        t("forty8", I64, [1], [48]),
    ]
    graph = helper.make_graph([*value, *OPS[op], *tail], "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    path.write_bytes(model.SerializeToString())
    return path


@pytest.mark.parametrize("op", list(OPS))
def test_a_size_from_the_input_s_values_is_refused_naming_its_node(tmp_path: Path, op: str) -> None:
    import onnx

    model = onnx.load(graph_with(op, tmp_path / f"{op}.onnx"))
    with pytest.raises(CmhsaError) as e:
        check_runnable(model, tmp_path / f"{op}.onnx", batch=1)
    # the node is named, except where shape inference itself cannot type the op on these inputs
    assert f"node 'op' ({op})" in e.value.message or "shape inference fails" in e.value.message, (
        e.value.message
    )


def test_the_same_graph_sized_by_a_constant_runs(tmp_path: Path) -> None:
    """The check is about where a size comes from: with n a constant, Expand's output is sized."""
    import onnx

    model = onnx.load(graph_with("Expand", tmp_path / "c.onnx", batch="batch", scale=4.0))
    for node in model.graph.node:  # n from the graph's constants instead of the pixels
        if node.output[0] == "m":
            node.op_type, node.input[0] = "Identity", "onef0"
            del node.attribute[:]
    assert check_runnable(model, tmp_path / "c.onnx", batch=2) > 0


def test_a_window_sized_by_a_pixel_is_refused_by_inspect_before_it_runs(tmp_path: Path) -> None:
    # was: 219 bytes reached 3.86 GB, then "tensor 'x' has no known type"
    path = graph_with("HannWindow", tmp_path / "hann.onnx", batch="batch")
    one_error_line(invoke("inspect", path), 2, "node 'op' (HannWindow)", "follow from the input's shape")


def test_a_declared_shape_is_a_claim_not_a_fact(tmp_path: Path) -> None:
    """A graph whose value_info and output declare small fixed shapes while a HannWindow and a OneHot
    inside take their size from a pixel is refused by check_runnable: every declared shape but the
    input's is removed before inference, so the declared sizes cannot hide the real ones."""
    import onnx

    for op, declared in (("HannWindow", [4]), ("OneHot", [2, 4])):
        model = onnx.load(graph_with(op, tmp_path / f"{op}.onnx"))
        model.graph.value_info.extend([helper.make_tensor_value_info("out", F, declared)])
        path = tmp_path / f"{op}-declared.onnx"
        path.write_bytes(model.SerializeToString())
        with pytest.raises(CmhsaError) as e:
            check_runnable(model, path, batch=1)
        assert f"node 'op' ({op})" in e.value.message, e.value.message
        r = invoke("inspect", path)
        assert r.exit_code == 2 and f"node 'op' ({op})" in r.stderr, r.output[-500:]


@pytest.fixture
def digits_onnx(shipped: Callable[[str], Path]) -> Path:
    return shipped("conv.onnx")


def exported_with_ballast(source: Path, tmp_path: Path, tensors: int) -> Path:
    """``source``, the digits fixture exported by cmhsa (so predict and eval run it as shipped), with
    ``tensors`` float64 ConstantOfShape nodes of 2^27 elements each (1 GiB, within the per-tensor
    bound) kept alive by the output: a few hundred bytes that need ``tensors`` GiB to run."""
    import onnx

    model = onnx.load(source)
    g = model.graph
    logits = g.output[0].name
    g.initializer.append(helper.make_tensor("ballast_shape", I64, [1], [2**27]))
    prev = logits
    for i in range(tensors):
        g.node.append(
            helper.make_node(
                "ConstantOfShape",
                ["ballast_shape"],
                [f"b{i}"],
                value=helper.make_tensor("v", TensorProto.DOUBLE, [1], [0.0]),
            )
        )
        g.node.append(helper.make_node("ReduceMax", [f"b{i}"], [f"s{i}"], keepdims=0))
        g.node.append(helper.make_node("CastLike", [f"s{i}", prev], [f"c{i}"]))
        g.node.append(helper.make_node("Add", [prev, f"c{i}"], [f"a{i}"]))
        prev = f"a{i}"
    g.node.append(helper.make_node("Identity", [prev], ["kept"]))
    g.output[0].name = "kept"
    path = tmp_path / "ballast.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_predict_and_eval_hold_an_onnx_file_to_the_memory_its_graph_needs(
    tmp_path: Path, digits_onnx: Path, monkeypatch
) -> None:
    """predict and eval refuse such a file, as inspect, convert and verify do: every onnxruntime
    session is made by load.ort_session, which sizes the graph and holds the total to memory."""
    from conftest import FIXTURE
    from convit_convert import resources

    path = exported_with_ballast(digits_onnx, tmp_path, 3)
    monkeypatch.setattr(resources, "available_memory", lambda: 2 * 2**30)
    digit = FIXTURE.parent / "digits" / "3.png"
    one_error_line(invoke("predict", path, digit), 2, str(path), "would need about", "GiB")
    one_error_line(invoke("eval", path, "--data", "digits"), 2, str(path), "would need about", "GiB")


def test_no_onnx_run_without_the_total_size_check(tmp_path: Path, digits_onnx: Path, monkeypatch) -> None:
    """The mechanism: onnxruntime's InferenceSession is made in one place, load.ort_session (no
    other module of the package names it), which holds the graph's total to memory before it makes
    one: refused, no session is made; allowed, one is. Its batch is a required keyword, so no
    caller can skip saying what it runs. And shapes.at_batch, where every size is inferred from,
    drops the declared shapes (value_info, the outputs')."""
    import inspect

    import onnx
    import onnxruntime

    from conftest import ROOT
    from convit_convert import resources
    from convit_convert.errors import CmhsaError
    from convit_convert.onnx import load, shapes

    made = [
        p.relative_to(ROOT).as_posix()
        for p in [*(ROOT / "convit_convert").rglob("*.py"), *(ROOT / "train").rglob("*.py")]
        if "InferenceSession(" in p.read_text()
    ]
    assert made == ["convit_convert/onnx/load.py"], made
    model = onnx.load(exported_with_ballast(digits_onnx, tmp_path, 3))
    sessions = []
    real = onnxruntime.InferenceSession
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: sessions.append(1) or real(*a, **k))
    monkeypatch.setattr(resources, "available_memory", lambda: 2 * 2**30)
    with pytest.raises(CmhsaError, match="would need about"):
        load.ort_session(model, tmp_path / "ballast.onnx", batch=1)
    assert sessions == []
    monkeypatch.setattr(resources, "available_memory", lambda: 2**40)
    load.ort_session(model, tmp_path / "ballast.onnx", batch=1)
    assert sessions == [1]
    assert inspect.signature(load.ort_session).parameters["batch"].default is inspect.Parameter.empty
    declared = onnx.helper.make_tensor_value_info("a0", onnx.TensorProto.FLOAT, [1])
    model.graph.value_info.append(declared)
    fixed = shapes.at_batch(model, 1)
    assert len(fixed.graph.value_info) == 0
    assert all(not o.type.tensor_type.HasField("shape") for o in fixed.graph.output)


def test_an_export_checked_in_memory_is_sized_too() -> None:
    """export_and_check without a path (bench/onnx_speed.py's call) goes through ort_session's size
    check like every other run (it failed there on Path(None) when the check moved into it)."""
    import torch

    from conftest import conv_model
    from convit_convert.onnx.export import export_and_check

    ex = export_and_check(conv_model(dtype=torch.float32), exporter="legacy")
    assert ex.check.passed, ex.check


def with_weights(source: Path, tmp_path: Path, elements: int, external: bool) -> tuple[Path, Path | None]:
    """``source`` (the digits fixture's export) with one more float32 initializer of ``elements``
    kept alive by the output: inline, or in a sparse file of its own beside the model (nothing
    written: its bytes read as zeros). Returns the model and its data file."""
    import onnx

    model = onnx.load(source)
    g = model.graph
    weights = TensorProto(name="weights", data_type=F, dims=[elements])
    data = None
    if external:
        data = tmp_path / "weights.bin"
        with open(data, "wb") as f:
            f.truncate(4 * elements)
        weights.data_location = TensorProto.EXTERNAL
        for key, value in (("location", data.name), ("offset", "0"), ("length", str(4 * elements))):
            entry = weights.external_data.add()
            entry.key, entry.value = key, value
    else:
        weights.raw_data = bytes(4 * elements)
    g.initializer.append(weights)
    logits = g.output[0].name
    g.node.append(helper.make_node("ReduceMax", ["weights"], ["w_max"], keepdims=0))
    g.node.append(helper.make_node("Add", [logits, "w_max"], ["kept"]))
    g.output[0].name = "kept"
    path = tmp_path / "weights.onnx"
    path.write_bytes(model.SerializeToString())
    return path, data


@pytest.mark.parametrize("external", [False, True], ids=["inline", "external"])
@pytest.mark.parametrize("command", ["predict", "inspect"])
def test_an_onnx_file_s_weights_are_held_to_memory_before_they_are_read(
    tmp_path: Path, digits_onnx: Path, monkeypatch, external: bool, command: str
) -> None:
    """4 MiB of weights, inline or external, with 16 MiB of memory: the file's total (its size and
    every external tensor's length, times the copies checking and running it holds) is refused
    before the protobuf is parsed or the external file opened."""
    import sys

    import onnx

    from conftest import FIXTURE
    from convit_convert import resources

    path, data = with_weights(digits_onnx, tmp_path, 2**20, external)
    opened: list[str] = []
    watching = [True]  # an audit hook stays for the session: it records only during this test
    sys.addaudithook(lambda event, args: event == "open" and watching[0] and opened.append(str(args[0])))
    monkeypatch.setattr(resources, "available_memory", lambda: 16 * 2**20)
    if not external:
        monkeypatch.setattr(onnx, "load_model", lambda *a, **k: pytest.fail("parsed before the check"))
    args = [path, FIXTURE.parent / "digits" / "3.png"] if command == "predict" else [path]
    opened.clear()
    try:
        one_error_line(invoke(command, *args), 2, str(path), "reading the ONNX file", "would need about")
    finally:
        watching[0] = False
    assert str(data) not in opened


def test_an_onnx_tensor_is_bounded_by_its_claim_before_it_is_read(tmp_path: Path, digits_onnx: Path) -> None:
    """A 2 GiB initializer in a sparse file of its own (2^29 elements): refused from its dims,
    as any tensor the graph computes is, before a byte of it is read."""
    path, _ = with_weights(digits_onnx, tmp_path, 2**29, external=True)
    one_error_line(invoke("inspect", path), 2, str(path), "tensor 'weights' holds 536,870,912 elements")


def test_a_sparse_initializer_is_bounded_by_its_dense_shape(tmp_path: Path, digits_onnx: Path) -> None:
    """Three bytes of values claiming 2^30 elements dense (what onnxruntime makes of them): refused
    from its shape, before onnxruntime sees the graph."""
    import onnx

    model = onnx.load(digits_onnx)
    values = helper.make_tensor("sparse_values", F, [1], [1.0])
    indices = helper.make_tensor("sparse_indices", I64, [1], [0])
    model.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [2**30]))
    path = tmp_path / "sparse.onnx"
    path.write_bytes(model.SerializeToString())
    one_error_line(invoke("inspect", path), 2, str(path), "sparse tensor 'sparse_values' is 1,073,741,824")
