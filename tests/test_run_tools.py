"""A run in the tools researchers already use: TensorBoard's event files (read back as metrics.csv
says, continued by a resume without duplicates, one run per seed, a link planted in their place
refused, served over TensorBoard's own HTTP API), a run repeated from its config file (`--config`,
`--print-config`), a start from the Hugging Face Hub (`hf-hub:`, offline from huggingface_hub's
cache), the best epoch's model kept (`best.safetensors`), gradient accumulation
(`--grad-accum-steps`), and folders of camera-sized photos held at the size training uses."""

from __future__ import annotations

import csv
import json
import math
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import FIXTURE, invoke, tiny_config
from convit_convert.train.progress import Progress
from convit_convert.train.run import run

QUIET = Progress(None)
FLAGS = dict(
    device="cpu", workers=0, epochs=3, warmup_epochs=0, batch_size=16, train_samples=64, val_samples=32
)
TIMED = ("epoch_seconds", "images_per_s")


def metrics(folder: Path) -> list[dict[str, str]]:
    return list(csv.DictReader((folder / "metrics.csv").open()))


def events(folder: Path) -> Any:
    """TensorBoard's own reader of the run's event files (orphaned steps purged, as it shows them)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


# TensorBoard -----------------------------------------------------------------------------------


def test_tensorboard_events_are_metrics_csv(tmp_path: Path) -> None:
    """Every metrics.csv column of every epoch (validation, learning rate, each block's gate and
    attention distance) is an `epoch/` scalar at the epoch's last update, float32-equal; the
    read-outs' loss, learning rate and images/s are `step/` scalars; the config is text."""
    cfg = tiny_config(
        tmp_path / "r", **FLAGS, phase="phase2", init="impulse", log_every=2, report_to="tensorboard"
    )
    run(cfg, progress=QUIET)
    acc, rows = events(tmp_path / "r"), metrics(tmp_path / "r")
    tags = acc.Tags()["scalars"]
    assert {"step/loss", "step/lr", "step/images_per_s"} <= set(tags)
    columns = [k for k in rows[0] if k != "epoch"]
    assert any(k.startswith("attn") for k in columns) and {f"epoch/{k}" for k in columns} <= set(tags)
    for k in columns:
        got = [(e.step, e.value) for e in acc.Scalars(f"epoch/{k}")]
        assert [s for s, _ in got] == [4, 8, 12], k  # 4 updates an epoch
        want = [float(r[k]) for r in rows]
        assert [v for _, v in got] == pytest.approx(want, rel=1e-5), k  # float32 events, 6-digit CSV
    assert [e.step for e in acc.Scalars("step/loss")] == [2, 4, 6, 8, 10, 12]
    assert "config" in acc.Tags()["tensors"]


def test_a_resumed_run_continues_its_curves_without_duplicates(tmp_path: Path) -> None:
    """Stopped after 6 updates (its checkpoint there), resumed: TensorBoard shows each step once,
    the same steps as a run never stopped."""
    whole = tiny_config(tmp_path / "whole", **FLAGS, log_every=1, report_to="tensorboard")
    run(whole, progress=QUIET)
    cut = tiny_config(tmp_path / "cut", **FLAGS, log_every=1, report_to="tensorboard")
    run(cut, progress=QUIET, stop_after_steps=6)
    run(cut.replace(resume=True), progress=QUIET)
    assert len(list((tmp_path / "cut" / "tensorboard").iterdir())) == 2  # a file per process
    for tag in ("step/loss", "epoch/top1", "epoch/train_loss"):
        steps = [e.step for e in events(tmp_path / "cut").Scalars(tag)]
        assert steps == sorted(set(steps)) == [e.step for e in events(tmp_path / "whole").Scalars(tag)], tag


def test_a_stack_writes_one_tensorboard_run_per_seed(tmp_path: Path) -> None:
    from convit_convert.train.stacked import run_seeds

    run_seeds(tiny_config(tmp_path / "s", **FLAGS, seeds=(0, 1), report_to="tensorboard"), progress=QUIET)
    for seed in ("seed0", "seed1"):
        top1 = [e.value for e in events(tmp_path / "s" / seed).Scalars("epoch/top1")]
        assert top1 == pytest.approx([float(r["top1"]) for r in metrics(tmp_path / "s" / seed)], rel=1e-5)


