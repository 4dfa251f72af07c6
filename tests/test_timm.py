"""cmhsa's models through timm's own API: registry, loading from a local file, the model API."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from timm.data import create_transform, resolve_data_config

import convit_convert.timm  # noqa: F401  (registers the models)
from convit_convert.api import load_checkpoint
from convit_convert.construct import convert_state_dict
from convit_convert.errors import CmhsaError
from convit_convert.io.checkpoint import save_checkpoint

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors"


@pytest.fixture(scope="module")
def attn_file(tmp_path_factory) -> Path:
    ckpt = load_checkpoint(FIXTURE)
    sd, cfg = convert_state_dict(ckpt.tensors, ckpt.config, pinning="gated", num_heads=10)
    path = tmp_path_factory.mktemp("timm") / "vit.safetensors"
    save_checkpoint(path, cfg, sd)
    return path


def test_registered_names() -> None:
    assert {"cmhsa_conv", "cmhsa_attn", "cmhsa5_224", "cmhsa3_224"} <= set(timm.list_models("cmhsa*"))


@pytest.mark.parametrize("name", ["cmhsa_conv", "cmhsa_attn"])
def test_pretrained_from_a_local_file_equals_cmhsa(name: str, attn_file: Path) -> None:
    """timm.create_model(pretrained=True) on a cmhsa file gives cmhsa's logits (fp32, 1e-6 relative)."""
    file = FIXTURE if name == "cmhsa_conv" else attn_file
    model = timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file))).eval()
    ref = load_checkpoint(file).model(dtype=torch.float32)
    x = torch.randn(3, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out, expected = model(x), ref(x)
    assert (out - expected).abs().max() <= 1e-6 * expected.abs().max()
    data_cfg = resolve_data_config(model=model)
    assert data_cfg["input_size"] == (1, 32, 32) and len(data_cfg["mean"]) == 1
    assert create_transform(**data_cfg)  # timm's preprocessing for it
    head = timm.create_model(
        name, pretrained=True, pretrained_cfg_overlay=dict(file=str(file)), num_classes=3
    )
    assert head.get_classifier().out_features == 3 and head(x).shape == (3, 3)
    assert torch.equal(head.patch_embed.weight, model.patch_embed.weight)  # only the head is new


def test_random_init_sizes_and_the_model_api() -> None:
    model = timm.create_model("cmhsa_attn", img_size=32, patch_size=4, depth=2, num_classes=7, qk_dim=8)
    assert model.cfg.num_heads == 9 and model.cfg.qk_dim == 8 and model.num_classes == 7
    x = torch.randn(2, 3, 32, 32)
    model.eval()
    with torch.no_grad():
        feats = model.forward_features(x)
        assert model.forward_head(feats, pre_logits=True).shape == (2, 48)
    model.train()
    torch.manual_seed(0)
    plain = model(x).sum()
    model.set_grad_checkpointing()
    torch.manual_seed(0)
    assert torch.allclose(model(x).sum(), plain)
    from timm.optim import param_groups_layer_decay

    groups = param_groups_layer_decay(model, weight_decay=0.05, layer_decay=0.75)
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    model.reset_classifier(0)
    assert model(x).shape == (2, 48)
    paper = timm.create_model("cmhsa3_224", depth=1)
    assert paper.cfg.kernel_size == 3 and paper.cfg.img_size == (224, 224) and paper.cfg.num_heads == 9


def test_refusals(attn_file: Path) -> None:
    with pytest.raises(CmhsaError, match="never downloads"):
        timm.create_model("cmhsa_attn", pretrained=True)
    with pytest.raises(CmhsaError, match="cmhsa_attn loads an attn one"):
        timm.create_model("cmhsa_attn", pretrained=True, pretrained_cfg_overlay=dict(file=str(FIXTURE)))
    with pytest.raises(CmhsaError, match="architecture comes from the file"):
        timm.create_model(
            "cmhsa_attn", pretrained=True, pretrained_cfg_overlay=dict(file=str(attn_file)), depth=3
        )
