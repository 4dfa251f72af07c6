"""Fewer heads than the theorem needs (the paper's open problem): which offsets to keep, and W^O
refit for them, measured on calibration images.

Per block, with u the conv mixer's input on the calibration images (tokens of M patches) and
y = conv(u) − b its output, a head pinned to offset δ contributes X_δ W_δ^T, X_δ the token at
q + δ (zero outside the image, where the sink answers 0). The exact construction uses every δ ∈ Δ
with W_δ the kernel's taps. With N < |Δ| heads:

1. *Choice*. ``rule="greedy"`` (by measurement): starting from Δ, drop the offset whose removal
   leaves the smallest residual ||y − Σ_{δ∈S} X_δ W_δ^T|| (taps fixed), until N remain.
   ``rule="corner"`` (the fixed rule to compare with): drop the offsets farthest from the centre
   first (the diagonals, then the sides; ties row-major), whatever the data.
2. *Refit* (``refit=True``), guarded: the calibration images are split, a quarter (``guard``) held
   back. On the rest, W_S(λ) = argmin ||Φ_S W − y||² + λ||W − T_S||², Φ_S = [X_δ]_{δ∈S}, T_S the
   kept taps (ridge towards the taps, λ = r · mean diag(Φ_SᵀΦ_S), r ∈ RIDGES, float64). On the
   held-back images each W_S(λ) and the taps are measured; the block keeps the best, so a refit is
   kept only where it beats plain dropping on images it was not fitted to (it can overfit: N·d²
   unknowns per block). At W = T_S the objective is plain dropping's error, so on the fitted images
   a kept refit is never worse either, and on the whole calibration set neither. With fewer than 2
   calibration images there is nothing to hold back: the taps are kept. ``refit=False`` keeps the
   taps: plain dropping.
3. *Whole-model guard* (:func:`guard_logits`): mixer errors compound through LayerNorm and the
   MLPs, so refits that each win on their own block can still move the logits further than plain
   dropping. While the logits on the held-back images are worse than plain dropping's, the block
   whose refit costs most there goes back to its taps.

Errors are relative: ||residual|| / ||y|| (Frobenius). :func:`heldout_errors` measures a converted
model on other images: each block's mixer on the conv model's own activations, the logits, and
top-1 against labels when there are any.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .config import ViTConfig
from .errors import CmhsaError
from .model import VisionTransformer
from .options.conversion import RULES
from .options.operations import CalibrationSource
from .taps import output_projection
from .theory import patch_offsets


@dataclass
class BlockChoice:
    kept: list[tuple[int, int]]
    dropped: list[tuple[int, int]]  # in the order they were dropped (greedy: least harmful first)
    steps: list[float]  # relative mixer error (taps unchanged) after each drop, in that order: the why
    wo: torch.Tensor  # (d, len(kept), d): W^O of each kept head (refit, or the taps)
    drop_error: float  # relative mixer error, kept taps unchanged (plain dropping), calibration set
    refit_error: float  # relative mixer error with ``wo``, calibration set (= drop_error with the taps)
    refit_kept: bool = False  # the refit beat the taps on the held-back images, so ``wo`` is the refit
    ridge: float | None = None  # r of the kept refit's λ = r · mean diag(ΦᵀΦ)
    guard_drop_error: float | None = None  # held-back calibration images: the taps
    guard_refit_error: float | None = None  # held-back calibration images: the best refit
    taps: torch.Tensor | None = None  # (d, len(kept), d): the kept taps, to fall back to

    def reverted(self) -> BlockChoice:
        """This choice with the taps instead of the refit (plain dropping)."""
        if not self.refit_kept:
            return self
        return dataclasses.replace(
            self, wo=self.taps, refit_error=self.drop_error, refit_kept=False, ridge=None
        )


def neighbours(x: torch.Tensor, grid: tuple[int, int], offsets: Sequence[tuple[int, int]]) -> torch.Tensor:
    """(B, N, d) tokens -> (B·N, len(offsets), d): each patch's token at offset δ, zero outside."""
    b, n, d = x.shape
    gh, gw = grid
    r = max(max(abs(dy), abs(dx)) for dy, dx in offsets)
    padded = F.pad(x.view(b, gh, gw, d), (0, 0, r, r, r, r))
    cols = [padded[:, r + dy : r + dy + gh, r + dx : r + dx + gw] for dy, dx in offsets]
    return torch.stack(cols, 3).reshape(b * n, len(offsets), d)


