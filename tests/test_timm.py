"""cmhsa's models through timm's own API: registry, loading from a local file, the model API."""

from __future__ import annotations

from pathlib import Path

import pytest
import timm
import torch
from timm.data import create_transform, resolve_data_config

import convit_convert.timm  # noqa: F401  (registers the models)
from conftest import invoke
from convit_convert.api import load_checkpoint, save_checkpoint
from convit_convert.construct import convert_state_dict
from convit_convert.errors import CmhsaError
from convit_convert.options.conversion import ConversionSpec

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors"


@pytest.fixture(scope="module")
def attn_file(tmp_path_factory) -> Path:
    ckpt = load_checkpoint(FIXTURE)
    plan = ConversionSpec(pinning="gated", heads=10).plan(ckpt.config)
    sd, cfg = convert_state_dict(ckpt.tensors, plan), plan.config
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


def test_timm_validate_on_an_imagefolder_equals_cmhsa_eval(tmp_path: Path) -> None:
    """examples/timm_validate.py (timm's dataset, loader and preprocessing from pretrained_cfg)
    gives the same top-1 as ``cmhsa eval --data imagefolder`` on the same folder."""
    import importlib.util

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for split, start in (("train", 0), ("val", 1000)):
        for i in range(start, start + 60):  # 60 images, about 6 per class
            folder = tmp_path / split / str(digits.target[i])
            folder.mkdir(parents=True, exist_ok=True)
            img = Image.fromarray((digits.images[i] * 255 / 16).astype("uint8"), mode="L")
            # every other image rotated: the model gets those wrong in ways that depend on the pixels
            (img.transpose(Image.Transpose.ROTATE_90) if i % 2 else img).save(folder / f"{i}.png")
    attn = tmp_path / "vit.safetensors"
    assert invoke(["convert", str(FIXTURE), "-o", str(attn)]).exit_code == 0
    r = invoke(
        [
            "eval",
            str(attn),
            "--data",
            "imagefolder",
            "--data-dir",
            str(tmp_path),
            *"--workers 0 --device cpu".split(),
        ],
    )
    assert r.exit_code == 0, r.output
    cmhsa_top1 = float(next(line for line in r.output.splitlines() if line.startswith("│")).split("│")[2])
    path = Path(__file__).resolve().parent.parent / "examples" / "timm_validate.py"
    spec = importlib.util.spec_from_file_location("timm_validate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    timm_top1 = module.validate(str(attn), str(tmp_path / "val"), "cmhsa_attn")
    assert 30 < cmhsa_top1 < 90  # neither all right nor all wrong: the rows must agree image by image
    assert round(timm_top1, 2) == cmhsa_top1, (timm_top1, cmhsa_top1)


def test_forward_intermediates_is_what_the_blocks_compute() -> None:
    """Against the blocks run one by one here; NCHW is the token grid; the final output is
    forward_features'."""
    torch.manual_seed(0)
    m = timm.create_model(
        "cmhsa_attn", img_size=16, patch_size=4, depth=3, num_classes=4, kernel_size=3
    ).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        tokens, ref = m.patch_embed(x), []
        for block in m.blocks:
            tokens = block(tokens)
            ref.append(tokens)
        final, feats = m.forward_intermediates(x, indices=2)
        assert torch.equal(final, m.forward_features(x)) and len(feats) == 2
        for f, r in zip(feats, ref[1:], strict=True):
            assert f.shape == (2, 48, 4, 4)
            assert torch.equal(f[:, :, 1, 2], r[:, 1 * 4 + 2])  # row-major patches: (y, x) is token 4y + x
        only = m.forward_intermediates(x, indices=[0], output_fmt="NLC", intermediates_only=True, norm=True)
        assert len(only) == 1 and torch.equal(only[0], m.norm(ref[0]))
    with pytest.raises(ValueError, match="indices"):
        m.forward_intermediates(x, indices=[3])


def test_traced_and_exported_graphs_compute_the_model() -> None:
    """torch.fx (timm's feature extraction traces it) and torch.export give the model's logits
    exactly (the same kernels, float32); the traced graph still refuses a wrong image size."""
    from torch.fx import symbolic_trace

    m = timm.create_model("cmhsa_attn", img_size=16, patch_size=4, depth=2, num_classes=4).eval()
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        expected = m(x)
        traced = symbolic_trace(m)
        assert torch.equal(traced(x), expected)
        assert torch.equal(torch.export.export(m, (x,)).module()(x), expected)
        with pytest.raises(ValueError, match=r"expected images of shape \(B, 3, 16, 16\)"):
            traced(torch.randn(1, 3, 16, 20))


def test_factory_keywords_features_and_heads() -> None:
    """timm's create_model keywords: device/dtype, num_classes=0, global_pool='', features_only."""
    meta = timm.create_model("cmhsa_attn", device="meta", dtype=torch.float64)
    assert {(t.device.type, t.dtype) for t in meta.parameters()} == {("meta", torch.float64)}
    assert meta.num_features == meta.head_hidden_size == 768 and meta.in_chans == 3
    assert timm.get_pretrained_cfg_value("cmhsa5_224", "fixed_input_size") is True
    meta.reset_classifier(5)
    assert meta.head.weight.dtype == torch.float64 and meta.head.weight.device.type == "meta"
    kw = dict(img_size=16, patch_size=4, depth=3)
    model = timm.create_model("cmhsa_conv", **kw, num_classes=4).eval()
    tokens = timm.create_model("cmhsa_conv", **kw, num_classes=0, global_pool="").eval()
    feats = timm.create_model("cmhsa_conv", **kw, features_only=True, out_indices=(0, 2)).eval()
    body = {k: v for k, v in model.state_dict().items() if not k.startswith("head.")}
    tokens.load_state_dict(body)
    missing, unexpected = feats.model.load_state_dict(body, strict=False)
    assert not missing and set(unexpected) == {"norm.weight", "norm.bias"}  # pruned: features end at the taps
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        assert torch.equal(tokens(x), model.forward_features(x))  # (B, N, D): no pool, no head
        _, ref = model.forward_intermediates(x, indices=[0, 2])
        out = feats(x)
    assert feats.feature_info.channels() == [48, 48] and feats.feature_info.reduction() == [4, 4]
    assert len(out) == 2 and all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))
    assert len(feats.model.blocks) == 3 and isinstance(feats.model.head, torch.nn.Identity)
    with pytest.raises(TypeError):
        timm.create_model("cmhsa_conv", **kw, not_a_model_arg=1)


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_timms_private_modules_are_needed_by_features_only_alone() -> None:
    """A timm without the private names cmhsa borrows for ``features_only`` (timm.models._builder's
    pretrained_cfg_for_features, _features' FeatureGetterNet) still registers and builds cmhsa's
    models and trains, and training never imports convit_convert.timm unless it exports a timm folder."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import convit_convert.train.run\n"
        "assert 'convit_convert.timm' not in sys.modules, 'training imported the timm registry'\n"
        "import timm.models._builder as b, timm.models._features as f\n"
        "del b.pretrained_cfg_for_features, f.FeatureGetterNet\n"
        "import timm, convit_convert.timm\n"
        "m = timm.create_model('cmhsa_conv', img_size=16, patch_size=4, depth=1, num_classes=3)\n"
        "assert m.num_classes == 3\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
