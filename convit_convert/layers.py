"""Pieces both models share: the patch <-> pixel views, patch embedding, MLP, pre-LN block.

Token layout (docs/FORMAT.md): patches in row-major order; a patch is flattened channel-last,
feature index (py·P + px)·C + c.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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


class PatchEmbed(nn.Module):
    """Image -> tokens. Identity on the flattened patch (the paper's choice, which lets phase 1 view
    tokens as pixels), or a learnable linear map P²·in_chans -> embed_dim held as
    ``patch_embed.weight`` / ``patch_embed.bias`` (docs/FORMAT.md)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, linear: bool) -> None:
        super().__init__()
        self.patch_size = patch_size
        if linear:
            self.weight = nn.Parameter(torch.empty(embed_dim, patch_size * patch_size * in_chans))
            self.bias = nn.Parameter(torch.zeros(embed_dim))
            nn.init.trunc_normal_(self.weight, std=0.02)
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, N, embed_dim)."""
        x = patchify(x, self.patch_size)
        return x if self.weight is None else F.linear(x, self.weight, self.bias)


class Mlp(nn.Module):
    """fc1 -> exact (erf) GELU -> fc2."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth per sample. A local copy of timm's, so the conversion path never imports
    timm (about 3.5 s of start-up)."""

    def __init__(self, drop_prob: float = 0.0) -> None:
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.drop_prob == 0.0 or not self.training:
            return x
        keep = 1.0 - self.drop_prob
        mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
        return x * mask / keep


class Block(nn.Module):
    """Pre-LN transformer block: x + mixer(norm1(x)), then x + mlp(norm2(x)).

    The token mixer is registered under ``mixer_name`` ('conv' or 'attn') so that parameter names
    match docs/FORMAT.md, e.g. ``blocks.0.conv.weight`` and ``blocks.0.attn.proj.weight``.
    """

    def __init__(
        self,
        dim: int,
        mixer_name: str,
        mixer: nn.Module,
        mlp_hidden_dim: int,
        norm_eps: float = 1e-6,
        drop_path: float = 0.0,
    ) -> None:
        super().__init__()
        self.mixer_name = mixer_name
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.add_module(mixer_name, mixer)
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, mlp_hidden_dim)
        self.drop_path = DropPath(drop_path)

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, N, dim) -> (B, N, dim)."""
        x = x + self.drop_path(self.mixer(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


def init_weights(module: nn.Module) -> None:
    """ViT-style init: truncated normal (std 0.02) Linear weights, zero biases."""
    if isinstance(module, nn.Linear):
        nn.init.trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
