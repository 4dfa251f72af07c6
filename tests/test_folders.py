"""A folder from elsewhere stays in its folder: a run folder (or its timm/) someone else made may
hold symbolic links, folders, hard links and other users' files where cmhsa's outputs belong, and a
list of names that points out of it. Every create, replace, rename and remove below an output folder
goes through io/folder.py, by name in the folder held open; anything that is not what cmhsa writes
there is refused in one line naming it, before anything is removed, and nothing outside the folder
changes. Each case here failed on main 8bdbcb2 (removed or replaced a file outside the run, or
stopped a run after its old model was gone)."""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import ROOT, invoke, one_error_line
from convit_convert import notices
from convit_convert.io import journal
from convit_convert.io.atomic import atomic_paths

TINY = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --workers 0 --warmup-epochs 0 --device cpu"
).split()


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-epoch phase-1 run with two numbered checkpoints, an ONNX export and a timm folder."""
    out = tmp_path_factory.mktemp("finished") / "run"
    args = ["train", "phase1", *TINY, "--epochs", "2", "--keep", "2", "--export-timm", "--export-onnx"]
    r = invoke(*args, "-o", out)
    assert r.exit_code == 0, r.output
    assert (out / "conv.onnx.report.json").is_file() and (out / "timm" / "README.md").is_file()
    return out


def downloaded(run: Path, into: Path) -> Path:
    """`run` as someone else's download: a copy in `into/run`, with files beside it to protect."""
    into.mkdir(exist_ok=True)
    copy = into / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns(".cmhsa.lock"))
    for name in ("model.safetensors", "config.json", "README.md", "notes.txt"):
        (into / name).write_text(f"the user's own {name}\n")
    return copy


