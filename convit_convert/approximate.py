"""Fewer heads than the theorem needs (the paper's open problem): which offsets to keep, and W^O
refit for them, measured on calibration images.

Per block, with u the conv mixer's input on the calibration images (tokens of M patches) and
y = conv(u) − b its output, a head pinned to offset δ contributes X_δ W_δ^T, X_δ the token at
q + δ (zero outside the image, where the sink answers 0). The exact construction uses every δ ∈ Δ
with W_δ the kernel's taps. With N < |Δ| heads:

1. *Choice*, greedy by measurement: starting from Δ, drop the offset whose removal leaves the
   smallest residual ||y − Σ_{δ∈S} X_δ W_δ^T|| (taps fixed), until N remain.
2. *Refit*: W_S = argmin ||Φ_S W − y||² + λ||W − T_S||², Φ_S = [X_δ]_{δ∈S}, T_S the kept taps
   (ridge towards the taps, λ = 1e-3 · mean diag(Φ_SᵀΦ_S), float64). At W = T_S the objective is
   plain dropping's error, so on the calibration set the refit is never worse; the ridge keeps
   it at the taps where the calibration set cannot tell (fewer rows than N·d, or all of Δ kept).

Errors are relative: ||residual|| / ||y|| (Frobenius), on the calibration images.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .construct import output_projection
from .model import VisionTransformer
from .theory import patch_offsets


@dataclass
class BlockChoice:
    kept: list[tuple[int, int]]
    dropped: list[tuple[int, int]]  # in the order they were dropped (least harmful first)
    wo: torch.Tensor  # (d, len(kept), d): the refit W^O of each kept head
    drop_error: float  # relative mixer error, kept taps unchanged (plain dropping)
    refit_error: float  # relative mixer error after the least-squares refit


def neighbours(x: torch.Tensor, grid: tuple[int, int], offsets: Sequence[tuple[int, int]]) -> torch.Tensor:
    """(B, N, d) tokens -> (B·N, len(offsets), d): each patch's token at offset δ, zero outside."""
    b, n, d = x.shape
    gh, gw = grid
    r = max(max(abs(dy), abs(dx)) for dy, dx in offsets)
    padded = F.pad(x.view(b, gh, gw, d), (0, 0, r, r, r, r))
    cols = [padded[:, r + dy : r + dy + gh, r + dx : r + dx + gw] for dy, dx in offsets]
    return torch.stack(cols, 3).reshape(b * n, len(offsets), d)


def choose_block(u: torch.Tensor, y: torch.Tensor, conv_weight: torch.Tensor, model: VisionTransformer,
                 num_heads: int, ridge: float = 1e-3) -> BlockChoice:  # fmt: skip
    """Offsets and W^O for ``num_heads`` heads of one block (module docstring); float64 inside."""
    cfg = model.cfg
    offsets = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    d = cfg.embed_dim
    x = neighbours(u.double(), cfg.grid_size, offsets)  # (M, |Δ|, d)
    taps = output_projection(conv_weight.double(), cfg.patch_size, cfg.dilation, offsets).view(
        d, len(offsets), d
    )
    target = y.double().reshape(-1, d)
    parts = torch.einsum("mki,oki->kmo", x, taps)  # each offset's contribution, (|Δ|, M, d)
    norm = target.norm().clamp_min(1e-300)
    kept, dropped = list(range(len(offsets))), []
    residual = target - parts.sum(0)
    while len(kept) > num_heads:
        errs = [(residual + parts[k]).norm().item() for k in kept]
        k = kept[min(range(len(kept)), key=errs.__getitem__)]
        residual = residual + parts[k]
        kept.remove(k)
        dropped.append(k)
    phi = x[:, kept].reshape(x.shape[0], -1)  # (M, N·d)
    t = taps[:, kept].permute(1, 2, 0).reshape(-1, d)  # the kept taps, as (N·d, d)
    gram = phi.T @ phi
    lam = ridge * gram.diagonal().mean().clamp_min(1e-300)
    eye = torch.eye(gram.shape[0], dtype=gram.dtype)
    w = torch.linalg.solve(gram + lam * eye, phi.T @ target + lam * t)  # (N·d, d)
    refit = target - phi @ w
    return BlockChoice(
        kept=[offsets[k] for k in kept], dropped=[offsets[k] for k in dropped],
        wo=w.view(len(kept), d, d).permute(2, 0, 1).to(conv_weight.dtype),
        drop_error=(residual.norm() / norm).item(), refit_error=(refit.norm() / norm).item(),
    )  # fmt: skip


@torch.no_grad()
def choose(conv: VisionTransformer, num_heads: int, images: torch.Tensor) -> list[BlockChoice]:
    """Every block's choice, on the calibration ``images`` run through the conv model itself."""
    conv = conv.eval()
    x = conv.patch_embed(images.to(next(conv.parameters()).dtype))
    out = []
    for block in conv.blocks:
        u = block.norm1(x)
        y = block.conv(u) - block.conv.bias.repeat(conv.cfg.patch_size**2)  # the bias stays in proj.bias
        out.append(choose_block(u, y, block.conv.weight, conv, num_heads))
        x = block(x)
    return out
