"""Fewer heads than the theorem needs: the greedy choice and the W^O refit (convit_convert.approximate)."""

from __future__ import annotations

import pytest
import torch

from convit_convert.approximate import choose
from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.spec import ConversionSpec
from convit_convert.verify import verify_models

CFG = ViTConfig.build(img_size=16, patch_size=4, depth=2, num_classes=5, kernel_size=5)


@pytest.fixture(scope="module")
def conv() -> VisionTransformer:
    torch.manual_seed(0)
    model = VisionTransformer(CFG).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def test_all_offsets_kept_is_the_exact_conversion(conv: VisionTransformer) -> None:
    """N = |Δ|: nothing dropped, the refit stays at the kernel's taps (ridge), exact on held-out images."""
    choices = choose(conv, 9, torch.randn(16, 3, 16, 16, dtype=torch.float64))
    assert all(not c.dropped and c.drop_error < 1e-12 and c.refit_error < 1e-12 for c in choices)
    plan = ConversionSpec(heads=9).plan(CFG)
    sd, acfg = (
        convert_state_dict(conv.state_dict(), plan, overrides=[(c.kept, c.wo) for c in choices]),
        plan.config,
    )
    attn = VisionTransformer(acfg).double()
    attn.load_state_dict(sd)
    # the refit is a float64 solve of a (N·d)² system: its rounding (~1e-13 here) sits at 1e-12's edge
    assert verify_models(conv, attn, dtype=torch.float64, tol=1e-10, seed=5).passed


@pytest.mark.parametrize("heads", [8, 6, 4, 1])
def test_refit_is_never_worse_than_dropping_on_the_calibration_set(
    conv: VisionTransformer, heads: int
) -> None:
    choices = choose(conv, heads, torch.randn(64, 3, 16, 16, dtype=torch.float64))
    for c in choices:
        assert len(c.kept) == heads and len(c.kept) + len(c.dropped) == 9
        assert c.drop_error > 0 and c.refit_error <= c.drop_error + 1e-12
    plan = ConversionSpec(heads=heads, approximate=True).plan(CFG)
    sd, acfg = (
        convert_state_dict(conv.state_dict(), plan, overrides=[(c.kept, c.wo) for c in choices]),
        plan.config,
    )
    attn = VisionTransformer(acfg).double()
    attn.load_state_dict(sd)  # the file format holds an approximate model like any other
    assert attn.cfg.num_heads == heads
    result = verify_models(conv, attn, dtype=torch.float64, tol=1e-12, seed=5)
    assert not result.passed and result.worst.rel < 2.0  # approximate: measured, and fails a tight tol