def tree(root: Path) -> dict[str, object]:
    """Every entry under `root`: files by content hash and link count, links by target, others by kind."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        st = os.lstat(p)
        rel = str(p.relative_to(root))
        if stat.S_ISREG(st.st_mode):
            out[rel] = (hashlib.sha256(p.read_bytes()).hexdigest(), st.st_nlink, st.st_uid)
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = stat.S_IFMT(st.st_mode)
    return out


def train(*args: object) -> object:
    return invoke("train", "phase1", *TINY, "--epochs", "3", *args)


# 1. a link where the run's timm/ folder belongs -------------------------------------------------


@pytest.mark.parametrize(
    "how", ["resume with a removal list", "overwrite", "resume and export-timm", "export-timm of a new run"]
)
def test_a_timm_link_out_of_the_run_is_refused_before_anything_changes(
    tmp_path: Path, finished_run: Path, how: str
) -> None:
    # was (the case): exit 0, and dl/model.safetensors, dl/config.json, dl/README.md gone
    run = downloaded(finished_run, tmp_path / "dl")
    shutil.rmtree(run / "timm")
    (run / "timm").symlink_to("..")
    if how == "resume with a removal list":
        names = ["timm/model.safetensors", "timm/config.json", "timm/README.md"]
        (run / "overwrite-pending.json").write_text(json.dumps(names))
        args: list[object] = ["--resume"]
    elif how == "overwrite":
        args = ["--overwrite"]
    elif how == "resume and export-timm":
        args = ["--resume", "--export-timm"]
    else:
        shutil.rmtree(run.parent / "new", ignore_errors=True)
        (run.parent / "new").mkdir()
        (run.parent / "new" / "timm").symlink_to("..")
        run = run.parent / "new"
        args = ["--export-timm"]
    before = tree(tmp_path)
    line = one_error_line(train(*args, "-o", run), 2, "timm", "symbolic link")
    assert str(run / "timm") in line
    assert tree(tmp_path) == before


# 2. an entry that is not what cmhsa writes there ------------------------------------------------


def _folder_for_a_checkpoint(run: Path) -> None:
    (run / "checkpoint-epoch0000.pt").mkdir()


def _linked_metrics(run: Path) -> None:
    (run / "metrics.csv").unlink()
    (run / "metrics.csv").symlink_to("../notes.txt")


def _hard_linked_model(run: Path) -> None:
    (run / "conv.safetensors").unlink()
    os.link(run.parent / "notes.txt", run / "conv.safetensors")


def _hard_linked_numbered(run: Path) -> None:
    (run / "checkpoint-epoch0001.pt").unlink()
    os.link(run.parent / "model.safetensors", run / "checkpoint-epoch0001.pt")


def _fifo_report(run: Path) -> None:
    (run / "conv.onnx.report.json").unlink()
    os.mkfifo(run / "conv.onnx.report.json")


def _linked_timm_card(run: Path) -> None:
    (run / "timm" / "README.md").unlink()
    (run / "timm" / "README.md").symlink_to("../../README.md")


def _timm_a_file(run: Path) -> None:
    shutil.rmtree(run / "timm")
    (run / "timm").write_text("not a folder\n")


PLANTED = {
    "a folder named like a numbered checkpoint": (_folder_for_a_checkpoint, "checkpoint-epoch0000.pt"),
    "a link for metrics.csv": (_linked_metrics, "metrics.csv"),
    "a hard link for the model": (_hard_linked_model, "conv.safetensors"),
    "a hard link for a numbered checkpoint": (_hard_linked_numbered, "checkpoint-epoch0001.pt"),
    "a FIFO for the ONNX report": (_fifo_report, "conv.onnx.report.json"),
    "a link in timm/": (_linked_timm_card, "README.md"),
    "a file named timm": (_timm_a_file, "timm"),
}


@pytest.mark.parametrize("mode", ["--overwrite", "--resume"])
@pytest.mark.parametrize("case", list(PLANTED))
def test_an_entry_cmhsa_would_replace_or_remove_is_refused_first(
    tmp_path: Path, finished_run: Path, case: str, mode: str
) -> None:
    # was, for the folder: --overwrite removed the old model, then stopped, and every --resume refused
    run = downloaded(finished_run, tmp_path / "dl")
    plant, name = PLANTED[case]
    plant(run)
    before = tree(tmp_path)
    one_error_line(train(mode, "-o", run), 2, name)
    assert tree(tmp_path) == before


def test_another_user_s_file_is_never_replaced(tmp_path: Path, finished_run: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    run = downloaded(finished_run, tmp_path / "dl")
    os.chown(run / "metrics.csv", 4242, 4242)
    before = tree(tmp_path)
    one_error_line(train("--resume", "-o", run), 2, "metrics.csv", "another user")
    assert tree(tmp_path) == before


def test_a_hard_linked_lock_is_refused_and_its_other_name_kept(tmp_path: Path, finished_run: Path) -> None:
    # was: the lock's PID written into the other file (truncated to "PID\n")
    run = downloaded(finished_run, tmp_path / "dl")
    os.link(run.parent / "notes.txt", run / ".cmhsa.lock")
    before = tree(tmp_path)
    one_error_line(train("--resume", "-o", run), 2, ".cmhsa.lock", "hard link")
    assert tree(tmp_path) == before


def test_a_converted_model_never_replaces_a_file_with_other_names(tmp_path: Path) -> None:
    fixture = ROOT / "fixtures" / "conv_digits.safetensors"
    (tmp_path / "elsewhere.txt").write_text("kept\n")
    os.link(tmp_path / "elsewhere.txt", tmp_path / "vit.report.json")
    before = tree(tmp_path)
    one_error_line(
        invoke("convert", fixture, "-o", tmp_path / "vit.safetensors"), 2, "vit.report.json", "hard link"
    )
    assert tree(tmp_path) == before


@pytest.mark.parametrize("plant", ["link", "hard link", "folder"])
def test_an_export_folder_from_elsewhere_is_never_written_through(tmp_path: Path, plant: str) -> None:
    fixture = ROOT / "fixtures" / "conv_digits.safetensors"
    (tmp_path / "victim.json").write_text("the user's\n")
    out = tmp_path / "shared"
    out.mkdir()
    if plant == "link":
        (out / "config.json").symlink_to("../victim.json")
    elif plant == "hard link":
        os.link(tmp_path / "victim.json", out / "config.json")
    else:
        (out / "config.json").mkdir()
    before = tree(tmp_path)
    one_error_line(invoke("export", fixture, "--format", "timm", "-o", out), 2, "config.json")
    assert tree(tmp_path) == before


# 3. removal lists name cmhsa's outputs exactly ---------------------------------------------------


def test_overwrite_removes_exactly_the_previous_run_s_outputs(tmp_path: Path, finished_run: Path) -> None:
    # was: a user's checkpoint-epoch-best-copy.pt removed, and conv.onnx.report.json left behind
    run = downloaded(finished_run, tmp_path / "dl")
    mine = [
        "checkpoint-epoch-best-copy.pt",
        "checkpoint-epoch12.pt",
        "checkpoint-epoch0001.pt.bak",
        "conv.txt",
    ]
    for name in mine:
        (run / name).write_text("the user's\n")
    (run / "timm" / "notes.md").write_text("the user's\n")
    r = invoke("train", "phase1", *TINY, "--epochs", "1", "--seed", "1", "--overwrite", "-o", run)
    assert r.exit_code == 0, r.output
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    outputs = [".cmhsa.lock", "checkpoint-last.pt", "config.json", "conv.safetensors", "metrics.csv", "timm"]
    assert left == sorted([*outputs, *mine, "timm/notes.md"])


# 4. the commit journal: what a writer rolls forward, it says ----------------------------------


def test_a_rolled_forward_commit_is_said_naming_each_file_it_replaced(tmp_path: Path) -> None:
    # was: a forged journal that passes every check replaced notes.txt silently
    pid = next(p for p in range(journal.pid_limit() - 1, 1, -1) if not journal.alive(p))
    (tmp_path / "notes.txt").write_text("the user's notes\n")
    temp = f".notes.txt.{pid}.abcdefgh.tmp"
    (tmp_path / temp).write_text("replaced\n")
    (tmp_path / f".cmhsa-commit.{pid}.json").write_text(json.dumps({"pairs": [[temp, "notes.txt"]]}))
    said: list[str] = []
    notices.set_sink(said.append)
    try:
        with atomic_paths(tmp_path / "other.txt") as (tmp,):
            tmp.write_text("x")
    finally:
        notices.set_sink(None)
    assert (tmp_path / "notes.txt").read_text() == "replaced\n"
    (line,) = said
    assert f"process {pid}" in line and line.endswith("replaced notes.txt")


def test_pid_max_is_never_a_process() -> None:
    limit = journal.pid_limit()
    assert not journal.alive(limit) and not journal.possible_pid(limit) and journal.possible_pid(limit - 1)


def test_a_journal_naming_a_hard_linked_temp_is_foreign(tmp_path: Path) -> None:
    pid = next(p for p in range(journal.pid_limit() - 1, 1, -1) if not journal.alive(p))
    (tmp_path / "victim").write_text("secret\n")
    temp = f".m.safetensors.{pid}.abcdefgh.tmp"
    os.link(tmp_path / "victim", tmp_path / temp)
    (tmp_path / f".cmhsa-commit.{pid}.json").write_text(json.dumps({"pairs": [[temp, "m.safetensors"]]}))
    said: list[str] = []
    notices.set_sink(said.append)
    try:
        found = journal.scan(tmp_path)
    finally:
        notices.set_sink(None)
    assert len(said) == 1 and "hard link" in said[0]
    assert found.pending == () and not (tmp_path / "m.safetensors").exists()


# 5. the mechanism: one module touches files below an output folder ------------------------------

# what creates, renames or removes a directory entry; reading and writing an open file is not here
MUTATING_OS = {"unlink", "remove", "replace", "rename", "renames", "rmdir", "removedirs", "mkdir", "makedirs"}
MUTATING_OS |= {"link", "symlink", "mkfifo", "mknod", "truncate", "chmod", "chown", "lchown"}
MUTATING_SHUTIL = {"rmtree", "move", "copy", "copy2", "copyfile", "copytree"}
MUTATING_METHODS = {"unlink", "rmdir", "mkdir", "rename", "touch", "symlink_to", "hardlink_to", "chmod"}


def mutations(source: str) -> list[str]:
    """Calls in `source` that create, rename or remove a file system entry."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, owner = node.func.attr, node.func.value
        name = owner.id if isinstance(owner, ast.Name) else None
        if (name == "os" and attr in MUTATING_OS) or (name == "shutil" and attr in MUTATING_SHUTIL):
            found.append(f"{name}.{attr} (line {node.lineno})")
        elif (name == "tempfile" and attr != "TemporaryFile") or (  # TemporaryFile: unnamed, in /tmp
            name not in ("os", "shutil") and attr in MUTATING_METHODS
        ):
            found.append(f".{attr} (line {node.lineno})")
    return found


