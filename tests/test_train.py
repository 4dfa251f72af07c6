"""Training: data paths, recipe wiring, resume equality, stopping, DDP on gloo, the CLI.

Tiny configs throughout (16 px images, 4 px patches, one or two blocks) so the file runs in about
a minute on 2 cores.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import convit_convert.data as cdata
import convit_convert.loaders as cloaders
from conftest import TINY_RUN, invoke, one_error_line, tiny_config
from convit_convert.cli.common import as_flags
from convit_convert.data import build_data
from convit_convert.errors import CheckFailed, CmhsaError
from convit_convert.loaders import EpochSampler, build_loader, build_transform
from convit_convert.options.training import TrainConfig
from convit_convert.train import build as engine
from convit_convert.train.progress import Progress
from convit_convert.train.recipe import build_recipe, scaled_lrs
from convit_convert.train.run import run

TINY = {**TINY_RUN, "workers": 0, "warmup_epochs": 1}
PLAIN = dict(mixup=0.0, cutmix=0.0, smoothing=0.0, drop_path=0.0, aa="none", reprob=0.0)


def metrics(run_dir: Path) -> list[dict[str, float]]:
    with open(run_dir / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


# data -----------------------------------------------------------------------------------------


def test_digits_and_synthetic_sources() -> None:
    d = build_data("digits", None, (32, 32))
    assert (len(d.train), len(d.val), d.num_classes) == (1438, 359, 10)
    img, label = d.train[0]
    assert img.size == (8, 8) and img.mode == "RGB" and 0 <= label < 10
    s1, s2 = (
        build_data("synthetic", None, (16, 16), num_classes=4),
        build_data("synthetic", None, (16, 16), num_classes=4),
    )
    assert np.array_equal(s1.train.images, s2.train.images)  # generated, reproducibly
    assert set(s1.train.labels) == {0, 1, 2, 3}


def test_val_samples_are_the_first_validation_images_for_every_seed() -> None:
    full = build_data("digits", None, (8, 8))
    for seed in (0, 1):
        d = build_data("digits", None, (8, 8), seed=seed, val_samples=50)
        assert len(d.val) == 50 and len(d.train) == len(full.train)
        assert all(np.array_equal(np.asarray(d.val[i][0]), np.asarray(full.val[i][0])) for i in (0, 49))
    with pytest.raises(CmhsaError, match=r"`val_samples` must be in 1\.\.359 for `data` digits, got 0"):
        build_data("digits", None, (8, 8), val_samples=0)


def test_imagefolder_and_bad_folders(tmp_path: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for c in ("cat", "dog"):
            (tmp_path / "f" / split / c).mkdir(parents=True)
            Image.new("RGB", (10, 12), (10, 20, 30)).save(tmp_path / "f" / split / c / "a.png")
    spec = build_data("imagefolder", tmp_path / "f", (16, 16))
    assert spec.num_classes == 2 and len(spec.train) == 2
    (tmp_path / "g" / "train").mkdir(parents=True)
    cases = [
        ("imagefolder", tmp_path / "g", "needs val/"),
        ("imagefolder", tmp_path / "nope", "does not exist"),
        ("cifar100", tmp_path / "f", "not found or corrupt"),
        ("cifar10", None, "needs `data_dir`"),
        ("mnist", None, "`data` must be one of"),
    ]
    for name, root, msg in cases:
        with pytest.raises(CmhsaError, match=msg):
            build_data(name, root, (16, 16))
    # evaluation needs only val/ (it needed train/ too); training still refuses a folder without it
    (tmp_path / "v").mkdir()
    (tmp_path / "f" / "val").rename(tmp_path / "v" / "val")
    spec = build_data("imagefolder", tmp_path / "v", (16, 16), val_only=True)
    assert (spec.num_classes, len(spec.train), len(spec.val)) == (2, 0, 2)
    with pytest.raises(CmhsaError, match="needs train/"):
        build_data("imagefolder", tmp_path / "v", (16, 16))


def test_eval_of_an_image_folder_needs_only_val(tmp_path: Path) -> None:
    """`cmhsa eval --data imagefolder` on a folder holding val/ alone: top-1 printed, exit 0."""
    from PIL import Image

    from convit_convert.api import save_checkpoint
    from convit_convert.config import ViTConfig
    from convit_convert.model import VisionTransformer

    rng = np.random.default_rng(0)
    for c in ("a", "b"):
        (tmp_path / "val" / c).mkdir(parents=True)
        for i in range(3):
            Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                tmp_path / "val" / c / f"{i}.png"
            )
    model = tmp_path / "m.safetensors"
    conv = VisionTransformer(
        ViTConfig.build(img_size=(16, 16), patch_size=4, depth=1, kernel_size=3, num_classes=2)
    )
    save_checkpoint(model, conv.cfg, conv.state_dict())
    r = invoke(["eval", str(model), "--data", "imagefolder", "--data-dir", str(tmp_path), "--workers", "0"])
    assert r.exit_code == 0 and "6 images" in " ".join(r.output.split()), r.output


@pytest.mark.parametrize("grey", [True, False])
def test_a_grey_image_folder_is_said(tmp_path: Path, grey: bool) -> None:
    """A folder of grey PNGs trained with 3 input channels gets the note Fashion-MNIST and digits
    get (each image seen three times over; --in-chans 1); a colour folder does not, nor does a grey
    one trained with --in-chans 1."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / "data" / split / c).mkdir(parents=True)
            for i in range(4):
                pixels = rng.integers(0, 256, (16, 16) if grey else (16, 16, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(tmp_path / "data" / split / c / f"{i}.png")
    flags = [
        *"--data imagefolder --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 --batch-size 4".split(),
        *"--workers 0 --epochs 1 --warmup-epochs 0 --device cpu --data-dir".split(),
        tmp_path / "data",
    ]
    r = invoke("train", "phase1", *flags, "-o", tmp_path / "run3")
    assert r.exit_code == 0, r.output
    said = "note: the imagefolder images are grey" in " ".join(r.output.split())
    assert said == grey, r.output
    if grey:
        r = invoke("train", "phase1", *flags, "--in-chans", "1", "-o", tmp_path / "run1")
        assert r.exit_code == 0 and "images are grey" not in r.output, r.output


def test_sampler_batches_do_not_depend_on_world_size() -> None:
    one = EpochSampler(100, rank=0, world=1, batch_size=8, seed=3, shuffle=True)
    two = [EpochSampler(100, rank=r, world=2, batch_size=4, seed=3, shuffle=True) for r in range(2)]
    for s in [one, *two]:
        s.set_epoch(5)
    a = np.array(one.indices()).reshape(-1, 8)
    b = np.concatenate([np.array(s.indices()).reshape(-1, 4) for s in two], axis=1)
    assert np.array_equal(a, b) and len(set(a.ravel())) == a.size
    evals = [
        EpochSampler(101, rank=r, world=3, batch_size=4, seed=0, shuffle=False).indices() for r in range(3)
    ]
    assert sorted(i for e in evals for i in e) == list(range(101))  # every val image once, no padding
    one.set_epoch(5, start_batch=2)
    assert [i for _, i in one] == a.ravel()[16:].tolist()
    for s in [one, *two, EpochSampler(101, rank=2, world=3, batch_size=4, seed=0, shuffle=False)]:
        assert len(s) == len(list(s))


def test_augmentation_is_seeded_per_sample_not_per_worker(tmp_path: Path) -> None:
    cfg = tiny_config(tmp_path / "run", TINY)
    spec = build_data("synthetic", None, (16, 16))
    tf = build_transform((16, 16), True, cfg.recipe)  # DeiT's full augmentation
    batches = []
    for workers in (0, 2):
        loader = build_loader(spec.train, tf, training=True, batch_size=8, seed=1, workers=workers)
        loader.sampler.set_epoch(2)
        batches.append(next(iter(loader))[0])
    assert torch.equal(batches[0], batches[1])
    loader.sampler.set_epoch(3)
    assert not torch.equal(next(iter(loader))[0], batches[0])


# recipe -----------------------------------------------------------------------------------------


def test_recipe_is_deits(tmp_path: Path) -> None:
    from timm.loss import SoftTargetCrossEntropy

    from convit_convert.model import VisionTransformer
    from convit_convert.train.phases import flag_config

    cfg = TrainConfig.from_flags(
        phase="phase2", init="conv.safetensors", img_size=16, patch_size=4, depth=1, epochs=10
    )
    assert (cfg.peak_lr, TrainConfig.from_flags().peak_lr) == (5e-5, 5e-4)  # the paper's peaks
    lr, min_lr, warm = scaled_lrs(cfg, world=4)  # 4 × 128 = 512: DeiT's reference batch
    assert (lr, min_lr, warm) == pytest.approx((5e-5, 1e-5, 1e-6))
    assert scaled_lrs(cfg, world=1)[0] == pytest.approx(5e-5 / 4)
    model = VisionTransformer(flag_config(cfg, 10).with_attention(9), 0.1)
    opt, sched, mixup, crit = build_recipe(cfg, model, 10, world=4, steps_per_epoch=3)
    assert type(opt).__name__ == "AdamW"
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-8
    decayed = {id(p) for g in opt.param_groups if g["weight_decay"] == 0.05 for p in g["params"]}
    names = {n for n, p in model.named_parameters() if id(p) not in decayed}
    assert {"blocks.0.attn.rel_pos_bias", "blocks.0.attn.sink", "blocks.0.norm1.weight", "head.bias"} <= names
    assert "blocks.0.attn.q.weight" not in names and "head.weight" not in names
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-6)  # warm-up starts at warmup_lr
    lrs = []
    for epoch in range(1, 11):
        sched.step(epoch)
        lrs.append(opt.param_groups[0]["lr"])
    # timm (and so DeiT): linear warm-up from warmup_lr over 5 epochs, then the cosine curve of the
    # whole run (warmup_prefix=False), so epoch 5 already sits on the cosine, below the peak
    assert lrs[3] == pytest.approx(1e-6 + 4 * (5e-5 - 1e-6) / 5)
    assert lrs[4] == pytest.approx(1e-5 + 0.5 * (5e-5 - 1e-5) * (1 + math.cos(math.pi * 5 / 10)))
    assert all(a >= b for a, b in itertools.pairwise(lrs[4:]))
    assert isinstance(crit, SoftTargetCrossEntropy)
    assert (mixup.mixup_alpha, mixup.cutmix_alpha, mixup.label_smoothing) == (0.8, 1.0, 0.1)
    tf = repr(build_transform((16, 16), True, cfg.recipe))
    assert "RandAugment" in tf and "RandomErasing(p=0.25" in tf and "bicubic" in tf


# runs --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("loader", ["device", "workers"])
def test_resume_mid_epoch_equals_uninterrupted(tmp_path: Path, loader: str) -> None:
    """4 epochs straight vs stopped in epoch 2 and resumed: same metrics, same weights, bit for bit
    (full DeiT augmentation, Mixup/CutMix, EMA and drop path on: depth 2, since one block's drop
    rate is 0; every RNG has to be restored, and the loader must not draw from drop path's)."""
    kw = dict(epochs=4, depth=2, model_ema=True, model_ema_decay=0.9, drop_path=0.1, loader=loader)
    straight = run(tiny_config(tmp_path / "a", TINY, **kw))
    first = run(tiny_config(tmp_path / "b", TINY, **kw), stop_after_steps=24)  # 16 steps/epoch: mid epoch 2
    assert first.stopped == "limit" and len(first.rows) == 1
    resumed = run(tiny_config(tmp_path / "b", TINY, resume=True, **kw))
    assert resumed.stopped is None

    def strip(rows: list[dict]) -> list[dict]:  # all but the timings
        return [{k: v for k, v in r.items() if k not in ("epoch_seconds", "images_per_s")} for r in rows]

    assert strip(resumed.rows) == strip(straight.rows)
    a, b = (
        load_file(str(tmp_path / "a" / "conv.safetensors")),
        load_file(str(tmp_path / "b" / "conv.safetensors")),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    ema_a = load_file(str(tmp_path / "a" / "conv-ema.safetensors"))
    ema_b = load_file(str(tmp_path / "b" / "conv-ema.safetensors"))
    assert all(torch.equal(ema_a[k], ema_b[k]) for k in ema_a)
    assert [r["epoch"] for r in metrics(tmp_path / "b")] == [1, 2, 3, 4]


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_workers_do_not_change_the_result(tmp_path: Path) -> None:
    """0 vs 2 data-loading workers (persistent), full recipe with drop path: the same weights."""
    kw = dict(epochs=2, depth=2, drop_path=0.1, loader="workers")
    a = run(tiny_config(tmp_path / "w0", TINY, workers=0, **kw))
    b = run(tiny_config(tmp_path / "w2", TINY, workers=2, **kw))
    wa, wb = (load_file(str(r.out / "conv.safetensors")) for r in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_extends_a_finished_run_with_a_rebuilt_schedule(tmp_path: Path) -> None:
    """--resume with a larger --epochs continues a finished run; the cosine schedule is rebuilt for
    the new total, so epochs 3-4 get the learning rates of a run planned for 4 epochs."""
    planned = run(tiny_config(tmp_path / "planned", TINY, epochs=4, **PLAIN))
    run(tiny_config(tmp_path / "grown", TINY, epochs=2, **PLAIN))
    log = io.StringIO()
    grown = run(
        tiny_config(tmp_path / "grown", TINY, epochs=4, resume=True, **PLAIN),
        progress=Progress(lambda m: print(m, file=log)),
    )
    assert [r["epoch"] for r in grown.rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in grown.rows[2:]] == pytest.approx([r["lr"] for r in planned.rows[2:]], rel=1e-12)
    assert "extending the run from 2 to 4 epochs" in log.getvalue(), log.getvalue()
    with pytest.raises(CmhsaError, match="already trained 4 epochs"):
        run(tiny_config(tmp_path / "grown", TINY, epochs=3, resume=True, **PLAIN))


def test_resume_with_a_new_lr_uses_it_and_says_so(tmp_path: Path) -> None:
    run(tiny_config(tmp_path / "run", TINY, epochs=3, **PLAIN), stop_after_steps=20)
    log = io.StringIO()
    res = run(
        tiny_config(tmp_path / "run", TINY, epochs=3, resume=True, **{**PLAIN, "lr": 1e-3}),
        progress=Progress(lambda m: print(m, file=log)),
    )
    said = " ".join(log.getvalue().split())
    assert "`lr` 0.001 instead of 0.004" in said and "no longer" in said, said  # the CLI says --lr (as_flags)
    assert "--lr 0.001 instead of 0.004" in as_flags(said)
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["lr"] == 1e-3 and res.rows[-1]["lr"] <= 1e-3


def test_default_workers_follow_the_machine(tmp_path: Path, monkeypatch) -> None:
    """No more workers than CPUs (PyTorch warns above that): 2 on a 2-core machine, at most 4;
    threads: OMP_NUM_THREADS where it is a whole number of at least 1 (torchrun sets it), never
    more than the CPUs, else the CPUs other work at this priority leaves idle, at least 1."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for busy, threads in ((0, 2), (1, 1), (5, 1), (None, 2)):  # None: no /proc to tell
        monkeypatch.setattr(cloaders, "busy_elsewhere", lambda busy=busy: busy)
        assert cloaders.default_threads() == threads, busy
    assert cloaders.default_workers() == 2
    wrong = ("0", "-1", "", "x", "1.5", "\u0661", "9" * 40)  # \u0661: an Arabic-Indic 1
    for given, threads in [("1", 1), (" 1 ", 1), ("2", 2), ("64", 2), *((w, 2) for w in wrong)]:
        monkeypatch.setenv("OMP_NUM_THREADS", given)
        assert cloaders.default_threads() == threads, given
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    assert cloaders.default_workers() == 4
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    cfg = tiny_config(tmp_path / "run", TINY, epochs=1, **PLAIN).replace(workers=None)
    run(cfg)
    assert (
        cfg.runtime.workers is None and cfg.runtime.threads is None
    )  # the run resolved them in its own copy
    doc = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (doc["workers"], doc["threads"], doc["threads_used"], doc["loader_used"]) == (1, 1, 1, "device")


def test_keep_and_existing_run_guard(tmp_path: Path) -> None:
    run(tiny_config(tmp_path / "run", TINY, epochs=3, keep=2, **PLAIN))
    names = sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*.pt"))
    assert names == ["checkpoint-epoch0002.pt", "checkpoint-epoch0003.pt", "checkpoint-last.pt"]
    with pytest.raises(CmhsaError, match="pass `resume`"):
        run(tiny_config(tmp_path / "run", TINY, epochs=3, **PLAIN))
    with pytest.raises(CmhsaError, match="no checkpoint to resume"):
        run(tiny_config(tmp_path / "fresh", TINY, resume=True))


def hook_loss(monkeypatch, hook) -> None:
    """Route every training loss through ``hook(call_number, loss)``."""
    real = engine.build_recipe

    def patched(*args, **kwargs):
        opt, sched, mixup, crit = real(*args, **kwargs)
        calls = {"n": 0}

        def loss(out, y):
            calls["n"] += 1
            return hook(calls["n"], crit(out, y))

        return opt, sched, mixup, loss

    monkeypatch.setattr(engine, "build_recipe", patched)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tmp_path: Path, monkeypatch) -> None:
    hook_loss(monkeypatch, lambda n, loss: loss * math.nan if n == 20 else loss)  # epoch 2, step 4
    with pytest.raises(CheckFailed, match=r"non-finite loss .* epoch 2, step 4") as info:
        run(tiny_config(tmp_path / "run", TINY, epochs=3, **PLAIN))
    assert str(tmp_path / "run" / "checkpoint-last.pt") in str(info.value)
    assert "`resume` and a lower `lr`" in str(info.value)  # advice that --resume now honours
    state = torch.load(tmp_path / "run" / "checkpoint-last.pt", weights_only=True)
    assert (state["epoch"], state["step"]) == (1, 0)
    assert all(torch.isfinite(t).all() for t in state["model"].values())


def test_non_finite_loss_in_the_first_epoch_names_no_checkpoint(tmp_path: Path, monkeypatch) -> None:
    hook_loss(monkeypatch, lambda n, loss: loss * math.nan if n == 3 else loss)
    with pytest.raises(CheckFailed, match="no checkpoint was saved yet") as info:
        run(tiny_config(tmp_path / "run", TINY, epochs=2, **PLAIN))
    assert "checkpoint-last.pt" not in str(info.value)
    assert not (tmp_path / "run" / "checkpoint-last.pt").exists()


@pytest.mark.sends_signals
def test_sigterm_finishes_the_step_saves_and_stops(tmp_path: Path, monkeypatch) -> None:
    def sigterm_at_3(n: int, loss: torch.Tensor) -> torch.Tensor:
        if n == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    hook_loss(monkeypatch, sigterm_at_3)
    before = signal.getsignal(signal.SIGTERM)
    res = run(tiny_config(tmp_path / "run", TINY, epochs=2, **PLAIN))
    assert res.stopped == "SIGTERM"
    state = torch.load(tmp_path / "run" / "checkpoint-last.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["global_step"]) == (0, 3, 3)
    assert signal.getsignal(signal.SIGTERM) is before  # handlers restored


@pytest.mark.slow
def test_ddp_two_gloo_processes_match_one_process(tmp_path: Path) -> None:
    """torchrun, 2 CPU processes with batch 16 each vs 1 process with batch 32: the same global
    batches (EpochSampler), gradients averaged by DDP, so the same losses to float rounding."""
    common = (
        "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
        "--epochs 2 --warmup-epochs 1 --lr 4e-3 --lr-base-batch 32 --workers 0 "
        "--mixup 0 --cutmix 0 --drop-path 0 --device cpu"
    ).split()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ddp = [
        sys.executable,
        *"-m torch.distributed.run --nproc-per-node 2 --master-port 29517 -m "
        "convit_convert train phase1".split(),
        *common,
        "--batch-size",
        "16",
        "-o",
        str(tmp_path / "ddp"),
    ]
    r = subprocess.run(ddp, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert r.stdout.count("epoch 2/2  train_loss") == 1  # rank 0 logs, rank 1 is silent
    single = [
        sys.executable,
        *"-m convit_convert train phase1".split(),
        *common,
        "--batch-size",
        "32",
        "-o",
        str(tmp_path / "one"),
    ]
    r = subprocess.run(single, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = metrics(tmp_path / "ddp"), metrics(tmp_path / "one")
    for ra, rb in zip(a, b, strict=True):
        assert ra["train_loss"] == pytest.approx(rb["train_loss"], rel=1e-4)
        assert ra["val_loss"] == pytest.approx(rb["val_loss"], rel=1e-4)
    assert json.loads((tmp_path / "ddp" / "config.json").read_text())["world_size"] == 2


# CLI ---------------------------------------------------------------------------------------------

CLI_TINY = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu"
).split()


@pytest.mark.slow  # the full tier's: the default tier's time (3 minutes on 2 cores)
def test_cli_phase1_phase2_eval_plot(tmp_path: Path) -> None:
    r = invoke("train", "phase1", *CLI_TINY, "-o", tmp_path / "p1", "--export-timm")
    assert r.exit_code == 0, r.output
    conv = tmp_path / "p1" / "conv.safetensors"
    assert "PASS: equal logits from timm.create_model('local-dir:" in r.output
    assert sorted(p.name for p in (tmp_path / "p1" / "timm").iterdir()) == [
        "README.md",
        "config.json",
        "model.safetensors",
        "modeling_cmhsa.py",
    ]
    cfg = json.loads((tmp_path / "p1" / "config.json").read_text())
    assert cfg["kind"] == "conv" and cfg["model"]["kernel_size"] == 3 and cfg["aa"] == "rand-m9-mstd0.5-inc1"
    r = invoke(
        "train",
        "phase2",
        *CLI_TINY,
        "--init",
        conv,
        "--qk-dim",
        "8",
        "-o",
        tmp_path / "p2",
        "--export-onnx",
    )
    assert r.exit_code == 0, r.output
    assert "verified: worst relative error" in r.output
    report = json.loads((tmp_path / "p2" / "vit.onnx.report.json").read_text())
    assert report["passed"] and report["input"]["path"] == str(tmp_path / "p2" / "vit.safetensors")
    assert (tmp_path / "p2" / "vit.onnx").stat().st_size == report["output"]["bytes"]
    cfg = json.loads((tmp_path / "p2" / "config.json").read_text())
    # the flags as given (none for the architecture), the model as trained beside them
    assert cfg["init_info"]["init_kind"] == "conv" and cfg["heads"] is None and cfg["lr"] is None
    assert cfg["model"]["num_heads"] == 9 and cfg["scaled_lr"]["lr"] == pytest.approx(5e-5 * 32 / 512)
    vit = tmp_path / "p2" / "vit.safetensors"
    r = invoke("eval", vit, "--data", "synthetic", "--workers", "0", "--device", "cpu")
    assert r.exit_code == 0 and "top-1" in r.output, r.output
    r = invoke("plot", tmp_path / "p1", tmp_path / "p2", "-o", tmp_path / "curves.png")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "curves.png").read_bytes()[:4] == b"\x89PNG"
    r = invoke("plot", tmp_path / "p1", tmp_path / "p2")  # default: beside the first run, not in the cwd
    assert r.exit_code == 0 and (tmp_path / "p1" / "curves.png").read_bytes()[:4] == b"\x89PNG"
    # phase 2 from an attention checkpoint, and from random (the paper's "2nd phase only")
    for init, name in ((vit, "p2b"), ("random", "p2r")):
        r = invoke("train", "phase2", *CLI_TINY, "--init", init, "-o", tmp_path / name)
        assert r.exit_code == 0, r.output


def test_cli_refuses_bad_training_input(tmp_path: Path, monkeypatch) -> None:
    conv_rgb = tmp_path / "p1" / "conv.safetensors"
    assert invoke("train", "phase1", *CLI_TINY, "-o", tmp_path / "p1").exit_code == 0
    cases = [
        (
            ["train", "phase1", *CLI_TINY, "--data", "imagefolder", "--data-dir", tmp_path / "none"],
            2,
            "does not exist",
        ),
        (["train", "phase1", *CLI_TINY, "--data", "cifar10"], 2, "needs --data-dir"),
        (["train", "phase1", *CLI_TINY, "--batch-size", "31"], 2, "even --batch-size"),
        (["train", "phase1", *CLI_TINY, "--amp", "fp16"], 2, "needs CUDA"),
        (["train", "phase1", *CLI_TINY, "--resume"], 2, "no checkpoint to resume"),
        # recipe flags, checked against what timm accepts, before anything is created
        (["train", "phase1", *CLI_TINY, "--opt", "foo"], 2, "--opt 'foo' is not one of timm's"),
        (
            ["train", "phase1", *CLI_TINY, "--sched", "foo"],
            2,
            "--sched 'foo': timm's scheduler factory refuses it",
        ),
        (["train", "phase1", *CLI_TINY, "--aa", "bogus"], 2, "--aa / --interpolation / --remode ('bogus'"),
        (
            ["train", "phase1", *CLI_TINY, "--interpolation", "foo"],
            2,
            "--interpolation 'foo': timm's create_transform",
        ),
        (["train", "phase1", *CLI_TINY, "--workers", "-1"], 2, "--workers must be 0 ≤ x ≤"),
        (["train", "phase1", *CLI_TINY, "--workers", "100000"], 2, "--workers must be 0 ≤ x ≤"),
        (["train", "phase1", *CLI_TINY, "--threads", "0"], 2, "--threads must be 1 ≤ x ≤"),
        (
            ["train", "phase1", *CLI_TINY, "--loader", "gpu"],
            2,
            "--loader must be one of auto, device, workers",
        ),
        (["train", "phase1", *CLI_TINY, "--loader", "device", "--aa", "original"], 2, "use --loader workers"),
        (["train", "phase1", *CLI_TINY, "--lr", "-1"], 2, "--lr must be 0 < x ≤ 10, got -1"),
        (["train", "phase1", *CLI_TINY, "--in-chans", "4"], 2, "takes 4-channel images"),
        (
            ["train", "phase2", *CLI_TINY, "--init", conv_rgb, "--kernel-size", "5"],
            2,
            "--kernel-size 5 disagrees",
        ),
        (
            ["train", "phase2", *CLI_TINY, "--init", tmp_path / "missing.safetensors"],
            2,
            "missing.safetensors",
        ),
        (["train", "phase2", *CLI_TINY, "--init", conv_rgb, "--margin", "0.5"], 1, "not exact"),
    ]
    for i, (args, code, msg) in enumerate(cases):
        r = invoke(*args, "-o", tmp_path / f"bad{i}")
        assert r.exit_code == code, (args, r.output)
        assert msg in r.output and "Traceback" not in r.output, (args, r.output)
        assert len(r.output.strip().splitlines()) == 1 or code == 1, (args, r.output)
        assert len(r.output.strip().splitlines()[-1]) < 300
        assert not (tmp_path / f"bad{i}").exists(), args  # nothing left behind, not even the folder
    # --out that cannot be a run folder: an existing file, a path through a file, a read-only disk
    (tmp_path / "afile").write_text("keep")
    r = invoke("train", "phase1", *CLI_TINY, "-o", tmp_path / "afile")
    assert r.exit_code == 2 and "names an existing file" in r.output
    assert (tmp_path / "afile").read_text() == "keep"
    r = invoke("train", "phase1", *CLI_TINY, "-o", tmp_path / "afile" / "run")
    assert r.exit_code == 2 and "cannot create the run folder (Not a directory)" in r.output, r.output

    def read_only(self, *a, **k):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    r = invoke("train", "phase1", *CLI_TINY, "-o", tmp_path / "ro")
    one_error_line(r, 2, "cannot create the run folder (Read-only file system)")
    assert not r.stdout.strip(), r.stdout


@pytest.mark.slow
def test_shipped_fixture_trains_and_evaluates(fixture_path: Path, tmp_path: Path) -> None:
    """The 1-channel digits fixture: cmhsa eval reads digits as grey (the model's in_chans), and
    phase 2 starts from it (converted exactly, verified) on the same data."""
    r = invoke("eval", fixture_path, "--data", "digits", "--workers", "0", "--device", "cpu")
    assert r.exit_code == 0, r.output
    top1 = float(re.search(r"conv\W+([\d.]+)", r.output).group(1))
    assert top1 == pytest.approx(98.33, abs=0.6), (
        r.output
    )  # the README's figure, give or take 2 of 359 images
    r = invoke(
        "train",
        "phase2",
        "--init",
        fixture_path,
        *"--data digits --train-samples 256 --epochs 1 --batch-size 64 --workers 0 --device cpu -o".split(),
        tmp_path / "p2",
    )
    assert r.exit_code == 0, r.output
    assert json.loads((tmp_path / "p2" / "config.json").read_text())["model"]["in_chans"] == 1
    r = invoke(
        "eval", tmp_path / "p2" / "vit.safetensors", "--data", "digits", "--workers", "0", "--device", "cpu"
    )
    assert r.exit_code == 0 and "attn, fused form" in r.output, r.output  # eval runs the fused form


def test_init_accepts_the_flags_that_built_the_checkpoint(tmp_path: Path) -> None:
    """`--mlp-ratio 2.7` builds an MLP of round(48 · 2.7) = 130; phase 2 from that checkpoint with
    the same flag is the same model (it was refused: 2.7 against the 130 / 48 read back)."""
    tiny = (
        "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
        "--batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu"
    ).split()
    r = invoke("train", "phase1", *tiny, "--mlp-ratio", "2.7", "-o", tmp_path / "p1")
    assert r.exit_code == 0, r.output
    conv = tmp_path / "p1" / "conv.safetensors"
    r = invoke("train", "phase2", *tiny, "--init", conv, "--mlp-ratio", "2.7", "-o", tmp_path / "p2")
    assert r.exit_code == 0, r.output
    r = invoke("train", "phase2", *tiny, "--init", conv, "--mlp-ratio", "3", "-o", tmp_path / "p3")
    assert r.exit_code == 2, r.output
    assert (
        "--mlp-ratio 3.0 (mlp_hidden_dim 144) disagrees with the checkpoint's mlp_hidden_dim 130" in r.stderr
    )


def test_missing_extra_names_a_command_that_works_from_a_checkout(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # import fails
    with pytest.raises(CmhsaError, match=r"pip install -e '\.\[digits\]'"):
        build_data("digits", None, (32, 32))


def test_one_image_size_the_models(tmp_path: Path, monkeypatch) -> None:
    """Phase 2 from a 16 px checkpoint with the image-size flag left at its default (224): the
    synthetic images are made at the model's 16 px, not the flag's (they were made at 224 and
    resized by the transforms)."""
    import convit_convert.data as data

    p1 = run(tiny_config(tmp_path / "p1", TINY, epochs=1, **PLAIN))
    made = []
    synthetic = data.synthetic
    monkeypatch.setattr(
        data, "synthetic", lambda size, *a, **k: made.append(size) or synthetic(size, *a, **k)
    )
    kw = {k: v for k, v in TINY.items() if k not in ("img_size", "patch_size", "depth", "kernel_size")}
    cfg = TrainConfig.from_flags(
        out=str(tmp_path / "p2"), phase="phase2", init=str(p1.model_path), epochs=1, **kw, **PLAIN
    )
    assert cfg.model.img_size == 224
    run(cfg)
    assert made == [(16, 16)]


def test_export_onnx_exports_the_trained_model_from_memory(tmp_path: Path) -> None:
    """``run`` itself exports (``export_onnx``), from the model in memory: onnxruntime's outputs on
    the written file match the safetensors file the run saved, read back independently."""
    import onnxruntime as ort

    from convit_convert.api import load_checkpoint

    res = run(tiny_config(tmp_path / "run", TINY, epochs=1, export_onnx=True, **PLAIN))
    assert res.export is not None and res.export.passed
    onnx_path = res.model_path.with_suffix(".onnx")
    sess = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    x = torch.randn(3, 3, 16, 16)
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    with torch.no_grad():
        want = load_checkpoint(res.model_path).model(torch.float32)(x)
    # float32 through two runtimes: 1e-4 relative is the export check's own tolerance
    assert (got - want).abs().max() <= 1e-4 * want.abs().max()


def test_export_timm_writes_the_trained_model_as_a_timm_folder(tmp_path: Path) -> None:
    """``export_timm``: the run's timm/ folder loads with timm (local-dir:) into a model whose logits
    equal those of the safetensors file the run saved, read back by cmhsa; a new run in the folder
    with `overwrite` and no export removes the old run's folder with its other outputs."""
    import timm

    import convit_convert.timm  # noqa: F401  (registers cmhsa_conv / cmhsa_attn)
    from convit_convert.api import load_checkpoint

    lines = []
    res = run(
        tiny_config(tmp_path / "run", TINY, epochs=1, export_timm=True, crop_pct=1.0, **PLAIN),
        progress=Progress(lines.append),
    )
    assert [ln for ln in lines if "exported preprocessing" in ln] == [
        "note: the exported preprocessing is cmhsa eval's (bicubic, crop 0.875), not this run's "
        "`interpolation` bicubic and `crop_pct` 1.0"
    ]
    assert res.timm is not None and res.timm.passed and res.timm.folder == res.out / "timm"
    loaded = timm.create_model(f"local-dir:{res.out / 'timm'}", pretrained=True).eval()
    x = torch.randn(3, 3, 16, 16)
    with torch.no_grad():
        # the same weights in the same model, both float32 on the CPU: equal, not close
        assert torch.equal(loaded(x), load_checkpoint(res.model_path).model(torch.float32).eval()(x))
    run(tiny_config(tmp_path / "run", TINY, epochs=1, seed=1, overwrite=True, **PLAIN))
    assert not (res.out / "timm").exists()  # its files removed, and the folder they left empty


def test_holdout_is_training_images_the_subset_left_out(tmp_path: Path) -> None:
    """--holdout: the evaluation images are training-split images, none of them trained on, none of
    them validation images; each image's pixels say which it is (train i: value i, val: 200 + i)."""
    from conftest import write_idx

    data = tmp_path / "fm"
    data.mkdir()
    for split, n, base in (("train", 120, 0), ("t10k", 30, 200)):
        write_idx(
            data / f"{split}-images-idx3-ubyte.gz", np.stack([np.full((28, 28), base + i) for i in range(n)])
        )
        write_idx(data / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)

    def ids(split) -> list[int]:
        return [int(np.asarray(split[i][0])[0, 0]) for i in range(len(split))]

    spec = cdata.build_data("fashion-mnist", data, train_samples=50, holdout=40, seed=3)
    train, held = ids(spec.train), ids(spec.val)
    assert len(set(train)) == 50 and len(set(held)) == 40 and not set(train) & set(held)
    assert max(held) < 120  # from the training split, not the validation images (200+)
    assert train == ids(
        cdata.build_data("fashion-mnist", data, train_samples=50, seed=3).train
    )  # same subset
    for kw, msg in (
        (dict(holdout=5), "`holdout` takes images the `train_samples` subset leaves out"),
        (dict(train_samples=50, holdout=5, val_samples=5), "replaces `val_samples`"),
        (dict(train_samples=100, holdout=21), "`train_samples` \\+ `holdout` must be at most 120"),
    ):
        with pytest.raises(CmhsaError, match=msg):
            cdata.build_data("fashion-mnist", data, **kw)
