"""Phase 1's two conv forms (convit_convert/conv_mixer.py): the token products (Theorem 1 read
backwards) and F.conv2d on the pixel view compute one function. The reference is independent of
both: conftest.reference_conv (explicit zero padding, then a valid convolution) on
conftest.tokens_to_pixels (explicit indexing of the documented token layout).

Tolerances. float64: both forms sum the same K²·C products in another order, so they agree to a
few ulps (1e-12 of the output's scale). float32: each output sums at most K²·C (here ≤ 81) products
of O(1) values; rounding in any order stays within ~sqrt(81)·2^-24 ≈ 5e-7 of the scale, so 1e-5
leaves a margin and still fails for any wrong tap (a missing tap is O(1)). bf16 autocast: the
inputs and weights rounded to 8 bits (2^-8 ≈ 4e-3 relative each), so 5e-2 of the scale.
"""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import reference_conv, tokens_to_pixels
from convit_convert import resources
from convit_convert.config import ViTConfig
from convit_convert.conv_mixer import ConvMixer, patchify, token_form_bytes, token_plan, token_sizes
from convit_convert.errors import CmhsaError
from convit_convert.model import VisionTransformer
from convit_convert.options.training import TrainConfig
from convit_convert.taps import output_projection
from convit_convert.train.phases import check_trainable

# (channels, K, P, dilation, grid): K < 2P (9 offsets), K >= 2P (25), even K, dilation > 1,
# non-square grids, 1 and 3 channels, the paper's P 16 / K 5; dilation wider than a patch: boxes
# with unread pixels inside (K 3, P 2, D 7) and no offset (0, 0) at all (K 2, P 2, D 5: wrong by
# 5.7 before the token form read offsets[0] through its shift)
CASES = [
    (3, 5, 16, 1, (3, 2)),
    (1, 3, 4, 1, (5, 5)),
    (3, 5, 2, 1, (6, 4)),
    (3, 7, 2, 1, (5, 3)),
    (2, 9, 4, 2, (3, 5)),
    (3, 3, 4, 3, (4, 6)),
    (2, 4, 4, 1, (3, 3)),
    (1, 3, 2, 7, (5, 5)),
    (1, 2, 2, 5, (4, 5)),
]


def mixer_and_input(c, k, p, d, grid, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = ConvMixer(c, k, d, grid, p, "tokens").double()
    with torch.no_grad():
        m.weight.copy_(torch.randn(m.weight.shape, generator=g, dtype=torch.float64))
        m.bias.copy_(torch.randn(c, generator=g, dtype=torch.float64))
    x = torch.randn(2, grid[0] * grid[1], p * p * c, generator=g, dtype=torch.float64)
    return m, x


def reference(m: ConvMixer, x: torch.Tensor) -> torch.Tensor:
    pixels = tokens_to_pixels(x, m.grid_size, m.patch_size)
    return patchify(reference_conv(pixels, m.weight, m.bias, m.dilation[0]), m.patch_size)


def outputs_and_grads(m: ConvMixer, x: torch.Tensor, form: str | None):
    """The output, and the gradients of a fixed random projection of it w.r.t. weight, bias, input."""
    m.zero_grad()
    x = x.clone().requires_grad_(True)
    out = reference(m, x) if form is None else m(x) if setattr(m, "form", form) is None else None
    probe = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(
        out.dtype
    )
    (out * probe).sum().backward()
    return out.detach(), m.weight.grad.clone(), m.bias.grad.clone(), x.grad.clone()


def scale(t: torch.Tensor) -> float:
    return float(t.detach().abs().max())


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[0]}-K{c[1]}-P{c[2]}-D{c[3]}-{c[4][0]}x{c[4][1]}")
@pytest.mark.parametrize("form", ["tokens", "pixels"])
def test_each_form_and_its_gradients_equal_the_reference_convolution(case, form: str) -> None:
    m, x = mixer_and_input(*case)
    ref = outputs_and_grads(m, x, None)
    got = outputs_and_grads(m, x, form)
    for name, a, b in zip(("output", "weight grad", "bias grad", "input grad"), got, ref, strict=True):
        assert (a - b).abs().max() <= 1e-12 * scale(b), (name, float((a - b).abs().max()), scale(b))


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: f"C{c[0]}-K{c[1]}-P{c[2]}")
def test_float32_and_bf16_autocast_stay_within_their_rounding(case) -> None:
    m64, x64 = mixer_and_input(*case)
    ref = outputs_and_grads(m64, x64, None)
    m32, x32 = copy.deepcopy(m64).float(), x64.float()
    for form in ("tokens", "pixels"):
        got = outputs_and_grads(m32, x32, form)
        for a, b in zip(got, ref, strict=True):
            assert (a.double() - b).abs().max() <= 1e-5 * scale(b), form
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = m32(x32)
        assert (out.double() - ref[0]).abs().max() <= 5e-2 * scale(ref[0]), form


