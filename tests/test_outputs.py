"""What a command writes, replaces and removes: outputs that belong together land together or not at
all, a kill or a signal mid-commit loses nothing, `--overwrite` keeps the previous run until the
new one has saved, nothing is written through a link, FIFO or device, and a refused command leaves
no folder behind.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    FIXTURE,
    ROOT,
    TINY_FLAGS,
    check_outcome,
    copy_run,
    in_a_process,
    invoke,
    leftovers,
    one_error_line,
    snapshot,
    special_files,
)


def test_plot_refuses_an_output_that_is_not_an_image(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.csv").write_text(
        "epoch,train_loss,val_loss,top1,top5\n1,2.0,1.9,30,80\n2,1.5,1.4,50,90\n"
    )
    before = snapshot(run)
    for suffix in (".txt", ".safetensors", ""):
        r = invoke("plot", run, "-o", tmp_path / f"curves{suffix}")
        check_outcome(r, run, before, allow_ok=False)
        assert not (tmp_path / f"curves{suffix}").exists()


# unsafe writes


def test_a_symlinked_lock_is_never_followed(tmp_path: Path, tiny_run: Path) -> None:
    # catches: the link's target truncated to the PID, exit 0
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".cmhsa.lock").symlink_to(victim)
    one_error_line(invoke("train", "phase1", *TINY_FLAGS, "-o", run), 2, ".cmhsa.lock", "symbolic link")
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in run.iterdir()) == [".cmhsa.lock"]


def test_an_output_that_is_a_device_fifo_or_link_is_refused_and_kept(tmp_path: Path) -> None:
    # catches: `--report /dev/null` and `-o FIFO` replaced by regular files
    nodes = special_files(tmp_path)
    kinds = {p: os.lstat(p).st_mode for p in [*nodes.values(), tmp_path / "target.safetensors"]}
    for kind, node in nodes.items():
        out = tmp_path / "v.safetensors"
        for args in (["-o", node], ["-o", out, "--report", node]):
            one_error_line(invoke("convert", FIXTURE, *args), 2, str(node.name), kind)
            assert not out.exists()
        onnx_node = node.with_name(node.name.replace(".safetensors", ".onnx"))
        os.rename(node, onnx_node)
        one_error_line(invoke("export", FIXTURE, "-o", onnx_node), 2, kind)
        os.rename(onnx_node, node)
    assert {p: os.lstat(p).st_mode for p in kinds} == kinds
    assert (tmp_path / "target.safetensors").read_bytes() == b"kept"


def test_a_run_folder_holding_another_run_is_refused_unless_overwrite(tmp_path: Path, tiny_run: Path) -> None:
    # catches: `train phase1 -o DIR` silently replacing another run's conv.safetensors, metrics.csv,
    # config.json
    run = copy_run(tiny_run, tmp_path / "run")
    (run / "checkpoint-last.pt").unlink()
    before = snapshot(run)
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--seed", "3", "-o", run),
        2,
        "another run's outputs",
        "--overwrite",
    )
    assert snapshot(run) == before
    r = invoke("train", "phase1", *TINY_FLAGS, "--seed", "3", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["seed"] == 3


def test_attention_writes_its_json_and_png_together_or_not_at_all(
    tmp_path: Path, attn_model: Path, monkeypatch
) -> None:
    # catches: the JSON written, then the PNG failing (disk full): one without the other, or an empty folder
    import matplotlib.figure

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    out = tmp_path / "att"
    one_error_line(
        invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", out), 2, "No space left"
    )
    assert not out.exists()
    out.mkdir()
    one_error_line(
        invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", out), 2, "No space left"
    )
    assert list(out.iterdir()) == []


# cmhsa with os.replace wrapped: the KILL_AT-th rename of a temp file first sends KILL_SIG to the
# process itself (as `strace -e inject=rename:signal=...` would), deterministically mid-commit
AT_RENAME = """
import os, sys
real = os.replace
calls = [0]
def replace(src, dst, *a, **k):
    if str(src).endswith(".tmp"):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT"]):
            os.kill(os.getpid(), int(os.environ["KILL_SIG"]))
    return real(src, dst, *a, **k)
