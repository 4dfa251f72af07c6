"""Phase-2 starts without a conv phase (--init mimetic, --init impulse), each checked by its
defining property on the model training builds: weight products measured against the published
formula's distribution, attention measured by `cmhsa attention` on data. Then both through the CLI:
train, save, inspect, export to ONNX."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import invoke, one_error_line
from convit_convert.analysis import recording
from convit_convert.api import save_checkpoint
from convit_convert.options.training import TrainConfig
from convit_convert.theory import patch_offsets
from convit_convert.train.phases import build_phase_model

# P 4, 3 hidden channels: d = 48 (the EXPERIMENTS.md model's width), a 4×4 grid, K 3: 9 heads
MODEL = dict(data="synthetic", img_size=16, patch_size=4, depth=2, kernel_size=3, phase="phase2")
CLI_TINY = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --epochs 1 --warmup-epochs 0 --device cpu"
).split()


def built(**kw):
    return build_phase_model(TrainConfig.from_flags(**{**MODEL, **kw}), num_classes=10, log=lambda _: None)


def head_products(attn, d: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each head's W_Q,hᵀ W_K,h and the layer's Σ_h W_V,hᵀ W_O,hᵀ, from the built weights."""
    h, qk, vd = attn.num_heads, attn.qk_dim, attn.v_dim
    q, k, v, o = (
        t.detach().double() for t in (attn.q.weight, attn.k.weight, attn.v.weight, attn.proj.weight)
    )
    qk_h = [q[i * qk : (i + 1) * qk].T @ k[i * qk : (i + 1) * qk] for i in range(h)]
    vo = sum(v[i * vd : (i + 1) * vd].T @ o[:, i * vd : (i + 1) * vd].T for i in range(h))
    return qk_h, vo


@pytest.mark.parametrize("alpha,beta", [(0.7, 0.4), (1.5, 0.1)])
def test_mimetic_products_follow_the_published_distribution(alpha: float, beta: float) -> None:
    """W_Q,hᵀW_K,h = α(Z_h + I) and Σ_h W_V,hᵀW_O,hᵀ = β(Z − I), Z with N(0, 1/d) entries. With
    d = 48: the diagonal's mean is α (−β) with std α/d (β/d), tested at 5 std; the off-diagonal
    entries have std α/√d (β/√d), whose estimate from 2,256 entries has a relative std of 1.5%,
    tested at 10%; their mean is 0 within 5 std of the mean (α/√d/47)."""
    pm = built(init="mimetic", mimetic_alpha=alpha, mimetic_beta=beta)
    assert pm.init == {
        "init": "mimetic",
        "mimetic_alpha": alpha,
        "mimetic_beta": beta,
        "locality_sigma_patches": 1.0,
    }
    d = pm.config.embed_dim
    assert d == 48 and pm.config.pinning == "hard"
    off = ~torch.eye(d, dtype=torch.bool)
    for block in pm.model.blocks:
        qk_h, vo = head_products(block.attn, d)
        for scale, sign, m in [(alpha, 1, p) for p in qk_h] + [(beta, -1, vo)]:
            assert m.diag().mean().item() == pytest.approx(sign * scale, abs=5 * scale / d)
            assert m[off].std().item() == pytest.approx(scale / math.sqrt(d), rel=0.10)
            assert abs(m[off].mean().item()) < 5 * scale / math.sqrt(d) / (d - 1)
        assert all(not torch.equal(qk_h[0], p) for p in qk_h[1:])  # an independent Z per head
        for name in ("q", "k", "v"):
            assert not getattr(block.attn, name).bias.any()
        # locality from position: with q = k = 0 the bias alone gives a neighbour e^-1/2 of the
        # query patch's weight and a patch two rows away e^-2 (σ = 1 patch)
        table = block.attn.rel_pos_bias.detach()
        gh, gw = pm.config.grid_size
        centre = table[:, gh - 1, gw - 1]
        assert torch.allclose(table[:, gh - 1, gw] - centre, torch.tensor(-0.5))
        assert torch.allclose(table[:, gh + 1, gw - 1] - centre, torch.tensor(-2.0))


def test_mimetic_is_seeded_and_refuses_gated_pinning(tmp_path: Path) -> None:
    a, b, c = built(init="mimetic"), built(init="mimetic"), built(init="mimetic", seed=1)
    qa, qb, qc = (m.model.blocks[0].attn.q.weight for m in (a, b, c))
    assert torch.equal(qa, qb) and not torch.equal(qa, qc)
    r = invoke("train", "phase2", *CLI_TINY, "--init", "mimetic", "--pinning", "gated", "-o", tmp_path / "g")
    assert r.exit_code == 2 and "give --pinning hard" in r.output and "Traceback" not in r.output, r.output
    for flag, value, msg in (
        ("--mimetic-alpha", "-1", "--mimetic-alpha must be 0 ≤ x ≤ 100, got -1"),
        ("--mimetic-beta", "nan", "--mimetic-beta must be 0 ≤ x ≤ 100, got nan"),
        ("--impulse-offsets", "diagonal", "--impulse-offsets must be one of conversion, random"),
    ):
        r = invoke("train", "phase2", *CLI_TINY, "--init", "impulse", flag, value, "-o", tmp_path / "bad")
        one_error_line(r, 2, msg)
        assert not r.stdout.strip(), r.stdout
        assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("offsets", ["conversion", "random"])
