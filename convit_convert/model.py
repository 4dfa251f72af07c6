"""Both models in one sitting: the phase-1 convolutional ViT and the phase-2 attention ViT.

    VisionTransformer(cfg)   cfg.kind "conv": each block mixes tokens with a K×K convolution
                             cfg.kind "attn": multi-head self-attention, relative position bias, sink

The skeleton is shared: patch embedding, pre-LN blocks, final norm, mean over tokens, head. No class
token and no absolute position embedding: phase 1 gets position from the convolution's zero
padding, phase 2 from the relative position bias (Section 4.1 of the paper). Every parameter name is
the file format's (docs/FORMAT.md), e.g. ``blocks.0.conv.weight``, ``blocks.0.attn.proj.weight``.

Token layout: patches in row-major order; a patch is flattened channel-last, feature index
(py·P + px)·C + c. The attention has two more forms, swapped in for deployment (as timm's
``reparameterize_model``): :func:`prepare_for_export` (explicit softmax, bias as one constant) and
:func:`fuse_attention` (weight products folded for inference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from .config import ViTConfig
from .kernels import head_logits, head_products, head_values


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) pixels -> (B, N, P²·C) tokens, N = (H/P)·(W/P)."""
    b, c, h, w = x.shape
    p = patch_size
    x = x.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(x: torch.Tensor, grid_size: tuple[int, int], patch_size: int) -> torch.Tensor:
    """(B, N, P²·C) tokens -> (B, C, H, W) pixels; the inverse of :func:`patchify`."""
    b, _, d = x.shape
    gh, gw = grid_size
    p = patch_size
    c = d // (p * p)
    x = x.reshape(b, gh, gw, p, p, c)
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, c, gh * p, gw * p)


class PatchEmbed(nn.Module):
    """Image -> tokens. Identity on the flattened patch (the paper's choice, which lets phase 1 view
    tokens as pixels), or a learnable linear map P²·in_chans -> embed_dim held as
    ``patch_embed.weight`` / ``patch_embed.bias`` (docs/FORMAT.md)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, linear: bool) -> None:
        super().__init__()
        self.patch_size = patch_size
        if linear:
            self.weight = nn.Parameter(torch.empty(embed_dim, patch_size * patch_size * in_chans))
            self.bias = nn.Parameter(torch.zeros(embed_dim))
            nn.init.trunc_normal_(self.weight, std=0.02)
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, embed_dim)."""
        x = patchify(x, self.patch_size)
        return x if self.weight is None else F.linear(x, self.weight, self.bias)


class Mlp(nn.Module):
    """fc1 -> exact (erf) GELU -> fc2."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth per sample. A local copy of timm's, so the conversion path never imports
    timm (about 3.5 s of start-up)."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class ConvMixer(nn.Conv2d):
    """Token mixer: view tokens as pixels, apply Conv2d(C, C, K, padding='same', dilation=D), view
    back. Subclasses Conv2d so its parameters are ``conv.weight`` (C, C, K, K) and ``conv.bias`` (C).
    """

    def __init__(
        self, channels: int, kernel_size: int, dilation: int, grid_size: tuple[int, int], patch_size: int
    ) -> None:
        super().__init__(channels, channels, kernel_size, padding="same", dilation=dilation)
        self.grid_size = grid_size
        self.patch_size = patch_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, P²·C) -> (B, N, P²·C)."""
        pixels = unpatchify(x, self.grid_size, self.patch_size)
        return patchify(super().forward(pixels), self.patch_size)