def test_only_the_folder_module_creates_renames_or_removes_files() -> None:
    offenders = {}
    for path in sorted([*(ROOT / "convit_convert").rglob("*.py"), *(ROOT / "train").rglob("*.py")]):
        if path.relative_to(ROOT).as_posix() == "convit_convert/io/folder.py":
            continue
        found = mutations(path.read_text())
        if found:
            offenders[path.relative_to(ROOT).as_posix()] = found
    assert offenders == {}


def test_the_mechanism_test_finds_what_it_forbids() -> None:
    src = "os.unlink(p)\nshutil.rmtree(d)\nPath(p).unlink()\nos.replace(a, b)\ntempfile.mkstemp(dir=d)\n"
    assert len(mutations(src)) == 5
    assert mutations("text.replace('a', 'b')\nos.path.join(a, b)\n") == []


# 6. an image folder from elsewhere: its scan ends ------------------------------------------------


def test_an_image_folder_with_link_loops_is_scanned_once_and_counted(tmp_path: Path) -> None:
    # was: two symlink loops hung `train` and `eval` in torchvision's os.walk, growing ~19 MB/s
    from PIL import Image

    for split in ("train", "val"):
        for cls in ("a", "b"):
            (tmp_path / split / cls / "deep").mkdir(parents=True)
            for i in range(2):
                Image.new("L", (8, 8), 40 * i).save(tmp_path / split / cls / f"{i}.png")
            Image.new("L", (8, 8)).save(tmp_path / split / cls / "deep" / "d.png")
            (tmp_path / split / cls / "deep" / "up").symlink_to("..")  # a loop
            (tmp_path / split / cls / "root").symlink_to("..")  # another, through the split
    args = "--data imagefolder --img-size 8 --patch-size 4 --depth 1 --kernel-size 3 --in-chans 1 --epochs 1"
    args += " --warmup-epochs 0 --batch-size 4 --workers 0 --device cpu"
    r = invoke("train", "phase1", *args.split(), "--data-dir", tmp_path, "-o", tmp_path / "run")
    assert r.exit_code == 0, r.output
    # per class: its 3 images and, through `root`, the other class's 3, each folder once
    assert "12 train / 12 val images" in r.output
