"""The operations layer's reports: each is a dataclass whose ``to_dict()`` is JSON and says what an
independent computation says (the metric loop against plain torch; inspect against the theory's
offsets and the file's own tensors)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from convit_convert.api import convert_file, inspect_file
from convit_convert.api.on_data import evaluate, evaluate_checkpoint
from convit_convert.approximate import noise_calibration
from convit_convert.config import ViTConfig
from convit_convert.model import VisionTransformer
from convit_convert.options.operations import EvalOptions, Verification
from convit_convert.theory import head_count


def test_the_metric_loop_against_plain_torch() -> None:
    """Top-1, top-5 and mean cross-entropy over uneven batches, against the same figures computed on
    all logits at once; ``reduce`` sees the four totals once (a 2-process sum leaves the means)."""
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig.build(img_size=16, patch_size=4, depth=1, num_classes=7)).double()
    xs, ys = torch.randn(45, 3, 16, 16, dtype=torch.float64), torch.randint(0, 7, (45,))
    batches = [(xs[i : i + 16], ys[i : i + 16]) for i in range(0, 45, 16)]  # 16, 16, 13
    seen = []

    def twice(sums: torch.Tensor) -> None:  # what an all-reduce over two identical ranks does
        seen.append(sums.clone())
        sums.mul_(2)

    got = evaluate(model, batches, torch.device("cpu"), None, reduce=twice)
    with torch.no_grad():
        logits = model.eval()(xs)
    ranks = (logits > logits.gather(1, ys[:, None])).sum(1)  # classes scoring above the true one
    assert got["top1"] == pytest.approx(100 * (ranks == 0).double().mean().item(), abs=1e-9)
    assert got["top5"] == pytest.approx(100 * (ranks < 5).double().mean().item(), abs=1e-9)
    # the loop takes the logits in float32 (as under autocast): 1e-6 covers their rounding (6e-8 each)
    assert got["val_loss"] == pytest.approx(F.cross_entropy(logits, ys).item(), rel=1e-6)
    assert len(seen) == 1 and seen[0][3].item() == 45


def test_eval_report_is_json(fixture_path: Path) -> None:
    """The shipped digits fixture: 98.33 % top-1 (README), 359 validation images (20 % of 1797)."""
    r = evaluate_checkpoint(fixture_path, EvalOptions("digits", workers=0, device="cpu"))
    d = json.loads(json.dumps(r.to_dict()))
    assert d["command"] == "eval" and d["kind"] == "conv" and d["form"] == "conv" and d["images"] == 359
    assert d["top1"] == pytest.approx(98.33, abs=0.6)


def test_inspection_report_is_json_and_reads_the_file(fixture_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "vit.safetensors"
    assert convert_file(fixture_path, out, verification=Verification(device="cpu")).passed
    d = json.loads(json.dumps(inspect_file(out).to_dict()))
    cfg = d["config"]
    hc = head_count(cfg["kernel_size"], cfg["patch_size"])
    assert d["kind"] == "attn" and d["heads_needed"]["patch"] == len(hc.offsets) == 9
    for block in d["pinned"]:  # every head pinned to one of the theory's offsets, each offset once
        assert sorted(tuple(o) for o in block) == sorted(hc.offsets)
    with safe_open(str(out), "pt") as f:
        assert d["parameters"] == sum(f.get_tensor(k).numel() for k in f.keys())  # noqa: SIM118
    assert d["file"]["bytes"] == out.stat().st_size


def test_calibration_report(fixture_path: Path) -> None:
    from convit_convert.api import load_checkpoint

    cfg = load_checkpoint(fixture_path).config
    c = noise_calibration(cfg, images=12, heldout=5)
    assert c.to_dict() == {
        "source": "synthetic N(0, 1) images (normalised-input statistics)",
        "images": 12,
        "heldout_images": 5,
        "labelled": False,
    }
    # the sets the report describes: 12 and 5 images of the model's input shape, standard normal
    assert c.images.shape == (12, cfg.in_chans, *cfg.img_size) and c.heldout.shape[0] == 5
    assert c.labels is None and abs(float(c.images.mean())) < 0.1 and abs(float(c.images.std()) - 1) < 0.1
