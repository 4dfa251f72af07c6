"""The conversion against independent references.

Tolerances: the construction is exact up to softmax leakage e^-40 ≈ 4e-18 (relative), so in float64
what remains is rounding of sums of at most K²·C·|Δ| products, far below 1e-12 relative. Float32
checks use 1e-5 (float32 eps 6e-8 times sums of a few hundred terms).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import conv_model, reference_conv, rel_err, tokens_to_pixels
from convit_convert.config import ViTConfig
from convit_convert.construct import convert_block, convert_state_dict, output_projection
from convit_convert.errors import CmhsaError
from convit_convert.model import RelPosAttention, VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from convit_convert.theory import patch_offsets
from convit_convert.verify import border_mask

PROPERTY = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)


@st.composite
def mixer_configs(draw: st.DrawFn) -> ViTConfig:
    p = draw(st.integers(1, 8))
    k = draw(st.integers(1, 11))
    d = draw(st.integers(1, 3))
    c = draw(st.integers(1, 3))
    gh, gw = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    linear = draw(st.booleans())
    in_chans = draw(st.integers(1, 3)) if linear else c
    return ViTConfig.build(
        img_size=(gh * p, gw * p),
        patch_size=p,
        in_chans=in_chans,
        hidden_chans=c,
        depth=1,
        mlp_ratio=1.0,
        num_classes=3,
        kernel_size=k,
        dilation=d,
        patch_embed="linear" if linear else "identity",
    )


def attention_from(cfg: ViTConfig, weight: torch.Tensor, bias: torch.Tensor | None, **kw) -> RelPosAttention:
    plan = ConversionSpec(**kw).plan(cfg)  # heads default: as many as Δ has offsets
    acfg = plan.config
    attn = RelPosAttention(acfg.embed_dim, acfg.grid_size, acfg.num_heads, acfg.qk_dim, acfg.v_dim, acfg.sink)
    attn.double().load_state_dict(convert_block(weight, bias, plan))
    return attn


@PROPERTY
@given(cfg=mixer_configs(), seed=st.integers(0, 2**16))
def test_attention_block_equals_conv2d(cfg: ViTConfig, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    c, k = cfg.hidden_chans, cfg.kernel_size
    weight = torch.randn(c, c, k, k, generator=g, dtype=torch.float64)
    bias = torch.randn(c, generator=g, dtype=torch.float64)
    attn = attention_from(cfg, weight, bias)
    x = torch.randn(2, cfg.num_patches, cfg.embed_dim, generator=g, dtype=torch.float64)
    with torch.no_grad():
        out = tokens_to_pixels(attn(x), cfg.grid_size, cfg.patch_size)
    ref = reference_conv(tokens_to_pixels(x, cfg.grid_size, cfg.patch_size), weight, bias, cfg.dilation)
    assert rel_err(out, ref) <= 1e-12


def output_projection_by_impulses(
    weight: torch.Tensor, p: int, d: int, offsets: list[tuple[int, int]]
) -> torch.Tensor:
    """W^O the slow way: put a one at each (head r, pixel s, channel i) of a neighbourhood image,
    convolve with F.conv2d, and read off the centre patch's output pixels (t, j)."""
    _c_out, c_in, _k, _ = weight.shape
    reach = max(max(abs(a), abs(b)) for a, b in offsets)
    g = 2 * reach + 1
    cols = []
    for dy, dx in offsets:
        for s in range(p * p):
            for i in range(c_in):
                img = torch.zeros(1, c_in, g * p, g * p, dtype=weight.dtype)
                img[0, i, (reach + dy) * p + s // p, (reach + dx) * p + s % p] = 1.0
                y = reference_conv(img, weight, None, d)[
                    0, :, reach * p : (reach + 1) * p, reach * p : (reach + 1) * p
                ]
                cols.append(y.permute(1, 2, 0).flatten())  # rows (t, j), channel-last
    return torch.stack(cols, 1)


@PROPERTY
@given(
    k=st.integers(1, 9),
    p=st.integers(1, 6),
    d=st.integers(1, 3),
    c_in=st.integers(1, 3),
    c_out=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_two_output_projection_constructions_agree(
    k: int, p: int, d: int, c_in: int, c_out: int, seed: int
) -> None:
    weight = torch.randn(
        c_out, c_in, k, k, generator=torch.Generator().manual_seed(seed), dtype=torch.float64
    )
    offsets = patch_offsets(k, p, d)
    fast = output_projection(weight, p, d, offsets)
    assert torch.equal(fast, output_projection_by_impulses(weight, p, d, offsets))


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"kernel_size": 4, "hidden_chans": 2, "in_chans": 3},  # even K, linear patch embedding
        {"kernel_size": 3, "dilation": 2, "patch_size": 2, "img_size": (10, 6)},
        {"kernel_size": 11, "patch_size": 4, "img_size": (24, 20)},  # 25 heads
        {
            "kernel_size": 3,
            "patch_size": 1,
            "img_size": (5, 4),
            "hidden_chans": 4,
            "in_chans": 4,
        },  # pixel input
        {"kernel_size": 1},
    ],
)
def test_whole_model_equivalence(kw: dict) -> None:
    conv = conv_model(seed=3, **kw)
    plan = ConversionSpec().plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg).double().eval()
    attn.load_state_dict(sd)
    x = torch.randn(3, conv.cfg.in_chans, *conv.cfg.img_size, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(attn(x), conv(x)) <= 1e-12
        assert rel_err(attn.forward_features(x), conv.forward_features(x)) <= 1e-12


def test_float32_paper_like_model() -> None:
    conv = conv_model(seed=1, dtype=torch.float32, img_size=64, patch_size=16, depth=2)
    plan = ConversionSpec().plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg).eval()
    attn.load_state_dict(sd)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert rel_err(attn(x), conv(x)) <= 1e-5


