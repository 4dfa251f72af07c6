"""Theorem 1's W^O gathered from a K×K kernel (Appendix A.2): the kernel tap that links input pixel
s of patch q + δ to output pixel t of patch q, per axis (:func:`kernel_taps`), and the whole output
projection, as a gather (:func:`output_projection`, the conversion's: exact for any values) or as
a contraction with the taps' one-hot selectors (:func:`tap_selectors`, :func:`project`: phase 1's
token form, whose gradient is then two small dense products instead of a scatter of 10^6 entries
onto the kernel's few taps). The conversion (``construct.py``, whose docstring states the formula)
and the token form (``conv_mixer.py``) both compute through :func:`kernel_taps`: one formula."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from .theory import same_padding


def kernel_taps(deltas: Sequence[int], patch_size: int, kernel_size: int, dilation: int) -> torch.Tensor:
    """(len(deltas), P, P) tap index k[r, s, t] along one axis; ``kernel_size`` where none.

    With PyTorch's cross-correlation and 'same' padding (left = D(K-1)//2): input coordinate
    (q+δ)·P + s, output coordinate q·P + t, tap k = (δ·P + s - t + left) / D where that is an
    integer in [0, K)."""
    p = patch_size
    left, _ = same_padding(kernel_size, dilation)
    delta = torch.tensor(list(deltas), dtype=torch.long).view(-1, 1, 1)
    s = torch.arange(p).view(1, -1, 1)
    t = torch.arange(p).view(1, 1, -1)
    num = delta * p + s - t + left
    k = torch.div(num, dilation, rounding_mode="floor")
    hit = (num % dilation == 0) & (k >= 0) & (k < kernel_size)
    return torch.where(hit, k, kernel_size)


def output_projection(
    weight: torch.Tensor, patch_size: int, dilation: int, offsets: Sequence[tuple[int, int]]
) -> torch.Tensor:
    """W^O from a conv kernel, by gathering (no loop over entries).

    weight: (C_out, C_in, K, K) as nn.Conv2d. Returns (P²·C_out, N_H·P²·C_in), rows (t, j), columns
    (r, s, i), where head r reads the patch at offset ``offsets[r]``.
    """
    c_out, c_in, k, k2 = weight.shape
    if k != k2:
        raise ValueError(f"square kernels only, got {k}x{k2}")
    p, n_h = patch_size, len(offsets)
    ky = kernel_taps([o[0] for o in offsets], p, k, dilation)  # (r, s_y, t_y)
    kx = kernel_taps([o[1] for o in offsets], p, k, dilation)  # (r, s_x, t_x)
    w = F.pad(weight, (0, 1, 0, 1)).permute(2, 3, 0, 1)  # (K+1, K+1, C_out, C_in); tap K is zero
    iy = ky.permute(2, 0, 1)[:, None, :, :, None]  # (t_y, 1, r, s_y, 1)
    ix = kx.permute(2, 0, 1)[None, :, :, None, :]  # (1, t_x, r, 1, s_x)
    wo = w[iy, ix]  # (t_y, t_x, r, s_y, s_x, C_out, C_in)
    return wo.permute(0, 1, 5, 2, 3, 4, 6).reshape(p * p * c_out, n_h * p * p * c_in)


def tap_selectors(
    offsets: Sequence[tuple[int, int]], patch_size: int, kernel_size: int, dilation: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kernel_taps` as one-hot float64 selectors (N_Δ, P, P, K): ``E[r, s, t, k]`` is 1 where
    tap k links input pixel s of the patch at ``offsets[r]`` to output pixel t, per axis (y, x)."""
    out = []
    for axis in (0, 1):
        taps = kernel_taps([o[axis] for o in offsets], patch_size, kernel_size, dilation)
        out.append(F.one_hot(taps, kernel_size + 1)[..., :kernel_size].double())  # tap K: none
    return out[0], out[1]


def project(weight: torch.Tensor, ey: torch.Tensor, ex: torch.Tensor) -> torch.Tensor:
    """The columns of :func:`output_projection` of ``weight`` (C_out, C_in, K, K) that M input
    pixels read, through their rows of :func:`tap_selectors` (``ey``, ``ex``: (M, P, K), pixel m's
    E[r_m, s_m]), as two contractions (float64, so each entry is its tap exactly, whatever TF32 or
    autocast is on): (P²·C_out, M·C_in), rows (t, j), columns (m, i). Only the columns a product
    reads are built, so its gradient reaches the kernel without a scatter."""
    c_out, c_in = weight.shape[:2]
    m, p = ey.shape[:2]
    w = weight.double().permute(2, 3, 0, 1)  # (K, K, C_out, C_in): (a, b, j, i)
    a = torch.einsum("mta,abji->mtbji", ey, w)  # the y taps: (m, t_y, b, j, i)
    wo = torch.einsum("mub,mtbji->tujmi", ex, a)  # the x taps: (t_y, t_x, j, m, i)
    return wo.reshape(p * p * c_out, m * c_in)
