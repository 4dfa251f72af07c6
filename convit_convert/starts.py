r"""Phase-2 starts without a conv phase: attention given a convolution's bias by its first weights alone.

Weight orientation as ``nn.Linear`` stores it: head h's query and key maps W_Q,h, W_K,h are
(qk_dim, d), its value map W_V,h is (v_dim, d) and its block of the output projection W_O,h is
(d, v_dim). The logit between tokens x_q and x_k is x_q W_Q,hᵀ W_K,h x_kᵀ / sqrt(qk_dim), and a
token attending only to itself comes out as x Σ_h W_V,hᵀ W_O,hᵀ. These two d × d products are what
the mimetic paper calls W_q W_kᵀ and W_v W_proj.

**mimetic** (Trockman & Kolter, "Mimetic Initialization of Self-Attention Layers", ICML 2023):

    per head h:   W_Q,hᵀ W_K,h       = α (Z_h + I)        (rank min(qk_dim, d): the top singular part)
    whole layer:  Σ_h W_V,hᵀ W_O,hᵀ  = β (Z − I)
    Z_h, Z with i.i.d. N(0, 1/d) entries; the paper's α₁ = β₁ = α and α₂ = β₂ = β.

Each product is factored by its SVD, U S Vᵀ: W_Q,h = sqrt(S) Uᵀ, W_K,h = sqrt(S) Vᵀ, and the value
product's singular pairs go round-robin to the heads (pair i to head i mod heads), so the heads
split the value space as a ViT's heads split its d columns. Query, key and value biases are zero.
Locality: the paper's ViT gets it from absolute position embeddings P (identity W_Q W_Kᵀ turns
P Pᵀ into a bump around each query). This model has no absolute position, only the relative
position bias, so the bump is put there directly: every head starts at

    rel_pos_bias_h[δ] = −‖δ‖² / (2σ²),  σ = 1 patch        (:data:`MIMETIC_SIGMA`)

a Gaussian over patch offsets: a neighbour gets e^−½ of the query patch's weight from position
alone, two patches away e^−2. Content (α I) then favours similar tokens within that bump.

**impulse** (Zheng, Li & Lucey, "Structured Initialization for Attention in Vision Transformers",
2024-25): each head's attention map starts as one impulse inside the K×K window. Here: the
conversion's positional part (:func:`~convit_convert.construct.positional_attention`: a pinning
logit at head r's offset, the sink, and with gated pinning a gate at 0, so content attention can
take over), and every other weight left at the model's random init. ``offsets="conversion"``
pins head r to Δ's r-th offset, as a converted model (extra heads free); ``"random"`` pins every
head to an offset drawn uniformly from Δ (repeats allowed), as the impulse paper's random filters.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .config import ViTConfig
from .construct import positional_attention
from .errors import CmhsaError
from .model import VisionTransformer
from .options.conversion import DEFAULT_MARGIN, pinned_heads
from .options.values import IMPULSE_OFFSETS
from .theory import patch_offsets

MIMETIC_SIGMA = 1.0  # width of the local decay the relative position bias starts as, in patches


def factor(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(L, R), each (rank, d), with Lᵀ R the best rank-``rank`` approximation of the d × d ``m``
    (exactly ``m`` when rank ≥ d; rows past d are zero)."""
    u, s, vh = torch.linalg.svd(m)
    k = min(rank, m.shape[0])
    left, right = m.new_zeros(rank, m.shape[0]), m.new_zeros(rank, m.shape[0])
    left[:k] = s[:k].sqrt()[:, None] * u[:, :k].T
    right[:k] = s[:k].sqrt()[:, None] * vh[:k]
    return left, right


def local_decay(cfg: ViTConfig, sigma: float = MIMETIC_SIGMA) -> torch.Tensor:
    """(heads, 2Gh-1, 2Gw-1): −‖δ‖² / (2σ²) at every relative offset δ = (dy, dx), for every head."""
    gh, gw = cfg.grid_size
    dy = torch.arange(-(gh - 1), gh, dtype=torch.float64)[:, None]
    dx = torch.arange(-(gw - 1), gw, dtype=torch.float64)[None, :]
    table = -(dy**2 + dx**2) / (2 * sigma**2)
    return table.expand(cfg.num_heads, -1, -1).clone()


