"""Read a phase-1 (conv-phase) ViT out of an ONNX graph by its structure, not by its names.

Whoever exported the model chose the parameter names, the exporter (``torch.onnx.export`` with
``dynamo=True`` or the legacy one), and even the token layout. cmhsa walks the graph along the
residual stream and expects, in order (layout ops are Reshape/Transpose/Flatten/Squeeze/Unsqueeze):

    image -> layout ops -> [linear]                               patch embedding
    per block:  r -> LayerNormalization -> layout ops -> [Pad] -> Conv -> layout ops -> Add(r, .)
                r -> LayerNormalization -> linear -> GELU -> linear -> Add(r, .)
    r -> LayerNormalization -> ReduceMean over the tokens -> linear -> logits

where a linear layer is ``MatMul`` (+ ``Add``) or ``Gemm`` (any transB, alpha, beta), GELU is
``Gelu`` or its ``Erf`` form (checked numerically to be the exact GELU), and every weight must be
a constant. The configuration comes from the graph: image size and channels from the input's
static shape, embed_dim from the LayerNorm weights, hidden_chans and K from the Conv weights,
P = sqrt(embed_dim / hidden_chans), depth from the Conv count, dilation and padding from the Conv
attributes (stride 1 and PyTorch's 'same' zero padding only), eps from LayerNormalization.

**Layout, proved not assumed.** The layout ops are replayed on index arrays (the input of each
op chain filled with 0, 1, 2, ...): that shows which token feature every pixel of each Conv's
input came from, and which pixel every token feature of its output goes to. The import requires
tokens to be P×P patches, every block to use the same layout, each Conv's output layout to be the
inverse of its input's, and the image to reach the first Conv unchanged (identity embedding) or
patch by patch (linear embedding). A layout other than cmhsa's (docs/FORMAT.md), such as
channel-first patches, is then one fixed permutation of the features, applied to the weights.

**Import proved.** The rebuilt PyTorch model and onnxruntime must then agree on random images
within a tolerance (:func:`check_import`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .checkpoint import Checkpoint, validate_tensors
from .config import ViTConfig
from .errors import CmhsaError
from .onnx_load import DOUBLE, FLOAT, load_onnx, ort_session
from .verify import relative_error

LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
FLAT_OPS = LAYOUT_OPS - {"Transpose"}  # keep row-major order, so a token's features stay together
GELU_OPS = frozenset({"Div", "Mul", "Add", "Sub", "Erf", "Sqrt", "Pow", "Identity", "Cast"})
SHAPE_OPS = frozenset({"Shape", "Size"})  # read a tensor's shape, not its data
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike",
                        "Multinomial", "Bernoulli"})  # fmt: skip
LINEAR_OPS = ("MatMul", "Gemm")


@dataclass
class Linear:
    weight: np.ndarray  # (out, in), as in PyTorch
    bias: np.ndarray  # (out,)
    form: str  # "MatMul+Add", "MatMul" (no bias), "Gemm"


@dataclass
class Norm:
    weight: np.ndarray
    bias: np.ndarray
    eps: float


@dataclass
class ConvBlock:
    norm1: Norm
    conv_weight: np.ndarray  # (C, C, K, K)
    conv_bias: np.ndarray  # (C,)
    dilation: int
    padding: str  # how the graph pads: "pads", "auto_pad SAME_UPPER", "Pad node", ...
    layout_in: np.ndarray  # (b, C, H, W): the residual element each pixel of the Conv input is
    layout_out: np.ndarray  # residual-shaped: the pixel of the Conv output each element is
    norm2: Norm
    fc1: Linear
    fc2: Linear
    gelu: str


@dataclass
class Structure:
    """What the graph computes, in the graph's own token layout."""

    in_chans: int
    img_size: tuple[int, int]
    residual_shape: tuple[int, ...]  # (b, tokens..., embed_dim) at the traced batch size b
    patchify: np.ndarray  # embedding-input-shaped: the image pixel each element is
    patch_embed: Linear | None
    blocks: list[ConvBlock]
    norm: Norm
    head: Linear
    forms: dict[str, list[str]] = field(default_factory=dict)


def _describe(node: Any) -> str:
    return f"node {node.name or node.output[0]!r} ({node.op_type})"


def _attr(node: Any, name: str, default: Any = None) -> Any:
    from onnx import helper

    for a in node.attribute:
        if a.name == name:
            value = helper.get_attribute_value(a)
            return value.decode() if isinstance(value, bytes) else value
    return default


