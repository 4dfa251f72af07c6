"""The graph matcher: an ONNX graph plus the value of every tensor on one concrete run, with the
moves the ViT reader (:mod:`.read`) makes along it (follow a chain, read a linear layer, a
LayerNorm, a GELU, a Conv and its padding, replay layout ops on index arrays)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import CmhsaError

LAYOUT_OPS = frozenset({"Reshape", "Transpose", "Flatten", "Squeeze", "Unsqueeze", "Identity", "Dropout"})
FLAT_OPS = LAYOUT_OPS - {"Transpose"}  # keep row-major order, so a token's features stay together
GELU_OPS = frozenset({"Div", "Mul", "Add", "Sub", "Erf", "Sqrt", "Pow", "Identity", "Cast"})
SHAPE_OPS = frozenset({"Shape", "Size"})  # read a tensor's shape, not its data
RANDOM_OPS = frozenset(
    {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}
)
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


def describe(node: Any) -> str:
    return f"node {node.name or node.output[0]!r} ({node.op_type})"


def attr(node: Any, name: str, default: Any = None) -> Any:
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
            f"{describe(node)}: unexpected here; expected {expected}. Not a conv-phase ViT cmhsa can read"
        )

    def const(self, name: str, node: Any) -> np.ndarray:
        """The value of a weight ``name`` that ``node`` reads; it must not depend on the input."""
        if name not in self.const_names:
            raise self.error(
                f"{describe(node)}: its weight {name!r} is computed from the input, not a constant"
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
        raise self.error(f"{describe(node)}: cannot evaluate its input {name!r}")

    def data_consumers(self, name: str) -> list[Any]:
        return [n for n in self.consumers.get(name, []) if n.op_type not in SHAPE_OPS]

    def sole_consumer(self, name: str, expected: str) -> Any:
        nodes = self.data_consumers(name)
        if len(nodes) != 1:
            found = ", ".join(describe(n) for n in nodes) or "nothing"
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
                    f"{describe(n)}: LayerNorm is decomposed into primitive ops; cmhsa reads "
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
        axis = attr(node, "axis", -1)
        if axis not in (-1, rank - 1):
            raise self.error(f"{describe(node)}: normalises from axis {axis}; expected the last axis only")
        weight = self.const(node.input[1], node).reshape(-1)
        d = self.shape(x)[-1]
        bias = self.optional_const(node, 2, d, weight.dtype)
        if weight.size != d or bias.size != d:
            raise self.error(f"{describe(node)}: weight or bias size differs from the feature size {d}")
        eps = float(np.float32(attr(node, "epsilon", 1e-5)))
        return Norm(weight, bias, eps), node.output[0]

    def linear(self, node: Any, x: str, what: str) -> tuple[Linear, str]:
        """A MatMul (+ Add) or Gemm reading ``x``; returns the layer and its output tensor."""
        if node.op_type not in LINEAR_OPS:
            raise self.unexpected(node, what)
        if node.input[0] != x:
            raise self.error(f"{describe(node)}: reads the data as its second operand; expected x @ W")
        w = self.const(node.input[1], node)
        if w.ndim != 2:
            raise self.error(f"{describe(node)}: weight of shape {list(w.shape)}, expected a matrix")
        if node.op_type == "Gemm":
            if attr(node, "transA", 0):
                raise self.error(f"{describe(node)}: transA=1 is not a linear layer on the data")
            weight = (w if attr(node, "transB", 0) else w.T) * attr(node, "alpha", 1.0)
            out_features = weight.shape[0]
            bias = np.zeros(out_features, w.dtype)
            if len(node.input) > 2 and node.input[2]:
                c = self.const(node.input[2], node) * attr(node, "beta", 1.0)
                if c.size not in (1, out_features):
                    raise self.error(
                        f"{describe(node)}: bias of shape {list(c.shape)}, expected ({out_features},)"
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
                f"{describe(node)}: weight {list(w.shape)} does not fit its input's "
                f"features {self.shape(x)[-1]}"
            )
        return Linear(np.ascontiguousarray(weight), np.array(bias), form), out

    def gelu(self, h: str) -> tuple[str, str]:
        """The exact GELU applied to ``h``: one Gelu node, or its Erf form, checked numerically."""
        nodes = self.data_consumers(h)
        if len(nodes) == 1 and nodes[0].op_type == "Gelu":
            if attr(nodes[0], "approximate", "none") != "none":
                raise self.error(
                    f"{describe(nodes[0])}: tanh-approximate GELU; the conv-phase ViT uses "
                    "the exact (erf) GELU"
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
            raise self.error(f"{describe(erfs[0])}: the Erf subgraph does not compute the exact GELU")
        return g, "Erf form"

    def conv(self, node: Any, pads_nodes: list[Any]) -> tuple[np.ndarray, np.ndarray, int, str]:
        w = self.const(node.input[1], node)
        if w.ndim != 4:
            raise self.error(f"{describe(node)}: weight of shape {list(w.shape)}, expected (C, C, K, K)")
        c_out, c_in, kh, kw = w.shape
        groups = attr(node, "group", 1)
        if groups != 1:
            raise self.error(
                f"{describe(node)}: unsupported convolution: groups {groups} (only dense "
                "convolutions are exact)"
            )
        strides = list(attr(node, "strides", [1, 1]))
        if strides != [1, 1]:
            raise self.error(
                f"{describe(node)}: unsupported convolution: strides {strides} (only stride 1 is exact)"
            )
        if kh != kw or c_out != c_in:
            raise self.error(
                f"{describe(node)}: weight {list(w.shape)} is not (C, C, K, K) with a square kernel"
            )
        dil = list(attr(node, "dilations", [1, 1]))
        if dil[0] != dil[1]:
            raise self.error(f"{describe(node)}: unsupported convolution: dilations {dil} differ per axis")
        k, d = kh, dil[0]
        total = d * (k - 1)
        same = [total // 2, total // 2, total - total // 2, total - total // 2]  # PyTorch 'same'
        auto = attr(node, "auto_pad", "NOTSET")
        if auto == "NOTSET":
            pads, how = list(attr(node, "pads", [0, 0, 0, 0])), "pads"
        elif auto in ("SAME_UPPER", "SAME_LOWER"):
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads, how = [lo, lo, total - lo, total - lo], f"auto_pad {auto}"
        elif auto == "VALID":
            pads, how = [0, 0, 0, 0], "auto_pad VALID"
        else:
            raise self.error(f"{describe(node)}: unknown auto_pad {auto!r}")
        for pad in pads_nodes:
            extra = self.pad_amounts(pad)
            pads = [p + e for p, e in zip(pads, extra, strict=True)]
            how = "Pad node + " + how
        if pads != same:
            raise self.error(
                f"{describe(node)}: unsupported convolution: pads {pads} (top, left, bottom, right) are not "
                f"PyTorch's 'same' zero padding {same} for K={k}, dilation {d}"
            )
        return w, self.optional_const(node, 2, c_out, w.dtype), d, how

    def pad_amounts(self, node: Any) -> list[int]:
        """(top, left, bottom, right) of a zero-constant Pad of an NCHW tensor."""
        mode = attr(node, "mode", "constant")
        pads = attr(node, "pads") if len(node.input) < 2 else self.const(node.input[1], node)
        value = 0.0
        if len(node.input) > 2 and node.input[2]:
            value = float(np.asarray(self.const(node.input[2], node)).reshape(-1)[0])
        if len(node.input) > 3 and node.input[3]:
            raise self.error(f"{describe(node)}: Pad with axes is not supported")
        pads = [int(p) for p in np.asarray(pads).reshape(-1)]
        if mode != "constant" or value != 0.0 or len(pads) != 8 or any(pads[i] for i in (0, 1, 4, 5)):
            raise self.error(
                f"{describe(node)}: unsupported convolution: padding other than spatial "
                f"zeros ({mode}, pads {pads})"
            )
        return [pads[2], pads[3], pads[6], pads[7]]

    def trace(self, chain: list[Any], index: np.ndarray) -> np.ndarray:
        """Replay the layout ops of ``chain`` on ``index`` (an array shaped like the chain's input)."""
        arr = index
        for n in chain:
            op = n.op_type
            if op == "Reshape":
                shape = [int(s) for s in self.value(n.input[1], n).reshape(-1)]
                if not attr(n, "allowzero", 0):
                    shape = [arr.shape[i] if s == 0 else s for i, s in enumerate(shape)]
                arr = arr.reshape(shape)
            elif op == "Transpose":
                arr = arr.transpose(attr(n, "perm", list(range(arr.ndim))[::-1]))
            elif op == "Flatten":
                axis = attr(n, "axis", 1) % max(arr.ndim, 1)
                arr = arr.reshape(math.prod(arr.shape[:axis]), -1)
            elif op in ("Squeeze", "Unsqueeze"):
                axes = attr(n, "axes")
                if axes is None and len(n.input) > 1 and n.input[1]:
                    axes = self.value(n.input[1], n).reshape(-1).tolist()
                if op == "Squeeze":
                    arr = np.squeeze(arr, axis=None if axes is None else tuple(int(a) for a in axes))
                else:
                    rank = arr.ndim + len(axes)
                    for a in sorted(int(a) % rank for a in axes):
                        arr = np.expand_dims(arr, a)
            if tuple(arr.shape) != self.shape(n.output[0]):
                raise self.error(f"{describe(n)}: could not replay this layout op")
        return arr
