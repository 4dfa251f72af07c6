"""The inference-only fused attention equals the unfused model (float64; rounding only, so 1e-12)."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import conv_model, rel_err
from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict
from convit_convert.deploy import FusedRelPosAttention, fuse_attention
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec


@pytest.mark.parametrize("portable", [False, True])  # True: the form `cmhsa export` writes
@pytest.mark.parametrize(
    ("qk_dim", "sink", "pinning"),
    [
        (4, True, "hard"),
        (4, False, "hard"),
        (48, True, "hard"),
        (48, False, "hard"),
        (4, True, "gated"),
        (48, True, "gated"),
    ],
)  # d = 48
def test_fused_equals_unfused_random_weights(qk_dim: int, sink: bool, pinning: str, portable: bool) -> None:
    torch.manual_seed(0)
    cfg = ViTConfig.build(img_size=(12, 16), patch_size=4, depth=2, num_classes=5).with_attention(
        5, qk_dim, 52, sink, pinning
    )
    model = VisionTransformer(cfg).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.5)  # every weight and bias non-trivial, attention not pinned
        if pinning == "gated":
            for b in model.blocks:
                b.attn.gate.fill_(0.4)  # both softmaxes weigh
    fused = fuse_attention(copy.deepcopy(model), portable)
    assert isinstance(fused.blocks[0].attn, FusedRelPosAttention)
    assert fused.blocks[0].attn.fold_qk == (qk_dim == 48)
    x = torch.randn(3, 3, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) <= 1e-12


def test_fused_converted_model_is_still_the_convolution() -> None:
    conv = conv_model(seed=4)
    plan = ConversionSpec().plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg).double().eval()
    attn.load_state_dict(sd)
    fused = fuse_attention(attn)
    x = torch.randn(2, 3, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fused(x), conv(x)) <= 1e-12


@pytest.mark.parametrize("qk_dim", [8, None])  # None: d = 48, the folded W_Q^T W_K path
def test_fused_runs_under_bf16_autocast(qk_dim: int | None) -> None:
    """Under autocast the fused block runs its products in bf16 itself (its in-place GEMMs are not
    autocast ops; mixed dtypes used to fail). Its error against the float64 convolution is about
    the unfused model's own under the same autocast (bf16 unit roundoff 3.9e-3; 2e-2 bound)."""
    conv = conv_model(seed=5)
    plan = ConversionSpec(qk_dim=qk_dim).plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg).eval()
    attn.load_state_dict({k: v.float() for k, v in sd.items()})
    fused = fuse_attention(copy.deepcopy(attn))
    x = torch.randn(2, 3, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        ref = conv(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            e_fused = rel_err(fused(x.float()).double(), ref)
            e_attn = rel_err(attn(x.float()).double(), ref)
    assert e_fused < 2e-2 and e_fused < 2 * e_attn + 1e-3, (e_fused, e_attn)


@pytest.mark.parametrize(("grid", "sink"), [(4, True), (4, False), (7, True)])  # N = 16 (+1 → 24), 49 → 56
def test_padded_attention_equals_plain_softmax(grid: int, sink: bool) -> None:
    """RelPosAttention pads its keys (the sink as the first padded key); against softmax over the
    N real keys plus a sink column, written here directly (float64)."""
    from convit_convert.attention import RelPosAttention

    torch.manual_seed(0)
    attn = RelPosAttention(12, (grid, grid), num_heads=3, qk_dim=4, v_dim=5, sink=sink).double()
    for t in attn.parameters():
        torch.nn.init.normal_(t, std=0.5)
    x = torch.randn(2, grid * grid, 12, dtype=torch.float64)
    q = attn.q(x).view(2, -1, 3, 4).transpose(1, 2)
    k = attn.k(x).view(2, -1, 3, 4).transpose(1, 2)
    v = attn.v(x).view(2, -1, 3, 5).transpose(1, 2)
    logits = q @ k.transpose(-2, -1) / 2 + attn.rel_pos_bias.flatten(1)[:, attn.rel_pos_index]
    if sink:
        logits = torch.cat([logits, attn.sink.view(1, 3, 1, 1).expand(2, 3, grid * grid, 1)], -1)
    w = logits.softmax(-1)[..., : grid * grid]
    ref = attn.proj((w @ v).transpose(1, 2).reshape(2, grid * grid, 15))
    assert rel_err(attn(x), ref) < 1e-12


def test_timm_reparameterize_model_fuses_the_attention() -> None:
    """timm's inference step (``reparameterize_model``) reaches Block.reparameterize: every
    attention becomes the fused form, the original model is untouched, the logits agree (float64)."""
    import timm
    from timm.utils.model import reparameterize_model

    import convit_convert.timm  # noqa: F401  (registers the models)

    torch.manual_seed(0)
    model = timm.create_model("cmhsa_attn", img_size=16, patch_size=4, depth=2, num_classes=5).double().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    fused = reparameterize_model(model)
    assert all(isinstance(b.attn, FusedRelPosAttention) for b in fused.blocks)
    assert not any(isinstance(b.attn, FusedRelPosAttention) for b in model.blocks)
    x = torch.randn(2, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(fused(x), model(x)) <= 1e-12


def test_for_inference_fuses_where_exact_and_falls_back_otherwise() -> None:
    from convit_convert.deploy import for_inference

    conv = conv_model(seed=4, dtype=torch.float32)
    plan = ConversionSpec().plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg)
    attn.load_state_dict(sd)
    model, form = for_inference(attn)
    assert form == "fused" and isinstance(model.blocks[0].attn, FusedRelPosAttention)
    assert not isinstance(attn.blocks[0].attn, FusedRelPosAttention)  # a copy was fused
    model, form = for_inference(attn, tol=-1.0)  # no error is within a negative tolerance
    assert form == "trained" and model is attn
    assert for_inference(conv)[1] == "conv"
