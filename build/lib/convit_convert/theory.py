"""How many attention heads a K×K convolution needs, as code (no torch import).

Notation follows "Can Vision Transformers Perform Convolution?" (the paper):
K kernel size, D dilation, P patch size, N_H number of heads, d = P²·C token width.

PyTorch's ``padding='same'`` pads ``left = D(K-1)//2`` pixels before and ``right = D(K-1) - left``
after, so output pixel ``y`` reads input pixels ``y - left .. y + right`` (in steps of D). A pixel in
patch ``g`` (pixels ``gP .. gP+P-1``) therefore reads patches ``g + δ`` for

    δ ∈ [-ceil(left / P), +ceil(right / P)]                                   (per axis)

which is the paper's Eq. (5)/(13) receptive field ``[-ceil((K-1)/2P), ceil((K-1)/2P)]²`` for odd K
and D = 1, made exact for even K (asymmetric padding). With dilation D > P some offsets in that
range are skipped, so Δ is computed as the set of offsets actually touched. Theorem 1 assigns one
head to each, so ``heads_needed = |Δ|``: 9 for 3 ≤ K < 2P, K² for pixel input (P = 1, Corollary 3,
any dilation), 1 for K = 1, 4 for K = 2 (PyTorch pads K = 2 on one side only).

Lower bounds (rank arguments):

* Theorem 6 (patch input): if the dilated kernel fits inside one patch (P ≥ D(K-1)+1), two pixels
  at the same position of different patches are never both in one output pixel's receptive field,
  so every touched offset needs its own head: N_H ≥ |Δ| (= 9 for K ≥ 3). The paper states it for
  D = 1 and |Δ| = 9; the same proof gives the general form used here.
* Theorem 5 (pixel input, P = 1): N_H ≥ min(K², d).
* Otherwise (1 < P < D(K-1)+1) the paper proves no matching bound; |Δ| heads are sufficient.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HeadCount",
    "axis_offsets",
    "head_count",
    "heads_needed",
    "offset_tap_share",
    "patch_offsets",
    "same_padding",
]


def same_padding(kernel_size: int, dilation: int = 1) -> tuple[int, int]:
    """Pixels PyTorch's ``padding='same'`` adds before and after, per axis."""
    total = dilation * (kernel_size - 1)
    return total // 2, total - total // 2


def axis_reads(kernel_size: int, patch_size: int, dilation: int = 1) -> dict[int, int]:
    """Per patch offset one axis of the kernel touches, floor((t - left + D·k) / P), how many
    (pixel t ∈ [0, P), tap k ∈ [0, K)) pairs read from it."""
    left, _ = same_padding(kernel_size, dilation)
    count: dict[int, int] = {}
    for t in range(patch_size):
        for k in range(kernel_size):
            o = (t - left + dilation * k) // patch_size
            count[o] = count.get(o, 0) + 1
    return count


def axis_offsets(kernel_size: int, patch_size: int, dilation: int = 1) -> list[int]:
    """Patch offsets one axis of the kernel touches (:func:`axis_reads`). Contiguous,
    [-ceil(left/P), ceil(right/P)], when D ≤ P."""
    return sorted(axis_reads(kernel_size, patch_size, dilation))


def offset_tap_share(kernel_size: int, patch_size: int, dilation: int = 1) -> dict[tuple[int, int], float]:
    """The share of the (output pixel, kernel tap) pairs of a patch that read from the patch at
    each offset δ: what a head pinned to δ carries, and what dropping it loses when the taps are
    of equal size. Separable: the product of the two axes' shares."""
    count = axis_reads(kernel_size, patch_size, dilation)
    total = patch_size * kernel_size
    return {(dy, dx): count[dy] * count[dx] / total**2 for dy in sorted(count) for dx in sorted(count)}


def patch_offsets(kernel_size: int, patch_size: int, dilation: int = 1) -> list[tuple[int, int]]:
    """The receptive-field offsets Δ as (dy, dx), row-major: head h of a converted layer pins δ_h."""
    axis = axis_offsets(kernel_size, patch_size, dilation)
    return [(dy, dx) for dy in axis for dx in axis]


def heads_needed(kernel_size: int, patch_size: int, dilation: int = 1) -> int:
    """|Δ|: the heads Theorem 1's construction uses for this kernel and patch size."""
    return len(axis_offsets(kernel_size, patch_size, dilation)) ** 2


@dataclass(frozen=True)
class HeadCount:
    """Heads needed for a K×K convolution, and the theorems behind the numbers."""

    kernel_size: int
    patch_size: int
    dilation: int
    offsets: list[tuple[int, int]]
    patch_heads: int  # |Δ| with patch input, sufficient by Theorem 1
    patch_lower_bound: int | None  # proven necessary with patch input, None where unproven
    patch_reason: str
    pixel_heads: int  # K² with pixel input, sufficient by Corollary 3
    pixel_lower_bound: int | None  # proven necessary with pixel input given channels, else None
    pixel_reason: str

    @property
    def extent(self) -> int:
        """Pixels the dilated kernel spans: D(K-1) + 1."""
        return self.dilation * (self.kernel_size - 1) + 1


def head_count(
    kernel_size: int, patch_size: int, dilation: int = 1, channels: int | None = None
) -> HeadCount:
    """Sufficient and necessary head counts with patch input and with pixel input.

    ``channels`` is the pixel feature width C; Theorem 5's pixel-input bound is min(K², C), so
    without it the bound is reported for C ≥ K².
    """
    if kernel_size < 1 or patch_size < 1 or dilation < 1:
        raise ValueError("kernel size, patch size and dilation must be positive")
    offsets = patch_offsets(kernel_size, patch_size, dilation)
    n = len(offsets)
    extent = dilation * (kernel_size - 1) + 1
    if kernel_size == 1:
        patch_lb, patch_reason = 1, "a 1×1 kernel reads only its own patch: 1 head, and 1 is needed"
    elif patch_size >= extent:
        patch_lb = n
        patch_reason = (
            f"Theorem 1: {n} heads suffice; Theorem 6: fewer cannot express every kernel, "
            f"since the kernel's extent {extent} ≤ P = {patch_size}"
        )
    elif patch_size == 1:
        patch_lb = None  # filled from the pixel-input bound below
        patch_reason = ""
    else:
        patch_lb = None
        patch_reason = (
            f"Theorem 1: {n} heads suffice; no lower bound is proven when the kernel's extent "
            f"{extent} exceeds P = {patch_size} (Theorem 6 needs P ≥ K)"
        )
    k2 = kernel_size * kernel_size
    pixel_lb = k2 if channels is None else min(k2, channels)
    cond = "" if channels is None else f" with C = {channels} channels"
    pixel_reason = (
        f"Corollary 3: K² = {k2} heads suffice; Theorem 5: fewer than min(K², C) = {pixel_lb} cannot{cond}"
    )
    if kernel_size == 1:
        pixel_lb, pixel_reason = 1, "a 1×1 kernel reads only its own pixel: 1 head"
    if patch_size == 1:  # patch input with P = 1 is pixel input
        patch_lb, patch_reason = pixel_lb, pixel_reason
    return HeadCount(
        kernel_size=kernel_size,
        patch_size=patch_size,
        dilation=dilation,
        offsets=offsets,
        patch_heads=n,
        patch_lower_bound=patch_lb,
        patch_reason=patch_reason,
        pixel_heads=k2,
        pixel_lower_bound=pixel_lb,
        pixel_reason=pixel_reason,
    )
