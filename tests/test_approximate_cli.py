"""``cmhsa convert --heads N --approximate`` and ``cmhsa heads --checkpoint``: refusals, the exact
case, the report against numbers recomputed here, labelled calibration against ``cmhsa eval``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import FIXTURE, invoke
from convit_convert.api import load_checkpoint
from convit_convert.approximate import choose, noise_calibration
from convit_convert.theory import patch_offsets

SMALL = (
    "--calib-images",
    "48",
    "--heldout-images",
    "40",
)  # FIXTURE: 32 px, P = 4, K = 5: 9 offsets, 4 blocks


def test_refusals(tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke("convert", FIXTURE, "-o", out, "--heads", "0", "--approximate")
    assert r.exit_code == 2 and "--heads must be 1 ≤ x ≤ 4096, got 0" in r.stderr and not out.exists()
    r = invoke("convert", FIXTURE, "-o", out, "--heads", "4", "--approximate", "--rule", "random")
    assert r.exit_code == 2 and "--rule must be one of greedy, corner" in r.stderr
    r = invoke("convert", FIXTURE, "-o", out, "--heads", "4")  # without --approximate: the bound, as before
    assert r.exit_code == 2 and "9 patch offsets" in r.stderr
    r = invoke("convert", FIXTURE, "-o", out, "--heads", "4", "--approximate", "--calib", "mnist")
    assert r.exit_code == 2 and "--calib must be one of" in r.stderr and not out.exists()
    r = invoke("convert", FIXTURE, "-o", out, "--calib", "digits")
    assert r.exit_code == 2 and "add --approximate" in r.stderr
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("heads", ["9", "12"])
def test_enough_heads_is_the_exact_conversion(tmp_path: Path, heads: str) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke("convert", FIXTURE, "-o", out, "--heads", heads, "--approximate")
    assert r.exit_code == 0, r.output
    assert "enough for this kernel, so the conversion is exact" in r.output
    rep = json.loads(out.with_name("v.report.json").read_text())
    assert rep["passed"] and rep["conversion"]["approximation"] is None
    assert max(e["rel"] for e in rep["verification"]["errors"]) <= 1e-5


def test_approximate_fails_tol_loudly_then_writes_a_model_whose_report_holds(tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke("convert", FIXTURE, "-o", out, "--heads", "6", "--approximate", *SMALL)
    assert r.exit_code == 1 and "FAIL" in r.output and not out.exists()
    rep = json.loads(out.with_name("v.report.json").read_text())  # the report is written either way
    assert rep["passed"] is False and rep["conversion"]["approximation"]["rule"] == "greedy"

    r = invoke("convert", FIXTURE, "-o", out, "--heads", "6", "--approximate", "--tol", "100", *SMALL)
    assert r.exit_code == 0, r.output
    rep = json.loads(out.with_name("v.report.json").read_text())
    a = rep["conversion"]["approximation"]
    all_offsets = {tuple(o) for o in patch_offsets(5, 4)}
    for b in a["blocks"]:
        assert len(b["kept"]) == 6 and len(b["dropped"]) == 3
        assert {tuple(o) for o in b["kept"] + b["dropped"]} == all_offsets
        assert b["error_after_each_drop"] == sorted(b["error_after_each_drop"])  # each drop loses more
        assert b["error_after_each_drop"][-1] == pytest.approx(b["calib_drop_error"])
        assert b["calib_refit_error"] <= b["calib_drop_error"] + 1e-12
    # the held-out logits error, recomputed here from the two files on the same noise images
    conv, attn = load_checkpoint(FIXTURE).model(), load_checkpoint(out).model()
    assert attn.cfg.num_heads == 6
    images = noise_calibration(conv.cfg, 48, 40, seed=0).heldout
    with torch.no_grad():
        lc, la = conv(images), attn(images)
    rel = ((la - lc).norm() / lc.norm()).item()
    assert a["heldout"]["logits_error"] == pytest.approx(rel, rel=1e-4)  # float32 forwards, float64 sums
    assert rep["conversion"]["offsets"] == a["blocks"][0]["kept"]


def test_no_refit_is_plain_dropping_and_corner_drops_diagonals_first(tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke(
        "convert",
        FIXTURE,
        "-o",
        out,
        *"--heads 5 --approximate --rule corner --no-refit --tol 100".split(),
        *SMALL,
    )
    assert r.exit_code == 0, r.output
    a = json.loads(out.with_name("v.report.json").read_text())["conversion"]["approximation"]
    for b in a["blocks"]:
        assert b["dropped"] == [[-1, -1], [-1, 1], [1, -1], [1, 1]]
        assert b["calib_refit_error"] == b["calib_drop_error"]


def test_refit_beats_corner_rule_on_calibration_set() -> None:
    """The measured choice with the refit is never worse than the fixed rule without it."""
    conv = load_checkpoint(FIXTURE).model()
    images = noise_calibration(conv.cfg, 48, 1).images
    for n in (8, 5, 2):
        fixed = choose(conv, n, images, rule="corner", refit=False)
        measured = choose(conv, n, images, rule="greedy", refit=True)
        for f, m in zip(fixed, measured, strict=True):
            assert m.drop_error <= f.drop_error + 1e-9  # greedy's first steps are optimal one at a time
            assert m.refit_error <= m.drop_error + 1e-12


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_labelled_calibration_matches_cmhsa_eval(tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke(
        "convert", FIXTURE, "-o", out, "--heads", "4", "--approximate", "--calib", "digits", "--tol", "10"
    )
    assert r.exit_code == 0, r.output
    h = json.loads(out.with_name("v.report.json").read_text())["conversion"]["approximation"]["heldout"]
    assert h["images"] == 359  # the whole digits validation split (fewer than --heldout-images 512)
    # the README's example (float32 forwards: its printed digits, not more)
    assert (round(h["attn_top1"], 2), round(h["conv_top1"], 2)) == (96.38, 98.33)
    assert round(h["logits_error"], 3) == 0.319
    for path, key in ((FIXTURE, "conv_top1"), (out, "attn_top1")):
        e = invoke("eval", path, "--data", "digits", "--workers", "0", "--device", "cpu")
        assert e.exit_code == 0, e.output
        top1 = float(next(line for line in e.output.splitlines() if line.startswith("│")).split("│")[2])
        assert abs(top1 - h[key]) <= 100 / 359 + 1e-6  # float32 eval against the report: one image at most


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_heads_checkpoint_sweep(tmp_path: Path) -> None:
    r = invoke("heads", "--checkpoint", FIXTURE, *SMALL)
    assert r.exit_code == 0, r.output
    rows = [line for line in r.output.splitlines() if line.startswith("│")]
    assert [int(line.split("│")[1]) for line in rows] == list(range(1, 10))
    last = [float(c) for c in rows[-1].split("│")[2:6]]
    assert last == [0.0, 0.0, 0.0, 0.0]  # N = 9: the exact conversion
    first = [float(c) for c in rows[0].split("│")[2:6]]
    assert all(v > 0.1 for v in first)
    r = invoke("heads", "--checkpoint", FIXTURE, "--kernel", "3")
    assert r.exit_code == 2 and "K = 5" in r.stderr
    r = invoke("heads")
    assert r.exit_code == 2 and "give --kernel-size and --patch-size, or --checkpoint" in r.stderr
    for bad, why in (
        (("--rule", "x"), "--rule must be one of"),
        (("--heldout-images", "0"), "--heldout-images must be 1 ≤ x ≤ 10000000, got 0"),
    ):
        r = invoke("heads", "--checkpoint", FIXTURE, *bad)
        assert r.exit_code == 2 and why in r.stderr and not r.stdout  # refused before anything is printed