def test_a_model_gives_the_same_logits_and_state_in_either_form() -> None:
    """Forms change how, not what: the same state dict (no buffer of the form is saved), the same
    logits and gradients; 'auto' is pixels on the CPU."""
    cfg = ViTConfig.build(img_size=(24, 16), patch_size=4, in_chans=1, depth=2, kernel_size=5, num_classes=7)
    models = {f: VisionTransformer(cfg, conv_form=f).double() for f in ("pixels", "tokens", "auto")}
    state = models["pixels"].state_dict()
    x = torch.randn(3, 1, 24, 16, dtype=torch.float64)
    probe = torch.randn(3, 7, dtype=torch.float64)
    logits = {}
    for f, m in models.items():
        assert m.state_dict().keys() == state.keys()
        m.load_state_dict(state)
        logits[f] = m(x)
        (logits[f] * probe).sum().backward()
    assert (logits["tokens"] - logits["pixels"]).abs().max() < 1e-12 * scale(logits["pixels"])
    assert torch.equal(logits["auto"], logits["pixels"])
    grads = {f: [p.grad for p in m.parameters()] for f, m in models.items()}
    top = max(scale(g) for g in grads["pixels"])
    names = [n for n, _ in models["pixels"].named_parameters()]
    for name, a, b in zip(names, grads["tokens"], grads["pixels"], strict=True):
        assert (a - b).abs().max() <= 1e-12 * top, name
    assert [b.conv.form_on(torch.device("cuda")) for b in models["auto"].blocks] == ["tokens"] * 2


def test_the_paper_s_mixer_reads_strips_of_its_neighbours() -> None:
    """P 16, K 5: the centre patch whole (768 features), each edge neighbour 2 columns or rows (96),
    each corner 2x2 pixels (12): a (B·N, 768) x (768, 768) product and a (B·N, 432) x (432, 768)
    one, through 1,200 of W^O's 6,912 columns."""
    m = ConvMixer(3, 5, 1, (14, 14), 16, "tokens")
    areas = [(y1 - y0) * (x1 - x0) * 3 for y0, y1, x0, x1 in m.boxes]
    assert m.offsets[0] == (0, 0) and m.boxes[0] == (0, 16, 0, 16) and m.centre == 768
    assert sorted(areas[1:]) == [12] * 4 + [96] * 4
    assert m.boxes[m.offsets.index((1, 0))] == (0, 2, 0, 16)  # the top rows of the patch below
    assert m.select_y.shape == m.select_x.shape == (400, 16, 5)
    assert m.token_weight().shape == (768, 1200)


def test_a_model_built_on_the_meta_device_holds_its_selectors_on_it() -> None:
    cfg = ViTConfig.build(img_size=224, patch_size=16, depth=6, kernel_size=5)
    with torch.device("meta"):
        model = VisionTransformer(cfg)
    assert all(b.conv.select_y.is_meta and b.conv.select_x.is_meta for b in model.blocks)


# which of W^O's columns the token form builds, against the conversion's gather (taps.output_projection)


def plan_columns(m: ConvMixer) -> torch.Tensor:
    """W^O's columns (r, s_y, s_x, i) of the boxes, in the plan's order."""
    p, c = m.patch_size, m.in_channels
    groups = [
        (r * p * p + y * p + x) * c for r, y, x in token_plan(c, m.kernel_size[0], p, m.dilation[0]).pixels()
    ]
    return (torch.tensor(groups)[:, None] + torch.arange(c)).flatten()


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"C{c[0]}-K{c[1]}-P{c[2]}-D{c[3]}")
def test_the_token_form_builds_exactly_the_columns_of_w_o_its_boxes_read(case) -> None:
    """The boxes hold every column of W^O a tap reaches (the rest of W^O is zero), each box's edge
    rows and columns are read (no box larger than it must be), and the columns built equal the
    gather's: exact, float64 from the same taps."""
    c, k, p, d, grid = case
    m, _ = mixer_and_input(c, k, p, d, grid)
    wo = output_projection(m.weight.detach(), p, d, m.offsets)
    cols = plan_columns(m)
    outside = torch.ones(wo.shape[1], dtype=torch.bool)
    outside[cols] = False
    ones = output_projection(torch.ones_like(m.weight), p, d, m.offsets)
    assert not ones[:, outside].any()
    for r, (y0, y1, x0, x1) in enumerate(m.boxes):
        read = ones[:, r * p * p * c : (r + 1) * p * p * c].any(0).view(p, p, c).any(2)
        assert read[y0].any() and read[y1 - 1].any() and read[:, x0].any() and read[:, x1 - 1].any()
        assert (
            not read[:y0].any() and not read[y1:].any() and not read[:, :x0].any() and not read[:, x1:].any()
        )
    assert torch.equal(m.token_weight().detach(), wo[:, cols])
    assert token_sizes(c, k, p, d) == (len(m.offsets), m.centre, len(cols) - m.centre)


def test_training_memory_is_estimated_for_the_form_that_will_run(monkeypatch: pytest.MonkeyPatch) -> None:
    # was: --conv-form tokens sized as the pixel form (a CPU run killed by the kernel at 22.8 GB)
    flags = dict(phase="phase1", data="synthetic", img_size=64, patch_size=4, kernel_size=17, depth=2)
    flags |= dict(batch_size=128, device="cpu", out="unused")
    pixels = TrainConfig.from_flags(conv_form="pixels", **flags)
    tokens = TrainConfig.from_flags(conv_form="tokens", **flags)
    mcfg = ViTConfig.build(img_size=64, patch_size=4, in_chans=3, depth=2, kernel_size=17, num_classes=10)
    extra = 2 * token_form_bytes(3, 17, 4, 1, mcfg.grid_size, 128)
    base = 16 * mcfg.num_params() + mcfg.activation_bytes(128, training=True)
    # measured on this size (2 cores, float32, one step's peak): pixels 0.25 GB, tokens 0.71 GB
    assert extra > base
    monkeypatch.setattr(resources, "available_memory", lambda: base + extra // 2)
    check_trainable(pixels, mcfg)
    with pytest.raises(CmhsaError, match="token form"):
        check_trainable(tokens, mcfg)
