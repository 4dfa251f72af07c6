"""cmhsa's models in timm's registry. Importing this module registers them; nothing is downloaded.

    import timm
    import convit_convert.timm  # noqa: F401

    timm.create_model("cmhsa_attn", pretrained=True, pretrained_cfg_overlay=dict(file="vit.safetensors"))
    timm.create_model("cmhsa_conv", pretrained=True, pretrained_cfg_overlay=dict(file="conv.safetensors"))
    timm.create_model("cmhsa5_224", num_classes=10)  # the paper's CMHSA-5 (attention), random init

With ``pretrained=True`` the architecture is the file's (its cmhsa metadata); ``num_classes=`` then
resets the head, as timm users expect. Without a file, the keyword arguments are
:meth:`ViTConfig.build`'s and :meth:`ViTConfig.with_attention`'s (``num_heads``, ``qk_dim``, ``sink``,
``pinning``), defaults the paper's model. timm's factory keywords work as for its own models:
``device``, ``dtype``, ``num_classes=0`` (no head), ``global_pool=""`` (tokens out), and
``features_only=True`` with ``out_indices`` (timm's FeatureGetterNet over ``forward_intermediates``).
``model.pretrained_cfg`` feeds ``timm.data.resolve_data_config(model=model)``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from timm.models import generate_default_cfgs, register_model
from timm.models._builder import pretrained_cfg_for_features
from timm.models._features import FeatureGetterNet
from torch import nn

from .api import load_checkpoint
from .config import ViTConfig
from .data import channel_stats
from .errors import CmhsaError, article
from .model import VisionTransformer
from .theory import heads_needed

_ATTN_ARGS = ("num_heads", "qk_dim", "sink", "pinning")


def pretrained_cfg(cfg: ViTConfig, file: str | None = None) -> dict[str, Any]:
    """timm's description of how a model wants its input, and where its head is."""
    mean, std = channel_stats(cfg.in_chans)
    # no first conv to adapt to other in_chans when the patch embedding is the identity (the paper's)
    first_conv = "patch_embed" if cfg.patch_embed == "linear" else ()
    # fixed_input_size: the relative position table is the patch grid's, so the image size is fixed
    return {"input_size": (cfg.in_chans, *cfg.img_size), "fixed_input_size": True, "mean": mean, "std": std,
            "interpolation": "bicubic", "crop_pct": 0.875, "num_classes": cfg.num_classes,
            "first_conv": first_conv, "classifier": "head", "file": file, "license": "mit"}  # fmt: skip


# Registered under each model's name, so timm's lookups by name (get_pretrained_cfg_value, the data
# config) work before a model is built. No weights: ``file`` stays None until a user names one.
default_cfgs = generate_default_cfgs(
    {name: pretrained_cfg(ViTConfig.build(**size)) for name, size in
     {"cmhsa_conv": {}, "cmhsa_attn": {}, "cmhsa5_224": {"kernel_size": 5}, "cmhsa3_224": {"kernel_size": 3}}.items()}
)  # fmt: skip


def _create(
    kind: str, pretrained: bool = False, pretrained_cfg_overlay: dict | None = None, **kwargs: Any
) -> nn.Module:
    for timm_only in ("pretrained_cfg", "cache_dir"):
        kwargs.pop(timm_only, None)
    num_classes, drop_path_rate = kwargs.pop("num_classes", None), kwargs.pop("drop_path_rate", 0.0)
    device, dtype = kwargs.pop("device", None), kwargs.pop("dtype", None)
    global_pool = kwargs.pop("global_pool", None)
    features = {
        k: kwargs.pop(k) for k in ("features_only", "out_indices", "feature_cls", "output_fmt") if k in kwargs
    }
    file = (pretrained_cfg_overlay or {}).get("file")
    if pretrained:
        if not file:
            raise CmhsaError(
                f"cmhsa_{kind} with pretrained=True needs pretrained_cfg_overlay=dict(file=...): cmhsa never downloads"
            )
        if kwargs:
            raise CmhsaError(
                f"the architecture comes from the file; {', '.join(sorted(kwargs))} cannot change it", file
            )
        ckpt = load_checkpoint(file)
        if ckpt.kind != kind:
            raise CmhsaError(
                f"is {article(ckpt.kind)} checkpoint; cmhsa_{kind} loads {article(kind)} one", file
            )
        model = ckpt.model(torch.float32, drop_path_rate).train()
    else:
        attn = {k: kwargs.pop(k) for k in _ATTN_ARGS if k in kwargs}
        head = {"num_classes": num_classes} if num_classes else {}  # 0 (no head): reset below
        cfg = ViTConfig.build(**kwargs, **head)
        if kind == "attn":
            heads = attn.pop("num_heads", heads_needed(cfg.kernel_size, cfg.patch_size, cfg.dilation))
            cfg = cfg.with_attention(heads, **attn)
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = VisionTransformer(cfg, drop_path_rate)
    model.to(device=device, dtype=dtype)
    if (num_classes is not None and num_classes != model.num_classes) or global_pool is not None:
        model.reset_classifier(model.num_classes if num_classes is None else num_classes, global_pool)
    model.pretrained_cfg = model.default_cfg = pretrained_cfg(model.cfg, file)
    return _features(model, **features) if features.pop("features_only", False) else model


def _features(
    model: VisionTransformer,
    out_indices: int | list[int] = 3,
    feature_cls: str = "getter",
    output_fmt: str = "NCHW",
) -> nn.Module:
    """timm's ``features_only=True``: the blocks' outputs through ``forward_intermediates`` (timm's
    FeatureGetterNet, as for its own ViTs: the last 3 blocks by default), the rest pruned."""
    if feature_cls != "getter":
        raise TypeError(f"cmhsa models give features through feature_cls='getter', not {feature_cls!r}")
    features = FeatureGetterNet(model, out_indices, output_fmt=output_fmt)
    features.pretrained_cfg = features.default_cfg = pretrained_cfg_for_features(model.pretrained_cfg)
    return features


@register_model
def cmhsa_conv(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Phase 1: the convolutional ViT (the paper's size unless a file or kwargs say otherwise)."""
    return _create("conv", pretrained, **kwargs)


@register_model
def cmhsa_attn(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """Phase 2: the attention ViT with relative position bias (the paper's size by default)."""
    return _create("attn", pretrained, **kwargs)


@register_model
def cmhsa5_224(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """The paper's CMHSA-5: 224 px, P = 16, d = 768, depth 6, 9 heads from a 5×5 kernel."""
    return _create("attn", pretrained, **{"kernel_size": 5, **kwargs})


@register_model
def cmhsa3_224(pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """The paper's CMHSA-3: as CMHSA-5 with a 3×3 kernel (still 9 heads: K < 2P)."""
    return _create("attn", pretrained, **{"kernel_size": 3, **kwargs})
