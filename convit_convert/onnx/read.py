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

The token layout is then proved and undone on the weights (:mod:`.layout`), and the import
checked against onnxruntime (:mod:`.importer`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..config import LIMITS
from ..errors import CmhsaError
from .graph import FLAT_OPS, LAYOUT_OPS, LINEAR_OPS, GraphReader, Linear, Norm, attr, describe
from .load import DOUBLE, FLOAT, ort_session, run_session


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
    # every intermediate comes back: their sizes, known before the run and held to the memory
    # available twice over (a crafted shape is refused here, before onnxruntime allocates it)
    session = ort_session(probe, path, optimize=False, batch=batch, kept=2)
    x = random_input(model, batch, seed)
    results = run_session(session, [out, *names], {inp: x}, path)
    return inp, out, dict(zip([out, *names], results, strict=True))


def _input_info(model: Any, path: Path) -> tuple[int | None, int, int, int]:
    """(static batch or None, C, H, W) of the one image input, which must have static C, H, W
    (initializers that old exporters also list as inputs are constants, not inputs)."""
    graph = model.graph
    init = {t.name for t in graph.initializer}
    inputs = [i for i in graph.input if i.name not in init]
    if len(inputs) != 1 or len(graph.output) != 1:
        raise CmhsaError(
            f"has {len(inputs)} input(s) and {len(graph.output)} output(s); a ViT has "
            "one image input and one logits output",
            path,
        )
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
    c_max, hw_max = LIMITS["in_chans"], LIMITS["img_size"]  # a config's limits, as the flags'
    if static[1] > c_max or max(static[2], static[3]) > hw_max:
        raise CmhsaError(
            f"input {inputs[0].name!r} has shape {static}; cmhsa reads C ≤ {c_max}, H and W ≤ {hw_max}", path
        )
    return static[0], static[1], static[2], static[3]


def random_input(model: Any, batch: int, seed: int) -> np.ndarray:
    tt = model.graph.input[0].type.tensor_type
    dims = [d.dim_value for d in tt.shape.dim]
    dtype = np.float32 if tt.elem_type == FLOAT else np.float64
    return np.random.default_rng(seed).standard_normal((batch, *dims[1:])).astype(dtype)


def without_initializer_inputs(model: Any) -> Any:
    """A copy of ``model`` whose graph inputs are its real inputs only."""
    import onnx

    init = {t.name for t in model.graph.initializer}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.input[:]
    out.graph.input.extend(i for i in model.graph.input if i.name not in init)
    return out


def read_structure(model: Any, path: Path, seed: int = 0) -> Structure:
    """Walk the residual stream of a checked ONNX model (see the module docstring); ``model`` must
    list only its real inputs (:func:`without_initializer_inputs`)."""
    static_batch, c_in, h, w = _input_info(model, path)
    batch = static_batch or 2
    inp, out, values = _concrete_run(model, path, batch, seed)
    g = GraphReader(model, values, path)
    ops = {n.op_type for n in model.graph.node}
    if "Conv" not in ops and "Softmax" in ops:
        raise g.error(
            "this is an attention model (its token mixers are Softmax attention, not "
            "Conv): cmhsa imports only "
            "conv-phase ONNX graphs; give the .safetensors this graph was exported from"
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
            raise g.error(f"{describe(node)}: could not replay the layout ops before it")
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
    axes = attr(pool, "axes")
    if axes is None and len(pool.input) > 1 and pool.input[1]:
        axes = g.const(pool.input[1], pool).reshape(-1).tolist()
    tokens = set(range(1, rank - 1))
    if g.shape(f) != g.shape(r) or axes is None or {int(a) % rank for a in axes} != tokens:
        raise g.error(
            f"{describe(pool)}: averages over axes {axes}; expected the token axes {sorted(tokens)}"
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
