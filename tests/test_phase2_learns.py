"""Trainable conversions (free extra heads, gated pinning) that are still exact at the start, the
attention analysis, Fashion-MNIST from IDX files, and the format's version 2."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from conftest import invoke, one_error_line, write_idx
from convit_convert.analysis import attention_stats
from convit_convert.api import load_checkpoint, save_checkpoint
from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict
from convit_convert.data import build_data
from convit_convert.deploy import fuse_attention, prepare_for_export
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.training import TrainConfig
from convit_convert.train.recipe import build_recipe
from convit_convert.train.run import run
from convit_convert.verify import verify_models

CFG = ViTConfig.build(img_size=(12, 16), patch_size=4, depth=2, num_classes=5, kernel_size=5)
VARIANTS = [("hard", 12), ("gated", 9), ("gated", 11)]  # free heads alone, gates alone, both


def random_conv(seed: int = 0) -> VisionTransformer:
    torch.manual_seed(seed)
    model = VisionTransformer(CFG)
    for p in model.parameters():  # weights of a trained-looking scale, biases included
        torch.nn.init.normal_(p, std=0.2)
    return model.eval()


def converted(pinning: str, heads: int, conv: VisionTransformer) -> VisionTransformer:
    plan = ConversionSpec(heads=heads, pinning=pinning).plan(CFG)
    sd, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
    attn = VisionTransformer(acfg)
    attn.load_state_dict(sd)
    return attn


@pytest.mark.parametrize(("pinning", "heads"), VARIANTS)
def test_trainable_conversions_are_exact_at_the_start(pinning: str, heads: int) -> None:
    """The same tolerances as the plain conversion: 1e-5 in float32, 1e-12 in float64, borders and
    logits included (a 3x4 grid: most patches are border patches)."""
    conv = random_conv()
    for dtype, tol in ((torch.float32, 1e-5), (torch.float64, 1e-12)):
        result = verify_models(copy.deepcopy(conv), converted(pinning, heads, conv), dtype=dtype, tol=tol)
        assert result.passed and all(e.judged for e in result.errors), result.worst


@pytest.mark.parametrize(("pinning", "heads"), VARIANTS)
def test_free_heads_and_gates_get_a_gradient_at_step_0(pinning: str, heads: int) -> None:
    attn = converted(pinning, heads, random_conv()).train()
    x = torch.randn(4, 3, 12, 16, generator=torch.Generator().manual_seed(1))
    torch.nn.functional.cross_entropy(attn(x), torch.tensor([0, 1, 2, 3])).backward()
    for block in attn.blocks:
        a = block.attn
        d = a.proj.weight.shape[0]
        w_o = a.proj.weight.grad.view(d, heads, a.v_dim)
        if heads > 9:  # the free heads' output weights: zero, yet learning from the first step
            assert torch.equal(a.proj.weight.detach().view(d, heads, -1)[:, 9:], torch.zeros_like(w_o[:, 9:]))
            assert (w_o[:, 9:].abs().amax(dim=(0, 2)) > 1e-6).all()
        if pinning == "gated":
            assert (a.gate.detach()[:9] == 0).all() and (a.gate.grad[:9].abs() > 1e-8).all()


def test_after_one_epoch_gates_and_free_heads_have_moved(tmp_path: Path) -> None:
    common = dict(
        data="synthetic",
        img_size=16,
        patch_size=4,
        depth=2,
        kernel_size=3,
        epochs=1,
        warmup_epochs=0,
        batch_size=32,
        workers=0,
        device="cpu",
        log_every=1000,
    )
    p1 = run(TrainConfig.from_flags(phase="phase1", out=str(tmp_path / "p1"), **common))
    conv = str(p1.out / "conv.safetensors")
    p2 = run(
        TrainConfig.from_flags(
            phase="phase2",
            out=str(tmp_path / "p2"),
            init=conv,
            pinning="gated",
            heads=10,
            attn_lr_mult=10.0,
            lr=1e-3,
            **common,
        )
    )
    ckpt = load_checkpoint(conv)
    start = convert_state_dict(ckpt.tensors, ConversionSpec(heads=10, pinning="gated").plan(ckpt.config))
    end = load_checkpoint(p2.out / "vit.safetensors").tensors
    for i in range(2):
        gate = end[f"blocks.{i}.attn.gate"]
        assert (gate[:9] - start[f"blocks.{i}.attn.gate"][:9]).abs().max() > 1e-4  # gates left 0
        free_w_o = end[f"blocks.{i}.attn.proj.weight"].view(48, 10, 48)[:, 9]
        assert free_w_o.abs().max() > 1e-4  # the free head's W_O left 0
    row = p2.rows[-1]  # the per-epoch attention metrics
    assert 0.9 < row["attn0_share"] <= 1.0 and 0 < row["attn0_gate"] < 0.2 and row["attn0_dist_px"] > 0


def test_fused_and_onnx_forms_of_gated_and_free_heads(tmp_path: Path) -> None:
    """Mid-training (gates at 0.3, free heads' W_O non-zero): the fused model in float64, and the
    exported ONNX file in onnxruntime (export's own check), against the model."""
    attn = converted("gated", 11, random_conv()).double().eval()
    with torch.no_grad():
        for block in attn.blocks:
            block.attn.gate.fill_(0.3)
            block.attn.proj.weight.normal_(std=0.05)
    x = torch.randn(3, 3, 12, 16, dtype=torch.float64)
    with torch.no_grad():
        ref = attn(x)
        for form in (fuse_attention, prepare_for_export):
            assert (form(copy.deepcopy(attn))(x) - ref).abs().max() <= 1e-12 * ref.abs().max()
    path = tmp_path / "gated.safetensors"
    save_checkpoint(path, attn.cfg, attn.float().state_dict())
    r = invoke(["export", str(path), "-o", str(tmp_path / "g.onnx"), "--exporter", "legacy"])
    assert r.exit_code == 0 and "PASS" in r.output, r.output


def test_attention_statistics_of_an_exact_conversion() -> None:
    """Hard pinning: each head puts all its weight on its offset (share 1), its distance is P·|δ| in
    pixels; a free head has no offset and spreads its weight (entropy > 0)."""
    attn = converted("hard", 10, random_conv())
    report = attention_stats(attn, [torch.randn(5, 3, 12, 16) for _ in range(2)])
    assert report.images == 10
    for block in report.blocks:
        for h in block[:9]:
            dy, dx = h.offset
            assert h.pinned_share == pytest.approx(1.0, abs=1e-6)
            assert h.mean_distance_px == pytest.approx(4 * (dy * dy + dx * dx) ** 0.5, abs=1e-5)
            assert h.gate is None
        free = block[9]
        assert free.offset is None and free.pinned_share is None and free.entropy > 1.0


def test_attention_command_writes_json_and_png(tmp_path: Path) -> None:
    path = tmp_path / "vit.safetensors"
    cfg = ViTConfig.build(img_size=(12, 16), patch_size=4, depth=2, num_classes=10, kernel_size=5)
    plan = ConversionSpec(heads=10, pinning="gated").plan(cfg)
    sd, acfg = convert_state_dict(VisionTransformer(cfg).state_dict(), plan), plan.config
    save_checkpoint(path, acfg, sd)
    r = invoke(
        [
            "attention",
            str(path),
            *"--data synthetic --images 20 --device cpu -o".split(),
            str(tmp_path / "att"),
        ],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "att" / "attention.json").read_text())
    assert doc["images"] == 20 and len(doc["blocks"]) == 2 and len(doc["blocks"][0]["heads"]) == 10
    head = doc["blocks"][0]["heads"][0]
    assert set(head) == {"offset", "pinned_share", "mean_distance_px", "entropy", "gate"}
    assert head["offset"] == [-1, -1] and head["gate"] == 0.0
    assert (tmp_path / "att" / "attention.png").read_bytes()[:4] == b"\x89PNG"


def test_fashion_mnist_from_idx_files(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    for split, n in (("train", 30), ("t10k", 8)):
        write_idx(tmp_path / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    spec = build_data("fashion-mnist", tmp_path, (28, 28), train_samples=12, seed=3)
    assert len(spec.train) == 12 and len(spec.val) == 8 and spec.num_classes == 10
    img, label = spec.val[3]
    assert img.mode == "L" and img.size == (28, 28) and label == 3
    assert (
        build_data("fashion-mnist", tmp_path, (28, 28), train_samples=12, seed=3).train.indices
        == spec.train.indices
    )
    (tmp_path / "t10k-labels-idx1-ubyte.gz").unlink()
    r = invoke(
        [
            *"train phase1 --data fashion-mnist --data-dir".split(),
            str(tmp_path),
            "-o",
            str(tmp_path / "run"),
            "--device",
            "cpu",
        ],
    )
    one_error_line(r, 2, "apt-get install dataset-fashion-mnist")
    assert not (tmp_path / "run").exists()


def test_version_1_files_load_and_newer_ones_are_refused(tmp_path: Path) -> None:
    plan = ConversionSpec().plan(CFG)
    sd, acfg = convert_state_dict(random_conv().state_dict(), plan), plan.config
    path = tmp_path / "v2.safetensors"
    save_checkpoint(path, acfg, sd)
    with safe_open(str(path), "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    assert meta["cmhsa.format_version"] == "2" and json.loads(meta["cmhsa.config"])["pinning"] == "hard"
    v1 = {k: v for k, v in meta.items() if k != "cmhsa.format_version"}
    config = json.loads(v1["cmhsa.config"])
    del config["pinning"]  # what version 1 wrote
    save_file(tensors, str(tmp_path / "v1.safetensors"), {**v1, "cmhsa.config": json.dumps(config)})
    assert load_checkpoint(tmp_path / "v1.safetensors").config.pinning == "hard"
    save_file(tensors, str(tmp_path / "v3.safetensors"), {**meta, "cmhsa.format_version": "3"})
    with pytest.raises(Exception, match="format version '3'"):
        load_checkpoint(tmp_path / "v3.safetensors")


def test_attention_learning_rate_multiplier_groups() -> None:
    cfg = TrainConfig.from_flags(phase="phase2", attn_lr_mult=10.0, weight_decay=0.05)
    model = converted("gated", 10, random_conv())
    opt, *_ = build_recipe(cfg, model, 5, world=1, steps_per_epoch=2)
    scaled = {id(p) for g in opt.param_groups if g.get("lr_scale") == 10.0 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) in scaled}
    assert (
        "blocks.0.attn.gate" in names
        and "blocks.0.attn.q.weight" in names
        and "blocks.0.attn.content_bias" in names
    )
    assert "blocks.0.attn.v.weight" not in names and "head.weight" not in names
    lrs = {g.get("lr_scale", 1.0): g["lr"] for g in opt.param_groups}
    assert lrs[10.0] == pytest.approx(10 * lrs[1.0])  # timm's scheduler applies lr_scale


def test_bad_pinning_is_one_line(tmp_path: Path) -> None:
    fixture = str(Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors")
    phase2 = ["train", "phase2", "--init", fixture, "--data", "digits", "-o", str(tmp_path / "r")]
    for argv in (
        ["convert", fixture, "-o", str(tmp_path / "v.safetensors"), "--pinning", "soft"],
        [*phase2, "--pinning", "soft"],
        [*phase2, "--attn-lr-mult", "0"],
    ):
        r = invoke(argv)
        line = one_error_line(r, 2)
        assert "--pinning" in line or "--attn-lr-mult" in line, line
    assert not list(tmp_path.iterdir())
