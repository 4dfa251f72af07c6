"""The paper's path with no flag beyond the data: phase 1, phase 2 from its checkpoint, eval, predict
and export, on each grey data source (the built-in digits and Fashion-MNIST, and a grey image
folder). Phase 1 on grey data keeps timm's 3 input channels; with ``--init`` the checkpoint decides
the channels, so phase 2 converts the grey images as phase 1 did (it refused them before)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import invoke, write_idx

# what makes each run short; none of it names channels, image size or the model
SHORT = ["--preset", "cpu", "--epochs", "1", "--warmup-epochs", "0"]


def grey_source(kind: str, root: Path) -> tuple[list[str], Path]:
    """``--data`` flags for a small grey source of ``kind``, and one grey image file of its kind."""
    rng = np.random.default_rng(0)
    picture = root / "one.png"
    Image.fromarray(rng.integers(0, 256, (28, 28), dtype=np.uint8), "L").save(picture)
    if kind == "digits":
        return ["--data", "digits", "--train-samples", "256"], picture
    if kind == "fashion-mnist":
        for split, n in (("train", 96), ("t10k", 32)):
            write_idx(root / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
            write_idx(root / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
        return ["--data", "fashion-mnist", "--data-dir", str(root)], picture
    for split, n in (("train", 24), ("val", 4)):
        for name in ("ankle", "boot", "coat"):
            (root / "folder" / split / name).mkdir(parents=True)
            for i in range(n):
                level = rng.integers(0, 256, (20, 20), dtype=np.uint8)
                Image.fromarray(level, "L").save(root / "folder" / split / name / f"{i}.png")
    return ["--data", "imagefolder", "--data-dir", str(root / "folder")], picture


@pytest.mark.parametrize(
    "kind",
    [
        "digits",
        pytest.param("fashion-mnist", marks=pytest.mark.slow),
        pytest.param("imagefolder", marks=pytest.mark.slow),
    ],
)
def test_the_paper_path_runs_on_grey_data_with_no_flag_beyond_the_data(tmp_path: Path, kind: str) -> None:
    data, picture = grey_source(kind, tmp_path)
    p1, p2 = tmp_path / "p1", tmp_path / "p2"
    r = invoke("train", "phase1", *data, *SHORT, "-o", p1)
    assert r.exit_code == 0, r.output[-2000:]
    assert "images are grey: with 3 input channels" in r.output  # timm's default, said once
    r = invoke("train", "phase2", *data, *SHORT, "--init", p1 / "conv.safetensors", "-o", p2)
    assert r.exit_code == 0, r.output[-2000:]
    assert "images are grey and the --init checkpoint takes 3 channels" in r.output
    assert "--in-chans 1:" not in r.output  # no advice the checkpoint would refuse
    config = json.loads((p2 / "config.json").read_text())
    assert config["model"]["in_chans"] == 3 and config["kind"] == "attn"
    # phase 1 again from its own checkpoint (the restart), on the same data
    r = invoke("train", "phase1", *data, *SHORT, "--init", p1 / "conv.safetensors", "-o", tmp_path / "again")
    assert r.exit_code == 0, r.output[-2000:]
    eval_data = [w for w in data if w not in ("--train-samples", "256")]
    r = invoke("eval", p2 / "vit.safetensors", *eval_data)
    assert r.exit_code == 0, r.output[-2000:]
    assert "top-1 %" in r.output
    r = invoke("predict", p2 / "vit.safetensors", picture)
    assert r.exit_code == 0, r.output[-2000:]
    assert "one.png" in r.output
    r = invoke("export", p2 / "vit.safetensors", "-o", tmp_path / "vit.onnx")
    assert r.exit_code == 0, r.output[-2000:]
    r = invoke("eval", tmp_path / "vit.onnx", *eval_data)
    assert r.exit_code == 0, r.output[-2000:]


def test_an_explicit_in_chans_that_disagrees_with_the_checkpoint_is_still_refused(tmp_path: Path) -> None:
    data, _ = grey_source("digits", tmp_path)
    assert invoke("train", "phase1", *data, *SHORT, "-o", tmp_path / "p1").exit_code == 0
    init = ["--init", tmp_path / "p1" / "conv.safetensors"]
    for phase in ("phase1", "phase2"):
        r = invoke("train", phase, *data, *SHORT, *init, "--in-chans", "1", "-o", tmp_path / phase)
        assert r.exit_code == 2, r.output[-2000:]
        assert "--in-chans 1 disagrees with the checkpoint's in_chans 3" in r.stderr
        assert not (tmp_path / phase).exists()
