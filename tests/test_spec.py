"""The conversion as typed objects: ConversionSpec validates once and holds every default;
ConversionPlan derives Δ, the pinned heads and the logits the written tensors carry."""

from __future__ import annotations

import math

import pytest
import torch

from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict, pinned_offsets
from convit_convert.errors import CmhsaError
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.training import TrainConfig

CFG = ViTConfig.build(img_size=16, patch_size=4, hidden_chans=2, depth=1, mlp_ratio=1.0, num_classes=3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"heads": 0}, "`heads` must be 1 ≤ x ≤ 4096, got 0"),
        ({"qk_dim": -2}, "`qk_dim` must be 1 ≤ x ≤ 65536, got -2"),
        ({"v_dim": 0}, "`v_dim` must be 1 ≤ x ≤ 1048576, got 0"),
        ({"pinning": "soft"}, "`pinning` must be one of hard, gated, got 'soft'"),
        ({"rule": "best"}, "`rule` must be one of greedy, corner, got 'best'"),
        ({"margin": 0.0}, "`margin` must be 0 < x ≤ 10000, got 0"),
        ({"margin": math.inf}, "`margin` must be 0 < x ≤ 10000, got inf"),
        ({"margin": 1e5}, "`margin` must be 0 < x ≤ 10000, got 100000"),  # as --margin 1e5 is
        ({"tol": math.nan}, "`tol` must be 0 ≤ x ≤ 1000000, got nan"),
        ({"tol": math.inf}, "`tol` must be 0 ≤ x ≤ 1000000, got inf"),  # as --tol inf is
        ({"qk_init_std": -1.0}, "`qk_init_std` must be 0 ≤ x ≤ 10, got -1"),
    ],
)
def test_a_bad_choice_is_refused_when_the_spec_is_made(changes: dict, message: str) -> None:
    with pytest.raises(CmhsaError) as e:
        ConversionSpec(**changes)
    assert e.value.message == message
    with pytest.raises(CmhsaError):  # replace validates again
        ConversionSpec().replace(**changes)


def test_the_plan_is_the_paper_construction_for_a_5x5_kernel() -> None:
    plan = ConversionSpec().plan(CFG)  # K 5, P 4: Δ = {-1, 0, 1}²
    assert plan.offsets == tuple((dy, dx) for dy in (-1, 0, 1) for dx in (-1, 0, 1))
    assert plan.needed == 9 and plan.exact and not plan.approximate
    assert plan.pinned == plan.offsets
    cfg = plan.config
    assert (cfg.kind, cfg.num_heads, cfg.qk_dim, cfg.v_dim, cfg.sink, cfg.pinning) == (
        "attn",
        9,
        32,
        32,
        True,
        "hard",
    )
    n = 16  # a 4x4 grid of patches: S = ln N + margin, M = S + margin
    assert plan.sink_logit == pytest.approx(math.log(n) + 40.0)
    assert plan.offset_logit == pytest.approx(math.log(n) + 80.0)


def test_extra_heads_are_free_and_fewer_are_approximate_only_when_asked() -> None:
    assert ConversionSpec(heads=11).plan(CFG).pinned[9:] == (None, None)
    few = ConversionSpec(heads=4).plan(CFG)
    assert not few.exact and not few.approximate  # refused by the construction (test_convert.py)
    assert ConversionSpec(heads=4, approximate=True).plan(CFG).approximate
    assert not ConversionSpec(approximate=True).plan(CFG).approximate  # enough heads: exact


def test_an_offset_beyond_the_grid_leaves_its_head_free() -> None:
    cfg = ViTConfig.build(
        img_size=(4, 12), patch_size=4, hidden_chans=1, depth=1, mlp_ratio=1.0, num_classes=2
    )
    plan = ConversionSpec().plan(cfg)  # one row of patches: dy = ±1 is never in the image
    assert [o for o in plan.pinned if o is not None] == [(0, -1), (0, 0), (0, 1)]


@pytest.mark.parametrize("spec", [ConversionSpec(), ConversionSpec(sink=False, margin=12.0, pinning="gated")])
def test_the_written_tensors_carry_the_plan(spec: ConversionSpec) -> None:
    """The bias table's entries and sinks are the plan's logits, and each head reads back (by the
    file's own bias, construct.pinned_offsets) as the offset the plan gave it."""
    conv = VisionTransformer(CFG)
    plan = spec.plan(CFG)
    sd = convert_state_dict(conv.state_dict(), plan)
    table = sd["blocks.0.attn.rel_pos_bias"]
    assert torch.allclose(table.amax(dim=(1, 2)), torch.full((9,), plan.offset_logit))
    if spec.sink:
        assert torch.allclose(sd["blocks.0.attn.sink"], torch.full((9,), plan.sink_logit))
    assert pinned_offsets(table, sd.get("blocks.0.attn.sink")) == list(plan.pinned)


def test_bad_export_options_are_refused_when_made() -> None:
    """(``cmhsa export``'s flags take their defaults from :class:`ExportOptions` itself.)"""
    from convit_convert.api import ExportOptions

    with pytest.raises(CmhsaError, match="`device` must be auto, cpu, cuda or cuda:N"):
        ExportOptions(device="tpu")
    with pytest.raises(CmhsaError, match="`tol` must be 0 ≤ x ≤ 1000000, got -1"):
        ExportOptions(tol=-1.0)


def test_train_builds_its_conversion_from_its_fields() -> None:
    cfg = TrainConfig.from_flags(
        phase="phase2", init="conv.safetensors", heads=10, qk_dim=8, margin=20.0, seed=3
    )
    spec = cfg.conversion
    assert (spec.heads, spec.qk_dim, spec.margin, spec.seed, spec.pinning) == (10, 8, 20.0, 3, "gated")
