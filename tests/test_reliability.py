"""What a hostile or unlucky user meets: one error boundary (exit 1/2/3, one line, a traceback
only with --debug), terminal-safe output, a locked run folder, resumes that refuse what does not
fit, outputs written all or none on a full disk, and phase 2 bit-identical on CPU.

Full disks are simulated (the write raises what the real one raises: OSError ENOSPC, or torch.save's
RuntimeError), since CI cannot mount a small tmpfs; and made real with a file-size limit
(RLIMIT_FSIZE, with SIGXFSZ ignored), under which the kernel cuts writes short as a full disk does.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURE, ROOT, in_a_process, invoke, one_error_line
from convit_convert import resources
from convit_convert.config import ViTConfig
from convit_convert.errors import CmhsaError
from convit_convert.options.training import TrainConfig
from convit_convert.train.run import run

TINY = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu"
).split()


def temps(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.name.endswith(".tmp")]


# the error boundary ------------------------------------------------------------------------------


def boom(exc: BaseException):
    def raiser(*args, **kwargs):
        raise exc

    return raiser


def test_an_internal_error_is_one_line_and_exit_3_unless_debug(tmp_path: Path, monkeypatch) -> None:
    import convit_convert.api.convert as api

    monkeypatch.setattr(api, "convert_checkpoint", boom(ZeroDivisionError("division by zero")))
    args = ("convert", FIXTURE, "-o", tmp_path / "v.safetensors")
    r = invoke(*args)
    one_error_line(r, 3, "internal error: ZeroDivisionError: division by zero", "--debug", "please report it")
    assert list(tmp_path.iterdir()) == []
    for debug in (invoke("--debug", *args), invoke(*args, env={"CMHSA_DEBUG": "1"})):
        assert debug.exit_code == 3 and "Traceback" in debug.stderr and "ZeroDivisionError" in debug.stderr
    assert "Traceback" not in invoke(*args).stderr  # --debug does not carry over to the next invocation


def test_an_allocation_failure_says_what_was_too_large(tmp_path: Path, monkeypatch) -> None:
    import convit_convert.api.convert as api

    oom = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 80000000000 bytes. Error code 12 (Cannot allocate memory)"
    )
    monkeypatch.setattr(api, "convert_checkpoint", boom(oom))
    one_error_line(
        invoke("convert", FIXTURE, "-o", tmp_path / "v.safetensors"), 2, "out of memory", "74.5 GiB"
    )
    monkeypatch.setattr(api, "convert_checkpoint", boom(MemoryError()))
    one_error_line(invoke("convert", FIXTURE, "-o", tmp_path / "v.safetensors"), 2, "out of memory")


def test_usage_errors_are_one_line_too() -> None:
    one_error_line(invoke("heads", "--kernel", "abc"), 2, "--kernel", "cmhsa heads --help")
    one_error_line(invoke("convert", "--no-such-flag"), 2, "No such option")


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["heads", "--kernel", "2001", "--patch", "1"], "--kernel must be 1 ≤ x ≤ 1025, got 2001"),
        (["heads", "--kernel", "5", "--patch", "4", "--channels", "0"], "--channels must be 1 ≤ x"),
        (["convert", FIXTURE, "-o", "x.safetensors", "--heads", "100000"], "--heads must be 1 ≤ x ≤ 4096"),
        (
            ["convert", FIXTURE, "-o", "x.safetensors", "--qk-dim", "100000000"],
            "--qk-dim must be 1 ≤ x ≤ 65536",
        ),
        (
            ["convert", FIXTURE, "-o", "x.safetensors", "--device", "tpu"],
            "--device must be auto, cpu, cuda or cuda:N",
        ),
        (["verify", FIXTURE, FIXTURE, "--batch", "100000000"], "--batch must be 1 ≤ x ≤ 65536"),
        (["verify", FIXTURE, FIXTURE, "--device", "tpu"], "--device must be auto, cpu, cuda or cuda:N"),
        (["eval", FIXTURE, "--workers", "-1"], "--workers must be 0 ≤ x"),
        (["eval", FIXTURE, "--crop-pct", "nan"], "--crop-pct must be 0.1 ≤ x ≤ 1, got nan"),
        (["train", "phase1", *TINY, "--img-size", "0"], "--img-size must be 1 ≤ x ≤ 16384, got 0"),
        (["train", "phase1", *TINY, "--opt-eps", "nan"], "--opt-eps must be 0 < x ≤ 1, got nan"),
        (["train", "phase1", *TINY, "--opt-betas", "2", "-1"], "--opt-betas must be 0 ≤ x < 1, got 2"),
        (["train", "phase1", *TINY, "--seed", "-1"], "--seed must be 0 ≤ x ≤ 4294967295, got -1"),
        (["train", "phase1", *TINY, "--lr-base-batch", "0"], "--lr-base-batch must be 1 ≤ x"),
        (["train", "phase1", *TINY, "--mlp-ratio", "nan"], "--mlp-ratio must be 0 < x ≤ 64, got nan"),
        (["train", "phase1", *TINY, "--depth", "1000000"], "--depth must be 1 ≤ x ≤ 1024"),
        (["train", "phase1", *TINY, "--num-classes", "0"], "--num-classes must be 2 ≤ x"),
        (
            ["train", "phase1", *TINY, "--model-ema-decay", "nan"],
            "--model-ema-decay must be 0 ≤ x < 1, got nan",
        ),
        (["train", "phase1", *TINY, "--clip-grad", "-1"], "--clip-grad must be 0 < x"),
        (["train", "phase1", *TINY, "--mixup-prob", "nan"], "--mixup-prob must be 0 ≤ x ≤ 1, got nan"),
        (["train", "phase1", *TINY, "--workers", "100000"], "--workers must be 0 ≤ x"),
        (["train", "phase1", *TINY, "--lr", "inf"], "--lr must be 0 < x ≤ 10, got inf"),
    ],
)
def test_out_of_range_numbers_are_refused_naming_the_flag(
    args: list, fragment: str, tmp_path: Path, monkeypatch
) -> None:
    """The issue's cases: each used to end in a traceback, run away, or be accepted silently."""
    monkeypatch.chdir(tmp_path)
    args = [*args, "-o", tmp_path / "run"] if args[0] == "train" else args
    one_error_line(invoke(*args), 2, fragment)
    assert list(tmp_path.iterdir()) == []