class GraphReader:
    """The graph plus the value of every tensor on one concrete run (``values``), which gives the
    shapes and the weights however the exporter computed them."""

    def __init__(self, model: Any, values: dict[str, np.ndarray], path: Path) -> None:
        from onnx import numpy_helper

        self.path = path
        self.nodes = list(model.graph.node)
        self.values = values
        self.producer = {out: n for n in self.nodes for out in n.output if out}
        self.consumers: dict[str, list[Any]] = {}
        for n in self.nodes:
            for name in n.input:
                if name:
                    self.consumers.setdefault(name, []).append(n)
        self.constants = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        # input-independent values, in one pass (the checker guarantees topological order)
        self.const_names = set(self.constants)
        for n in self.nodes:
            inputs = [i for i in n.input if i]
            if n.op_type == "Constant" or (
                inputs and n.op_type not in RANDOM_OPS and all(i in self.const_names for i in inputs)
            ):
                self.const_names.update(o for o in n.output if o)

    def error(self, message: str) -> CmhsaError:
        return CmhsaError(message, self.path)

    def unexpected(self, node: Any, expected: str) -> CmhsaError:
        return self.error(
            f"{_describe(node)}: unexpected here; expected {expected}. Not a conv-phase ViT cmhsa can read"
        )

    def const(self, name: str, node: Any) -> np.ndarray:
        """The value of a weight ``name`` that ``node`` reads; it must not depend on the input."""
        if name not in self.const_names:
            raise self.error(
                f"{_describe(node)}: its weight {name!r} is computed from the input, not a constant"
            )
        return self.value(name, node)

    def optional_const(self, node: Any, index: int, size: int, dtype: Any) -> np.ndarray:
        """Input ``index`` of ``node`` (a bias) as a flat vector, or zeros when it is left out."""
        if len(node.input) > index and node.input[index]:
            return self.const(node.input[index], node).reshape(-1)
        return np.zeros(size, dtype)

    def value(self, name: str, node: Any) -> np.ndarray:
        if name in self.constants:
            return self.constants[name]
        if name in self.values:
            return self.values[name]
        producer = self.producer.get(name)
        if producer is not None and producer.op_type == "Constant":
            from onnx import numpy_helper

            for a in producer.attribute:
                if a.name == "value":
                    return numpy_helper.to_array(a.t)
        raise self.error(f"{_describe(node)}: cannot evaluate its input {name!r}")

    def data_consumers(self, name: str) -> list[Any]:
        return [n for n in self.consumers.get(name, []) if n.op_type not in SHAPE_OPS]

    def sole_consumer(self, name: str, expected: str) -> Any:
        nodes = self.data_consumers(name)
        if len(nodes) != 1:
            found = ", ".join(_describe(n) for n in nodes) or "nothing"
            raise self.error(f"tensor {name!r} feeds {found}; expected only {expected}")
        return nodes[0]

    def follow(self, name: str, ops: frozenset[str]) -> tuple[str, list[Any]]:
        """Walk a chain of ``ops`` (each the only reader of the one before) from ``name``."""
        chain = []
        while True:
            nodes = self.data_consumers(name)
            if len(nodes) != 1 or nodes[0].op_type not in ops or nodes[0].input[0] != name:
                return name, chain
            chain.append(nodes[0])
            name = nodes[0].output[0]

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.values:
            raise self.error(f"tensor {name!r} has no known type, so cmhsa cannot follow it")
        return tuple(self.values[name].shape)

    # ---- layers ---------------------------------------------------------------------------

    def residual_fork(self, r: str, what: str, final_ok: bool = False) -> tuple[Any, Any | None]:
        """The readers of the token stream ``r``: a LayerNormalization and the residual Add (or,
        with ``final_ok``, the final LayerNormalization alone, returned with Add None)."""
        nodes = self.data_consumers(r)
        for n in nodes:
            if n.op_type in ("ReduceMean", "Sub", "Pow"):
                raise self.error(
                    f"{_describe(n)}: LayerNorm is decomposed into primitive ops; cmhsa reads "
                    "LayerNormalization nodes (export with opset_version >= 17)"
                )
        norms = [n for n in nodes if n.op_type == "LayerNormalization"]
        adds = [n for n in nodes if n.op_type == "Add"]
        if final_ok and len(nodes) == 1 and norms:
            return norms[0], None
        if not (len(nodes) == 2 and len(norms) == 1 and len(adds) == 1):
            others = [n for n in nodes if n not in norms[:1] + adds[:1]] or nodes
            raise self.unexpected(others[0], what)
        return norms[0], adds[0]

    def residual_add(self, branch: str, r: str, fork_add: Any, what: str) -> str:
        """The Add that closes a residual branch: reads ``r`` and ``branch`` and is the Add that
        :meth:`residual_fork` found; returns its output, the next token stream."""
        add = self.sole_consumer(branch, what)
        if (
            add.op_type != "Add"
            or add.output[0] != fork_add.output[0]
            or sorted(add.input) != sorted([r, branch])
        ):
            raise self.unexpected(add, what)
        return add.output[0]

    def layer_norm(self, node: Any) -> tuple[Norm, str]:
        x = node.input[0]
        rank = len(self.shape(x))
        axis = _attr(node, "axis", -1)
        if axis not in (-1, rank - 1):
            raise self.error(f"{_describe(node)}: normalises from axis {axis}; expected the last axis only")
        weight = self.const(node.input[1], node).reshape(-1)
        d = self.shape(x)[-1]
        bias = self.optional_const(node, 2, d, weight.dtype)
        if weight.size != d or bias.size != d:
            raise self.error(f"{_describe(node)}: weight or bias size differs from the feature size {d}")
        eps = float(np.float32(_attr(node, "epsilon", 1e-5)))
        return Norm(weight, bias, eps), node.output[0]

    def linear(self, node: Any, x: str, what: str) -> tuple[Linear, str]:
        """A MatMul (+ Add) or Gemm reading ``x``; returns the layer and its output tensor."""
        if node.op_type not in LINEAR_OPS:
            raise self.unexpected(node, what)
        if node.input[0] != x:
            raise self.error(f"{_describe(node)}: reads the data as its second operand; expected x @ W")
        w = self.const(node.input[1], node)
        if w.ndim != 2:
            raise self.error(f"{_describe(node)}: weight of shape {list(w.shape)}, expected a matrix")
        if node.op_type == "Gemm":
            if _attr(node, "transA", 0):
                raise self.error(f"{_describe(node)}: transA=1 is not a linear layer on the data")
            weight = (w if _attr(node, "transB", 0) else w.T) * _attr(node, "alpha", 1.0)
            out_features = weight.shape[0]
            bias = np.zeros(out_features, w.dtype)
            if len(node.input) > 2 and node.input[2]:
                c = self.const(node.input[2], node) * _attr(node, "beta", 1.0)
                if c.size not in (1, out_features):
                    raise self.error(
                        f"{_describe(node)}: bias of shape {list(c.shape)}, expected ({out_features},)"
                    )
                bias = np.broadcast_to(c.reshape(-1), (out_features,))
            out, form = node.output[0], "Gemm"
        else:
            weight = w.T
            out_features = weight.shape[0]
            bias, out, form = np.zeros(out_features, w.dtype), node.output[0], "MatMul"
            nxt = self.data_consumers(out)
            if len(nxt) == 1 and nxt[0].op_type == "Add":
                other = [i for i in nxt[0].input if i != out]
                if len(other) == 1 and other[0] in self.const_names:
                    c = self.value(other[0], nxt[0])
                    if c.size in (1, out_features) and c.ndim <= len(self.shape(out)):
                        bias = np.broadcast_to(c.reshape(-1), (out_features,))
                        out, form = nxt[0].output[0], "MatMul+Add"
        if self.shape(x)[-1] != weight.shape[1]:
            raise self.error(
                f"{_describe(node)}: weight {list(w.shape)} does not fit its input's features {self.shape(x)[-1]}"
            )
        return Linear(np.ascontiguousarray(weight), np.array(bias), form), out

    def gelu(self, h: str) -> tuple[str, str]:
        """The exact GELU applied to ``h``: one Gelu node, or its Erf form, checked numerically."""
        nodes = self.data_consumers(h)
        if len(nodes) == 1 and nodes[0].op_type == "Gelu":
            if _attr(nodes[0], "approximate", "none") != "none":
                raise self.error(
                    f"{_describe(nodes[0])}: tanh-approximate GELU; the conv-phase ViT uses the exact (erf) GELU"
                )
            return nodes[0].output[0], "Gelu"
        # Erf form, 0.5·x·(1 + erf(x/√2)) in some order: all elementwise nodes up to the next linear
        seen: dict[str, Any] = {}
        frontier, outputs = [h], set()
        while frontier:
            name = frontier.pop()
            for n in self.data_consumers(name):
                if (n.op_type in LINEAR_OPS or n.op_type in FLAT_OPS - {"Identity"}) and n.input[0] == name:
                    outputs.add(name)  # the GELU's output reaches the next linear (maybe reshaped)
                    continue
                if n.op_type not in GELU_OPS:
                    raise self.unexpected(
                        n, "GELU (a Gelu node or its Erf form) between the MLP's linear layers"
                    )
                if n.output[0] not in seen:
                    seen[n.output[0]] = n
                    frontier.extend(o for o in n.output if o)
        erfs = [n for n in seen.values() if n.op_type == "Erf"]
        if len(erfs) != 1 or len(outputs) != 1:
            raise self.error(
                f"tensor {h!r}: the MLP's activation is not a GELU (expected a Gelu node or one Erf)"
            )
        (g,) = outputs
        a, y = self.values[h], self.values[g]
        exact = torch.nn.functional.gelu(torch.from_numpy(np.asarray(a, np.float64))).numpy()
        if y.shape != a.shape or np.abs(y - exact).max() > 1e-5 * max(1.0, np.abs(exact).max()):
            raise self.error(f"{_describe(erfs[0])}: the Erf subgraph does not compute the exact GELU")
        return g, "Erf form"

    def conv(self, node: Any, pads_nodes: list[Any]) -> tuple[np.ndarray, np.ndarray, int, str]:
        w = self.const(node.input[1], node)
        if w.ndim != 4:
            raise self.error(f"{_describe(node)}: weight of shape {list(w.shape)}, expected (C, C, K, K)")
        c_out, c_in, kh, kw = w.shape
        groups = _attr(node, "group", 1)
        if groups != 1:
            raise self.error(
                f"{_describe(node)}: unsupported convolution: groups {groups} (only dense convolutions are exact)"
            )
        strides = list(_attr(node, "strides", [1, 1]))
        if strides != [1, 1]:
            raise self.error(
                f"{_describe(node)}: unsupported convolution: strides {strides} (only stride 1 is exact)"
            )
        if kh != kw or c_out != c_in:
            raise self.error(
                f"{_describe(node)}: weight {list(w.shape)} is not (C, C, K, K) with a square kernel"
            )
        dil = list(_attr(node, "dilations", [1, 1]))
        if dil[0] != dil[1]:
            raise self.error(f"{_describe(node)}: unsupported convolution: dilations {dil} differ per axis")
        k, d = kh, dil[0]
        total = d * (k - 1)
        same = [total // 2, total // 2, total - total // 2, total - total // 2]  # PyTorch 'same'
        auto = _attr(node, "auto_pad", "NOTSET")
        if auto == "NOTSET":
            pads, how = list(_attr(node, "pads", [0, 0, 0, 0])), "pads"
        elif auto in ("SAME_UPPER", "SAME_LOWER"):
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads, how = [lo, lo, total - lo, total - lo], f"auto_pad {auto}"
        elif auto == "VALID":
            pads, how = [0, 0, 0, 0], "auto_pad VALID"
        else:
            raise self.error(f"{_describe(node)}: unknown auto_pad {auto!r}")
        for pad in pads_nodes:
            extra = self.pad_amounts(pad)
            pads = [p + e for p, e in zip(pads, extra, strict=True)]
            how = "Pad node + " + how
        if pads != same:
            raise self.error(
                f"{_describe(node)}: unsupported convolution: pads {pads} (top, left, bottom, right) are not "
                f"PyTorch's 'same' zero padding {same} for K={k}, dilation {d}"
            )
        return w, self.optional_const(node, 2, c_out, w.dtype), d, how

    def pad_amounts(self, node: Any) -> list[int]:
        """(top, left, bottom, right) of a zero-constant Pad of an NCHW tensor."""
        mode = _attr(node, "mode", "constant")
        pads = _attr(node, "pads") if len(node.input) < 2 else self.const(node.input[1], node)
        value = 0.0
        if len(node.input) > 2 and node.input[2]:
            value = float(np.asarray(self.const(node.input[2], node)).reshape(-1)[0])
        if len(node.input) > 3 and node.input[3]:
            raise self.error(f"{_describe(node)}: Pad with axes is not supported")
        pads = [int(p) for p in np.asarray(pads).reshape(-1)]
        if mode != "constant" or value != 0.0 or len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)):
            raise self.error(
                f"{_describe(node)}: unsupported convolution: padding other than spatial zeros ({mode}, pads {pads})"
            )
        return [pads[2], pads[3], pads[6], pads[7]]

    def trace(self, chain: list[Any], index: np.ndarray) -> np.ndarray:
        """Replay the layout ops of ``chain`` on ``index`` (an array shaped like the chain's input)."""
        arr = index
        for n in chain:
            op = n.op_type
            if op == "Reshape":
                shape = [int(s) for s in self.value(n.input[1], n).reshape(-1)]
                if not _attr(n, "allowzero", 0):
                    shape = [arr.shape[i] if s == 0 else s for i, s in enumerate(shape)]
                arr = arr.reshape(shape)
            elif op == "Transpose":
                arr = arr.transpose(_attr(n, "perm", list(range(arr.ndim))[::-1]))
            elif op == "Flatten":
                axis = _attr(n, "axis", 1) % max(arr.ndim, 1)
                arr = arr.reshape(math.prod(arr.shape[:axis]), -1)
            elif op in ("Squeeze", "Unsqueeze"):
                axes = _attr(n, "axes")
                if axes is None and len(n.input) > 1 and n.input[1]:
                    axes = self.value(n.input[1], n).reshape(-1).tolist()
                if op == "Squeeze":
                    arr = np.squeeze(arr, axis=None if axes is None else tuple(int(a) for a in axes))
                else:
                    rank = arr.ndim + len(axes)
                    for a in sorted(int(a) % rank for a in axes):
                        arr = np.expand_dims(arr, a)
            if tuple(arr.shape) != self.shape(n.output[0]):
                raise self.error(f"{_describe(n)}: could not replay this layout op")
        return arr