def test_tensorboard_events_go_through_the_held_folder(tmp_path: Path, monkeypatch) -> None:
    """A link planted where the events go is refused in one line before the first step, its target
    untouched; without tensorboard installed the flag is refused in one line saying what to install."""
    import importlib.util

    from conftest import one_error_line

    out, elsewhere = tmp_path / "r", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    (out / "tensorboard").symlink_to(elsewhere)
    flags = ["--data", "synthetic", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--epochs", "1"]
    r = invoke("train", "phase1", *flags, "--device", "cpu", "--report-to", "tensorboard", "-o", out)
    one_error_line(r, 2, "tensorboard")
    assert list(elsewhere.iterdir()) == [] and not (out / "metrics.csv").exists()
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a)
    )
    r = invoke(
        "train", "phase1", *flags, "--device", "cpu", "--report-to", "tensorboard", "-o", tmp_path / "n"
    )
    one_error_line(r, 2, "pip install tensorboard")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_tensorboard_server_lists_the_runs_scalars(tmp_path: Path) -> None:
    """`tensorboard --logdir RUN` on 127.0.0.1 at a free port: its HTTP API lists the run's scalar
    tags within 90 s; the server is stopped by the test."""
    import urllib.request

    cfg = tiny_config(tmp_path / "r", **FLAGS, phase="phase2", init="impulse", report_to="tensorboard")
    run(cfg, progress=QUIET)
    port = free_port()
    cmd = [sys.executable, "-m", "tensorboard.main", "--logdir", str(tmp_path / "r"), "--host", "127.0.0.1"]
    server = subprocess.Popen(
        [*cmd, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline, tags = time.monotonic() + 90, {}
        while time.monotonic() < deadline and not tags:
            time.sleep(1)
            try:
                url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
                with urllib.request.urlopen(url, timeout=5) as reply:
                    tags = json.loads(reply.read())
            except OSError:
                continue
        assert "epoch/top1" in tags.get("tensorboard", {}), tags
    finally:
        server.terminate()
        server.wait(timeout=30)


# a run from a file -------------------------------------------------------------------------------

TINY_CLI = ["--data", "digits", "--in-chans", "1", "--img-size", "16", "--patch-size", "4", "--depth", "1"]
TINY_CLI += ["--kernel-size", "3", "--epochs", "2", "--batch-size", "32", "--device", "cpu"]


def test_a_run_repeats_from_its_config_json(tmp_path: Path) -> None:
    """`--config RUN/config.json -o AGAIN` repeats the run bit for bit on this machine; `--lr` and
    `--epochs` beside it change those two alone; `--print-config` prints what --config reads, in
    the file's format (a YAML file: YAML), and reading it back gives the same run."""
    assert invoke("train", "phase1", *TINY_CLI, "-o", tmp_path / "a").exit_code == 0
    r = invoke("train", "phase1", "--config", tmp_path / "a" / "config.json", "-o", tmp_path / "b")
    assert r.exit_code == 0, r.output
    wa, wb = (load_file(tmp_path / x / "conv.safetensors") for x in ("a", "b"))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    r = invoke(
        "train",
        "phase1",
        "--config",
        tmp_path / "a" / "config.json",
        "--lr",
        "7e-4",
        "--epochs",
        "1",
        "--print-config",
    )
    printed = json.loads(r.output)
    saved = json.loads((tmp_path / "a" / "config.json").read_text())
    changed = {k for k in printed if printed[k] != saved.get(k)}
    assert changed == {"lr", "epochs", "given"} and printed["lr"] == 7e-4 and printed["epochs"] == 1
    assert not {"out", "resume", "overwrite"} & set(printed)
    (tmp_path / "mine.yaml").write_text("data: digits\nin_chans: 1\nimg_size: 16\npatch_size: 4\ndepth: 1\n")
    r = invoke("train", "phase1", "--config", tmp_path / "mine.yaml", "--kernel-size", "3", "--print-config")
    (tmp_path / "back.yaml").write_text(r.output)
    import yaml

    doc = yaml.safe_load(r.output)
    assert (
        doc["img_size"] == 16 and doc["kernel_size"] == 3 and set(doc["given"]) >= {"img_size", "kernel_size"}
    )
    again = invoke("train", "phase1", "--config", tmp_path / "back.yaml", "--print-config")
    assert yaml.safe_load(again.output) == doc


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ('{"lr": 1e-3, "lrr": 2}', "holds 'lrr', which is no flag of `cmhsa train phase1`"),
        ('{"phase": "phase2"}', "is a phase2 run's config; give it to `cmhsa train phase2`"),
        ('{"lr": "fast"}', "--lr"),
        ('{"given": "lr"}', "a 'given' that is not a list of flags"),
        ("[1, 2]", "is not a mapping of flags"),
    ],
)
def test_a_config_file_cmhsa_cannot_use_is_one_line(tmp_path: Path, text: str, said: str) -> None:
    from conftest import one_error_line

    (tmp_path / "c.json").write_text(text)
    r = invoke("train", "phase1", "--config", tmp_path / "c.json", "-o", tmp_path / "r")
    one_error_line(r, 2, said)
    assert not (tmp_path / "r").exists()


