r"""Phase 1's token mixer: a K×K convolution over the pixel view of the tokens, computed one of two
ways, the same function either way (``form``):

- ``"pixels"``: tokens -> pixels, ``F.conv2d(padding='same', dilation=D)``, pixels -> tokens.
- ``"tokens"``: Theorem 1 read backwards. For every patch offset δ the kernel reaches,

      conv(X)_q = Σ_δ X_{q+δ} · W^O_δ + b          (X_{q+δ} = 0 outside the image)

  with W^O built from ``conv.weight`` through the conversion's own taps
  (:func:`convit_convert.taps.kernel_taps`). For δ ≠ 0 only the input pixels within the kernel's
  reach of the patch edge have a tap, a box of the neighbour (:class:`TokenPlan`; P 16, K 5: 2
  columns or rows, 96 of 768 features; corners 12), so each shifted neighbour contributes only its
  box, cut out by slicing (whose backward copies into a slice: no scatter): the mixer is two
  products on tensor cores, the patch itself through W^O's centre block ((B·N, d) by (d, d)) and
  the 8 strips through the rest, accumulated onto it ((B·N, 432) by (432, 768) at the paper's
  size), instead of a 3-channel convolution that cannot use them. Only those 1,200 of W^O's 6,912
  columns are built, contracted from the kernel with one-hot tap selectors
  (:func:`convit_convert.taps.project`), so the kernel's gradient is two small dense products, not
  a scatter of 10^6 entries onto 75 taps.

``"auto"`` (the default) picks per device, by measurement (BENCHMARKS.md, "Training on a CPU", "... GPU"):
"tokens" on CUDA, "pixels" on the CPU. The parameters are ``conv.weight`` (C, C, K, K) and
``conv.bias`` (C) in every form, so checkpoints and the conversion do not depend on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .options.values import CONV_FORMS
from .taps import kernel_taps, project, tap_selectors
from .theory import patch_offsets

ConvFormName = Literal["auto", "pixels", "tokens"]
AUTO_FORM = {"cuda": "tokens"}  # by device type; anything else: "pixels" (BENCHMARKS.md)


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


@dataclass(frozen=True)
class TokenPlan:
    """What the token form reads, computed once from (C, K, P, D) by the taps: the offsets δ (the
    centre first where the kernel reads it) and, per offset, the box of input pixels it reads in
    the patch at q + δ (rows [y0, y1), columns [x0, x1): every pixel some tap reaches, and between
    them, where a dilation wider than a patch leaves gaps, pixels whose taps are all zero). Its
    columns of W^O are the boxes' pixels in this order, each with its C channels."""

    offsets: list[tuple[int, int]]
    boxes: list[tuple[int, int, int, int]]  # per offset: (y0, y1, x0, x1)

    def pixels(self) -> list[tuple[int, int, int]]:
        """(r, s_y, s_x) per column group of W^O: offset r's box, row by row."""
        return [
            (r, y, x)
            for r, (y0, y1, x0, x1) in enumerate(self.boxes)
            for y in range(y0, y1)
            for x in range(x0, x1)
        ]

    def first_is_the_patch(self, patch_size: int) -> bool:
        """Whether offsets[0] is (0, 0) and reads its whole patch: the first product's input is then
        the tokens themselves (a view), not a copy."""
        return self.offsets[0] == (0, 0) and self.boxes[0] == (0, patch_size, 0, patch_size)

    def sizes(self, channels: int) -> tuple[int, int]:
        """(features offsets[0] reads, Σ features the other offsets' strips read)."""
        area = [(y1 - y0) * (x1 - x0) * channels for y0, y1, x0, x1 in self.boxes]
        return area[0], sum(area[1:])


