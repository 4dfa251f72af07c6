"""timm's Mixup/CutMix for a stack of seeds: each seed's draws from its own RNG, applied to every
seed's batch at once.

timm's ``Mixup`` (mode ``batch``, the recipe's) draws one lambda per batch, and for CutMix one box,
from numpy's global RNG, then mixes the batch with itself flipped and mixes the one-hot targets
alike (``mixup_target``). A stack draws those per seed, under each seed's RNG
(:func:`draw`, host work only), and :func:`mixed` applies all seeds' draws with one set of tensor
ops instead of S: each seed's images and targets are the values timm's call computes for it
(the same elementwise products and sums; tests/test_stacked.py compares a stack against separate
runs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from timm.data import Mixup
from timm.data.mixup import cutmix_bbox_and_lam, one_hot


@dataclass(frozen=True)
class Draw:
    """One batch's Mixup/CutMix choice: ``lam`` 1 leaves it as it is; ``box`` (top, bottom, left,
    right) pastes that region of the flipped batch (CutMix), else the two are blended by ``lam``."""

    lam: float
    box: tuple[int, int, int, int] | None


def drawable(mixup: Mixup) -> bool:
    """Whether this timm's Mixup has the draw :func:`draw` replays (a private method: a release
    without it is mixed seed by seed, by its own call)."""
    return callable(getattr(mixup, "_params_per_batch", None))


def draw(mixup: Mixup, shape: tuple[int, ...]) -> Draw:
    """timm's draws for one batch of ``shape`` (B, C, H, W), from the global numpy RNG, in the order
    ``Mixup.__call__`` makes them (``_params_per_batch``, then CutMix's box)."""
    lam, use_cutmix = getattr(mixup, "_params_per_batch")()  # noqa: B009  (drawable() checked it)
    if lam == 1.0 or not use_cutmix:
        return Draw(lam, None)
    box, lam = cutmix_bbox_and_lam(
        shape, lam, ratio_minmax=mixup.cutmix_minmax, correct_lam=mixup.correct_lam
    )
    return Draw(lam, tuple(int(v) for v in box))


def mixed(
    mixup: Mixup, draws: list[Draw], images: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(S, B, C, H, W) images and (S, B) labels, seed i mixed as ``draws[i]`` says -> the mixed
    images and (S, B, classes) soft targets, as timm's ``Mixup.__call__`` gives each seed's batch."""
    seeds, _, _, h, w = images.shape
    dev, dtype = images.device, images.dtype
    flipped = images.flip(1)  # each seed's batch reversed, as timm's x.flip(0)
    lam = torch.tensor([d.lam for d in draws], dtype=dtype).view(seeds, 1, 1, 1, 1).to(dev)
    rest = torch.tensor([1.0 - d.lam for d in draws], dtype=dtype).view(seeds, 1, 1, 1, 1).to(dev)
    blend = torch.tensor([d.lam != 1.0 and d.box is None for d in draws]).view(seeds, 1, 1, 1, 1).to(dev)
    boxes = torch.tensor([d.box or (0, 0, 0, 0) for d in draws]).to(dev)  # (S, 4); empty: none
    rows, cols = torch.arange(h, device=dev), torch.arange(w, device=dev)
    inside_rows = (rows >= boxes[:, :1]) & (rows < boxes[:, 1:2])  # (S, H)
    inside_cols = (cols >= boxes[:, 2:3]) & (cols < boxes[:, 3:4])  # (S, W)
    pasted = (inside_rows[:, :, None] & inside_cols[:, None, :])[:, None, None]  # (S, 1, 1, H, W)
    out = torch.where(pasted, flipped, torch.where(blend, images * lam + flipped * rest, images))
    # timm's mixup_target: one-hot (smoothed) targets of the batch and of it flipped, by lam
    classes, smoothing = mixup.num_classes, mixup.label_smoothing
    off = smoothing / classes
    on = 1.0 - smoothing + off
    y1 = one_hot(labels, classes, on_value=on, off_value=off)  # (S·B, classes)
    y2 = one_hot(labels.flip(1), classes, on_value=on, off_value=off)  # each seed's batch reversed
    target_lam, target_rest = lam.view(seeds, 1, 1).to(y1.dtype), rest.view(seeds, 1, 1).to(y1.dtype)
    targets = y1.view(seeds, -1, classes) * target_lam + y2.view(seeds, -1, classes) * target_rest
    return out, targets
