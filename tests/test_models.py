"""The two models: token layout, the conv mixer, the attention's bias convention and sink."""

from __future__ import annotations

import torch

from conftest import conv_model, reference_conv, tokens_to_pixels
from convit_convert.config import ViTConfig
from convit_convert.model import RelPosAttention, VisionTransformer, patchify, unpatchify


def test_patch_layout_is_channel_last_row_major() -> None:
    b, c, p, (gh, gw) = 2, 3, 4, (3, 2)
    x = torch.randn(b, c, gh * p, gw * p)
    tokens = patchify(x, p)
    assert tokens.shape == (b, gh * gw, p * p * c)
    gy, gx, py, px, ch = 2, 1, 3, 0, 2
    assert tokens[1, gy * gw + gx, (py * p + px) * c + ch] == x[1, ch, gy * p + py, gx * p + px]
    assert torch.equal(tokens_to_pixels(tokens, (gh, gw), p), x)
    assert torch.equal(unpatchify(tokens, (gh, gw), p), x)


def test_conv_mixer_is_a_same_convolution_on_the_pixel_view() -> None:
    for k, d in [(5, 1), (4, 1), (3, 2), (1, 1)]:
        model = conv_model(kernel_size=k, dilation=d, hidden_chans=2, in_chans=2)
        mixer = model.blocks[0].conv
        x = torch.randn(2, model.cfg.num_patches, model.cfg.embed_dim, dtype=torch.float64)
        ref = reference_conv(tokens_to_pixels(x, model.cfg.grid_size, 4), mixer.weight, mixer.bias, d)
        assert torch.allclose(unpatchify(mixer(x), model.cfg.grid_size, 4), ref, rtol=0, atol=1e-12)


def test_relative_position_bias_convention() -> None:
    """bias[h, dy+Gh-1, dx+Gw-1] = large makes query (y, x) read key (y+dy, x+dx), checked by loop."""
    gh, gw, dim = 3, 4, 5
    attn = RelPosAttention(dim, (gh, gw), num_heads=1, qk_dim=2, v_dim=dim, sink=True).double()
    dy, dx = 1, -2
    with torch.no_grad():
        for lin in (attn.q, attn.k):
            lin.weight.zero_()
        attn.v.weight.copy_(torch.eye(dim))
        attn.v.bias.zero_()
        attn.proj.weight.copy_(torch.eye(dim))
        attn.proj.bias.zero_()
        attn.rel_pos_bias.zero_()
        attn.rel_pos_bias[0, dy + gh - 1, dx + gw - 1] = 90.0
        attn.sink.fill_(50.0)
    x = torch.randn(1, gh * gw, dim, dtype=torch.float64)
    out = attn(x)
    for y in range(gh):
        for x_ in range(gw):
            ky, kx = y + dy, x_ + dx
            expected = (
                x[0, ky * gw + kx] if 0 <= ky < gh and 0 <= kx < gw else torch.zeros(dim, dtype=torch.float64)
            )
            assert torch.allclose(out[0, y * gw + x_], expected, rtol=0, atol=1e-12), (y, x_)


def test_models_forward_nonsquare_and_heads() -> None:
    cfg = ViTConfig.build(img_size=(16, 24), patch_size=8, in_chans=3, hidden_chans=2, depth=2, num_classes=7)
    attn = VisionTransformer(cfg.with_attention(num_heads=9, qk_dim=8), drop_path_rate=0.1)
    x = torch.randn(2, 3, 16, 24)
    feats = attn.forward_features(x)
    assert feats.shape == (2, 6, 128)
    assert attn.forward_head(feats, pre_logits=True).shape == (2, 128)
    assert attn(x).shape == (2, 7)
    assert attn.blocks[0].attn.v.weight.shape == (9 * 128, 128)
    assert "blocks.1.attn.rel_pos_bias" in attn.no_weight_decay()
    assert set(attn.state_dict()) >= {"patch_embed.weight", "blocks.0.attn.sink", "head.weight"}
    attn.eval()
    assert torch.equal(attn(x), attn(x))  # drop path is off in eval
    try:
        attn(torch.randn(1, 3, 16, 16))
    except ValueError as e:
        assert "16, 24" in str(e)
    else:
        raise AssertionError("wrong image size accepted")


def test_state_dict_names_match_the_format() -> None:
    conv = conv_model()
    assert "blocks.0.conv.weight" in conv.state_dict()
    assert "patch_embed.weight" not in conv.state_dict()  # identity embedding has no tensors
    assert not any("rel_pos_index" in k for k in VisionTransformer(conv.cfg.with_attention(9)).state_dict())