@functools.lru_cache(maxsize=16)  # every block of a model has the same: computed once
def token_plan(channels: int, kernel_size: int, patch_size: int, dilation: int) -> TokenPlan:
    """The :class:`TokenPlan` of a (C, K, P, D) convolution: per axis and offset, the first and the
    last of the neighbour's P pixels some tap reads (:func:`convit_convert.taps.kernel_taps`)."""
    offsets = patch_offsets(kernel_size, patch_size, dilation)
    offsets.sort(key=lambda o: o != (0, 0))  # the centre first
    spans = []
    for axis in (0, 1):  # (N_Δ, P): whether pixel s of the neighbour at offsets[r] is read
        taps = kernel_taps([o[axis] for o in offsets], patch_size, kernel_size, dilation)  # (N_Δ, P, P)
        read = (taps < kernel_size).any(2).tolist()  # a list: no device reads
        rows = [[s for s, hit in enumerate(row) if hit] for row in read]
        spans.append([(row[0], row[-1] + 1) for row in rows])
    return TokenPlan(offsets, [(*y, *x) for y, x in zip(*spans, strict=True)])


def token_sizes(channels: int, kernel_size: int, patch_size: int, dilation: int) -> tuple[int, int, int]:
    """(N_Δ, centre, Σ|strip|) of :func:`token_plan`: what sizing a run needs before it allocates."""
    plan = token_plan(channels, kernel_size, patch_size, dilation)
    return len(plan.offsets), *plan.sizes(channels)


def token_form_bytes(
    channels: int,
    kernel_size: int,
    patch_size: int,
    dilation: int,
    grid_size: tuple[int, int],
    batch: int,
) -> int:
    """Bytes one block's token form allocates in a training step, beyond what the pixel form's
    estimate (``ViTConfig.activation_bytes``) counts, from the sizes :meth:`ConvMixer.token_products`
    allocates: W^O's float64 contractions (the y taps M·P·K·C², its d·M·C columns twice), then in
    float32, and the float32 activations kept for the backward (the first product's features where
    they are a copy, y, each strip and their concatenation, the sum), M = (centre + Σ|strip|) / C."""
    plan = token_plan(channels, kernel_size, patch_size, dilation)
    centre, strips = plan.sizes(channels)
    d, p, (gh, gw) = patch_size**2 * channels, patch_size, grid_size
    m = (centre + strips) // channels
    weights = 8 * (m * p * kernel_size * channels**2 + 2 * d * (centre + strips)) + 4 * d * (centre + strips)
    per_image = gh * gw * ((0 if plan.first_is_the_patch(p) else centre) + 2 * d + 2 * strips)
    return weights + 4 * batch * per_image


def shifted(grid: torch.Tensor, dy: int, dx: int) -> torch.Tensor:
    """(B, gh, gw, ...) -> the same shape, entry q the entry at q + (dy, dx), zero beyond the grid:
    a slice and a pad, whose backward copies into a slice (no scatter)."""
    gh, gw = grid.shape[1:3]

    def span(n: int, k: int) -> tuple[slice, int, int]:  # rows read, zeros before and after
        return slice(min(max(k, 0), n), max(min(n + k, n), 0)), min(max(-k, 0), n), min(max(k, 0), n)

    (ys, y_before, y_after), (xs, x_before, x_after) = span(gh, dy), span(gw, dx)
    pad = (0, 0) * (grid.dim() - 3) + (x_before, x_after, y_before, y_after)
    return F.pad(grid[:, ys, xs], pad)


