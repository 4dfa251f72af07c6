"""The sizes an ONNX graph's tensors take from its declared input's shape, known before it runs.

Exporters compute a Reshape's target from ``Shape(image)`` through Gather, Div, Cast, Concat...;
ONNX's shape inference propagates only some of those ops. :func:`shape_known` fixes the input's
symbolic batch to the one the graph will run at (:func:`at_batch`) and replaces every tensor
computed from shapes and constants alone, by a small set of integer ops on at most MAX_FOLDED
elements (never an op that makes a tensor larger than its inputs), by its value: what remains
unknown after shape inference then depends on the input's *values*, and ``load.check_runnable``
refuses it naming the node. No list of dangerous ops: a HannWindow sized by a pixel is caught
because nothing fixes its size, not because it is named.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# ops that turn shapes and constants into other shapes: each output no larger than its inputs
SHAPE_ARITHMETIC = frozenset(
    "Gather Unsqueeze Squeeze Concat Cast Div Mul Add Sub Slice Floor Ceil Identity Equal Where Mod "
    "Max Min Abs Neg ReduceProd Reshape Sqrt Less Greater Not And Or Transpose".split()
)
# ops that can make a tensor larger than their inputs: folded only once their output's size, computed
# from the known inputs, is small
GROWING = ("ConstantOfShape", "Range", "Expand", "Tile")
MAX_FOLDED = 64  # elements of a shape-like tensor worth computing here (a rank is at most a few)
MAX_ROUNDS = 16  # inference and folding alternate until nothing new is known


def at_batch(model: Any, batch: int) -> Any:
    """A copy of ``model`` whose declared image input has ``batch`` for a symbolic first dimension,
    and no other declared shape: a file's ``value_info`` and output shapes are claims, not facts
    (a small declared output can hide a node sized by a pixel value), so every size below the input
    is inferred from the graph alone."""
    import onnx

    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    del fixed.graph.value_info[:]
    for out in fixed.graph.output:
        if out.type.HasField("tensor_type"):
            out.type.tensor_type.ClearField("shape")
    init = {t.name for t in fixed.graph.initializer}
    for i in fixed.graph.input:
        if i.name not in init and i.type.HasField("tensor_type") and i.type.tensor_type.shape.dim:
            first = i.type.tensor_type.shape.dim[0]
            if not first.HasField("dim_value"):
                first.dim_value = batch
    return fixed


def _static_shapes(model: Any) -> dict[str, list[int]]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model, data_prop=True)
    out = {}
    for v in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        if v.type.HasField("tensor_type") and v.type.tensor_type.HasField("shape"):
            dims = v.type.tensor_type.shape.dim
            if all(d.HasField("dim_value") for d in dims):
                out[v.name] = [d.dim_value for d in dims]
    return out


def _small_output(node: Any, known: dict[str, np.ndarray]) -> bool:
    """Whether a GROWING node's output, sized from its known inputs, has at most MAX_FOLDED elements."""
    if not all(not i or i in known for i in node.input):
        return False
    try:
        v = [known[i] for i in node.input if i]
        if node.op_type == "ConstantOfShape":
            size = int(np.prod(v[0]))
        elif node.op_type == "Range":
            start, limit, delta = (float(x) for x in v)
            size = max(int(np.ceil((limit - start) / delta)), 0)
        elif node.op_type == "Expand":
            size = int(np.prod(np.broadcast_shapes(v[0].shape, tuple(int(d) for d in v[1]))))
        else:  # Tile
            size = v[0].size * int(np.prod(v[1]))
    except (ValueError, TypeError, ZeroDivisionError, OverflowError, IndexError):
        return False
    return 0 <= size <= MAX_FOLDED


def _fold(model: Any, known: dict[str, np.ndarray]) -> bool:
    """One pass: the nodes whose outputs follow from shapes and constants get them in ``known``
    (and become Constant nodes in ``model``); whether anything new was found."""
    from onnx import helper, numpy_helper
    from onnx.reference import ReferenceEvaluator

    shapes = _static_shapes(model)
    new = False
    for index, node in enumerate(model.graph.node):
        if all(o in known for o in node.output if o):
            continue
        values: list[np.ndarray] | None = None
        if node.op_type in ("Shape", "Size") and node.input[0] in shapes:
            dims = shapes[node.input[0]]
            if node.op_type == "Size":
                values = [np.array(int(np.prod(dims)), dtype=np.int64)]
            else:
                attrs = {a.name: a.i for a in node.attribute}
                values = [np.array(dims[attrs.get("start", 0) : attrs.get("end", len(dims))], dtype=np.int64)]
        elif node.op_type == "Constant":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if "value" in attrs and int(np.prod(attrs["value"].dims)) <= MAX_FOLDED:
                values = [numpy_helper.to_array(attrs["value"])]
        elif (
            node.op_type in SHAPE_ARITHMETIC or (node.op_type in GROWING and _small_output(node, known))
        ) and all(not i or i in known for i in node.input):
            try:
                values = ReferenceEvaluator(node).run(None, {i: known[i] for i in node.input if i})
            except Exception:  # an op the reference cannot run on these: left to shape inference
                values = None
        if values is None or any(np.asarray(v).size > MAX_FOLDED for v in values):
            continue
        for name, value in zip(node.output, values, strict=False):
            known[name] = np.asarray(value)
        consts = [
            helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.asarray(value), name))
            for name, value in zip(node.output, values, strict=False)
            if name
        ]
        if len(consts) == 1:
            consts[0].name = node.name
            model.graph.node[index].CopyFrom(consts[0])
        new = True
    return new


def shape_known(model: Any, batch: int) -> Any:
    """``model`` at ``batch`` with every tensor that follows from the input's shape and the graph's
    constants folded into a Constant: what shape inference then leaves unknown depends on values."""
    import onnx

    folded = at_batch(model, batch)
    static = _static_shapes(folded)
    if all(o in static for n in folded.graph.node for o in n.output if o):
        return folded  # inference alone sizes every tensor (cmhsa's own exports): nothing to fold
    known: dict[str, np.ndarray] = {}
    for t in folded.graph.initializer:
        if int(np.prod(t.dims)) <= MAX_FOLDED:
            known[t.name] = onnx.numpy_helper.to_array(t)
    for _ in range(MAX_ROUNDS):
        if not _fold(folded, known):
            break
    return folded
