"""The skeleton both models share: patch embedding, pre-LN blocks, final norm, average pool, head.

No class token and no absolute position embedding: phase 1 gets position from the convolution's
zero padding, phase 2 from the relative position bias (Section 4.1 of the paper).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .config import ViTConfig
from .layers import Block, PatchEmbed, init_weights


class VisionTransformer(nn.Module):
    """patch_embed -> depth × Block(mixer) -> norm -> mean over tokens -> head.

    Subclasses choose the token mixer; everything else (and every parameter name) is shared.
    """

    kind: str = ""
    mixer_name: str = ""

    def __init__(
        self,
        cfg: ViTConfig,
        make_mixer: Callable[[], nn.Module],
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        cfg.validate(self.kind)
        self.cfg = cfg
        self.num_classes = cfg.num_classes
        self.patch_embed = PatchEmbed(
            cfg.patch_size, cfg.in_chans, cfg.embed_dim, linear=cfg.patch_embed == "linear"
        )
        dpr = torch.linspace(0, drop_path_rate, cfg.depth).tolist()  # stochastic depth decay rule
        self.blocks = nn.ModuleList(
            Block(cfg.embed_dim, self.mixer_name, make_mixer(), cfg.mlp_hidden_dim, cfg.norm_eps, p)
            for p in dpr
        )
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.embed_dim, cfg.num_classes)
        self.apply(init_weights)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) images -> (B, N, embed_dim) normalised tokens."""
        expected = (self.cfg.in_chans, *self.cfg.img_size)
        if tuple(x.shape[1:]) != expected:
            raise ValueError(
                f"expected images of shape (B, {', '.join(map(str, expected))}), got {tuple(x.shape)}"
            )
        x = self.patch_embed(x)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        """(B, N, embed_dim) -> (B, num_classes) logits, or the pooled (B, embed_dim) features."""
        x = x.mean(dim=1)
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(B, in_chans, H, W) -> (B, num_classes)."""
        return self.forward_head(self.forward_features(x))

    def no_weight_decay(self) -> set[str]:
        """Parameter names to exclude from weight decay (timm's create_optimizer_v2 reads this)."""
        return set()