# terminal-safe output ----------------------------------------------------------------------------


def test_escape_sequences_from_a_file_never_reach_the_terminal(tmp_path: Path) -> None:
    tensors = load_file(str(FIXTURE))
    from safetensors import safe_open

    with safe_open(str(FIXTURE), "pt") as f:
        meta = dict(f.metadata())
    evil = "\x1b]0;owned\x07\x1b[2J"
    crafted = tmp_path / "meta.safetensors"
    save_file(tensors, str(crafted), {**meta, "cmhsa.trained": f"phase1 {evil}"})
    r = invoke("inspect", crafted)
    assert r.exit_code == 0 and "\x1b" not in r.output and "\\x1b]0;owned\\x07" in r.output
    renamed = tmp_path / "name.safetensors"
    save_file({**tensors, f"blocks.0.{evil}": tensors["head.bias"].clone()}, str(renamed), meta)
    r = invoke("inspect", renamed)
    one_error_line(r, 2, "\\x1b")
    assert "\x1b" not in r.output and "\x07" not in r.output


# the run folder: locked, and resumed only by what fits it ----------------------------------------


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_a_second_training_into_a_busy_run_folder_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = subprocess.Popen(
        [
            sys.executable,
            *"-m convit_convert train phase1".split(),
            *TINY,
            "--epochs",
            "1000",
            "-o",
            str(out),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        deadline = time.time() + 120
        while not (out / "config.json").exists():  # written under the lock, once training starts
            assert first.poll() is None and time.time() < deadline, (
                first.stderr.read() if first.stderr else ""
            )
            time.sleep(0.2)
        for extra in (["--seed", "7"], ["--resume"]):
            one_error_line(
                invoke("train", "phase1", *TINY, *extra, "-o", out),
                2,
                "in use by another cmhsa process",
                f"PID {first.pid}",
            )
        assert json.loads((out / "config.json").read_text())["seed"] == 0
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=120)
    r = invoke("train", "phase1", *TINY, "--resume", "-o", out)  # the lock went with its process
    assert "in use" not in r.output and (r.exit_code == 0 or "already trained" in r.stderr), r.output


def test_resume_refuses_another_phase_and_changed_flags(tmp_path: Path) -> None:
    out = tmp_path / "p1"
    assert invoke("train", "phase1", *TINY, "-o", out).exit_code == 0
    one_error_line(
        invoke("train", "phase2", *TINY, "--resume", "-o", out),
        2,
        "holds a phase1 run",
        "cmhsa train phase1 --resume",
    )
    one_error_line(
        invoke("train", "phase1", *TINY, "--resume", "--seed", "7", "-o", out),
        2,
        "--seed 7 differs from the run's 0",
    )


def crafted_checkpoints(tmp_path: Path) -> tuple[Path, dict]:
    out = tmp_path / "base"
    assert invoke("train", "phase1", *TINY, "-o", out).exit_code == 0
    return out, torch.load(out / "checkpoint-last.pt", weights_only=True)


def test_a_crafted_training_checkpoint_is_refused_in_one_error_line(tmp_path: Path) -> None:
    out, good = crafted_checkpoints(tmp_path)
    weight = next(iter(good["model"]))

    def variant(**changes) -> dict:
        d = {**good, **changes}
        return {k: v for k, v in d.items() if v is not DROP}

    DROP = object()
    cases = {
        "no epoch": (variant(epoch=DROP), "no 'epoch'"),
        "epoch a string": (variant(epoch="1"), "'epoch' is a str"),
        "metrics disagree": (variant(epoch=5), "1 metrics rows for 5 finished epochs"),
        "bad optimizer": (
            variant(optimizer={"state": {}, "param_groups": [{"params": [0]}]}),
            "does not fit",
        ),
        "wrong shapes": (variant(model={**good["model"], weight: torch.zeros(3)}), "does not fit"),
        "bad rng": (
            variant(
                step=1,
                rng={
                    "python": (3, (1,), None),
                    "torch": torch.zeros(3, dtype=torch.uint8),
                    "numpy": ("MT19937", torch.zeros(3), 0, 0, 0.0),
                },
            ),
            "does not fit",
        ),
        "not a dict": ([1, 2], "a list, not a dict"),
    }
    for name, (state, fragment) in cases.items():
        run_dir = tmp_path / name.replace(" ", "-")
        run_dir.mkdir()
        for f in ("config.json", "metrics.csv"):
            (run_dir / f).write_bytes((out / f).read_bytes())
        torch.save(state, run_dir / "checkpoint-last.pt")
        before = sorted(p.name for p in run_dir.iterdir())
        r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", run_dir)
        one_error_line(r, 2, "checkpoint-last.pt", fragment)
        assert sorted(p.name for p in run_dir.iterdir() if p.name != ".cmhsa.lock") == before, name


class Payload:  # pickled by reference: loading it would need this global
    pass


def test_an_unsafe_pickle_is_refused_without_advice_to_load_it_unsafely(tmp_path: Path) -> None:
    out, good = crafted_checkpoints(tmp_path)
    torch.save({**good, "extra": Payload()}, out / "checkpoint-last.pt")
    r = invoke("train", "phase1", *TINY, "--epochs", "2", "--resume", "-o", out)
    one_error_line(r, 2, "will not load it", "not written by cmhsa train")
    assert "weights_only" not in r.stderr and "--weights-only" not in r.stderr


# a full disk: outputs that belong together are written together or not at all -------------------


def test_a_full_disk_at_a_checkpoint_keeps_the_last_one_and_its_metrics(tmp_path: Path, monkeypatch) -> None:
    real, calls = torch.save, []

    def full_on_the_second(obj, f, *a, **k):
        calls.append(f)
        if len(calls) == 2:
            raise RuntimeError(
                "[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed "
                "writing file data/3: file write failed"
            )
        return real(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full_on_the_second)
    out = tmp_path / "run"
    r = invoke("train", "phase1", *TINY, "--epochs", "3", "-o", out)
    one_error_line(
        r, 2, "checkpoint-last.pt", "cannot write (PytorchStreamWriter failed writing file", "nor metrics.csv"
    )
    assert real is not None and torch.load(out / "checkpoint-last.pt", weights_only=True)["epoch"] == 1
    assert len((out / "metrics.csv").read_text().splitlines()) == 2  # header + epoch 1: as the checkpoint
    assert temps(tmp_path) == []


def test_a_full_disk_while_writing_convert_s_report_keeps_both_old_files(tmp_path: Path, monkeypatch) -> None:
    import convit_convert.api.convert as api

    out, report = tmp_path / "v.safetensors", tmp_path / "v.report.json"
    out.write_bytes(b"old model")
    report.write_text("old report")

    def no_space(_: dict) -> str:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(api, "report_text", no_space)
    r = invoke("convert", FIXTURE, "-o", out)
    one_error_line(r, 2, str(out), "No space left on device", "nor v.report.json")
    assert out.read_bytes() == b"old model" and report.read_text() == "old report" and temps(tmp_path) == []


def cli_under_a_file_size_limit(limit: int, *args: object) -> subprocess.CompletedProcess[str]:
    """`python -m convit_convert ARGS` in a process that may write no file past `limit` bytes:
    writes beyond it fail (EFBIG) or come back short, as on a full disk."""
    resource = pytest.importorskip("resource")  # POSIX only

    def limit_writes() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the writer

    return in_a_process("-m", "convit_convert", *args, preexec_fn=limit_writes)


def test_a_real_write_failure_in_convert_keeps_the_old_model_and_report(tmp_path: Path) -> None:
    out, report = tmp_path / "v.safetensors", tmp_path / "v.report.json"
    out.write_bytes(b"old model")
    report.write_text("old report")
    p = cli_under_a_file_size_limit(64 * 1024, "convert", FIXTURE, "-o", out)  # the model is ~1 MB
    one_error_line(
        p, 2, str(out), "cannot write (File too large)", "nor v.report.json", "previous file is kept"
    )
    assert out.read_bytes() == b"old model" and report.read_text() == "old report" and temps(tmp_path) == []


def test_a_real_short_write_at_a_checkpoint_keeps_the_last_one_and_its_metrics(tmp_path: Path) -> None:
    """torch.save under the limit raises "unexpected pos N vs M" (not "failed writing file"): that
    too is a failed write, not an internal error."""
    out = tmp_path / "run"
    assert invoke("train", "phase1", *TINY, "-o", out).exit_code == 0
    before = (out / "checkpoint-last.pt").read_bytes(), (out / "metrics.csv").read_text()
    p = cli_under_a_file_size_limit(20_000, "train", "phase1", *TINY, "--epochs", "2", "-o", out, "--resume")
    one_error_line(p, 2, "checkpoint-last.pt", "cannot write (", "nor metrics.csv", "previous file is kept")
    assert ((out / "checkpoint-last.pt").read_bytes(), (out / "metrics.csv").read_text()) == before
    assert temps(tmp_path) == []


def test_a_graph_that_passes_the_checker_but_fails_in_onnxruntime(tmp_path: Path) -> None:
    """A Gather whose index is out of range: valid to onnx.checker and shape inference, an error
    only when onnxruntime runs it."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["x", "i"], ["y"], axis=1)],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, 8, 8])],
        [helper.make_tensor("i", TensorProto.INT64, [1], [7])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    path = tmp_path / "gather.onnx"
    onnx.save(model, str(path))
    one_error_line(
        invoke("convert", path, "-o", tmp_path / "v.safetensors"),
        2,
        str(path),
        "onnxruntime cannot run the graph",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gather.onnx"]


def test_a_kernel_reaching_past_the_image_is_refused(tmp_path: Path) -> None:
    one_error_line(
        invoke("train", "phase1", *TINY, "--kernel-size", "33", "-o", tmp_path / "r"),
        2,
        "kernel_size 33 (dilation 1) reaches 16 pixels, beyond the 16x16 image",
    )
    assert not (tmp_path / "r").exists()


# phase 2 is deterministic on CPU -----------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gated", "hard", "free-heads"])
def test_phase2_on_cpu_is_bit_identical_run_to_run_and_across_a_resume(tmp_path: Path, variant: str) -> None:
    """From the fixture (8x8 patches, 4 blocks) on digits, default threads. Before the relative
    position bias was gathered with index_select, two identical runs differed by up to 1e-9 in a
    few hundred weights (the backward of advanced indexing accumulates with atomics on CPU)."""
    kw = dict(
        phase="phase2",
        data="digits",
        init=str(FIXTURE),
        train_samples=128,
        val_samples=32,
        epochs=2,
        batch_size=32,
        warmup_epochs=0,
        lr=1e-3,
        lr_base_batch=32,
        workers=0,
        device="cpu",
        log_every=1000,
        pinning="hard" if variant == "hard" else "gated",
        heads=12 if variant == "free-heads" else None,
    )

    def cfg(name: str, **more) -> TrainConfig:
        return TrainConfig.from_flags(out=str(tmp_path / name), **kw, **more)

    run(cfg("a"))
    run(cfg("b"))
    first = run(cfg("c"), stop_after_steps=6)  # 4 steps per epoch: mid epoch 2
    assert first.stopped == "limit"
    run(cfg("c", resume=True))
    a, b, c = (load_file(str(tmp_path / n / "vit.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert all(torch.equal(a[k], c[k]) for k in a), [k for k in a if not torch.equal(a[k], c[k])]


def test_library_errors_stay_library_errors() -> None:
    """The library raises CmhsaError (no exit codes, no printing): the boundary is the CLI's."""
    from convit_convert.api import resolve_device

    with pytest.raises(CmhsaError, match="`device` must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        resolve_device("tpu")


# sizes that cannot fit are refused before anything is allocated ---------------------------------


@pytest.mark.parametrize("kind", ["conv", "hard", "gated", "gated-nosink"])
def test_the_size_estimate_counts_what_torch_builds(kind: str) -> None:
    from convit_convert.config import ViTConfig
    from convit_convert.model import VisionTransformer

    cfg = ViTConfig.build(img_size=(24, 16), patch_size=4, in_chans=1, hidden_chans=2, depth=2, num_classes=7)
    if kind != "conv":
        cfg = cfg.with_attention(
            11, qk_dim=5, v_dim=7, sink=kind != "gated-nosink", pinning=kind.split("-")[0]
        )
    assert cfg.num_params() == sum(p.numel() for p in VisionTransformer(cfg).parameters())


def test_sizes_beyond_memory_are_refused_with_the_estimate(tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    one_error_line(
        invoke("convert", FIXTURE, "-o", out, "--heads", "4096", "--qk-dim", "65536"),
        2,
        str(FIXTURE),
        "would need about",
        "GiB of memory available",
    )
    # a model that fits (hidden_chans 1: d = 32², 128×128 patches) on images that do not
    one_error_line(
        invoke(
            "train",
            "phase1",
            *TINY,
            *"--img-size 4096 --patch-size 32 --hidden-chans 1 --batch-size 2 -o".split(),
            tmp_path / "r",
        ),
        2,
        "synthetic data at 4096x4096 px would need",
    )
    one_error_line(
        invoke(
            "train",
            "phase1",
            *TINY,
            *"--img-size 512 --hidden-chans 64 --depth 24 -o".split(),
            tmp_path / "r",
        ),
        2,
        "training a conv model of",
        "would need about",
    )
    assert invoke("convert", FIXTURE, "-o", out).exit_code == 0
    one_error_line(
        invoke("verify", FIXTURE, out, "--batch", "65536", "--dtype", "float64"),
        2,
        "verifying at batch 65536 would need about",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.report.json", "v.safetensors"]


def test_a_file_claiming_a_huge_model_is_refused_before_it_is_built(tmp_path: Path) -> None:
    """The config in a file is bounded like the flags: no (N, N) index for a 16384-patch-wide grid."""
    from safetensors import safe_open

    tensors = load_file(str(FIXTURE))
    with safe_open(str(FIXTURE), "pt") as f:
        meta = dict(f.metadata())
    for img, fragment in (
        ([65536, 65536], "img_size 65536 is more than cmhsa supports"),
        ([2048, 2048], "512x512 patches is more than cmhsa supports"),
    ):
        cfg = {**json.loads(meta["cmhsa.config"]), "img_size": img}
        crafted = tmp_path / f"claims-{img[0]}.safetensors"
        save_file(tensors, str(crafted), {**meta, "cmhsa.config": json.dumps(cfg)})
        for args in (["inspect", crafted], ["convert", crafted, "-o", tmp_path / "v.safetensors"]):
            one_error_line(invoke(*args), 2, str(crafted), fragment)
    assert not (tmp_path / "v.safetensors").exists()


def test_the_memory_check_covers_a_stack_of_seeds(monkeypatch: pytest.MonkeyPatch) -> None:
    """A `--seeds` stack holds every seed's weights, moments and batch at once: checked as that,
    refused where one seed fits (a check of each seed's alone would pass 64 seeds)."""
    from convit_convert.train.phases import check_trainable

    flags = dict(phase="phase1", data="synthetic", img_size=32, patch_size=4, depth=2, batch_size=64)
    flags |= dict(device="cpu", out="unused")
    mcfg = ViTConfig.build(img_size=32, patch_size=4, in_chans=3, depth=2, kernel_size=5, num_classes=10)
    one_seed = 16 * mcfg.num_params() + mcfg.activation_bytes(64, training=True)
    monkeypatch.setattr(resources, "available_memory", lambda: 3 * one_seed)
    check_trainable(TrainConfig.from_flags(**flags), mcfg)
    check_trainable(TrainConfig.from_flags(seeds=(0, 1, 2), **flags), mcfg)
    with pytest.raises(CmhsaError, match="4 seeds stacked"):
        check_trainable(TrainConfig.from_flags(seeds=(0, 1, 2, 3), **flags), mcfg)


def test_out_of_memory_names_what_made_the_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the user gave no size (an image, an ONNX file's preprocessing, a stack of seeds), a
    failed allocation is said as that thing's, not as "reduce the sizes given"."""
    from PIL import Image

    import convit_convert.api.predict as api
    import convit_convert.train.stacked as stacked

    Image.new("L", (8, 8)).save(tmp_path / "pic.png")
    monkeypatch.setattr(api, "read_image", boom(MemoryError()))
    r = invoke("predict", FIXTURE, tmp_path / "pic.png")
    line = one_error_line(r, 2, "out of memory for the image", str(tmp_path / "pic.png"))
    assert "reduce the sizes given" not in line
    monkeypatch.setattr(stacked, "train_epochs", boom(MemoryError()))
    r = invoke("train", "phase1", *TINY, "--seeds", "0,1", "-o", tmp_path / "s")
    one_error_line(r, 2, "out of memory for 2 seeds stacked at batch", "--seeds")
