"""`--init CHECKPOINT` in both phases: a fresh run from trained weights (the file's tensors, a new
optimizer and a new schedule with its warm-up), the model's shape the file's, and fine-tuning on
data of other classes (a new head, said in one line; every other tensor the file's; the new data's
class names recorded). The checkpoint may be a cmhsa file or a timm folder cmhsa wrote.

The references are the files themselves (safetensors' own reader) and a fresh run's schedule."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import FIXTURE, invoke, one_error_line
from convit_convert.options.training import TrainConfig
from convit_convert.train.phases import build_phase_model

# the shipped digits model's own geometry (32 px, P 4, depth 4, grey): --init takes the file's shape
DIGITS = "--preset cpu --data digits --in-chans 1 --img-size 32 --hflip 0 --batch-size 64".split()
DIGITS += "--train-samples 128 --val-samples 64".split()  # seconds a run
QUIET = dict(log=lambda _: None)


def three_classes(root: Path) -> Path:
    """A 3-class image folder (grey, 32 px): bird, cat, dog, told apart by brightness."""
    for split in ("train", "val"):
        for k, name in enumerate(("bird", "cat", "dog")):
            (root / split / name).mkdir(parents=True)
            for i in range(6):
                Image.new("L", (32, 32), 40 + 80 * k + i).save(root / split / name / f"{i}.png")
    return root


def metrics(run: Path) -> list[dict[str, str]]:
    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_phase1_starts_from_the_file_s_tensors_as_a_fresh_run(tmp_path: Path) -> None:
    """Every tensor as the file holds it, and the learning rate of every epoch that of a run from
    random weights with the same recipe (its warm-up from step 0), not the continuation of a schedule."""
    cfg = TrainConfig.from_flags(phase="phase1", data="digits", init=str(FIXTURE), in_chans=1, img_size=32)
    pm = build_phase_model(cfg, 10, data_chans=1, **QUIET)
    expected = load_file(FIXTURE)
    got = pm.model.state_dict()
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k].float()) for k in expected)
    assert pm.init["init_kind"] == "conv" and len(pm.init["init_sha256"]) == 64
    # one recipe for both (an --init run's default peak rate is the lower one from a checkpoint)
    recipe = [*DIGITS, "--epochs", "3", "--warmup-epochs", "2", "--depth", "4", "--lr", "1e-3"]
    assert invoke("train", "phase1", *recipe, "--init", FIXTURE, "-o", tmp_path / "restart").exit_code == 0
    assert invoke("train", "phase1", *recipe, "-o", tmp_path / "fresh").exit_code == 0
    lrs = [[row["lr"] for row in metrics(tmp_path / run)] for run in ("restart", "fresh")]
    assert lrs[0] == lrs[1] and len(lrs[0]) == 3
    doc = json.loads((tmp_path / "restart" / "config.json").read_text())
    assert doc["init_info"]["init"] == str(FIXTURE) and doc["init"] == str(FIXTURE)


def test_fine_tuning_on_three_classes_trains_and_predicts_their_names(tmp_path: Path) -> None:
    data = three_classes(tmp_path / "imgs")
    flags = [*DIGITS[:1], "cpu", "--data", "imagefolder", "--data-dir", data, "--img-size", "32"]
    flags += ["--epochs", "2", "--warmup-epochs", "0", "--batch-size", "6", "--hflip", "0"]
    r = invoke("train", "phase1", *flags, "--init", FIXTURE, "-o", tmp_path / "ft")
    assert r.exit_code == 0, r.output
    said = [line for line in r.output.splitlines() if line.startswith("fine-tuning")]
    assert len(said) == 1 and "head.weight, head.bias made anew" in said[0] and "10 classes" in said[0]
    trained = load_file(tmp_path / "ft" / "conv.safetensors")
    assert trained["head.weight"].shape == (3, 48)
    doc = json.loads((tmp_path / "ft" / "config.json").read_text())
    assert doc["classes"] == ["bird", "cat", "dog"]
    assert doc["init_info"]["replaced"] == ["head.weight", "head.bias"]
    assert doc["init_info"]["init_num_classes"] == 10
    r = invoke("predict", tmp_path / "ft" / "conv.safetensors", data / "val" / "cat", "--top-k", "3")
    assert r.exit_code == 0, r.output
    shown = {
        name
        for line in r.output.splitlines()
        if line.startswith("│")
        for name in ("bird", "cat", "dog")
        if name in line
    }
    assert shown == {"bird", "cat", "dog"}
    # the library's view: every tensor but the head is the file's, the head new and of 3 classes
    cfg = TrainConfig.from_flags(phase="phase1", data="imagefolder", data_dir=str(data), init=str(FIXTURE))
    pm = build_phase_model(cfg, 3, data_chans=1, **QUIET)
    source = load_file(FIXTURE)
    got = pm.model.state_dict()
    assert all(torch.equal(got[k], source[k].float()) for k in source if not k.startswith("head."))
    assert got["head.weight"].shape == (3, 48) and pm.config.num_classes == 3


def test_phase2_fine_tunes_a_converted_model_and_an_attention_one(tmp_path: Path) -> None:
    """From a conv checkpoint: converted exactly, then a new head; from an attention checkpoint
    (here as a timm folder cmhsa wrote): loaded, then a new head."""
    from convit_convert.api import convert_checkpoint, load_checkpoint

    conv = load_checkpoint(FIXTURE)
    cfg = TrainConfig.from_flags(phase="phase2", data="imagefolder", data_dir="x", init=str(FIXTURE))
    converted = convert_checkpoint(conv, cfg.conversion, verify=False)
    pm = build_phase_model(cfg, 3, data_chans=1, **QUIET)
    got = pm.model.state_dict()
    assert pm.config.kind == "attn" and pm.init["replaced"] == ["head.weight", "head.bias"]
    assert all(torch.equal(got[k], converted.tensors[k].float()) for k in got if not k.startswith("head."))
    vit = tmp_path / "vit.safetensors"
    assert invoke("convert", FIXTURE, "-o", vit).exit_code == 0
    assert invoke("export", vit, "--format", "timm", "-o", tmp_path / "timm").exit_code == 0
    cfg = TrainConfig.from_flags(
        phase="phase2", data="imagefolder", data_dir="x", init=str(tmp_path / "timm")
    )
    pm = build_phase_model(cfg, 3, data_chans=1, **QUIET)
    source = load_file(tmp_path / "timm" / "model.safetensors")
    got = pm.model.state_dict()
    assert all(torch.equal(got[k], source[k]) for k in source if not k.startswith("head."))
    assert pm.init["init_kind"] == "attn" and got["head.bias"].shape == (3,)


def test_a_timm_folder_and_a_seed_template_start_phase1(tmp_path: Path) -> None:
    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "timm").exit_code == 0
    recipe = [*DIGITS, "--epochs", "1", "--warmup-epochs", "0"]
    r = invoke("train", "phase1", *recipe, "--init", tmp_path / "timm", "-o", tmp_path / "from_timm")
    assert r.exit_code == 0, r.output
    for s in (0, 1):  # each seed from its own checkpoint
        (tmp_path / f"p1-{s}").mkdir()
        (tmp_path / f"p1-{s}" / "conv.safetensors").write_bytes(FIXTURE.read_bytes())
    template = str(tmp_path / "p1-{seed}" / "conv.safetensors")
    r = invoke("train", "phase1", *recipe, "--seeds", "0,1", "--init", template, "-o", tmp_path / "stack")
    assert r.exit_code == 0, r.output
    inits = [
        json.loads((tmp_path / "stack" / f"seed{s}" / "config.json").read_text())["init"] for s in (0, 1)
    ]
    assert inits == [template.replace("{seed}", str(s)) for s in (0, 1)]


@pytest.mark.parametrize(
    ("extra", "words"),
    [
        (["--depth", "3"], "--depth 3 disagrees with the checkpoint's depth 4"),
        (["--img-size", "28"], "--img-size 28 disagrees with the checkpoint's img_size (32, 32)"),
        (["--init", "impulse"], "--init impulse is a start of phase 2's attention"),
        (["--in-chans", "3"], "--in-chans 3 disagrees with the checkpoint's in_chans 1"),
    ],
)
def test_what_cannot_start_phase1_is_refused_in_one_line(
    tmp_path: Path, extra: list[str], words: str
) -> None:
    args = ["--preset", "cpu", "--data", "digits", "--epochs", "1", "--init", FIXTURE, *extra]
    one_error_line(invoke("train", "phase1", *args, "-o", tmp_path / "r"), 2, words)
    assert not (tmp_path / "r").exists()


def test_colour_data_on_a_grey_checkpoint_is_converted_to_its_channels(tmp_path: Path) -> None:
    """The checkpoint decides the channels: colour images on a grey checkpoint are made grey, said
    in a note; an explicit `--in-chans` that disagrees with it is refused (the test above)."""
    for split in ("train", "val"):
        for name in ("a", "b"):
            (tmp_path / "rgb" / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("RGB", (32, 32), (10 * i, 200, 50)).save(
                    tmp_path / "rgb" / split / name / f"{i}.png"
                )
    flags = ["--preset", "cpu", "--data", "imagefolder", "--data-dir", tmp_path / "rgb", "--img-size", "32"]
    flags += ["--epochs", "1", "--warmup-epochs", "0", "--batch-size", "4", "--init", FIXTURE]
    r = invoke("train", "phase1", *flags, "-o", tmp_path / "r")
    assert r.exit_code == 0, r.output
    assert "note: the imagefolder images are colour and the --init checkpoint takes 1 channel" in r.output
    assert json.loads((tmp_path / "r" / "config.json").read_text())["model"]["in_chans"] == 1
    assert invoke("train", "phase1", *flags, "--in-chans", "1", "-o", tmp_path / "r2").exit_code == 0


def test_phase1_never_replaces_the_file_it_starts_from(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "conv.safetensors").write_bytes(FIXTURE.read_bytes())
    before = (run / "conv.safetensors").read_bytes()
    args = [*DIGITS, "--epochs", "1", "--init", run / "conv.safetensors", "-o", run]
    one_error_line(invoke("train", "phase1", *args), 2, "is a file this run writes")
    assert (run / "conv.safetensors").read_bytes() == before
    vit = tmp_path / "vit.safetensors"
    assert invoke("convert", FIXTURE, "-o", vit).exit_code == 0
    r = invoke("train", "phase1", *DIGITS, "--epochs", "1", "--init", vit, "-o", tmp_path / "r")
    one_error_line(r, 2, str(vit), "is an attention checkpoint", "phase2 --init")
