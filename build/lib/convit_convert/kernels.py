"""Per-head products of attention weights, as custom ops that torch.compile keeps whole.

Both ops read each head's operands in place and write each head's result into its column block
of one (B, N, h·e) tensor, so no (B, h, N, e) ↔ (B, N, h·e) layout copy is made; cuBLAS takes the
column blocks through their leading dimension. Traced by inductor, the same loops are copied
into blocks of their own (BENCHMARKS.md: the fused model compiled 2.1x slower that way).

    head_products(P, X)   = [P_1 X,   ..., P_h X]        one X shared by the heads (the fused form)
    head_values(P, V)     = [P_1 V_1, ..., P_h V_h]      V = [V_1, ..., V_h] (B, M, h·e) (training)
    head_logits(Q, K, h, L) = (Q_h K_h^T)_h, (B, h, N, L)  columns M..L-1 zero (training)

The training ops' backwards are ops too: traced as plain code, inductor would copy the blocks there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import register_flop_formula


def head_products_loop(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(B, h, N, K) weights and (B, K, e) rows -> (B, N, h·e) = [P_1 X, ..., P_h X]. Called
    through the custom op :data:`head_products`."""
    b, h, n, _ = p.shape
    e = x.shape[-1]
    z = x.new_empty(b, n, h * e)
    for i in range(h):
        z[:, :, i * e : (i + 1) * e].baddbmm_(p[:, i], x, beta=0)
    return z


head_products = torch.library.custom_op(
    "cmhsa::head_products", mutates_args=(), schema="(Tensor p, Tensor x) -> Tensor"
)(head_products_loop)


