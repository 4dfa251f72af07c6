"""Phase 1: the "convolutional ViT", each block's attention replaced by a K×K convolution."""

from __future__ import annotations

import torch
from torch import nn

from .config import ViTConfig
from .layers import patchify, unpatchify
from .vit import VisionTransformer


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


class ConvViT(VisionTransformer):
    """Phase-1 model (kind "conv")."""

    kind = "conv"
    mixer_name = "conv"

    def __init__(self, cfg: ViTConfig, drop_path_rate: float = 0.0) -> None:
        super().__init__(
            cfg,
            lambda: ConvMixer(cfg.hidden_chans, cfg.kernel_size, cfg.dilation, cfg.grid_size, cfg.patch_size),
            drop_path_rate,
        )