def test_a_yaml_config_with_anchors_is_refused(tmp_path: Path) -> None:
    from conftest import one_error_line

    (tmp_path / "c.yaml").write_text("a: &x [1, 2]\nb: *x\n")
    one_error_line(
        invoke("train", "phase1", "--config", tmp_path / "c.yaml", "-o", tmp_path / "r"), 2, "anchor"
    )


# a start from the Hub -----------------------------------------------------------------------------


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_a_hub_model_name_is_a_start_and_a_model_offline(tmp_path: Path, monkeypatch) -> None:
    """`hf-hub:ORG/NAME` through huggingface_hub's cache (offline: nothing downloads) for inspect,
    predict, eval, export and train --init; the fine-tuned model's card names `base_model`; a name
    the cache lacks is one line naming it."""
    from huggingface_hub import ModelCard, constants

    from conftest import hub_cache, one_error_line

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "exported").exit_code == 0
    hub_cache(tmp_path / "hub", "alice/cmhsa-digits", tmp_path / "exported")
    name, digit = "hf-hub:alice/cmhsa-digits", FIXTURE.parent / "digits" / "3.png"
    local = invoke("predict", FIXTURE, digit).output
    for args in (
        ("inspect", name),
        ("eval", name, "--data", "digits"),
        ("export", name, "-o", tmp_path / "m.onnx"),
    ):
        r = invoke(*args)
        assert r.exit_code == 0, (args, r.output)
    assert invoke("predict", name, digit).output.splitlines()[1:] == local.splitlines()[1:]
    flags = ["--data", "digits", "--epochs", "1", "--device", "cpu"]
    assert invoke("train", "phase1", "--init", name, *flags, "-o", tmp_path / "run").exit_code == 0
    r = invoke("export", tmp_path / "run" / "conv.safetensors", "--format", "timm", "-o", tmp_path / "t")
    assert (
        r.exit_code == 0
        and ModelCard.load(tmp_path / "t" / "README.md").data.base_model == "alice/cmhsa-digits"
    )
    one_error_line(invoke("predict", "hf-hub:alice/absent", digit), 2, "huggingface_hub could not provide")


# the best epoch's model ---------------------------------------------------------------------------


def test_the_best_epochs_model_is_kept_and_a_resume_keeps_it_right(tmp_path: Path) -> None:
    """best.safetensors holds the weights of the epoch of the best top-1 (config.json and the end
    line name it); `cmhsa eval` on it gives that top-1 (the workers loader: eval's own resize);
    a run stopped and resumed keeps the same best file as a run never stopped."""
    flags = {k: v for k, v in FLAGS.items() if k != "val_samples"} | dict(epochs=4, loader="workers", lr=3e-2)
    lines: list[str] = []
    run(tiny_config(tmp_path / "r", **flags, data="digits", in_chans=1), progress=Progress(lines.append))
    rows = metrics(tmp_path / "r")
    best = max(rows, key=lambda r: float(r["top1"]))
    said = json.loads((tmp_path / "r" / "config.json").read_text())["best"]
    assert (said["epoch"], said["file"], said["weights"]) == (int(best["epoch"]), "best.safetensors", "model")
    assert any(f"epoch {best['epoch']}, top-1 {float(best['top1']):.2f}, the best" in line for line in lines)
    r = invoke("eval", tmp_path / "r" / "best.safetensors", "--data", "digits")
    assert r.exit_code == 0, r.output
    assert f"{float(best['top1']):.2f}" in r.output, (best, r.output)
    cut = tiny_config(tmp_path / "c", **flags, data="digits", in_chans=1)
    run(cut, progress=QUIET, stop_after_steps=6)
    run(cut.replace(resume=True), progress=QUIET)
    a, b = (load_file(tmp_path / x / "best.safetensors") for x in ("r", "c"))
    assert all(torch.equal(a[k], b[k]) for k in a)


# gradient accumulation ----------------------------------------------------------------------------

EXACT = dict(drop_path=0.0, mixup=0.0, cutmix=0.0, aa="none", reprob=0.0, hflip=0.0, scale=(1.0, 1.0))