def _concrete_run(model: Any, path: Path, batch: int, seed: int) -> tuple[str, str, dict[str, np.ndarray]]:
    """Run the graph once in onnxruntime with every intermediate tensor as an output."""
    import onnx
    from onnx import helper

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    inp, out = model.graph.input[0].name, model.graph.output[0].name
    names = []
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    for n in model.graph.node:
        for o in n.output:
            if o and o != out and types.get(o):
                probe.graph.output.append(helper.make_tensor_value_info(o, types[o], None))
                names.append(o)
    session = ort_session(probe, path, optimize=False)
    x = _random_input(model, batch, seed)
    results = session.run([out, *names], {inp: x})
    return inp, out, dict(zip([out, *names], results, strict=True))


def _input_info(model: Any, path: Path) -> tuple[int | None, int, int, int]:
    """(static batch or None, C, H, W) of the one image input, which must have static C, H, W."""
    graph = model.graph
    init = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise CmhsaError(
            f"has {len(inputs)} input(s) and {len(graph.output)} output(s); a ViT has one image input and one logits output",
            path,
        )
    del graph.input[:]
    graph.input.append(inputs[0])  # initializers listed as inputs (old exporters) are constants here
    tt = inputs[0].type.tensor_type
    if tt.elem_type not in (FLOAT, DOUBLE):
        raise CmhsaError(f"input {inputs[0].name!r} is not float32 or float64 images", path)
    dims = list(tt.shape.dim)
    static = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    if len(dims) != 4 or any(s is None or s < 1 for s in static[1:]):
        shown = [s if s is not None else (d.dim_param or "?") for s, d in zip(static, dims, strict=True)]
        raise CmhsaError(
            f"input {inputs[0].name!r} has shape {shown}; expected (batch, C, H, W) with static C, H and W",
            path,
        )
    return static[0], static[1], static[2], static[3]