def drop_order(
    parts: torch.Tensor, target: torch.Tensor, offsets: Sequence[tuple[int, int]], rule: str, num_heads: int
) -> tuple[list[int], list[float]]:
    """Indices into ``offsets`` to drop, in order, down to ``num_heads`` kept, and the relative
    residual after each drop. ``parts``: (|Δ|, M, d) each offset's contribution to ``target``."""
    norm = target.norm().clamp_min(1e-300)
    residual = target - parts.sum(0)
    kept, order, steps = list(range(len(offsets))), [], []
    corner = sorted(kept, key=lambda k: (-max(map(abs, offsets[k])), -sum(map(abs, offsets[k])), k))
    while len(kept) > num_heads:
        if rule == "greedy":
            errs = [(residual + parts[k]).norm().item() for k in kept]
            k = kept[min(range(len(kept)), key=errs.__getitem__)]
        else:
            k = corner[len(order)]
        residual = residual + parts[k]
        kept.remove(k)
        order.append(k)
        steps.append((residual.norm() / norm).item())
    return order, steps


RIDGES = (1e-3, 1e-2, 1e-1, 1.0)  # r in λ = r · mean diag(ΦᵀΦ), chosen on the held-back images
GUARD = 0.25  # the share of calibration images held back to judge the refit


def held_back(images: int, guard: float = GUARD) -> int:
    """How many of ``images`` calibration images are held back to judge the refit (the last ones):
    a ``guard`` share, at least one, and none when there is only one image."""
    return min(images - 1, max(1, round(guard * images)))


