"""Model kinds by name: ``build_model("conv" | "attn", cfg)``."""

from __future__ import annotations

import torch

from .attn_vit import AttnViT
from .checkpoint import Checkpoint
from .config import ViTConfig
from .conv_vit import ConvViT
from .vit import VisionTransformer

MODELS: dict[str, type[VisionTransformer]] = {"conv": ConvViT, "attn": AttnViT}


def build_model(kind: str, cfg: ViTConfig, drop_path_rate: float = 0.0) -> VisionTransformer:
    return MODELS[kind](cfg, drop_path_rate=drop_path_rate)


def model_from_checkpoint(ckpt: Checkpoint, dtype: torch.dtype | None = None) -> VisionTransformer:
    """The model a checkpoint describes, in eval mode, with its weights (a conv saved without bias
    gets a zero bias: the same function)."""
    model = build_model(ckpt.kind, ckpt.config)
    tensors = dict(ckpt.tensors)
    for i, block in enumerate(model.blocks):
        name = f"blocks.{i}.conv.bias"
        if ckpt.kind == "conv" and name not in tensors:
            tensors[name] = torch.zeros_like(block.conv.bias, dtype=ckpt.dtype)
    model.to(ckpt.dtype if dtype is None else dtype)
    model.load_state_dict(tensors, strict=True)
    return model.eval()