def _random_input(model: Any, batch: int, seed: int) -> np.ndarray:
    tt = model.graph.input[0].type.tensor_type
    dims = [d.dim_value for d in tt.shape.dim]
    dtype = np.float32 if tt.elem_type == FLOAT else np.float64
    return np.random.default_rng(seed).standard_normal((batch, *dims[1:])).astype(dtype)


def read_structure(model: Any, path: Path, seed: int = 0) -> Structure:
    """Walk the residual stream of a checked ONNX model (see the module docstring)."""
    static_batch, c_in, h, w = _input_info(model, path)
    batch = static_batch or 2
    inp, out, values = _concrete_run(model, path, batch, seed)
    g = GraphReader(model, values, path)
    ops = {n.op_type for n in model.graph.node}
    if "Conv" not in ops and "Softmax" in ops:
        raise g.error(
            "this is an attention model (its token mixers are Softmax attention, not Conv), not a conv-phase one: "
            "convert takes the conv phase's model"
        )
    forms: dict[str, set[str]] = {"linear": set(), "gelu": set(), "conv padding": set()}

    # patch embedding
    e, embed_chain = g.follow(inp, LAYOUT_OPS)
    patchify = g.trace(embed_chain, np.arange(batch * c_in * h * w).reshape(batch, c_in, h, w))
    nodes = g.data_consumers(e)
    patch_embed = None
    if len(nodes) == 1 and nodes[0].op_type in LINEAR_OPS:
        patch_embed, r = g.linear(nodes[0], e, "the patch embedding")
        forms["linear"].add(patch_embed.form)
        r, _ = g.follow(r, FLAT_OPS)
    else:
        r = e
    residual_shape = g.shape(r)
    if len(residual_shape) < 3 or residual_shape[0] != batch:
        raise g.error(
            f"tensor {r!r}: tokens of shape {list(residual_shape)}; expected (batch, tokens, features)"
        )

    blocks: list[ConvBlock] = []
    while True:
        norm_node, fork = g.residual_fork(
            r, "a LayerNormalization and the residual Add reading the token stream", final_ok=True
        )
        if fork is None:
            break  # the final norm
        if g.shape(r) != residual_shape:
            raise g.error(f"tensor {r!r}: the token stream changes shape between blocks")
        i = len(blocks)
        norm1, a = g.layer_norm(norm_node)
        a, chain = g.follow(a, LAYOUT_OPS | {"Pad"})
        pads = []
        while chain and chain[-1].op_type == "Pad":
            pads.insert(0, chain.pop())
        if any(n.op_type == "Pad" for n in chain):
            raise g.unexpected(next(n for n in chain if n.op_type == "Pad"), "padding right before the Conv")
        conv_in = pads[0].input[0] if pads else a
        node = g.sole_consumer(a, f"block {i}'s Conv")
        if node.op_type != "Conv":
            raise g.unexpected(node, f"block {i}'s Conv (the token mixer) after its first LayerNorm")
        conv_w, conv_b, dilation, how = g.conv(node, pads)
        forms["conv padding"].add(how)
        layout_in = g.trace(chain, np.arange(math.prod(residual_shape)).reshape(residual_shape))
        if layout_in.shape != g.shape(conv_in):
            raise g.error(f"{_describe(node)}: could not replay the layout ops before it")
        y, out_chain = g.follow(node.output[0], LAYOUT_OPS)
        pixels = g.shape(node.output[0])
        layout_out = g.trace(out_chain, np.arange(math.prod(pixels)).reshape(pixels))
        r = g.residual_add(y, r, fork, f"block {i}'s residual Add (block input + Conv branch)")
        if g.shape(r) != residual_shape:
            raise g.error(f"tensor {r!r}: the Conv branch does not return the token shape")

        norm_node, fork = g.residual_fork(r, f"block {i}'s second LayerNormalization and residual Add")
        norm2, b = g.layer_norm(norm_node)
        b, _ = g.follow(b, FLAT_OPS)
        fc1, hdn = g.linear(g.sole_consumer(b, f"block {i}'s MLP"), b, f"block {i}'s first MLP linear layer")
        hdn, _ = g.follow(hdn, FLAT_OPS)
        act, gelu_form = g.gelu(hdn)
        act, _ = g.follow(act, FLAT_OPS)
        fc2, m = g.linear(
            g.sole_consumer(act, f"block {i}'s second MLP linear layer"),
            act,
            f"block {i}'s second MLP linear layer",
        )
        m, _ = g.follow(m, FLAT_OPS)
        r_next = g.residual_add(m, r, fork, f"block {i}'s residual Add (block input + MLP branch)")
        if math.prod(g.shape(m)) != math.prod(residual_shape):
            raise g.error(f"tensor {m!r}: the MLP branch does not return the token shape")
        r = r_next
        forms["linear"].update((fc1.form, fc2.form))
        forms["gelu"].add(gelu_form)
        blocks.append(
            ConvBlock(norm1, conv_w, conv_b, dilation, how, layout_in, layout_out, norm2, fc1, fc2, gelu_form)
        )

    if not blocks:
        raise g.error("has no Conv blocks: not a conv-phase ViT")
    norm, f = g.layer_norm(norm_node)
    rank = len(g.shape(f))
    f, _ = g.follow(f, FLAT_OPS)
    pool = g.sole_consumer(f, "the mean over tokens after the final LayerNorm")
    if pool.op_type != "ReduceMean":
        raise g.unexpected(pool, "the mean over tokens (ReduceMean) after the final LayerNorm")
    axes = _attr(pool, "axes")
    if axes is None and len(pool.input) > 1 and pool.input[1]:
        axes = g.const(pool.input[1], pool).reshape(-1).tolist()
    tokens = set(range(1, rank - 1))
    if g.shape(f) != g.shape(r) or axes is None or {int(a) % rank for a in axes} != tokens:
        raise g.error(
            f"{_describe(pool)}: averages over axes {axes}; expected the token axes {sorted(tokens)}"
        )
    p, _ = g.follow(pool.output[0], FLAT_OPS)
    head, logits = g.linear(
        g.sole_consumer(p, "the classifier head"), p, "the classifier head (a linear layer)"
    )
    forms["linear"].add(head.form)
    logits, _ = g.follow(logits, FLAT_OPS)
    if logits != out:
        consumer = g.data_consumers(logits)
        raise (
            g.unexpected(consumer[0], "the graph output after the head")
            if consumer
            else g.error(f"tensor {logits!r}: the head's output is not the graph's output")
        )
    convs = [n for n in g.nodes if n.op_type == "Conv"]
    if len(convs) != len(blocks):
        raise g.error(f"has {len(convs)} Conv nodes but {len(blocks)} on the residual stream")
    return Structure(
        in_chans=c_in,
        img_size=(h, w),
        residual_shape=residual_shape,
        patchify=patchify,
        patch_embed=patch_embed,
        blocks=blocks,
        norm=norm,
        head=head,
        forms={k: sorted(v) for k, v in forms.items()},
    )


