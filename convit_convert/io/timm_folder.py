"""A model as timm's pretrained folder: what ``timm.create_model("local-dir:DIR", pretrained=True)``
reads (timm >= 1.0.16, after ``import convit_convert.timm``) and the Hugging Face Hub hosts
(``hf-hub:user/name``, once ``huggingface_hub.upload_folder`` has put the folder there):

    DIR/model.safetensors   the weights, in cmhsa's checkpoint format (cmhsa reads the file too)
    DIR/config.json         timm's: {"architecture": "cmhsa_attn", "num_classes": 10,
                            "num_features": 48, "model_args": {"cmhsa_config": {...}},
                            "pretrained_cfg": {"input_size": [1, 28, 28], "mean": [...], ...}}
    DIR/README.md           the model card (io/model_card.py): the Hub's metadata, how it was
                            made, its input, the import line

``model_args`` carries the model's whole cmhsa config, so any size cmhsa supports is rebuilt as it
was; ``pretrained_cfg`` is how the model wants its input (timm's ``resolve_data_config`` reads it).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..config import ViTConfig
from ..defaults import EVAL_CROP_PCT, EVAL_INTERPOLATION
from ..errors import CmhsaError
from .atomic import atomic_paths
from .checkpoint import write_checkpoint
from .model_card import CARD, model_card

WEIGHTS, CONFIG = "model.safetensors", "config.json"
ARCHITECTURES = {"conv": "cmhsa_conv", "attn": "cmhsa_attn"}  # timm's registered names, by kind
CONFIG_ARG = "cmhsa_config"  # the model_args key holding the cmhsa config


def pretrained_cfg(cfg: ViTConfig, file: str | None = None) -> dict[str, Any]:
    """timm's description of how a model wants its input (what ``cmhsa eval`` does: bicubic resize
    to size / 0.875, centre crop, ImageNet's mean and std), and where its head is."""
    from ..data import channel_stats

    mean, std = channel_stats(cfg.in_chans)
    # no first conv to adapt to other in_chans when the patch embedding is the identity (the paper's)
    first_conv = "patch_embed" if cfg.patch_embed == "linear" else ()
    # fixed_input_size: the relative position table is the patch grid's, so the image size is fixed
    return {
        "input_size": (cfg.in_chans, *cfg.img_size),
        "fixed_input_size": True,
        "mean": mean,
        "std": std,
        "interpolation": EVAL_INTERPOLATION,
        "crop_pct": EVAL_CROP_PCT,
        "num_classes": cfg.num_classes,
        "first_conv": first_conv,
        "classifier": "head",
        "file": file,
        "license": "mit",
    }


def preprocessing(cfg: ViTConfig) -> dict[str, str]:
    """How a model of ``cfg`` wants an image, as strings (an ONNX file's ``metadata_props``):
    ``cmhsa eval``'s transform, timm's eval one, step by step (resize the shorter side to
    floor(size / crop_pct), centre crop, scale to 0..1, normalise)."""
    pcfg = pretrained_cfg(cfg)
    c, h, w = pcfg["input_size"]
    return {
        "input_size": json.dumps([c, h, w]),
        "channels": "L" if c == 1 else "RGB",
        "resize_shorter_to": str(math.floor(min(h, w) / pcfg["crop_pct"])),
        "interpolation": pcfg["interpolation"],
        "crop": "center",
        "crop_pct": str(pcfg["crop_pct"]),
        "scale": "1/255",
        "mean": json.dumps(list(pcfg["mean"])),
        "std": json.dumps(list(pcfg["std"])),
        "num_classes": str(cfg.num_classes),
        "layout": "NCHW float32, input pixel_values, output logits",
    }


def timm_config(cfg: ViTConfig) -> dict[str, Any]:
    """config.json's content for a model of ``cfg``."""
    pcfg = {k: v for k, v in pretrained_cfg(cfg).items() if k != "file"}
    return {
        "architecture": ARCHITECTURES[cfg.kind],
        "num_classes": cfg.num_classes,
        "num_features": cfg.embed_dim,
        "model_args": {CONFIG_ARG: cfg.to_dict()},
        "pretrained_cfg": pcfg,
    }


def write_timm_folder(
    folder: Path, cfg: ViTConfig, state_dict: dict[str, Any], metadata: dict[str, str] | None = None
) -> list[Path]:
    """Write ``folder``'s three files together (all or none; the folder is made if missing): the
    weights, timm's config.json and the model card README.md (io/model_card.py, from ``metadata``);
    ``state_dict``: every tensor of the model (timm loads it strictly). The paths written."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise CmhsaError("is a file; a timm folder is a directory", folder)
    folder.mkdir(parents=True, exist_ok=True)
    weights, config, card = folder / WEIGHTS, folder / CONFIG, folder / CARD
    text = model_card(cfg, metadata or {}, cfg.num_params(), preprocessing(cfg))
    with atomic_paths(weights, config, card) as (tmp_weights, tmp_config, tmp_card):
        write_checkpoint(tmp_weights, cfg, state_dict, metadata, weights)
        tmp_config.write_text(json.dumps(timm_config(cfg), indent=2) + "\n", encoding="utf-8")
        tmp_card.write_text(text, encoding="utf-8")
    return [weights, config, card]


def config_from_arg(value: Any, kind: str, where: object) -> ViTConfig:
    """The cmhsa config a timm folder's ``model_args[CONFIG_ARG]`` holds (timm passes each of
    model_args to the model's factory as a keyword); a one-line CmhsaError naming ``where`` if it is
    not a valid config of ``kind``."""
    if not isinstance(value, dict):
        raise CmhsaError(f"model_args' {CONFIG_ARG!r} is not a JSON object: not a folder cmhsa wrote", where)
    return ViTConfig.from_dict(value, kind, where)
