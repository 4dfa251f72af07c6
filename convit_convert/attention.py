"""The phase-2 token mixer: multi-head self-attention with a relative position bias per head, an
optional sink per head (a key that attends to nothing) and optional gated pinning.

    RelPosAttention(dim, grid_size, heads, qk_dim, v_dim, sink, gated, form="padded")

``form`` picks, per instance and once at construction, how the two products q k^T and P·V are
computed: "padded" (heads split out of the projections, keys padded to an aligned length, one
batched product each) or "by_head" (the custom per-head ops of :mod:`convit_convert.kernels`, no
layout copies). Both compute the same function; bench/investigations/train_forms.py compares their speed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import head_logits, head_values


def relative_position_index(grid_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) index into a flattened (2Gh-1, 2Gw-1) table: query (y, x) to key (y+dy, x+dx) reads
    entry (dy + Gh - 1, dx + Gw - 1)."""
    gh, gw = grid_size
    # on the default device: the meta device when a model is built for its shapes only, so checking
    # a file that claims a large image costs nothing (at 64x64 patches it is 128 MB per block)
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = ys[None, :] - ys[:, None] + gh - 1  # [query, key]
    dx = xs[None, :] - xs[:, None] + gw - 1
    return dy * (2 * gw - 1) + dx


class RelPosAttention(nn.Module):
    """MHSA with a learnable relative position bias per head and, optionally, a sink per head.

    logits_h(q, k) = (W_Q x_q)·(W_K x_k) / sqrt(qk_dim) + rel_pos_bias[h, dy+Gh-1, dx+Gw-1]

    The sink is one extra key per head with zero key and zero value whose logit is the learnable
    scalar ``sink[h]``: a head can attend to "nothing" (output 0). That is what makes the converted
    model exact at the image border, where zero padding has no patch to attend to.

    ``gated`` (pinning "gated", ConViT's gated positional self-attention started at the conv):

        weights_h = (1 - g_h) · softmax(rel_pos_bias_h, sink_h)
                    + g_h · softmax(q·k / sqrt(qk_dim) + content_bias_h)

    with ``gate`` g_h used linearly, clamped to [0, 1] (the gradient passes the clamp unchanged, so
    a gate pushed below 0 can come back). At g = 0 a head is exactly its positional attention.
    """

    def __init__(
        self,
        dim: int,
        grid_size: tuple[int, int],
        num_heads: int,
        qk_dim: int,
        v_dim: int,
        sink: bool = True,
        gated: bool = False,
        form: AttentionFormName = "padded",
    ) -> None:
        super().__init__()
        if form not in FORMS:
            raise ValueError(f"form must be one of {', '.join(FORMS)}, got {form!r}")
        self.form: AttentionForm = FORMS[form]
        self.num_heads, self.qk_dim, self.v_dim = num_heads, qk_dim, v_dim
        self.grid_size = grid_size
        self.q = nn.Linear(dim, num_heads * qk_dim)
        self.k = nn.Linear(dim, num_heads * qk_dim)
        self.v = nn.Linear(dim, num_heads * v_dim)
        self.proj = nn.Linear(num_heads * v_dim, dim)
        gh, gw = grid_size
        self.rel_pos_bias = nn.Parameter(torch.zeros(num_heads, 2 * gh - 1, 2 * gw - 1))
        self.sink = nn.Parameter(torch.zeros(num_heads)) if sink else None
        self.gate = nn.Parameter(torch.zeros(num_heads)) if gated else None
        self.content_bias = nn.Parameter(torch.zeros(num_heads, 2 * gh - 1, 2 * gw - 1)) if gated else None
        self.register_buffer("rel_pos_index", relative_position_index(grid_size), persistent=False)
        self.record: list[torch.Tensor] | None = None  # convit_convert.analysis collects the weights here

    def init_non_persistent_buffers(self) -> None:
        """Rebuild ``rel_pos_index`` where it lives (timm's convention, timm/layers/pos_embed_rel.py):
        a loader that builds the model without running this constructor's buffers (transformers'
        TimmWrapper, on the meta device) calls it, since no file holds the index."""
        device = self.rel_pos_bias.device
        with torch.device("cpu" if device.type == "meta" else device):
            self.rel_pos_index = relative_position_index(self.grid_size)

    def position_bias(self, table: torch.Tensor | None = None) -> torch.Tensor:
        """(heads, N, N): a relative position table (default ``rel_pos_bias``) gathered for every
        query/key pair. ``index_select``, not ``table[:, index]``: its backward (index_add) sums in
        a fixed order on CPU, where advanced indexing's accumulates with atomics (runs that are not
        bit-identical) and was about 50x slower at 8x8 patches."""
        table = (self.rel_pos_bias if table is None else table).flatten(1)
        return table.index_select(1, self.rel_pos_index.flatten()).view(-1, *self.rel_pos_index.shape)

    def gates(self) -> torch.Tensor:
        """(heads,): the gates clamped to [0, 1], with the gradient passed straight through."""
        g = self.gate
        return g + (g.clamp(0, 1) - g).detach()

    def positional_weights(self) -> torch.Tensor:
        """(heads, N, N): the input-independent attention of the bias alone, sink in the denominator."""
        return softmax_with_sink(self.position_bias(), self.sink)

    @torch.no_grad()
    def frozen_gate(self) -> tuple[torch.Tensor, torch.Tensor]:
        """For inference forms: the gates g as (1, heads, 1, 1) and the constant positional part
        (1 − g)·positional_weights as (1, heads, N, N), both detached copies."""
        g = self.gates().detach().view(1, -1, 1, 1).clone()
        return g, ((1 - g) * self.positional_weights().unsqueeze(0)).detach().clone()

    def attn_bias(self) -> torch.Tensor:
        """(heads, N, N) bias, or (heads, N, N+1) with the sink as the last key."""
        bias = self.position_bias()
        if self.sink is None:
            return bias
        n = bias.shape[1]
        return torch.cat([bias, self.sink.view(-1, 1, 1).expand(-1, n, 1)], dim=-1)

    def qkv(self, x: torch.Tensor, pad_sink: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(B, N, dim) -> q, k (B, h, N[+1], qk_dim), v (B, h, N[+1], v_dim); with a sink and
        ``pad_sink``, k and v end with the null key and value (zeros), as the ONNX form uses them."""
        b, n, _ = x.shape
        h = self.num_heads
        q = self.q(x).view(b, n, h, self.qk_dim).transpose(1, 2)
        k = self.k(x).view(b, n, h, self.qk_dim).transpose(1, 2)
        v = self.v(x).view(b, n, h, self.v_dim).transpose(1, 2)
        if self.sink is not None and pad_sink:  # the null key: q·0 = 0, so its logit is the sink bias alone
            k = F.pad(k, (0, 0, 0, 1))
            v = F.pad(v, (0, 0, 0, 1))
        return q, k, v

    def merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, h, N, v_dim) head outputs -> (B, N, dim) through ``proj``."""
        b, h, n, vd = x.shape
        return self.proj(x.transpose(1, 2).reshape(b, n, h * vd))

    def padded_bias(self, table: torch.Tensor | None = None, sink: bool = True) -> torch.Tensor:
        """(heads, N, N_pad) float32: :meth:`position_bias` with key columns appended up to
        ``N_pad = padded_keys(N, sink)``; with ``sink``, column N holds the sink logit, the rest −inf."""
        bias = self.position_bias(table)
        h, n, _ = bias.shape
        with_sink = sink and self.sink is not None
        pad = bias.new_full((h, n, padded_keys(n, with_sink) - n), float("-inf"))
        if with_sink:
            pad = torch.cat([self.sink.view(h, 1, 1).expand(h, n, 1).to(bias.dtype), pad[..., 1:]], -1)
        return torch.cat([bias, pad], -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim).

        Written out rather than through ``F.scaled_dot_product_attention``: no fused kernel takes an
        arbitrary bias with v_dim = 768 (SDPA falls back to its math path). The keys are padded
        with zeros to ``N_pad`` = N (+1 for the sink) rounded up to a multiple of 8:

            weights = softmax([q k^T / sqrt(qk_dim) + B,  s_h,  −inf ...])    (B, h, N, N_pad)

        The sink is the first padded key (logit s_h, value zero), so it only enlarges the softmax's
        denominator; the other padded keys have logit −inf and weight exactly 0. The padding keeps
        every row of the (B, h, N, ·) logits and weights 16-byte aligned, so cuBLAS runs its aligned
        kernels for q k^T and P·V and their gradients (N = 196 rows of bf16 are not). The logits
        stay in float32 under autocast (the float32 bias promotes them). bench/gpu_suite.py
        measures the forms against each other. The two products, q k^T and P·V, are computed
        by the instance's form (:data:`FORMS`, chosen at construction).
        """
        n = x.shape[1]
        npad = padded_keys(n, self.sink is not None and self.gate is None)
        form = self.form
        qk = form.logits(self.q(x), self.k(x), self.num_heads, npad) * self.qk_dim**-0.5
        if self.gate is None:
            weights = (qk + self.padded_bias()).softmax(dim=-1)
        else:
            g = self.gates().view(1, -1, 1, 1)
            content = (qk + self.padded_bias(self.content_bias, sink=False)).softmax(dim=-1)
            weights = (1 - g) * F.pad(self.positional_weights(), (0, npad - n)) + g * content
        if self.record is not None:
            self.record.append(weights[..., :n].detach())
        v = self.v(x)
        return self.proj(form.values(weights.to(v.dtype), v))


class AttentionForm(NamedTuple):
    """How :meth:`RelPosAttention.forward` computes its two products from the projections, each
    (B, N, h·e) as ``nn.Linear`` makes them (head h is column block h):

    - ``logits(q, k, heads, keys)`` -> (B, h, N, keys): Q_h K_h^T, zero in the columns past N (the
      sink and the alignment padding are zero keys);
    - ``values(weights, v)`` -> (B, N, h·v_dim): [P_1 V_1, ..., P_h V_h] with the weights' first N
      columns (the padded keys' values are zero).
    """

    logits: Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]
    values: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def logits_padded(q: torch.Tensor, k: torch.Tensor, heads: int, keys: int) -> torch.Tensor:
    """Heads split to (B, h, N, e), keys padded with zero rows, one batched product."""
    b, n, _ = q.shape
    q = q.view(b, n, heads, -1).transpose(1, 2)
    k = F.pad(k.view(b, n, heads, -1).transpose(1, 2), (0, 0, 0, keys - n))
    return q @ k.transpose(-2, -1)


def values_padded(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Values split to (B, h, N, v_dim) and padded with zero rows, one batched product, heads
    merged. Padding and merging each copy the values' size."""
    b, h, n, keys = weights.shape
    v = F.pad(v.view(b, n, h, -1).transpose(1, 2), (0, 0, 0, keys - n))
    return (weights @ v).transpose(1, 2).reshape(b, n, -1)


# Batched products over heads split out of (B, N, h·e): the layout copies around them are the
# compiled training step's largest non-GEMM cost on an H100 (BENCHMARKS.md).
PADDED = AttentionForm(logits_padded, values_padded)
# Per-head products read and written in place by custom ops (convit_convert.kernels): no copies.
BY_HEAD = AttentionForm(head_logits, head_values)
# The forms by name. "padded" is the default until a GPU has compared the two
# (bench/investigations/train_forms.py):
# on the CPU, BY_HEAD took 0.90x (qk_dim 64) and 0.72x (qk_dim 768) PADDED's time per training step
# at the paper's size, but 1.06-1.28x on the README digits demo's model (its per-head calls dominate).
AttentionFormName = Literal["padded", "by_head"]
FORMS: dict[str, AttentionForm] = {"padded": PADDED, "by_head": BY_HEAD}


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 8: rows of 2-byte floats 16-byte aligned (cuBLAS's aligned
    kernels)."""
    return -(-n // 8) * 8


def padded_keys(n: int, sink: bool) -> int:
    """N keys, +1 for a sink, :func:`aligned`."""
    return aligned(n + int(sink))


def softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis of (..., heads, N, N) logits, with each head's sink logit (a key
    of value zero) in the denominator only: exp(logits - lse), lse = log(e^sink + Σ_j e^logits_j)."""
    if sink is None:
        return logits.softmax(dim=-1)
    lse = torch.logaddexp(logits.logsumexp(dim=-1, keepdim=True), sink.view(-1, 1, 1))
    return (logits - lse).exp()