def test_impulse_heads_attend_to_their_offset(tmp_path: Path, offsets: str) -> None:
    """The fresh model, saved and read by `cmhsa attention` on images: every head pinned (to Δ in
    order, or to offsets drawn from Δ), its weight on that offset 1 to within 1e-6 (the margin of
    40 leaves e^-40), at every in-image query (read from the recorded weights), gates at 0."""
    pm = built(init="impulse", impulse_offsets=offsets, seed=3)
    cfg = pm.config
    assert cfg.pinning == "gated" and pm.init["impulse_offsets"] == offsets
    path = tmp_path / "fresh.safetensors"
    save_checkpoint(path, cfg, pm.model.state_dict())
    r = invoke(
        "attention", path, "-o", tmp_path / "att", "--data", "synthetic", "--images", "64", "--device", "cpu"
    )
    assert r.exit_code == 0, r.output
    report = json.loads((tmp_path / "att" / "attention.json").read_text())
    window = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    drawn = []
    for block in report["blocks"]:
        heads = block["heads"]
        assert all(h["pinned_share"] > 1 - 1e-6 and h["gate"] == 0.0 for h in heads), heads
        got = [tuple(h["offset"]) for h in heads]
        assert got == window if offsets == "conversion" else set(got) <= set(window)
        drawn.append(got)
    if offsets == "random":
        assert drawn[0] != drawn[1] and len(set(drawn[0] + drawn[1])) > 3  # drawn, not Δ in order
    # every in-image query, not just the mean
    gh, gw = cfg.grid_size
    x = torch.randn(8, 3, 16, 16)
    model = pm.model.eval()
    with torch.no_grad(), recording(model) as records:
        model(x)
    for block, rec in zip(report["blocks"], records, strict=True):
        w = rec[0]
        for hi, head in enumerate(block["heads"]):
            dy, dx = head["offset"]
            for qy in range(gh):
                for qx in range(gw):
                    ky, kx = qy + dy, qx + dx
                    if 0 <= ky < gh and 0 <= kx < gw:
                        assert w[:, hi, qy * gw + qx, ky * gw + kx].min() > 1 - 1e-6


@pytest.mark.parametrize("init", ["mimetic", "impulse"])
def test_starts_train_save_inspect_and_export(tmp_path: Path, init: str) -> None:
    given = [] if init == "impulse" else ["--init", init]  # impulse: the default without a checkpoint
    r = invoke("train", "phase2", *CLI_TINY, *given, "-o", tmp_path / "run")
    assert r.exit_code == 0, r.output
    assert f"started {init}" in r.output
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["init_info"]["init"] == init and cfg["model"]["pinning"] == (
        "hard" if init == "mimetic" else "gated"
    )
    vit = tmp_path / "run" / "vit.safetensors"
    r = invoke("inspect", vit)
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.startswith("│ init "))
    assert f"│ {init}" in row and "{" not in row, row  # words, not the metadata's raw JSON
    gated = cfg["model"]["pinning"] == "gated"
    assert (" g=" in r.output) == gated and ("g: the head's gate" in r.output) == gated
    r = invoke("export", vit, "-o", tmp_path / "vit.onnx")
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "vit.onnx.report.json").read_text())["passed"]


def test_phase2_without_init_says_where_it_starts(tmp_path: Path) -> None:
    """A forgotten --init turns a two-phase run into a 'phase 2 only' arm: the run says so, once,
    and names the flag; a warm-up of all the epochs says the peak is never reached."""
    r = invoke(
        "train", "phase2", "-o", tmp_path / "a", *CLI_TINY, "--train-samples", "64", "--val-samples", "32"
    )
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if "--init not given" in line]
    assert (
        len(said) == 1
        and "starts from impulse weights" in said[0]
        and "--init PHASE1_RUN/conv.safetensors" in said[0]
    )
    assert "never reaches its peak" not in r.output
    r = invoke(
        "train",
        "phase2",
        "-o",
        tmp_path / "b",
        *CLI_TINY,
        *"--init random --warmup-epochs 1 --train-samples 64 --val-samples 32".split(),
    )
    assert r.exit_code == 0, r.output
    assert "--init not given" not in r.output
    assert "warning: --warmup-epochs 1 >= --epochs 1: the learning rate never reaches its peak" in r.output