def test_two_micro_batches_of_16_train_as_one_batch_of_32(tmp_path: Path) -> None:
    """With augmentation and drop path off, `--grad-accum-steps 2 --batch-size 16` and
    `--batch-size 32` see the same images each update and end within 1e-4 (relative, each tensor)
    after 2 epochs; both count 4 updates an epoch and scale the learning rate for a batch of 32."""
    common = dict(FLAGS, train_samples=128, epochs=2, smoothing=0.0, **EXACT)
    big = run(tiny_config(tmp_path / "big", **{**common, "batch_size": 32}), progress=QUIET)
    acc = run(
        tiny_config(tmp_path / "acc", **{**common, "batch_size": 16, "grad_accum_steps": 2}), progress=QUIET
    )
    wa, wb = (load_file(tmp_path / x / "conv.safetensors") for x in ("big", "acc"))
    worst = max(((wa[k] - wb[k]).abs().max() / wa[k].abs().max().clamp_min(1e-12)).item() for k in wa)
    assert worst < 1e-4, worst
    assert [r["lr"] for r in big.rows] == [r["lr"] for r in acc.rows]
    state = torch.load(tmp_path / "acc" / "checkpoint-last.pt", weights_only=True)
    assert state["global_step"] == 8  # updates, not micro-batches
    assert math.isclose(big.rows[-1]["train_loss"], acc.rows[-1]["train_loss"], rel_tol=1e-5)


def test_gradient_accumulation_with_seeds(tmp_path: Path) -> None:
    """`--seeds` in turn: each seed's run as its own with the flag; a batched stack refuses it in one line."""
    from conftest import one_error_line
    from convit_convert.train.stacked import run_seeds

    flags = dict(FLAGS, epochs=1, grad_accum_steps=2)
    run_seeds(tiny_config(tmp_path / "s", **flags, seeds=(0, 1)), progress=QUIET)
    run(tiny_config(tmp_path / "one", **flags, seed=1), progress=QUIET)
    a, b = (load_file(p / "conv.safetensors") for p in (tmp_path / "s" / "seed1", tmp_path / "one"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    cli = ["--data", "synthetic", "--img-size", "16", "--patch-size", "4", "--depth", "1", "--epochs", "1"]
    r = invoke(
        "train",
        "phase1",
        *cli,
        "--grad-accum-steps",
        "2",
        "--seeds",
        "0,1",
        "--seeds-step",
        "batched",
        "-o",
        tmp_path / "b",
    )
    one_error_line(r, 2, "--grad-accum-steps")


# folders of photos --------------------------------------------------------------------------------


def test_photos_are_held_at_the_size_training_uses(tmp_path: Path, monkeypatch) -> None:
    """JPEGs of 2000x1500 for a 16-pixel model: the device loader holds them with their shorter side
    at held_side's (what the eval view and the smallest training crop need), decoded straight to it
    (PIL's draft), counted while they load; a split that would not fit goes to the workers loader."""
    import numpy as np
    from PIL import Image

    from convit_convert.data import build_data
    from convit_convert.options.training import TrainConfig
    from convit_convert.train import held
    from convit_convert.train.build import choose_loader
    from convit_convert.train.held import held_side, hold

    photo = Image.fromarray((np.random.default_rng(0).random((150, 200, 3)) * 255).astype(np.uint8))
    photo = photo.resize((2000, 1500))
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(3):
                photo.save(tmp_path / split / c / f"{i}.jpg", quality=90)
    spec = build_data("imagefolder", tmp_path, None)
    cfg = TrainConfig.from_flags(data="imagefolder", data_dir=str(tmp_path), img_size=16)
    assert choose_loader(cfg, spec, 3, (16, 16)) == ("device", "")
    side = held_side((16, 16), cfg.recipe.crop_pct, cfg.recipe.scale[0])
    assert side == 57  # 16 / sqrt(0.08), above eval's floor(16 / 0.875)
    counted: list[int] = []
    x, _ = hold(spec.train, 3, torch.device("cpu"), side, counted.append)
    assert tuple(x.shape) == (6, 3, 57, 76) and len(counted) == 6
    monkeypatch.setattr(held, "available_memory", lambda: 4 * 6 * 3 * 57 * 76 - 4)
    loader, why = choose_loader(cfg, spec, 3, (16, 16))
    assert loader == "workers" and "a quarter of the memory free" in why
    with Image.open(tmp_path / "train" / "a" / "0.jpg") as im:
        im.draft("RGB", (76, 57))
        assert im.size == (250, 188)  # decoded at an eighth: what read_image then resizes from
