r"""Theorem 1 as code: a K×K convolution layer -> an exactly equivalent MHSA layer on patches.

Notation (the paper, Section 2 and Appendix A.2): P patch size, C channels, d = P²·C token width,
Δ = {δ_1, …, δ_{N_H}} the patch offsets the kernel touches (:func:`theory.patch_offsets`), head
r ∈ [N_H], pixels s, t ∈ [P²] of a patch, input channel i, output channel j, kernel W^C, bias b^C.

    W^Q_r = W^K_r = 0                     (the context-aware part is switched off)
    B_r[δ] = M · 1{δ = δ_r}               (Lemma 2: head r attends to patch q + δ_r only)
    W^V_r = I_d                           (head r returns the whole token X_{q+δ_r})
    W^O[(r, s, i), (t, j)] = W^C[x(r,s,t), y(r,s,t), i, j]    (Appendix A.2, Remark)
    b^O[(t, j)] = b^C[j]

so that MHSA(X)_q = concat_r(X_{q+δ_r}) W^O + b^O = conv(X)_q (Eq. 14-15). (x, y)(r, s, t) is the
kernel tap linking input pixel s of patch q + δ_r to output pixel t of patch q; the entry is 0
where there is none. Per axis, with PyTorch's cross-correlation, dilation D and 'same' padding
(left = D(K-1)//2): input coordinate (q+δ)·P + s, output coordinate q·P + t, and

    tap k = (δ·P + s - t + left) / D     if that is an integer in [0, K), else none.

In our tensors (Linear weights are (out, in), tokens flattened channel-last):
``proj.weight[(t_y·P + t_x)·C + j, r·v_dim + (s_y·P + s_x)·C + i]``. The gather itself is
:func:`convit_convert.taps.output_projection`, which phase 1's token form also computes through.

Borders (not in the paper). Where q + δ_r lies outside the image, the convolution reads zero
padding, but Lemma 2's head has no key to pin: its softmax spreads over all N patches and returns
their mean. Each head therefore gets a *sink*, a null key with zero value and logit ``sink[r]``.
With logits chosen as

    sink logit     S = ln N + margin          (beats all N real keys: they keep e^-margin in all)
    offset logit   M = S + margin             (beats the sink and the other keys by e^-margin)

an in-image head returns X_{q+δ_r} and an out-of-image head returns 0, both to within e^-margin
relative (margin 40: e^-40 ≈ 4e-18, below float64 resolution). Without a sink (the paper's model,
``sink=False``), M = ln N + margin and border patches are wrong, interior ones exact.

Trainable starts (not in the paper; W^Q = W^K = 0 is a saddle and a margin of 40 saturates the
softmax, so the exact construction cannot learn attention). Heads beyond |Δ| (``num_heads`` >
|Δ|), and heads whose offset lies outside the grid, are *free*: no pinning entry, sink logit 0,
W^Q, W^K, W^V trunc-normal(0.02), W^O = 0. They add exactly nothing at the start, yet W^O gets a
gradient at once (ReZero's principle). With ``pinning="gated"`` each head mixes its positional
attention with content attention through a gate g_h (:class:`~convit_convert.model.RelPosAttention`),
0 for pinned heads (exact) and 1 for free ones; W^Q, W^K trunc-normal(0.02).

Exactness needs only v_dim ≥ d; qk_dim is free because W^Q = W^K = 0. A small random W^Q, W^K
(``qk_init_std``) keeps the model exact while |q·k|/sqrt(qk_dim) ≪ margin, and moves phase 2 off the
W^Q = W^K = 0 saddle.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .config import ViTConfig
from .errors import CmhsaError
from .options.conversion import DEFAULT_MARGIN, ConversionPlan, Offset, pinned_heads, pinning_logits
from .taps import output_projection
from .theory import head_count


def check_heads(plan: ConversionPlan, path: object = None) -> None:
    """Refuse head counts below what the construction needs, citing the lower bound and the way out."""
    cfg, num_heads = plan.source, plan.config.num_heads
    if plan.exact:
        return
    hc = head_count(cfg.kernel_size, cfg.patch_size, cfg.dilation, channels=cfg.hidden_chans)
    why = (
        f"and no fewer can express every such kernel ({hc.patch_reason})"
        if hc.patch_lower_bound is not None and num_heads < hc.patch_lower_bound  # type: ignore[operator]
        else f"({hc.patch_reason})"
    )
    raise CmhsaError(
        f"{num_heads} heads are too few: a {cfg.kernel_size}x{cfg.kernel_size} kernel "
        f"(dilation {cfg.dilation}) with {cfg.patch_size}-pixel patches touches "
        f"{plan.needed} patch offsets, one head each {why}; with `approximate`, cmhsa convert builds "
        f"the best {num_heads}-head approximation instead and measures what it costs",
        path,
    )


def convert_block(
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    plan: ConversionPlan,
    *,
    generator: torch.Generator | None = None,
    offsets: Sequence[Offset] | None = None,
    wo: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """One conv mixer -> the tensors of one attention mixer (names relative to ``attn.``).

    Zero W_Q and W_K come back as broadcast views of one zero; ``.clone()`` them before editing in
    place. ``offsets`` and ``wo`` (d, len(offsets), d) replace Δ and the kernel's taps (an
    approximate conversion).
    """
    cfg = plan.config
    d, p = cfg.embed_dim, cfg.patch_size
    n_h, qk, vd = cfg.num_heads, cfg.qk_dim, cfg.v_dim  # vd >= d: convert_state_dict checks it
    dtype = weight.dtype
    heads = plan.pinned if offsets is None else pinned_heads(cfg, list(offsets))
    offsets = list(plan.offsets[:n_h] if offsets is None else offsets)  # type: ignore[index]
    usable = [o is not None for o in heads[: len(offsets)]]
    if wo is None:
        wo = output_projection(weight, p, cfg.dilation, offsets).view(d, len(offsets), d)
    wo = wo.to(dtype) * torch.tensor(usable, dtype=dtype).view(1, -1, 1)
    proj = torch.zeros(d, n_h, vd, dtype=dtype)  # extra heads and value dims: zero output weights
    proj[:, : len(offsets), :d] = wo

    free = [r for r, o in enumerate(heads) if o is None]  # alive: trainable, silent through W_O = 0
    gated = cfg.pinning == "gated"
    qk_init_std = plan.spec.qk_init_std

    def init(shape: tuple[int, ...]) -> torch.Tensor:  # the layer's usual init, from the seeded generator
        return nn.init.trunc_normal_(
            torch.empty(shape, dtype=torch.float64), std=0.02, generator=generator
        ).to(dtype)

    def qk_weight() -> torch.Tensor:
        if gated:  # W_Q, W_K only feed the content attention, which starts gated off
            return init((n_h * qk, d))
        if (
            qk_init_std == 0.0 and not free
        ):  # W_Q = W_K = 0 as a broadcast view: no memory for 2/5 of the model
            return torch.zeros((), dtype=dtype).expand(n_h * qk, d)
        w = (torch.randn(n_h * qk, d, generator=generator, dtype=torch.float64) * qk_init_std).to(dtype)
        for r in free:
            w[r * qk : (r + 1) * qk] = init((qk, d))
        return w

    v = torch.eye(vd, d, dtype=dtype).repeat(n_h, 1)  # W^V_r = (I_d; 0)
    for r in free:
        v[r * vd : (r + 1) * vd] = init((vd, d))
    out = {
        "q.weight": qk_weight(),
        "q.bias": torch.zeros(n_h * qk, dtype=dtype),
        "k.weight": qk_weight(),
        "k.bias": torch.zeros(n_h * qk, dtype=dtype),
        "v.weight": v,
        "v.bias": torch.zeros(n_h * vd, dtype=dtype),
        "proj.weight": proj.reshape(d, n_h * vd),
        "proj.bias": (torch.zeros(cfg.hidden_chans, dtype=dtype) if bias is None else bias).repeat(p * p),
    }
    return out | positional_attention(cfg, heads, plan.spec.margin, dtype)


def positional_attention(
    cfg: ViTConfig,
    heads: Sequence[tuple[int, int] | None],
    margin: float = DEFAULT_MARGIN,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Where each head of an attention layer looks (names relative to ``attn.``): ``rel_pos_bias``
    (heads, 2Gh-1, 2Gw-1) with the pinning logit M at head r's offset ``heads[r]`` (Lemma 2),
    ``sink`` (S for a pinned head, 0 for a free one: not pulled to its sink, one more key among N)
    and, with gated pinning, ``gate`` (0 pinned: fully positional; 1 free: fully content) and a
    zero ``content_bias``."""
    gh, gw = cfg.grid_size
    m, s = pinning_logits(cfg.num_patches, bool(cfg.sink), margin)
    table = torch.zeros(len(heads), 2 * gh - 1, 2 * gw - 1, dtype=dtype)
    for r, pinned in enumerate(heads):  # one entry per pinned head
        if pinned is not None:
            table[r, pinned[0] + gh - 1, pinned[1] + gw - 1] = m
    out = {"rel_pos_bias": table}
    if cfg.sink:
        out["sink"] = torch.tensor([0.0 if o is None else s for o in heads], dtype=dtype)
    if cfg.pinning == "gated":
        out["gate"] = torch.tensor([float(o is None) for o in heads], dtype=dtype)
        out["content_bias"] = torch.zeros_like(table)
    return out