os.replace = replace
from convit_convert.cli import main
sys.argv = ["cmhsa", *sys.argv[1:]]
main()
"""


def cmhsa_signalled_at_rename(args: list[object], at: int, sig: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_AT": str(at), "KILL_SIG": str(int(sig))}
    return in_a_process("-c", AT_RENAME, *args, env=env, timeout=600)


def pair_is_one_write(model: Path, report: Path) -> bool:
    """The report describes the model beside it (it records the model's sha256)."""
    return (
        json.loads(report.read_text())["output"]["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    )


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_convert_killed_between_its_two_renames_is_completed_by_the_next_command(tmp_path: Path) -> None:
    # catches: the new model beside the previous report, and a temp file, for good
    out, report = tmp_path / "vit.safetensors", tmp_path / "vit.report.json"
    assert invoke("convert", FIXTURE, "-o", out, "--heads", "10").exit_code == 0
    old_report = report.read_bytes()
    r = cmhsa_signalled_at_rename(["convert", FIXTURE, "-o", out], 2, signal.SIGKILL)
    assert r.returncode == -signal.SIGKILL
    assert report.read_bytes() == old_report and not pair_is_one_write(out, report)  # mid-commit
    # a reader never renames: it refuses the half-committed file, naming what finishes it
    one_error_line(invoke("inspect", out), 2, "was cut short", "running again the cmhsa command")
    assert report.read_bytes() == old_report
    # any command writing into the folder rolls the commit forward first
    assert invoke("convert", FIXTURE, "-o", tmp_path / "other.safetensors").exit_code == 0
    assert pair_is_one_write(out, report) and leftovers(tmp_path) == []
    assert invoke("inspect", out).exit_code == 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_at_a_pair_s_first_rename_is_taken_after_the_pair(tmp_path: Path, sig: int) -> None:
    # catches: exit 143/130 with the new model beside the previous report
    out, report = tmp_path / "vit.safetensors", tmp_path / "vit.report.json"
    assert invoke("convert", FIXTURE, "-o", out, "--heads", "10").exit_code == 0
    r = cmhsa_signalled_at_rename(["convert", FIXTURE, "-o", out], 1, sig)
    assert r.returncode == 128 + sig, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    assert pair_is_one_write(out, report) and leftovers(tmp_path) == []
    assert json.loads(report.read_text())["conversion"]["heads"] == 9  # the new pair, whole


@pytest.mark.slow
def test_training_killed_between_checkpoint_and_metrics_resumes_with_every_row(tmp_path: Path) -> None:
    # catches: 2 rows in checkpoint-last.pt, 1 in metrics.csv, and `--resume` exited 0 without the row
    out = tmp_path / "run"
    args = ["train", "phase1", *TINY_FLAGS, "--epochs", "2", "-o", out]
    r = cmhsa_signalled_at_rename(args, 2, signal.SIGKILL)  # epoch 1's save: 3 renames; epoch 2's: 4 to 6
    assert r.returncode == -signal.SIGKILL
    r = cmhsa_signalled_at_rename(
        ["train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", out], 5, signal.SIGKILL
    )
    assert r.returncode == -signal.SIGKILL
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", out)
    assert r.exit_code == 0, r.output
    rows = (out / "metrics.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[1].startswith("1,") and rows[2].startswith("2,"), rows
    assert json.loads((out / "config.json").read_text())["epochs"] == 2
    assert leftovers(out) == []


def test_overwrite_keeps_the_previous_run_until_the_new_one_saves(tmp_path: Path, tiny_run: Path) -> None:
    # catches: the previous run removed, then the new one refused (exit 2): everything lost
    run = copy_run(tiny_run, tmp_path / "run")
    before = snapshot(run)
    for bad in (["--data", "fashion-mnist", "--data-dir", tmp_path / "none"], ["--train-samples", "100000"]):
        one_error_line(invoke("train", "phase1", *TINY_FLAGS, *bad, "--overwrite", "-o", run), 2)
        assert snapshot(run) == before, bad
    r = invoke("train", "phase1", *TINY_FLAGS, "--seed", "3", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert json.loads((run / "config.json").read_text())["seed"] == 3


def test_overwrite_never_removes_the_file_init_starts_from(tmp_path: Path, tiny_run: Path) -> None:
    # catches: `phase2 --init RUN/conv.safetensors -o RUN --overwrite` deleted it, then "no such file"
    run = copy_run(tiny_run, tmp_path / "run")
    conv = (run / "conv.safetensors").read_bytes()
    r = invoke("train", "phase2", *TINY_FLAGS, "--init", run / "conv.safetensors", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    assert (run / "conv.safetensors").read_bytes() == conv and (run / "vit.safetensors").is_file()


def test_a_failed_save_on_resume_changes_no_file(tmp_path: Path, tiny_run: Path, monkeypatch) -> None:
    # catches: a full disk during `--resume` left config.json changed though the error said it was kept
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    before = snapshot(run)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "--threads", "1", "-o", run),
        2,
        "No space left",
    )
    assert snapshot(run) == before


def test_a_refused_command_leaves_no_folder_it_made(tmp_path: Path, attn_model: Path, monkeypatch) -> None:
    # catches: n1/n2 left by `-o n1/n2/run` with a bad --data-dir, nope/deeper by a --resume with nothing
    # to resume, x/y by `attention -o x/y/att` on a full disk
    monkeypatch.chdir(tmp_path)
    one_error_line(
        invoke(
            "train", "phase1", *TINY_FLAGS, "--data", "fashion-mnist", "--data-dir", "none", "-o", "n1/n2/run"
        ),
        2,
    )
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--resume", "-o", "nope/deeper/run"), 2, "no checkpoint"
    )
    import matplotlib.figure

    def full(self, *a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    one_error_line(
        invoke("attention", attn_model, "--data", "digits", "--images", "20", "-o", "x/y/att"),
        2,
        "No space",
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.parametrize(
    ("redirect", "command", "why"),
    [
        ("> /dev/full", ["inspect", FIXTURE], "No space left on device"),
        ("> /dev/full", ["verify", FIXTURE, "ATTN"], "No space left on device"),
        (">&-", ["inspect", FIXTURE], "it is closed"),
        ("| head -c1", ["inspect", FIXTURE], None),
    ],
)
def test_a_report_that_cannot_be_written_is_an_error(
    attn_model: Path, redirect: str, command: list, why: str | None
) -> None:
    # catches: exit 0 with nothing written for /dev/full and >&-: `cmhsa inspect X > report.txt` on a full
    # disk gave an empty file and success. A reader that went away (| head) still ends quietly
    args = [str(attn_model) if a == "ATTN" else str(a) for a in command]
    p = subprocess.run(
        [
            "bash",
            "-c",
            f'"$@" {redirect}; exit "${{PIPESTATUS[0]}}"',
            "_",
            sys.executable,
            "-m",
            "convit_convert",
            *args,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    if why is None:
        assert p.returncode == 0 and p.stderr == "", p.stderr
    else:
        assert p.returncode == 2, (p.returncode, p.stderr)
        assert p.stderr.strip() == f"error: cannot write the output to standard output ({why})", p.stderr


# cmhsa with os.unlink wrapped: the first removal of a file whose name holds KILL_NAME first sends
# KILL_SIG to the process itself, deterministically in the middle of `--overwrite`'s removal
AT_UNLINK = """
import os, sys
real = os.unlink
def unlink(path, *a, **k):
    if os.environ["KILL_NAME"] in str(path):
        os.kill(os.getpid(), int(os.environ["KILL_SIG"]))
    return real(path, *a, **k)
os.unlink = unlink
from convit_convert.cli import main
sys.argv = ["cmhsa", *sys.argv[1:]]
main()
"""


@pytest.fixture(scope="module")
def exported_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-epoch phase-1 run with numbered checkpoints and a timm folder."""
    out = tmp_path_factory.mktemp("exported") / "run"
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--keep", "2", "--export-timm", "-o", out)
    assert r.exit_code == 0, r.output
    assert (out / "timm" / "model.safetensors").is_file() and (out / "checkpoint-epoch0002.pt").is_file()
    return out


def copy_tree(run: Path, to: Path) -> Path:
    shutil.copytree(run, to, ignore=shutil.ignore_patterns(".cmhsa.lock"))
    return to


def old_files_left(run: Path) -> list[str]:
    return sorted(
        str(p.relative_to(run))
        for p in run.rglob("*")
        if p.name.startswith("checkpoint-epoch") or p.parent.name == "timm" or p.name == "timm"
    )


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_overwrite_cut_short_after_the_first_checkpoint_is_finished_by_resume(
    tmp_path: Path, exported_run: Path
) -> None:
    # catches: `--resume` finished with the new conv.safetensors beside the old run's timm/ and
    # checkpoint-epoch*.pt, for good
    run = copy_tree(exported_run, tmp_path / "run")
    args = ["train", "phase1", *TINY_FLAGS, "--epochs", "2", "--seed", "3", "--overwrite", "-o", run]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KILL_NAME": "model.safetensors"}
    env["KILL_SIG"] = str(int(signal.SIGKILL))  # killed at the timm folder's first removal
    r = in_a_process("-c", AT_UNLINK, *args, env=env, timeout=600)
    assert r.returncode == -signal.SIGKILL, r.stderr[-2000:]
    assert json.loads((run / "config.json").read_text())["seed"] == 3  # the new run's first checkpoint
    assert old_files_left(run)  # killed mid-removal
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--seed", "3", "--resume", "-o", run)
    assert r.exit_code == 0, r.output[-2000:]
    assert old_files_left(run) == [] and not (run / "overwrite-pending.json").exists()


@pytest.mark.parametrize(
    "sig",
    [
        None,
        pytest.param(signal.SIGINT, marks=pytest.mark.slow),
        pytest.param(signal.SIGTERM, marks=pytest.mark.slow),
    ],
)
def test_overwrite_leaves_no_empty_timm_folder(tmp_path: Path, exported_run: Path, sig: int | None) -> None:
    # catches: an empty timm/ after every --overwrite of a run that had exported one
    run = copy_tree(exported_run, tmp_path / "run")
    args = ["train", "phase1", *TINY_FLAGS, "--epochs", "2", "--seed", "3", "--overwrite", "-o", run]
    if sig is None:
        assert invoke(*args).exit_code == 0
    else:  # the signal comes at the first save's first rename: the run saves, removes, and stops
        r = cmhsa_signalled_at_rename(args, 1, sig)
        assert r.returncode == 128 + sig, r.stderr[-2000:]
    assert old_files_left(run) == [] and not (run / "overwrite-pending.json").exists()


def test_init_naming_a_file_the_run_writes_is_refused(tmp_path: Path, attn_model: Path) -> None:
    # catches: `phase2 --init I2/vit.safetensors -o I2 --overwrite` replaced the starting weights with the
    # trained model, though --help says the --init file is never removed
    run = tmp_path / "I2"
    run.mkdir()
    start = run / "vit.safetensors"
    start.write_bytes(attn_model.read_bytes())
    args = [
        *"train phase2 --data digits --train-samples 64 --val-samples 32 --batch-size 32 --epochs 1".split(),
        *"--warmup-epochs 0 --workers 0 --device cpu".split(),
    ]
    one_error_line(
        invoke(*args, "--init", start, "--overwrite", "-o", run), 2, "--init", "a file this run writes"
    )
    assert start.read_bytes() == attn_model.read_bytes() and sorted(os.listdir(run)) == ["vit.safetensors"]
    r = invoke(*args, "--init", start, "-o", tmp_path / "other")
    assert r.exit_code == 0, r.output[-2000:]
    info = json.loads((tmp_path / "other" / "config.json").read_text())["init_info"]
    assert info["init_sha256"] == hashlib.sha256(attn_model.read_bytes()).hexdigest()


# an output is never a file the command reads, nor inside a folder it reads -------------------------


def _predict_inputs(tmp_path: Path) -> tuple[Path, Path]:
    from PIL import Image

    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i in range(2):
        Image.new("L", (8, 8), 60 * i).save(imgs / f"{i}.png")
    pic = tmp_path / "pic.json"  # an image whose name is what -o takes
    Image.new("L", (8, 8), 200).save(pic, format="PNG")
    return imgs, pic


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("the image itself", "is an input of this command"),
        ("a hard link to the image", "is the same file as"),
        ("inside an image folder", "a folder this command reads"),
        ("inside the model's timm folder", "a folder this command reads"),
    ],
)
def test_predict_never_writes_over_or_into_what_it_reads(
    tmp_path: Path, downloads: Path, monkeypatch: pytest.MonkeyPatch, case: str, words: str
) -> None:
    """Refused in one line before any image is predicted, every input as it was (`-o pic.json` never
    replaces the input image pic.json)."""
    import convit_convert.api.predict as api

    imgs, pic = _predict_inputs(tmp_path)
    model: Path = downloads / "vit.safetensors"
    if case == "the image itself":
        out = pic
    elif case == "a hard link to the image":
        out = tmp_path / "other.json"
        os.link(pic, out)
    elif case == "inside an image folder":
        out = imgs / "predictions.csv"
    else:
        model = downloads / "timm"
        out = model / "predictions.json"
    monkeypatch.setattr(api, "predict_images", lambda *a, **k: pytest.fail("predicted first"))
    before = {p: p.read_bytes() for p in [pic, *imgs.iterdir()]}
    one_error_line(invoke("predict", model, pic, imgs, "-o", out), 2, str(out), words)
    assert {p: p.read_bytes() for p in [pic, *imgs.iterdir()]} == before
    assert not out.exists() or out.read_bytes() == before[pic]


def test_export_and_attention_refuse_an_output_among_their_inputs(tmp_path: Path, downloads: Path) -> None:
    vit = tmp_path / "vit.safetensors"
    shutil.copy(downloads / "vit.safetensors", vit)
    before = vit.read_bytes()
    r = invoke("export", vit, "-o", tmp_path / "vit.onnx", "--report", vit)
    one_error_line(r, 2, str(vit), "is an input of this command")
    data = tmp_path / "data"
    shutil.copytree(ROOT / "fixtures" / "digits", data)
    r = invoke("attention", vit, "--data", "imagefolder", "--data-dir", data, "-o", data / "att")
    one_error_line(r, 2, "a folder this command reads")
    assert vit.read_bytes() == before and sorted(os.listdir(data)) == sorted(
        os.listdir(ROOT / "fixtures" / "digits")
    )


def test_a_timm_folder_or_a_model_never_replaces_what_it_is_made_from(
    tmp_path: Path, conv_onnx_external: Path
) -> None:
    """Cases beyond the issue's: `export --format timm -o DIR` where the input is DIR/model.safetensors,
    and `convert` onto an ONNX file's external data."""
    folder = tmp_path / "d"
    folder.mkdir()
    shutil.copy(FIXTURE, folder / "model.safetensors")
    before = snapshot(folder)
    r = invoke("export", folder / "model.safetensors", "--format", "timm", "-o", folder)
    one_error_line(r, 2, str(folder / "model.safetensors"), "is an input of this command")
    assert snapshot(folder) == before
    data = conv_onnx_external.parent / "weights.safetensors"  # an external data file, named so
    before = snapshot(conv_onnx_external.parent)
    r = invoke("convert", conv_onnx_external, "-o", data)
    one_error_line(r, 2, str(data), "is an input of this command")
    assert snapshot(conv_onnx_external.parent) == before


@pytest.fixture
def conv_onnx_external(tmp_path: Path) -> Path:
    """The digits model as ONNX with its weights in an external data file named weights.safetensors."""
    import onnx

    folder = tmp_path / "onnx"
    folder.mkdir()
    assert invoke("export", FIXTURE, "-o", folder / "inline.onnx").exit_code == 0
    model = onnx.load(folder / "inline.onnx")
    onnx.save(
        model,
        folder / "conv.onnx",
        save_as_external_data=True,
        location="weights.safetensors",
        size_threshold=0,
    )
    (folder / "inline.onnx").unlink()
    (folder / "inline.onnx.report.json").unlink()
    return folder / "conv.onnx"