def relative_position_index(grid_size: tuple[int, int]) -> torch.Tensor:
    """(N, N) index into a flattened (2Gh-1, 2Gw-1) table: query (y, x) to key (y+dy, x+dx) reads
    entry (dy + Gh - 1, dx + Gw - 1)."""
    gh, gw = grid_size
    cpu = "cpu"  # also when built on the meta device (for its shapes): a small index, computed at once
    ys, xs = torch.meshgrid(torch.arange(gh, device=cpu), torch.arange(gw, device=cpu), indexing="ij")
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

        weights_h = (1 - g_h) · softmax(rel_pos_bias_h, sink_h) + g_h · softmax(q·k / sqrt(qk_dim) + content_bias_h)

    with ``gate`` g_h used linearly, clamped to [0, 1] (the gradient passes the clamp unchanged, so
    a gate pushed below 0 can come back). At g = 0 a head is exactly its positional attention.
    """

    def __init__(
        self, dim: int, grid_size: tuple[int, int], num_heads: int, qk_dim: int, v_dim: int,
        sink: bool = True, gated: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
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
        by :data:`attention_form` (``PADDED`` unless set).
        """
        n = x.shape[1]
        npad = padded_keys(n, self.sink is not None and self.gate is None)
        form = attention_form
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
# The form the model uses. PADDED until a GPU has compared the two (bench/train_forms.py): on the
# CPU, BY_HEAD took 0.90x (qk_dim 64) and 0.72x (qk_dim 768) PADDED's time per training step at the
# paper's size, but 1.06-1.28x on the README digits demo's model, where its per-head calls dominate.
attention_form: AttentionForm = PADDED


def aligned(n: int) -> int:
    """``n`` rounded up to a multiple of 8: rows of 2-byte floats 16-byte aligned (cuBLAS's aligned kernels)."""
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


class Block(nn.Module):
    """Pre-LN transformer block: x + mixer(norm1(x)), then x + mlp(norm2(x)).

    The token mixer is registered under ``mixer_name``, the model's kind ('conv' or 'attn').
    """

    def __init__(
        self, dim: int, mixer_name: str, mixer: nn.Module, mlp_hidden_dim: int, norm_eps: float = 1e-6,
        drop_path: float = 0.0,
    ) -> None:  # fmt: skip
        super().__init__()
        self.mixer_name = mixer_name
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.add_module(mixer_name, mixer)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_hidden_dim)
        self.drop_path = DropPath(drop_path)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim)."""
        x = x + self.drop_path(self.mixer(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def init_weights(module: nn.Module) -> None:
    """ViT-style init: truncated normal (std 0.02) Linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)


ATTENTION_PARAMS = (".attn.q.weight", ".attn.q.bias", ".attn.k.weight", ".attn.k.bias", ".attn.gate",
                    ".attn.content_bias", ".attn.rel_pos_bias", ".attn.sink")  # fmt: skip # where attention looks