def test_without_sink_border_is_wrong_interior_exact() -> None:
    """The paper's construction: an out-of-image head averages all patches instead of reading 0."""
    cfg = ViTConfig.build(img_size=(20, 24), patch_size=4, hidden_chans=2, in_chans=2, kernel_size=5, depth=1)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(2, 2, 5, 5, generator=g, dtype=torch.float64)
    attn = attention_from(cfg, weight, None, sink=False)
    x = torch.randn(2, cfg.num_patches, cfg.embed_dim, generator=g, dtype=torch.float64)
    with torch.no_grad():
        out = attn(x)
    ref_px = reference_conv(tokens_to_pixels(x, cfg.grid_size, 4), weight, None, 1)
    from convit_convert.model import patchify

    ref = patchify(ref_px, 4)
    border = border_mask(cfg)
    assert border.sum() == 5 * 6 - 3 * 4
    assert rel_err(out[:, ~border], ref[:, ~border]) <= 1e-12
    assert rel_err(out[:, border], ref[:, border]) > 1e-2


def test_extra_heads_and_wide_values_stay_exact() -> None:
    cfg = ViTConfig.build(img_size=(12, 12), patch_size=4, hidden_chans=2, in_chans=2, kernel_size=3, depth=1)
    weight = torch.randn(2, 2, 3, 3, dtype=torch.float64)
    attn = attention_from(cfg, weight, None, heads=12, qk_dim=4, v_dim=40)
    proj = attn.proj.weight.view(32, 12, 40)
    assert torch.count_nonzero(proj[:, 9:]) == 0 and torch.count_nonzero(proj[:, :, 32:]) == 0
    x = torch.randn(1, 9, 32, dtype=torch.float64)
    ref = reference_conv(tokens_to_pixels(x, (3, 3), 4), weight, None, 1)
    with torch.no_grad():
        assert rel_err(tokens_to_pixels(attn(x), (3, 3), 4), ref) <= 1e-12


def test_random_qk_init_stays_exact() -> None:
    conv = conv_model(seed=2)
    plan = ConversionSpec(qk_dim=16, qk_init_std=1e-3).plan(conv.cfg)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    assert sd["blocks.0.attn.q.weight"].abs().max() > 0
    attn = VisionTransformer(acfg).double().eval()
    attn.load_state_dict(sd)
    x = torch.randn(2, 3, 12, 8, dtype=torch.float64)
    with torch.no_grad():
        assert rel_err(attn(x), conv(x)) <= 1e-12


def test_too_few_heads_is_refused_citing_the_bound() -> None:
    conv = conv_model()
    with pytest.raises(CmhsaError, match=r"8 heads are too few.*9 patch offsets.*Theorem 6"):
        convert_state_dict(conv.state_dict(), ConversionSpec(heads=8).plan(conv.cfg))
    cfg = ViTConfig.build(img_size=32, patch_size=4, kernel_size=7, depth=1)  # no proven bound here
    with pytest.raises(CmhsaError, match=r"9 patch offsets.*no lower bound is proven"):
        convert_state_dict(
            conv_model(img_size=32, kernel_size=7, depth=1).state_dict(), ConversionSpec(heads=4).plan(cfg)
        )


def test_narrow_values_are_refused_naming_the_file() -> None:
    """v_dim < embed_dim cannot carry a patch's d channels: refused, once, as bad input."""
    conv = conv_model()
    d = conv.cfg.embed_dim
    with pytest.raises(CmhsaError, match=rf"conv.safetensors: v_dim {d - 1} < embed_dim {d}"):
        convert_state_dict(
            conv.state_dict(), ConversionSpec(v_dim=d - 1).plan(conv.cfg), path="conv.safetensors"
        )


def test_low_precision_weights_are_copied_exactly() -> None:
    conv = conv_model(dtype=torch.bfloat16)
    plan = ConversionSpec().plan(conv.cfg)
    sd, _ = convert_state_dict(conv.state_dict(), plan), plan.config
    w = conv.blocks[0].conv.weight
    proj = sd["blocks.0.attn.proj.weight"]
    assert proj.dtype == torch.bfloat16
    assert set(proj.unique().tolist()) <= set(w.flatten().tolist()) | {0.0}
    assert torch.equal(sd["blocks.1.mlp.fc1.weight"], conv.blocks[1].mlp.fc1.weight)