@head_products.register_fake
def _(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return x.new_empty(p.shape[0], p.shape[2], p.shape[1] * x.shape[2])


def _save_inputs(ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> None:
    ctx.save_for_backward(*inputs)


def _head_products_backward(ctx: Any, gz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """z_h = P_h X:  dP_h = dZ_h X^T,  dX = Σ_h P_h^T dZ_h."""
    p, x = ctx.saved_tensors
    b, h, n, _ = p.shape
    gz = gz.view(b, n, h, x.shape[-1]).transpose(1, 2)  # (B, h, N, e)
    return gz @ x.unsqueeze(1).transpose(-2, -1), (p.transpose(-2, -1) @ gz).sum(1)


head_products.register_autograd(_head_products_backward, setup_context=_save_inputs)


def head_values_loop(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """(B, h, N, K) weights and (B, M, h·e) values, M ≤ K -> (B, N, h·e) = [P_1 V_1, ..., P_h V_h]
    with P_h's first M columns: keys M..K-1 (the sink and the alignment padding) have zero values."""
    b, h, n, _ = p.shape
    m, e = v.shape[1], v.shape[2] // h
    z = v.new_empty(b, n, h * e)
    for i in range(h):
        z[:, :, i * e : (i + 1) * e].baddbmm_(p[:, i, :, :m], v[:, :, i * e : (i + 1) * e], beta=0)
    return z


def head_values_grad_loop(
    gz: torch.Tensor, p: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`head_values_loop`: dP_h = dZ_h V_h^T (zero in the columns past M),
    dV_h = P_h^T dZ_h, each head written in place."""
    b, h, n, k = p.shape
    m, e = v.shape[1], v.shape[2] // h
    gp, gv = p.new_empty(b, h, n, k), v.new_empty(v.shape)
    gp[..., m:].zero_()
    for i in range(h):
        cols = slice(i * e, (i + 1) * e)
        gp[:, i, :, :m].baddbmm_(gz[:, :, cols], v[:, :, cols].transpose(1, 2), beta=0)
        gv[:, :, cols].baddbmm_(p[:, i, :, :m].transpose(1, 2), gz[:, :, cols], beta=0)
    return gp, gv


def grad_op(name: str, loop: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A backward ``(grad, a, b) -> (d_a, d_b)`` as a custom op of its own, shaped as a and b."""
    op = torch.library.custom_op(f"cmhsa::{name}", mutates_args=())(loop)
    op.register_fake(lambda g, a, b: (a.new_empty(a.shape), b.new_empty(b.shape)))
    return op


head_values = torch.library.custom_op(
    "cmhsa::head_values", mutates_args=(), schema="(Tensor p, Tensor v) -> Tensor"
)(head_values_loop)
head_values_grad = grad_op("head_values_grad", head_values_grad_loop)


@head_values.register_fake
def _(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return v.new_empty(p.shape[0], p.shape[2], v.shape[2])


def _head_values_backward(ctx: Any, gz: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    p, v = ctx.saved_tensors
    return head_values_grad(gz.contiguous(), p, v)


head_values.register_autograd(_head_values_backward, setup_context=_save_inputs)


def head_logits_loop(q: torch.Tensor, k: torch.Tensor, heads: int, keys: int) -> torch.Tensor:
    """(B, N, h·e) queries and (B, M, h·e) keys -> (B, h, N, keys) = Q_h K_h^T per head, zero in the
    columns past M (the sink and the alignment padding: zero keys)."""
    b, n, _ = q.shape
    m, e = k.shape[1], k.shape[2] // heads
    s = q.new_empty(b, heads, n, keys)
    s[..., m:].zero_()
    for i in range(heads):
        cols = slice(i * e, (i + 1) * e)
        s[:, i, :, :m].baddbmm_(q[:, :, cols], k[:, :, cols].transpose(1, 2), beta=0)
    return s


def head_logits_grad_loop(
    gs: torch.Tensor, q: torch.Tensor, k: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`head_logits_loop`: dQ_h = dS_h K_h, dK_h = dS_h^T Q_h (the first M
    columns of dS_h), each head written in place."""
    h, m = gs.shape[1], k.shape[1]
    e = k.shape[2] // h
    gq, gk = q.new_empty(q.shape), k.new_empty(k.shape)
    for i in range(h):
        cols = slice(i * e, (i + 1) * e)
        gq[:, :, cols].baddbmm_(gs[:, i, :, :m], k[:, :, cols], beta=0)
        gk[:, :, cols].baddbmm_(gs[:, i, :, :m].transpose(1, 2), q[:, :, cols], beta=0)
    return gq, gk


head_logits = torch.library.custom_op(
    "cmhsa::head_logits", mutates_args=(), schema="(Tensor q, Tensor k, int heads, int keys) -> Tensor"
)(head_logits_loop)
head_logits_grad = grad_op("head_logits_grad", head_logits_grad_loop)


@head_logits.register_fake
def _(q: torch.Tensor, k: torch.Tensor, heads: int, keys: int) -> torch.Tensor:
    return q.new_empty(q.shape[0], heads, q.shape[1], keys)


def _head_logits_setup(
    ctx: Any, inputs: tuple[torch.Tensor, torch.Tensor, int, int], output: torch.Tensor
) -> None:
    ctx.save_for_backward(inputs[0], inputs[1])


def _head_logits_backward(ctx: Any, gs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None, None]:
    q, k = ctx.saved_tensors
    return (*head_logits_grad(gs.contiguous(), q, k), None, None)


head_logits.register_autograd(_head_logits_backward, setup_context=_head_logits_setup)


# FLOPs for torch.utils.flop_counter (the benchmarks' MFU): it sees a custom op, not the bmms inside.
@register_flop_formula(torch.ops.cmhsa.head_products)
def _(p_shape: torch.Size, x_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    b, h, n, k = p_shape
    return 2 * b * h * n * k * x_shape[-1]


@register_flop_formula(torch.ops.cmhsa.head_values)
def _(p_shape: torch.Size, v_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    b, _, n, _ = p_shape
    return 2 * b * n * v_shape[1] * v_shape[2]


@register_flop_formula(torch.ops.cmhsa.head_values_grad)
def _(gz_shape: torch.Size, p_shape: torch.Size, v_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    b, _, n, _ = p_shape
    return 4 * b * n * v_shape[1] * v_shape[2]


@register_flop_formula(torch.ops.cmhsa.head_logits)
def _(q_shape: torch.Size, k_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    return 2 * q_shape[0] * q_shape[1] * k_shape[1] * k_shape[2]


@register_flop_formula(torch.ops.cmhsa.head_logits_grad)
def _(gs_shape: torch.Size, q_shape: torch.Size, k_shape: torch.Size, *args: Any, **kwargs: Any) -> int:
    return 4 * q_shape[0] * q_shape[1] * k_shape[1] * k_shape[2]