class VisionTransformer(nn.Module):
    """patch_embed -> depth × Block(mixer) -> norm -> mean over tokens -> head.

    The token mixer follows ``cfg.kind``: a :class:`ConvMixer` ("conv") or a
    :class:`RelPosAttention` ("attn"); everything else, and every parameter name, is shared.
    """

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        self.kind = cfg.kind
        self.num_classes = cfg.num_classes
        self.patch_embed = PatchEmbed(
            cfg.patch_size, cfg.in_chans, cfg.embed_dim, linear=cfg.patch_embed == "linear"
        )
        dpr = torch.linspace(
            0, drop_path_rate, cfg.depth, device="cpu"
        ).tolist()  # stochastic depth decay rule
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, cfg.kind, self._mixer(cfg), cfg.mlp_hidden_dim, cfg.norm_eps, p) for p in dpr
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.head: nn.Module = nn.Linear(cfg.embed_dim, cfg.num_classes)
        self.grad_checkpointing = False
        self.apply(init_weights)

    @staticmethod
    def _mixer(cfg: ViTConfig) -> nn.Module:
        if cfg.kind == "conv":
            return ConvMixer(cfg.hidden_chans, cfg.kernel_size, cfg.dilation, cfg.grid_size, cfg.patch_size)
        gated = cfg.pinning == "gated"
        return RelPosAttention(
            cfg.embed_dim, cfg.grid_size, cfg.num_heads, cfg.qk_dim, cfg.v_dim, bool(cfg.sink), gated
        )

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) images -> (B, N, embed_dim) normalised tokens."""
        expected = (self.cfg.in_chans, *self.cfg.img_size)
        if tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"expected images of shape (B, {', '.join(map(str, expected))}), got {tuple(x.shape)}"
            )
        x = self.patch_embed(x)
        for block in self.blocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.norm(x)

    def forward_intermediates(
        self, x: torch.Tensor, indices: int | list[int] | None = None, norm: bool = False,
        stop_early: bool = False, output_fmt: str = "NCHW", intermediates_only: bool = False,
    ) -> list[torch.Tensor] | tuple[torch.Tensor, list[torch.Tensor]]:  # fmt: skip
        """timm's feature API: the outputs of the blocks ``indices`` (an int n: the last n; default:
        all), as (B, embed_dim, gh, gw) ("NCHW") or (B, N, embed_dim) ("NLC"), after the final norm
        with ``norm``; and, unless ``intermediates_only``, the final normalised tokens."""
        depth = len(self.blocks)
        take = list(range(depth))[-indices:] if isinstance(indices, int) else list(indices or range(depth))
        if any(not -depth <= i < depth for i in take) or output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"indices must be blocks of 0..{depth - 1} and output_fmt NCHW or NLC")
        take = [i % depth for i in take]
        b = x.shape[0]
        gh, gw = self.cfg.grid_size
        out, feats = self.patch_embed(x), []
        last = max(take) if stop_early or intermediates_only else depth - 1
        for i, block in enumerate(self.blocks[: last + 1]):
            out = block(out)
            if i in take:
                f = self.norm(out) if norm else out
                feats.append(f if output_fmt == "NLC" else f.transpose(1, 2).reshape(b, -1, gh, gw))
        return feats if intermediates_only else (self.norm(out), feats)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, N, embed_dim) -> (B, num_classes) logits, or the pooled (B, embed_dim) features."""
        x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_classes)."""
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int) -> None:
        """A new, freshly initialised head for ``num_classes`` (0: none, forward returns features)."""
        self.num_classes = num_classes
        self.head = nn.Linear(self.cfg.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head.apply(init_weights)
        if num_classes > 0:
            self.cfg = dataclasses.replace(self.cfg, num_classes=num_classes)

    def group_matcher(self, coarse: bool = False) -> dict[str, Any]:
        """Parameter groups by name, for timm's layer-wise learning-rate decay."""
        return {
            "stem": r"^patch_embed",
            "blocks": r"^blocks\.(\d+)" if coarse else [(r"^blocks\.(\d+)", None), (r"^norm", (99999,))],
        }

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.grad_checkpointing = enable

    def no_weight_decay(self) -> set[str]:
        """Parameter names to exclude from weight decay (timm's create_optimizer_v2 reads this)."""
        return {
            n
            for n, _ in self.named_parameters()
            if n.endswith(("rel_pos_bias", "sink", "gate", "content_bias"))
        }


# ---- deployment forms of the attention -------------------------------------------------------


class ExportAttention(nn.Module):
    """:class:`RelPosAttention` for export: explicit attention, bias and sink as one constant.

    logits_h = q_h k_h^T / sqrt(qk_dim) + B_h,   B = attn_bias(): (heads, N, N[+1])

    With a sink, keys and values end with a zero row (as in training), so the last logit column
    is q·0 + sink_h = sink_h and its value is zero. A gated layer's positional attention does not
    depend on the input: it is one constant too, and the content softmax is written out beside it.
    """

    def __init__(self, attn: RelPosAttention) -> None:
        super().__init__()
        self.attn = attn
        self.scale = attn.qk_dim**-0.5
        self.gated = attn.gate is not None
        with torch.no_grad():
            if self.gated:
                g, mixed_pos = attn.frozen_gate()
                self.register_buffer(
                    "bias", attn.position_bias(attn.content_bias).detach().clone().unsqueeze(0)
                )
                self.register_buffer("mixed_pos", mixed_pos)
                self.register_buffer("g", g)
            else:
                self.register_buffer(
                    "bias", attn.attn_bias().detach().clone().unsqueeze(0)
                )  # (1, h, N, N[+1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim)."""
        q, k, v = self.attn.qkv(x, pad_sink=not self.gated)
        weights = torch.softmax((q @ k.transpose(-2, -1)) * self.scale + self.bias, dim=-1)
        if self.gated:
            weights = self.mixed_pos + self.g * weights
        return self.attn.merge_heads(weights @ v)