class ConvMixer(nn.Conv2d):
    """Token mixer: Conv2d(C, C, K, padding='same', dilation=D) over the pixel view of the tokens,
    computed as ``form`` says (module docstring). Subclasses Conv2d so its parameters are
    ``conv.weight`` (C, C, K, K) and ``conv.bias`` (C)."""

    def __init__(
        self,
        channels: int,
        kernel_size: int,
        dilation: int,
        grid_size: tuple[int, int],
        patch_size: int,
        form: ConvFormName = "auto",
    ) -> None:
        super().__init__(channels, channels, kernel_size, padding="same", dilation=dilation)
        if form not in CONV_FORMS:
            raise ValueError(f"form must be one of {CONV_FORMS}, got {form!r}")
        self.grid_size = grid_size
        self.patch_size = patch_size
        self.form = form
        device = torch.empty(0).device  # the device the model is being built on
        for name, t in self._index_buffers().items():  # small index tensors, rebuilt with the model
            self.register_buffer(name, t.to(device), persistent=False)

    def _index_buffers(self) -> dict[str, torch.Tensor]:
        """The token form's tap selectors (on the CPU), from the conv's own sizes: no file holds them."""
        c, k, p, d = self.in_channels, self.kernel_size[0], self.patch_size, self.dilation[0]
        # on the CPU whatever the default device: a model built on the meta device for its shapes
        # alone would otherwise index meta tensors, which imports torch's symbolic shapes (a second)
        with torch.device("cpu"):
            plan = token_plan(c, k, p, d)
            ey, ex = tap_selectors(plan.offsets, p, k, d)  # (N_Δ, P, P, K)
            r, y, x = torch.tensor(plan.pixels()).unbind(1)
            selectors = {"select_y": ey[r, y], "select_x": ex[r, x]}  # (M, P, K): W^O's column groups
        self.offsets, self.boxes = plan.offsets, plan.boxes
        self.first_is_the_patch = plan.first_is_the_patch(p)
        self.centre, _ = plan.sizes(c)  # features offsets[0] reads: d where it is (0, 0) (D ≤ P)
        return selectors

    def init_non_persistent_buffers(self) -> None:
        """Rebuild the index buffers where the weights live (timm's convention: transformers'
        TimmWrapper, which builds the model without them, calls this)."""
        device = self.weight.device
        for name, t in self._index_buffers().items():
            setattr(self, name, t.to("cpu" if device.type == "meta" else device))

    def form_on(self, device: torch.device) -> str:
        """The form this mixer computes in on ``device``."""
        return AUTO_FORM.get(device.type, "pixels") if self.form == "auto" else self.form

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, P²·C) -> (B, N, P²·C)."""
        if self.form_on(x.device) == "tokens":
            return self.token_products(x)
        pixels = unpatchify(x, self.grid_size, self.patch_size)
        return patchify(super().forward(pixels), self.patch_size)

    def token_weight(self) -> torch.Tensor:
        """(d, centre + Σ|strip|): the columns of W^O the products use, from ``conv.weight``, exact
        and differentiable (two small float64 contractions, outside autocast; taps.project)."""
        with torch.autocast(self.weight.device.type, enabled=False):
            wo = project(self.weight, self.select_y.double(), self.select_x.double())
            return wo.to(self.weight.dtype)

    def box_of_neighbour(self, grid: torch.Tensor, r: int) -> torch.Tensor:
        """(B, gh, gw, P, P, C) -> (B, gh, gw, |box_r|·C): per patch q, the box of offset r's
        neighbour q + δ_r, zero beyond the image."""
        if r == 0 and self.first_is_the_patch:
            return grid.flatten(3)  # the patch itself, whole: a view
        (dy, dx), (y0, y1, x0, x1) = self.offsets[r], self.boxes[r]
        return shifted(grid[:, :, :, y0:y1, x0:x1], dy, dx).flatten(3)

    def token_products(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d): X_{q+δ_0}[box_0] · W_0 + b, plus Σ_{r>0} X_{q+δ_r}[box_r] · W_r
        as a second product accumulated onto the first (module docstring)."""
        b, n, d = x.shape
        gh, gw = self.grid_size
        p = self.patch_size
        w = self.token_weight()
        bias = None if self.bias is None else self.bias.repeat(p**2)  # feature (s·C + c)
        grid = x.view(b, gh, gw, p, p, -1)  # (B, gh, gw, P_y, P_x, C)
        y = F.linear(self.box_of_neighbour(grid, 0).view(b, n, -1), w[:, : self.centre], bias)
        if len(self.offsets) == 1:
            return y
        parts = [self.box_of_neighbour(grid, r) for r in range(1, len(self.offsets))]
        strips = torch.cat(parts, dim=3).view(b * n, -1)
        out = torch.addmm(y.view(b * n, d), strips, w[:, self.centre :].t())
        return out.view(b, n, d)