def convert_state_dict(
    conv_sd: Mapping[str, torch.Tensor],
    plan: ConversionPlan,
    *,
    path: object = None,
    overrides: Sequence[tuple[Sequence[Offset], torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """A conv-phase state dict -> the state dict of ``plan.config``, computing the same function.

    Tensors outside the token mixers are shared, not copied. Fewer heads than the construction
    needs are refused unless ``overrides`` brings each block's kept offsets and their W^O (an
    approximate conversion, :mod:`convit_convert.approximate`).
    """
    cfg, attn_cfg = plan.source, plan.config
    if overrides is None:
        check_heads(plan, path)
    attn_cfg.validate(path)
    if attn_cfg.v_dim < cfg.embed_dim:  # type: ignore[operator]
        raise CmhsaError(
            f"v_dim {attn_cfg.v_dim} < embed_dim {cfg.embed_dim}: exactness needs v_dim >= embed_dim", path
        )
    gen = torch.Generator().manual_seed(plan.spec.seed)
    out: dict[str, torch.Tensor] = {}
    for name, t in conv_sd.items():
        if ".conv." not in name:
            out[name] = t
    for i in range(cfg.depth):
        block = convert_block(
            conv_sd[f"blocks.{i}.conv.weight"],
            conv_sd.get(f"blocks.{i}.conv.bias"),
            plan,
            generator=gen,
            **({} if overrides is None else {"offsets": overrides[i][0], "wo": overrides[i][1]}),
        )
        out.update({f"blocks.{i}.attn.{k}": v for k, v in block.items()})
    return out


def pinned_offsets(
    rel_pos_bias: torch.Tensor, sink: torch.Tensor | None = None
) -> list[tuple[int, int] | None]:
    """Read each head's pinned offset (dy, dx) back from its bias table: the argmax, if it beats
    every other entry by more than ln N (so the head attends to it alone); else None."""
    n_h, th, tw = rel_pos_bias.shape
    gh, gw = (th + 1) // 2, (tw + 1) // 2
    flat = rel_pos_bias.reshape(n_h, -1).double()
    top2 = flat.topk(min(2, flat.shape[1]), dim=1)
    result: list[tuple[int, int] | None] = []
    for h in range(n_h):
        best, idx = top2.values[h, 0].item(), int(top2.indices[h, 0])
        rival = top2.values[h, 1].item() if flat.shape[1] > 1 else -math.inf
        if sink is not None:
            rival = max(rival, float(sink[h]))
        pinned = best - rival > math.log(gh * gw)
        result.append((idx // tw - gh + 1, idx % tw - gw + 1) if pinned else None)
    return result