@dataclass
class BlockProblem:
    """One block on the calibration images, computed once for every head count: each offset's
    neighbour tokens, the kernel's taps, the target, and the drop sequence down to ``down_to``
    heads (the sequence for N heads is its prefix: each drop depends only on those before it)."""

    offsets: list[tuple[int, int]]
    x: torch.Tensor  # (M, |Δ|, d) each patch's neighbour tokens, rows image-major, float64
    taps: torch.Tensor  # (d, |Δ|, d) the kernel's W^O, float64
    target: torch.Tensor  # (M, d) the mixer's output less its bias
    order: list[int]  # indices into ``offsets``, in the order they are dropped
    steps: list[float]  # relative error after each drop (taps kept)
    images: int  # B: M = B · patches
    dtype: torch.dtype  # the conv weight's: W^O comes back in it

    @classmethod
    def build(
        cls,
        u: torch.Tensor,
        y: torch.Tensor,
        conv_weight: torch.Tensor,
        cfg: ViTConfig,
        rule: str,
        down_to: int,
    ) -> BlockProblem:
        """``u`` (B, N, d) the mixer's input on B calibration images, ``y`` its output less the bias."""
        offsets = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
        d = cfg.embed_dim
        x = neighbours(u.double(), cfg.grid_size, offsets)
        taps = output_projection(conv_weight.double(), cfg.patch_size, cfg.dilation, offsets).view(
            d, len(offsets), d
        )
        target = y.double().reshape(-1, d)
        parts = torch.einsum("mki,oki->kmo", x, taps)  # each offset's contribution, (|Δ|, M, d)
        order, steps = drop_order(parts, target, offsets, rule, down_to)
        return cls(offsets, x, taps, target, order, steps, u.shape[0], conv_weight.dtype)

    def choice(self, num_heads: int, refit: bool = True, guard: float = GUARD) -> BlockChoice:
        """Offsets and W^O for ``num_heads`` heads (module docstring)."""
        drops = len(self.offsets) - num_heads
        if drops > len(self.order):
            raise ValueError(f"the drop sequence stops at {len(self.offsets) - len(self.order)} heads")
        dropped = self.order[:drops]
        kept = [k for k in range(len(self.offsets)) if k not in dropped]
        d, target = self.target.shape[1], self.target
        t = self.taps[:, kept].permute(1, 2, 0).reshape(-1, d)  # the kept taps, as (N·d, d)
        phi = self.x[:, kept].reshape(self.x.shape[0], -1)  # (M, N·d)

        def rel(w: torch.Tensor, rows: slice = slice(None)) -> float:
            return ((target[rows] - phi[rows] @ w).norm() / target[rows].norm().clamp_min(1e-300)).item()

        def as_wo(w: torch.Tensor) -> torch.Tensor:
            return w.view(len(kept), d, d).permute(2, 0, 1).to(self.dtype)

        drop_error, taps = rel(t), as_wo(t)
        choice = BlockChoice(
            kept=[self.offsets[k] for k in kept],
            dropped=[self.offsets[k] for k in dropped],
            steps=self.steps[:drops],
            wo=taps,
            drop_error=drop_error,
            refit_error=drop_error,
            taps=taps,
        )
        held = held_back(self.images, guard)
        if not refit or held < 1:
            return choice
        split = (self.images - held) * (self.x.shape[0] // self.images)
        fit, back = slice(0, split), slice(split, None)
        gram, rhs = phi[fit].T @ phi[fit], phi[fit].T @ target[fit]
        scale = gram.diagonal().mean().clamp_min(1e-300)
        eye = torch.eye(gram.shape[0], dtype=gram.dtype)
        fits = [(r, torch.linalg.solve(gram + r * scale * eye, rhs + r * scale * t)) for r in RIDGES]
        errors = [rel(w, back) for _, w in fits]
        best = min(range(len(fits)), key=errors.__getitem__)
        choice.guard_drop_error, choice.guard_refit_error = rel(t, back), errors[best]
        if choice.guard_refit_error < choice.guard_drop_error:  # the refit generalises: keep it
            r, w = fits[best]
            choice.wo, choice.refit_error, choice.refit_kept, choice.ridge = as_wo(w), rel(w), True, r
        return choice


@torch.no_grad()
def problems(
    conv: VisionTransformer, images: torch.Tensor, rule: str = "greedy", down_to: int = 1
) -> list[BlockProblem]:
    """Every block's problem, the calibration ``images`` run through the conv model itself once."""
    if rule not in RULES:
        raise CmhsaError(f"`rule` must be one of {', '.join(RULES)}, got {rule!r}")
    conv = conv.eval()
    x = conv.patch_embed(images.to(next(conv.parameters()).dtype))
    out = []
    for block in conv.blocks:
        u = block.norm1(x)
        y = block.conv(u) - block.conv.bias.repeat(conv.cfg.patch_size**2)  # the bias stays in proj.bias
        out.append(BlockProblem.build(u, y, block.conv.weight, conv.cfg, rule, down_to))
        x = block(x)
    return out


def choose(
    conv: VisionTransformer,
    num_heads: int,
    images: torch.Tensor,
    rule: str = "greedy",
    refit: bool = True,
    guard: float = GUARD,
) -> list[BlockChoice]:
    """Every block's choice for ``num_heads`` heads, on the calibration ``images``."""
    return [p.choice(num_heads, refit, guard) for p in problems(conv, images, rule, num_heads)]


def guard_logits(
    conv: VisionTransformer,
    blocks: list[BlockChoice],
    images: torch.Tensor,
    build: Callable[[list[BlockChoice]], VisionTransformer],
) -> tuple[list[BlockChoice], float, float]:
    """The refit guarded on the whole model: while the logits' relative error on the held-back
    ``images`` is above plain dropping's (every block on its taps), put back the taps in the block
    whose refit costs the most there. Mixer errors compound through LayerNorm and the MLPs, so
    refits that each beat the taps on their own block can still move the logits further. Returns
    the choices and the logits errors (plain dropping, the choices kept); ``build`` makes the
    attention model of a list of choices."""

    def error(choices: list[BlockChoice]) -> float:
        return heldout_errors(conv, build(choices), images).logits_error

    drop, kept = error([b.reverted() for b in blocks]), error(blocks)
    while kept > drop:  # ends: with every refit reverted the model is plain dropping's
        trials = [
            (error(trial), trial)
            for i, b in enumerate(blocks)
            if b.refit_kept
            for trial in [[*blocks[:i], b.reverted(), *blocks[i + 1 :]]]
        ]
        kept, blocks = min(trials, key=lambda t: t[0])
    return blocks, drop, kept


@dataclass
class HeldOut:
    """A converted model against its conv model on held-out images."""

    images: int
    mixer_errors: list[float]  # per block: relative error of the attention mixer on the conv's activations
    logits_error: float  # relative error of the logits (Frobenius)
    conv_top1: float | None  # percent, with labels
    attn_top1: float | None

    @property
    def accuracy_drop(self) -> float | None:
        return None if self.conv_top1 is None else self.conv_top1 - self.attn_top1  # type: ignore[operator]

    def to_dict(self) -> dict[str, object]:
        return {
            "images": self.images,
            "mixer_errors": self.mixer_errors,
            "logits_error": self.logits_error,
            "conv_top1": self.conv_top1,
            "attn_top1": self.attn_top1,
            "accuracy_drop": self.accuracy_drop,
        }


@torch.no_grad()
def heldout_errors(
    conv: VisionTransformer,
    attn: VisionTransformer,
    images: torch.Tensor,
    labels: torch.Tensor | None = None,
    batch: int = 256,
) -> HeldOut:
    """Each block's mixer (fed the conv model's own activations, so errors do not compound), the
    logits, and top-1 with ``labels``; on float32 copies of both models (the errors measured here
    are those of dropped heads, orders above float32's rounding), sums in float64."""
    conv, attn = copy.deepcopy(conv).eval().float(), copy.deepcopy(attn).eval().float()
    sq = [[0.0, 0.0] for _ in conv.blocks]
    lg, correct_c, correct_a = [0.0, 0.0], 0, 0
    for i in range(0, len(images), batch):
        x = conv.patch_embed(images[i : i + batch].float())
        for k, (cb, ab) in enumerate(zip(conv.blocks, attn.blocks, strict=True)):
            u = cb.norm1(x)
            ref = cb.conv(u)
            sq[k][0] += (ab.attn(u) - ref).double().square().sum().item()
            sq[k][1] += ref.double().square().sum().item()
            x = cb(x)
        lc = conv.forward_head(conv.norm(x))
        la = attn(images[i : i + batch].float())
        lg[0] += (la - lc).double().square().sum().item()
        lg[1] += lc.double().square().sum().item()
        if labels is not None:
            y = labels[i : i + batch]
            correct_c += (lc.argmax(-1) == y).sum().item()
            correct_a += (la.argmax(-1) == y).sum().item()
    n = len(images)
    top = (lambda c: 100.0 * c / n) if labels is not None else (lambda c: None)
    return HeldOut(
        n,
        [(a / max(b, 1e-300)) ** 0.5 for a, b in sq],
        (lg[0] / max(lg[1], 1e-300)) ** 0.5,
        top(correct_c),
        top(correct_a),
    )


@dataclass
class Calibration:
    """Images to choose and refit on, and held-out images (with labels, if any) to measure on."""

    images: torch.Tensor  # (M, C, H, W), preprocessed as the model expects
    heldout: torch.Tensor
    labels: torch.Tensor | None
    source: str  # what they are, for the report

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "images": len(self.images),
            "heldout_images": len(self.heldout),
            "labelled": self.labels is not None,
        }