def mimetic_block(
    cfg: ViTConfig, alpha: float, beta: float, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """One attention layer's mimetic tensors (names relative to ``attn.``; module docstring)."""
    d, h, qk, vd = cfg.embed_dim, cfg.num_heads, cfg.qk_dim, cfg.v_dim
    eye = torch.eye(d, dtype=torch.float64)

    def z() -> torch.Tensor:
        return torch.randn(d, d, generator=generator, dtype=torch.float64) / math.sqrt(d)

    q, k = torch.zeros(h * qk, d, dtype=torch.float64), torch.zeros(h * qk, d, dtype=torch.float64)
    for head in range(h):
        q[head * qk : (head + 1) * qk], k[head * qk : (head + 1) * qk] = factor(alpha * (z() + eye), qk)
    # Σ_h W_V,hᵀ W_O,hᵀ = Σ_i s_i u_i v_iᵀ: pair i is row (i // h) of head (i % h)'s W_V and column of its W_O
    left, right = factor(beta * (z() - eye), d)
    v, proj = torch.zeros(h, vd, d, dtype=torch.float64), torch.zeros(d, h, vd, dtype=torch.float64)
    for i in range(min(d, h * vd)):
        v[i % h, i // h] = left[i]
        proj[:, i % h, i // h] = right[i]
    out = {
        "q.weight": q,
        "k.weight": k,
        "v.weight": v.reshape(h * vd, d),
        "proj.weight": proj.reshape(d, h * vd),
        "q.bias": torch.zeros(h * qk),
        "k.bias": torch.zeros(h * qk),
        "v.bias": torch.zeros(h * vd),
        "rel_pos_bias": local_decay(cfg),
    }
    return {name: t.float() for name, t in out.items()}


def impulse_block(
    cfg: ViTConfig, offsets: str, margin: float, generator: torch.Generator
) -> tuple[dict[str, torch.Tensor], list[tuple[int, int] | None]]:
    """One attention layer's positional tensors pinned to impulses (module docstring), and each
    head's offset (None: a free head)."""
    window = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    if offsets == "random":
        draw = torch.randint(len(window), (cfg.num_heads,), generator=generator).tolist()
        chosen = [window[i] for i in draw]
    else:
        chosen = window[: cfg.num_heads]
    heads = pinned_heads(cfg, chosen)
    return positional_attention(cfg, heads, margin), heads


def check_start(init: str, pinning: str | None, impulse_offsets: str) -> None:
    """Refuse a start this module cannot build, in one line."""
    if init not in ("mimetic", "impulse"):
        raise CmhsaError(f"`init` {init!r} is not a start: mimetic or impulse")
    if init == "mimetic" and pinning == "gated":
        raise CmhsaError(
            "`init` mimetic starts locality in the relative position bias of hard "
            "pinning; give `pinning` hard"
        )
    if impulse_offsets not in IMPULSE_OFFSETS:
        raise CmhsaError(
            f"`impulse_offsets` must be one of {', '.join(IMPULSE_OFFSETS)}, got {impulse_offsets!r}"
        )


def start_model(
    model: VisionTransformer,
    init: str,
    *,
    seed: int,
    mimetic_alpha: float = math.nan,
    mimetic_beta: float = math.nan,
    impulse_offsets: str = "conversion",
    margin: float = DEFAULT_MARGIN,
) -> dict[str, Any]:
    """Overwrite a freshly initialised attention model's attention tensors with the ``init`` start
    ("mimetic" or "impulse"); return what was done, for config.json. Everything else keeps its
    random init. Deterministic in ``seed``. Mimetic needs both α and β (TrainConfig.start has the
    defaults)."""
    cfg = model.cfg
    if cfg.kind != "attn":
        raise CmhsaError(f"`init` {init} starts an attention model, not a {cfg.kind} one")
    check_start(init, cfg.pinning, impulse_offsets)
    if init == "mimetic" and not (mimetic_alpha >= 0 and mimetic_beta >= 0):  # also refuses NaN: not given
        raise CmhsaError(f"`init` mimetic needs α, β >= 0, got {mimetic_alpha}, {mimetic_beta}")
    generator = torch.Generator().manual_seed(seed)
    info: dict[str, Any] = {"init": init}
    pinned = []
    for block in model.blocks:
        if init == "mimetic":
            tensors = mimetic_block(cfg, mimetic_alpha, mimetic_beta, generator)
        else:
            tensors, heads = impulse_block(cfg, impulse_offsets, margin, generator)
            pinned.append([None if o is None else list(o) for o in heads])
        state = block.attn.state_dict()
        state.update({name: t.to(state[name].dtype) for name, t in tensors.items()})
        block.attn.load_state_dict(state)
    if init == "mimetic":
        info.update(
            mimetic_alpha=mimetic_alpha, mimetic_beta=mimetic_beta, locality_sigma_patches=MIMETIC_SIGMA
        )
    else:
        info.update(impulse_offsets=impulse_offsets, margin=margin, pinned=pinned)
    return info
