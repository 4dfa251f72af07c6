r"""Phase 1's token mixer: a K×K convolution over the pixel view of the tokens, computed one of two
ways, the same function either way (``form``):

- ``"pixels"``: tokens -> pixels, ``F.conv2d(padding='same', dilation=D)``, pixels -> tokens.
- ``"tokens"``: Theorem 1 read backwards. For every patch offset δ the kernel reaches,

      conv(X)_q = Σ_δ X_{q+δ} · W^O_δ + b          (X_{q+δ} = 0 outside the image)

  with W^O built from ``conv.weight`` through the conversion's own taps
  (:func:`convit_convert.taps.kernel_taps`). For δ ≠ 0 only the input pixels within the kernel's
  reach of the patch edge have a tap (P 16, K 5: 2 columns or rows, 96 of 768 features; corners
  12), so each shifted neighbour contributes only those features: the mixer is two products on
  tensor cores, the patch itself through W^O's centre block ((B·N, d) by (d, d)) and the 8
  strips through the rest, accumulated onto it ((B·N, 432) by (432, 768) at the paper's size),
  instead of a 3-channel convolution that cannot use them. W^O is contracted from the kernel
  with one-hot tap selectors (:func:`convit_convert.taps.project`), so its gradient is two
  small dense products, not a scatter of 10^6 entries onto 75 taps.

``"auto"`` (the default) picks per device, by measurement (BENCHMARKS.md, "Phase 1's two forms"):
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
from .taps import kernel_taps, output_projection, project, tap_selectors
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
    """What the token form reads, computed once from (C, K, P, D): the offsets δ (the centre
    first), per other offset the input features that have a tap (its strip), the union of the
    strips (``ring``: the pixels within the kernel's reach of a patch's edge), and the columns of
    W^O (d, N_Δ·d) the products use, centre block first."""

    offsets: list[tuple[int, int]]
    strips: list[torch.Tensor]  # per offset after the centre: positions in ``ring`` (long)
    ring: torch.Tensor  # (R,) features of a patch some neighbour's strip reads
    columns: torch.Tensor  # (centre + Σ|strip|,) into W^O's columns
    centre: int  # features the centre reads: d where the kernel fits in a patch (K ≤ P)


@functools.lru_cache(maxsize=16)  # every block of a model has the same: computed once
def token_plan(channels: int, kernel_size: int, patch_size: int, dilation: int) -> TokenPlan:
    """The :class:`TokenPlan` of a (C, K, P, D) convolution (which features each offset reads, from
    W^O's structure: the projection of an all-ones kernel)."""
    offsets = patch_offsets(kernel_size, patch_size, dilation)
    offsets.sort(key=lambda o: o != (0, 0))  # the centre first
    ones = torch.ones(channels, channels, kernel_size, kernel_size, dtype=torch.float64)
    wo = output_projection(ones, patch_size, dilation, offsets)
    d = wo.shape[0]
    reads = [torch.nonzero(b.any(0)).flatten() for b in wo.view(d, len(offsets), d).unbind(1)]
    ring = torch.unique(torch.cat(reads[1:])) if len(reads) > 1 else torch.empty(0, dtype=torch.long)
    position = torch.full((d,), -1, dtype=torch.long)
    position[ring] = torch.arange(len(ring))
    columns = torch.cat([r * d + f for r, f in enumerate(reads)])
    return TokenPlan(offsets, [position[f] for f in reads[1:]], ring, columns, len(reads[0]))


def token_sizes(channels: int, kernel_size: int, patch_size: int, dilation: int) -> tuple[int, int, int, int]:
    """(N_Δ, centre, Σ|strip|, |ring|) of :func:`token_plan`, counted from the taps alone (per axis,
    which of a neighbour's P pixels some tap reads), without building W^O: what sizing a run needs
    before it allocates anything."""
    offsets = patch_offsets(kernel_size, patch_size, dilation)
    offsets.sort(key=lambda o: o != (0, 0))
    read = [  # per axis: (N_Δ, P) whether input pixel s of the neighbour at offsets[r] is read
        (kernel_taps([o[axis] for o in offsets], patch_size, kernel_size, dilation) < kernel_size).any(2)
        for axis in (0, 1)
    ]
    pixels = read[0][:, :, None] & read[1][:, None, :]  # (N_Δ, P, P)
    counts = pixels.flatten(1).sum(1).tolist()
    ring = int(pixels[1:].any(0).sum()) if len(offsets) > 1 else 0
    return len(offsets), channels * counts[0], channels * sum(counts[1:]), channels * ring


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
    allocates: W^O's float64 contractions (y taps N_Δ·P²·K·C², W^O and its reshape 2·N_Δ·d², its
    columns d·(centre + S), then in float32) and the float32 activations kept for the backward (the
    centre's features, y, the ring's features and its zero-padded grid, the strips and their
    concatenation, the sum)."""
    n_delta, centre, strips, ring = token_sizes(channels, kernel_size, patch_size, dilation)
    d, p, (gh, gw) = patch_size**2 * channels, patch_size, grid_size
    reach = max(max(abs(dy), abs(dx)) for dy, dx in patch_offsets(kernel_size, patch_size, dilation))
    n = gh * gw
    weights = 8 * (n_delta * p * p * kernel_size * channels**2 + 2 * n_delta * d * d + d * (centre + strips))
    weights += 4 * d * (centre + strips)
    per_image = n * ((centre if centre < d else 0) + 2 * d + ring + 2 * strips)
    per_image += (gh + 2 * reach) * (gw + 2 * reach) * ring
    return weights + 4 * batch * per_image


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
        """The token form's index tensors (on the CPU), from the conv's own sizes: no file holds them."""
        c, k, p, d = self.in_channels, self.kernel_size[0], self.patch_size, self.dilation[0]
        with torch.device("cpu"):
            plan = token_plan(c, k, p, d)
            ey, ex = tap_selectors(plan.offsets, p, k, d)
        self.offsets = plan.offsets
        self.centre = plan.centre
        self.reach = max(max(abs(dy), abs(dx)) for dy, dx in plan.offsets)
        buffers = {"ring": plan.ring, "columns": plan.columns, "select_y": ey, "select_x": ex}
        return buffers | {f"strip_{r}": f for r, f in enumerate(plan.strips)}

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
        """(d, d + Σ|strip|): the columns of W^O the products use, from ``conv.weight``, exact and
        differentiable (two small float64 contractions, outside autocast; taps.project)."""
        with torch.autocast(self.weight.device.type, enabled=False):
            wo = project(self.weight, self.select_y.double(), self.select_x.double())
            return wo.index_select(1, self.columns).to(self.weight.dtype)

    def token_products(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, d) -> (B, N, d): X_q · W_0 + b, plus Σ_{δ≠0} X_{q+δ}[strip_δ] · W_δ as a second
        product accumulated onto the first (module docstring)."""
        b, n, d = x.shape
        w = self.token_weight()
        bias = None if self.bias is None else self.bias.repeat(self.patch_size**2)  # feature (s·C + c)
        d_c = self.centre
        centre = x if d_c == d else x.index_select(2, self.columns[:d_c])
        y = F.linear(centre, w[:, :d_c], bias)
        if len(self.offsets) == 1:
            return y
        gh, gw = self.grid_size
        r = self.reach
        ring = F.pad(x.index_select(2, self.ring).view(b, gh, gw, -1), (0, 0, r, r, r, r))  # 0 beyond
        parts = [
            ring[:, r + dy : r + dy + gh, r + dx : r + dx + gw].index_select(3, getattr(self, f"strip_{i}"))
            for i, (dy, dx) in enumerate(self.offsets[1:])
        ]
        strips = torch.cat(parts, dim=3).view(b * n, -1)
        out = torch.addmm(y.view(b * n, d), strips, w[:, d_c:].t())
        return out.view(b, n, d)