def noise_calibration(
    cfg: ViTConfig,
    images: int = CalibrationSource.calib_images,
    heldout: int = CalibrationSource.heldout_images,
    seed: int = 0,
) -> Calibration:
    """Standard normal images: the statistics of normalised inputs (mean 0, std 1 per channel)."""
    CalibrationSource(calib_images=images, heldout_images=heldout, seed=seed)  # their ranges
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.in_chans, *cfg.img_size)
    return Calibration(
        torch.randn(images, *shape, generator=g),
        torch.randn(heldout, *shape, generator=g),
        None,
        "synthetic N(0, 1) images (normalised-input statistics)",
    )


@dataclass
class Approximation:
    """What an approximate conversion kept and dropped per block, and what it measured."""

    rule: str
    refit: bool
    calibration: str
    calib_images: int
    blocks: list[BlockChoice]
    heldout: HeldOut | None = None
    guard_images: int = 0  # calibration images held back to judge the refit
    guard_logits_drop: float | None = None  # their logits' relative error, plain dropping
    guard_logits_error: float | None = None  # and with the refits kept

    def to_dict(self) -> dict[str, object]:
        def off(o: tuple[int, int]) -> list[int]:
            return [o[0], o[1]]

        return {
            "rule": self.rule,
            "refit": self.refit,
            "calibration": self.calibration,
            "calib_images": self.calib_images,
            "guard_images": self.guard_images,
            "guard_logits_drop": self.guard_logits_drop,
            "guard_logits_error": self.guard_logits_error,
            "blocks": [
                {
                    "kept": [off(o) for o in c.kept],
                    "dropped": [off(o) for o in c.dropped],
                    "error_after_each_drop": c.steps,
                    "calib_drop_error": c.drop_error,
                    "calib_refit_error": c.refit_error,
                    "refit_kept": c.refit_kept,
                    "ridge": c.ridge,
                    "guard_drop_error": c.guard_drop_error,
                    "guard_refit_error": c.guard_refit_error,
                    "heldout_mixer_error": None if self.heldout is None else self.heldout.mixer_errors[i],
                }
                for i, c in enumerate(self.blocks)
            ],
            "heldout": None if self.heldout is None else self.heldout.to_dict(),
        }