def prepare_for_export(model: VisionTransformer) -> VisionTransformer:
    """Swap every attention mixer for :class:`ExportAttention`, in place; eval mode."""
    for block in model.blocks:
        if isinstance(block.mixer, RelPosAttention):
            setattr(block, block.mixer_name, ExportAttention(block.mixer))
    return model.eval()


class FusedRelPosAttention(nn.Module):
    """The same function as a :class:`RelPosAttention`, with weight products folded, for inference
    (like RepVGG's re-parameterisation). For head h with W_v,h (v_dim × d), W_o,h (d × v_dim) the
    columns of proj for that head:

        out_i = Σ_h Σ_j p_h(i, j) (W_o,h (W_v,h x_j + b_v,h)) + b_o
              = [P_1 X̃, ..., P_H X̃] Ũ + b_o,      X̃ = [X, 1],   Ũ = [Ũ_1; ...; Ũ_H],
        Ũ_h = [U_h; c_h] ((d+1) × d),  U_h = W_v,h^T W_o,h^T,  c_h = W_o,h b_v,h

    The column of ones carries each head's value bias c_h weighted by Σ_j p_h(i, j), which is < 1
    where the sink takes weight (the sink's key row of X̃ is zero). The heads' P_h X̃ are written
    side by side into one (B, N, H·d̃) tensor (:func:`head_products`) and a single GEMM with
    reduction length H·d̃ sums the heads, so no (B, N, d) accumulator is read and written once per
    head. With qk_dim ≥ d/2 the query/key product folds the same way: q_i·k_j = x̃_i A_h x̃_j^T
    with A_h = [W_q,h, b_q,h]^T [W_k,h, b_k,h], a (d+1)² matrix instead of two qk_dim × d
    projections. Keys are padded as in :meth:`RelPosAttention.forward` (the sink is the first
    padded key) and X̃ with zero rows and columns to (N_pad, d̃), d̃ = d+1 rounded up to a
    multiple of 8, so every product's rows are 16-byte aligned and its reduction length a
    multiple of 8: cuBLAS runs its aligned kernels.

    This cuts d² · (2·heads) multiply-adds per token per block (v and proj become one product) and,
    with qk_dim = d, another d² · heads. The result equals the unfused model up to float rounding.
    Use :func:`fuse_attention` on a trained model in eval mode; the fused model cannot be trained or
    saved in the checkpoint format.
    """

    def __init__(self, attn: RelPosAttention) -> None:
        super().__init__()
        h, qk, vd = attn.num_heads, attn.qk_dim, attn.v_dim
        d = attn.q.in_features
        self.num_heads = h
        self.scale = qk**-0.5
        with torch.no_grad():
            da = aligned(d + 1)  # x̃ = [x, 1, 0 ...]
            wo = attn.proj.weight.view(d, h, vd).permute(1, 2, 0)  # (h, vd, d_out)
            u = attn.v.weight.view(h, vd, d).transpose(1, 2) @ wo  # (h, d_in, d_out)
            c = torch.einsum("hv,hvd->hd", attn.v.bias.view(h, vd), wo)  # (h, d_out)
            u = F.pad(torch.cat([u, c[:, None]], 1), (0, 0, 0, da - d - 1))  # (h, d̃, d_out): [U_h; c_h; 0]
            self.register_buffer("u", u.reshape(h * da, d).contiguous())  # [P_h X̃]_h @ u
            self.register_buffer("proj_bias", attn.proj.bias.detach().clone())
            self.fold_qk = 2 * qk >= d
            if self.fold_qk:

                def augmented(lin: nn.Linear) -> torch.Tensor:  # [W, b, 0] per head: (h, qk, d̃)
                    return F.pad(torch.cat([lin.weight, lin.bias[:, None]], 1), (0, da - d - 1)).view(
                        h, qk, da
                    )

                a = augmented(attn.q).transpose(1, 2) @ augmented(attn.k)  # (h, d̃, d̃): q·k = x̃ A_h x̃^T
                self.register_buffer("a", (a * self.scale).permute(1, 0, 2).reshape(da, h * da).contiguous())
            else:
                self.q, self.k = attn.q, attn.k
                self.qk_dim = qk
            self.gated = attn.gate is not None
            if self.gated:  # content logits carry the content bias; the positional part is a constant
                g, mixed_pos = attn.frozen_gate()
                self.register_buffer("bias", attn.padded_bias(attn.content_bias, sink=False).detach().clone())
                n, npad = mixed_pos.shape[-2], self.bias.shape[-1]
                self.register_buffer("mixed_pos", F.pad(mixed_pos, (0, npad - n)))
                self.register_buffer("g", g)
            else:
                self.register_buffer("bias", attn.padded_bias().detach().clone())  # (h, N, N_pad)

    def logits(self, x: torch.Tensor, xa: torch.Tensor) -> torch.Tensor:
        """(B, N, d) tokens and (B, N_pad, d̃) x̃ -> (B, heads, N, N_pad) attention logits, bias and
        sink included: products in x's dtype, the sum in float32 or wider (a bf16 bias would round
        the pinning margin)."""
        b, n, _ = x.shape
        h, dtype = self.num_heads, x.dtype
        npad = self.bias.shape[-1]
        acc = torch.promote_types(dtype, torch.float32)
        bias = self.bias.to(acc).expand(b, h, n, npad)
        if self.fold_qk:
            da = self.a.shape[0]
            z = xa[:, :n] @ self.a.to(dtype)  # (B, N, h·d̃); head h is a column block
            xt = xa.transpose(1, 2)  # (B, d̃, N_pad): zero padded keys
            out = bias.contiguous()
            for i in range(h):
                zi = z[:, :, i * da : (i + 1) * da]
                if dtype == acc:
                    out[:, i].baddbmm_(zi, xt)
                else:
                    out[:, i] += torch.bmm(zi, xt)
            return out
        q = F.linear(x, self.q.weight.to(dtype), self.q.bias.to(dtype)).view(b, n, h, self.qk_dim)
        k = F.linear(x, self.k.weight.to(dtype), self.k.bias.to(dtype)).view(b, n, h, self.qk_dim)
        q = (q.transpose(1, 2) * self.scale).reshape(b * h, n, self.qk_dim)
        k = F.pad(k.transpose(1, 2), (0, 0, 0, npad - n)).reshape(b * h, npad, self.qk_dim).transpose(1, 2)
        bias = bias.reshape(b * h, n, npad)
        qk = torch.baddbmm(bias, q, k) if dtype == acc else torch.bmm(q, k).to(acc) + bias
        return qk.view(b, h, n, npad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d). Under autocast the block runs its products in the autocast dtype
        itself (its in-place GEMMs are not autocast ops)."""
        device = x.device.type
        if torch.is_autocast_enabled(device):
            with torch.autocast(device, enabled=False):
                return self._forward(x.to(torch.get_autocast_dtype(device)))
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        dtype, npad, da = x.dtype, self.bias.shape[-1], self.u.shape[0] // self.num_heads
        xa = F.pad(torch.cat([x, x.new_ones(b, n, 1)], -1), (0, da - d - 1, 0, npad - n))  # (B, N_pad, d̃)
        p = self.logits(x, xa).softmax(-1)  # (B, h, N, N_pad); padded keys weigh 0, the sink's row of x̃ is 0
        if self.gated:
            p = self.mixed_pos + self.g * p
        z = head_products(p.to(dtype), xa)  # (B, N, h·d̃): [P_1 X̃, ..., P_h X̃]
        return torch.addmm(self.proj_bias.to(dtype), z.view(b * n, -1), self.u.to(dtype)).view(b, n, d)


@torch.no_grad()
def fuse_attention(model: nn.Module) -> nn.Module:
    """Replace every RelPosAttention in ``model`` (in place) by its fused equivalent; eval only."""
    model.eval()
    for block in getattr(model, "blocks", []):
        if isinstance(getattr(block, "attn", None), RelPosAttention):
            block.attn = FusedRelPosAttention(block.attn)
    return model