def feature_order(s: Structure, patch_size: int, path: Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Prove the token layout and return the feature permutations into cmhsa's layout:
    ``pi[f]`` is the cmhsa feature of the graph's feature f, ``rho[g]`` the same for the patch
    embedding's input (linear embedding only)."""

    def bad(msg: str) -> CmhsaError:
        return CmhsaError(f"token layout: {msg}", path)

    b, *tok, d = s.residual_shape
    n = math.prod(tok)
    h, w = s.img_size
    p, gw = patch_size, s.img_size[1] // patch_size
    first = s.blocks[0].layout_in
    c = first.shape[1]
    for i, blk in enumerate(s.blocks):
        if not np.array_equal(blk.layout_in, first):
            raise bad(f"block {i}'s Conv sees the tokens in another layout than block 0's")
        total = first.size
        if not np.array_equal(np.sort(blk.layout_in.reshape(-1)), np.arange(total)):
            raise bad(f"block {i}'s Conv input is not a rearrangement of the tokens")
        if blk.layout_out.size != total or not np.array_equal(
            blk.layout_out.reshape(-1)[blk.layout_in.reshape(-1)], np.arange(total)
        ):
            raise bad(f"block {i}'s Conv output is not laid out as tokens the way its input was read")
    sample, ch, y, x = np.indices(first.shape)
    idx = first  # graph's residual element read at each pixel
    s_m, n_m, f_m = idx // (n * d), (idx // d) % n, idx % d
    if not np.array_equal(s_m, sample):
        raise bad("the Conv mixes images of a batch")
    token = sample * n + (y // p) * gw + x // p  # cmhsa's token of each pixel
    feature = ((y % p) * p + x % p) * c + ch  # cmhsa's feature of each pixel
    tok_map = np.full(b * n, -1)
    tok_map[(s_m * n + n_m).reshape(-1)] = token.reshape(-1)
    if not np.array_equal(tok_map[s_m * n + n_m], token):
        raise bad(f"a token is not one {p}x{p} patch")
    feat = np.full((b * n, d), -1)
    feat[s_m * n + n_m, f_m] = feature
    pi = feat[0]
    if not (feat == pi).all():
        raise bad("tokens do not all order their pixels the same way")
    # the image reaches the tokens patch by patch
    pix = s.patchify.reshape(b * n, -1)
    if s.patch_embed is None:
        if s.patchify.size != idx.size or not np.array_equal(
            s.patchify.reshape(-1)[idx.reshape(-1)], np.arange(idx.size)
        ):
            raise bad("with no patch-embedding layer, the first Conv does not see the input image unchanged")
        return pi, None
    c_in = s.in_chans
    s_i, c_i, y_i, x_i = np.unravel_index(pix, (b, c_in, h, w))
    if not np.array_equal(s_i * n + (y_i // p) * gw + x_i // p, np.broadcast_to(tok_map[:, None], pix.shape)):
        raise bad("the patch embedding does not read each token's own patch")
    rho_all = ((y_i % p) * p + x_i % p) * c_in + c_i
    rho = rho_all[0]
    if not (rho_all == rho).all() or not np.array_equal(np.sort(rho), np.arange(p * p * c_in)):
        raise bad("the patch embedding's input is not every pixel of the patch once, in one order")
    return pi, rho


def to_checkpoint(s: Structure, path: Path) -> tuple[ViTConfig, dict[str, torch.Tensor]]:
    """The cmhsa config and tensors (docs/FORMAT.md names and layout) of a read structure."""
    d = s.residual_shape[-1]
    blk0 = s.blocks[0]
    c, k = blk0.conv_weight.shape[0], blk0.conv_weight.shape[2]
    p = math.isqrt(d // c) if d % c == 0 else 0
    if p * p * c != d:
        raise CmhsaError(f"embed_dim {d} is not P² x {c} (the Conv's channels) for any whole P", path)
    for i, blk in enumerate(s.blocks):
        if blk.conv_weight.shape != blk0.conv_weight.shape or blk.dilation != blk0.dilation:
            raise CmhsaError(f"block {i}'s Conv differs in shape or dilation from block 0's", path)
        if blk.fc1.weight.shape != blk0.fc1.weight.shape:
            raise CmhsaError(f"block {i}'s MLP width differs from block 0's", path)
    eps = {n.eps for blk in s.blocks for n in (blk.norm1, blk.norm2)} | {s.norm.eps}
    if len(eps) != 1:
        raise CmhsaError(
            f"LayerNorm epsilons differ between layers ({sorted(eps)}); cmhsa models share one", path
        )
    pi, rho = feature_order(s, p, path)
    cfg = ViTConfig(
        img_size=s.img_size,
        patch_size=p,
        in_chans=s.in_chans,
        hidden_chans=int(c),
        embed_dim=int(d),
        patch_embed="identity" if s.patch_embed is None else "linear",
        depth=len(s.blocks),
        mlp_hidden_dim=int(blk0.fc1.weight.shape[0]),
        num_classes=int(s.head.weight.shape[0]),
        norm_eps=float(str(np.float32(eps.pop()))),  # 1e-06, not 9.99999997e-07
        kernel_size=int(k),
        dilation=int(blk0.dilation),
    )
    cfg.validate("conv", path)

    def rows(wt: np.ndarray) -> np.ndarray:  # vector entries / matrix rows into cmhsa's order
        out = np.empty_like(wt)
        out[pi] = wt
        return out

    def cols(wt: np.ndarray, order: np.ndarray) -> np.ndarray:
        out = np.empty_like(wt)
        out[:, order] = wt
        return out

    t: dict[str, np.ndarray] = {}
    if s.patch_embed is not None:
        t["patch_embed.weight"] = cols(rows(s.patch_embed.weight), rho)
        t["patch_embed.bias"] = rows(s.patch_embed.bias)
    for i, blk in enumerate(s.blocks):
        b = f"blocks.{i}."
        t[b + "norm1.weight"], t[b + "norm1.bias"] = rows(blk.norm1.weight), rows(blk.norm1.bias)
        t[b + "conv.weight"], t[b + "conv.bias"] = blk.conv_weight, blk.conv_bias
        t[b + "norm2.weight"], t[b + "norm2.bias"] = rows(blk.norm2.weight), rows(blk.norm2.bias)
        t[b + "mlp.fc1.weight"], t[b + "mlp.fc1.bias"] = cols(blk.fc1.weight, pi), blk.fc1.bias
        t[b + "mlp.fc2.weight"], t[b + "mlp.fc2.bias"] = rows(blk.fc2.weight), rows(blk.fc2.bias)
    t["norm.weight"], t["norm.bias"] = rows(s.norm.weight), rows(s.norm.bias)
    t["head.weight"], t["head.bias"] = cols(s.head.weight, pi), s.head.bias
    dtype = np.result_type(*t.values())
    tensors = {name: torch.from_numpy(np.array(v, dtype=dtype, order="C")) for name, v in t.items()}
    layout = (
        "cmhsa"
        if np.array_equal(pi, np.arange(d)) and (rho is None or np.array_equal(rho, np.arange(rho.size)))
        else "permuted"
    )
    s.forms["token layout"] = [layout]
    return cfg, tensors


def check_import(
    model: Any, ckpt: Checkpoint, path: Path, tol: float, batch: int, seed: int = 1
) -> dict[str, Any]:
    """Run the ONNX file in onnxruntime and the rebuilt PyTorch model on the same ``batch`` random
    images; CmhsaError unless max|Δ| / max|onnxruntime| <= tol. Returns what was measured."""
    from .models import model_from_checkpoint

    session = ort_session(model, path)
    x = _random_input(model, batch, seed)
    ref = session.run(None, {model.graph.input[0].name: x})[0]
    with torch.no_grad():
        out = model_from_checkpoint(ckpt)(torch.from_numpy(x)).numpy()
    if out.shape != ref.shape:
        raise CmhsaError(
            f"onnxruntime returns shape {list(ref.shape)}, the rebuilt model {list(out.shape)}", path
        )
    max_abs = float(np.abs(out - ref).max())
    ref_max = float(np.abs(ref).max())
    rel = relative_error(max_abs, ref_max)
    result = {
        "passed": rel <= tol,
        "batch": batch,
        "seed": seed,
        "max_abs": max_abs,
        "ref_max": ref_max,
        "rel": rel,
        "tol": tol,
        "providers": session.get_providers(),
    }
    if not result["passed"]:
        raise CmhsaError(
            f"the PyTorch model rebuilt from the graph disagrees with onnxruntime (relative error {rel:.2e} > "
            f"tol {tol:g}); the graph is not a conv-phase ViT cmhsa reads correctly",
            path,
        )
    return result


def import_onnx(path: str | Path, tol: float = 1e-5, seed: int = 0) -> Checkpoint:
    """Load, read and prove a conv-phase ONNX model; the result is an ordinary conv Checkpoint
    whose ``import_report`` records how it was read and the onnxruntime agreement."""
    import onnx

    path = Path(path)
    model = load_onnx(path)
    structure = read_structure(model, path, seed)
    cfg, tensors = to_checkpoint(structure, path)
    validate_tensors("conv", cfg, tensors, path)
    ckpt = Checkpoint(path, "conv", cfg, tensors, {}, "onnx")
    # the batch the graph was traced at: its static batch, if it has one
    check = check_import(model, ckpt, path, tol, batch=structure.residual_shape[0], seed=seed + 1)
    ckpt.import_report = {
        "producer": f"{model.producer_name} {model.producer_version}".strip(),
        "ir_version": model.ir_version,
        "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
        "onnx": onnx.__version__,
        "read": structure.forms,
        "onnxruntime_check": check,
    }
    return ckpt
