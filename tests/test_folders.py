"""A folder from elsewhere stays in its folder: a run folder (or its timm/) someone else made may
hold symbolic links, folders, hard links and other users' files where cmhsa's outputs belong, and a
list of names that points out of it. Every create, replace, rename and remove below an output folder
goes through io/folder.py, by name in the folder held open; anything that is not what cmhsa writes
there is refused in one line naming it, before anything is removed, and nothing outside the folder
changes: no file outside the run removed or replaced, no run stopped after its old model was gone."""

from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

import pytest

from conftest import ROOT, atomic_write, invoke, one_error_line
from convit_convert import notices
from convit_convert.io import journal

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
        atomic_write(tmp_path / "other.txt", lambda tmp: tmp.write_text("x"))
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


@functools.cache
def parsed(source: str) -> ast.Module:
    """``source``'s syntax tree, parsed once per process: the checks below walk every module, each
    several times (never changing the tree)."""
    return ast.parse(source)


def mutations(source: str) -> list[str]:
    """Calls in `source` that create, rename or remove a file system entry."""
    found = []
    for node in ast.walk(parsed(source)):
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


# 7. every output through the folder the command holds ---------------------------------------------


def test_a_seed_folder_swapped_for_a_link_mid_run_is_never_written_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `--seeds` run holds each seed's folder from the start: one swapped for a link while it
    trains still gets its model, EMA and exports, and the link's target gets nothing (a save by path
    would write seed1's model, EMA and exports there)."""
    from convit_convert.train.run import RunFiles

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    elsewhere.mkdir()
    finished = RunFiles.finished

    def swapped_first(self: RunFiles, stop: object = None) -> object:
        if self.folder.path.name == "seed1" and not (out / "moved").exists():
            os.rename(out / "seed1", out / "moved")  # what the run holds, under another name
            (out / "seed1").symlink_to(elsewhere)
        return finished(self, stop)

    monkeypatch.setattr(RunFiles, "finished", swapped_first)
    flags = ["--seeds", "0,1", "--model-ema", "--export-onnx", "--export-timm", "-o", out]
    r = invoke("train", "phase1", *TINY, "--epochs", "1", *flags)
    assert r.exit_code == 0, r.output
    assert list(elsewhere.iterdir()) == []
    held = out / "moved"
    for name in ("conv.safetensors", "conv-ema.safetensors", "conv.onnx", "conv.onnx.report.json"):
        assert (held / name).is_file() and (out / "seed0" / name).is_file(), name
    assert (held / "timm" / "model.safetensors").is_file()


# the mechanism: a path becomes a held folder only where a command begins, and every write goes to a
# temp file atomic_names gave

# where a path the user gave is opened as a folder (Folder.open, held_outputs, make_folder): each
# command's entry point, and the readers that only look
DOORS = {"open", "held_outputs", "make_folder"}
ENTRY_POINTS = {
    "convit_convert/api/common.py": {"save_checkpoint"},
    "convit_convert/api/convert.py": {"convert_file"},
    "convit_convert/api/export.py": {"export_file"},
    "convit_convert/api/verify.py": {"verify_files"},
    "convit_convert/timm.py": {"export_timm_folder"},
    "convit_convert/data.py": {"cifar"},  # torchvision's --download into the folder the user named
    "convit_convert/io/journal.py": {"scan"},  # reads a folder's journals, writes nothing
    "train/run_folder.py": {"run_folder"},
    "train/stacked.py": {"_run_seeds"},
    "train/plot.py": {"plot_runs", "plot_attention"},
    "train/arms.py": {"_launch", "_child"},  # the experiments' runner: an arm's folder
}
# modules that are doors themselves: the folder module, the door, and the CLI (every command begins there)
DOOR_MODULES = ("convit_convert/io/folder.py", "convit_convert/io/outputs.py", "convit_convert/cli/")


def functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def doors_opened(source: str) -> dict[str, list[str]]:
    """Per function, the calls in it that open a path as a folder (the innermost function's)."""
    found: dict[str, list[str]] = {}
    tree = parsed(source)
    owner = {}
    for fn in functions(tree):
        for node in ast.walk(fn):
            owner[node] = fn.name  # ast.walk goes outer first: the innermost function wins
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        is_folder_open = (
            isinstance(f, ast.Attribute) and f.attr == "open" and getattr(f.value, "id", "") == "Folder"
        )
        if is_folder_open or (name in DOORS - {"open"}):
            found.setdefault(owner.get(node, "<module>"), []).append(f"{name} (line {node.lineno})")
    return found


WRITE_METHODS = {"write_text", "write_bytes"}  # the object is the path
WRITE_PATH_ARG = {"savefig": 0, "save": 1}  # fig.savefig(path), torch.save(obj, path)


def unheld_writes(source: str) -> list[str]:
    """Writes whose path is not a temp file ``atomic_names`` gave (a name bound by ``with
    atomic_names(...) as ...`` in the function, or a parameter named ``tmp``): ``open`` for writing,
    ``Path.write_text`` / ``write_bytes``, ``savefig``, ``torch.save``, and any ``os.open``."""
    found = []
    for fn in functions(parsed(source)):
        held = {a.arg for a in fn.args.args if a.arg == "tmp"}
        for node in ast.walk(fn):
            if isinstance(node, ast.With | ast.AsyncWith):
                for item in node.items:
                    call = item.context_expr
                    if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "atomic_names":
                        held |= {n.id for n in ast.walk(item.optional_vars) if isinstance(n, ast.Name)}
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            f, path = node.func, None
            if isinstance(f, ast.Name) and f.id == "open":
                mode = node.args[1] if len(node.args) > 1 else None
                if isinstance(mode, ast.Constant) and set(str(mode.value)) & set("wax+"):
                    path = node.args[0]
            elif isinstance(f, ast.Attribute) and f.attr in WRITE_METHODS:
                path = f.value
            elif isinstance(f, ast.Attribute) and f.attr in WRITE_PATH_ARG:
                at = WRITE_PATH_ARG[f.attr]
                if f.attr == "save" and getattr(f.value, "id", "") != "torch":
                    continue
                path = node.args[at] if len(node.args) > at else None
            elif isinstance(f, ast.Attribute) and f.attr == "open" and getattr(f.value, "id", "") == "os":
                flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
                if any(w in flags for w in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND")):
                    found.append(f"os.open (line {node.lineno})")
                continue
            if path is None:
                continue
            root = path.value if isinstance(path, ast.Subscript) else path
            if not (isinstance(root, ast.Name) and root.id in held):
                found.append(f"{fn.name}: {ast.unparse(f)} (line {node.lineno})")
    return found


def package_sources() -> dict[str, str]:
    files = [*(ROOT / "convit_convert").rglob("*.py"), *(ROOT / "train").rglob("*.py")]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(files)}


def test_only_a_command_s_entry_point_opens_an_output_by_path() -> None:
    """The rule that makes the link swap above hold for every command to come: below the entry
    point (a CLI command, a public function given a path, a run's folder), writers take a held folder
    and a bare name, never a path."""
    offenders = {}
    for rel, source in package_sources().items():
        if rel.startswith(DOOR_MODULES):
            continue
        extra = {
            fn: calls for fn, calls in doors_opened(source).items() if fn not in ENTRY_POINTS.get(rel, ())
        }
        if extra:
            offenders[rel] = extra
    assert offenders == {}
    for rel, names in ENTRY_POINTS.items():  # each entry point named still opens one (no stale name)
        assert names <= doors_opened(package_sources()[rel]).keys(), rel


def test_every_write_goes_to_a_temp_file_of_a_held_folder() -> None:
    offenders = {
        rel: found
        for rel, source in package_sources().items()
        if rel != "convit_convert/io/folder.py" and (found := unheld_writes(source))
    }
    assert offenders == {}


def test_the_output_mechanism_tests_find_what_they_forbid() -> None:
    src = (
        "def save(path, model):\n    torch.save(model, path)\n    Path(path).write_text('x')\n"
        "    open(path, 'wb')\n    fig.savefig(path)\n    os.open(path, os.O_WRONLY)\n"
        "def fine(folder, name, tmp):\n    open(tmp, 'wb')\n    with atomic_names(t) as (a, b):\n"
        "        a.write_text('x')\n        torch.save(m, b)\n    open(path)\n"
    )
    assert len(unheld_writes(src)) == 5
    door = "def helper(p):\n    with Folder.open(p) as f:\n        pass\n    make_folder(p)\n"
    assert sorted(doors_opened(door)["helper"]) == ["make_folder (line 4)", "open (line 2)"]


@pytest.mark.slow  # eight commands, a training among them: 20 s
def test_no_output_is_opened_by_a_path_while_commands_run(tmp_path: Path, downloads: Path) -> None:
    """The same rule watched at run time (Python's audit hook on every open): while each command
    that writes runs in this process, a file below the test's folder is opened for writing only
    through a held folder (/proc/self/fd/N/NAME, or a bare name relative to the folder's
    descriptor), never by its path."""
    import sys

    from PIL import Image

    seen: list[str] = []

    def hook(event: str, args: tuple) -> None:
        if event != "open" or not WATCHING:
            return
        path, mode, flags = args
        writes = (mode is not None and set(str(mode)) & set("wax+")) or (
            mode is None and isinstance(flags, int) and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        )
        text = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else ""
        if writes and text.startswith(str(tmp_path)):
            seen.append(text)

    WATCHING.clear()
    sys.addaudithook(hook)  # hooks cannot be removed: it watches only while WATCHING is set
    (tmp_path / "img").mkdir()
    Image.new("L", (8, 8), 90).save(tmp_path / "img" / "a.png")
    vit, out = downloads / "vit.safetensors", tmp_path / "out"
    commands = [
        ("convert", FIXTURE_PATH, "-o", out / "vit.safetensors"),
        ("export", vit, "-o", out / "vit.onnx"),
        ("export", vit, "--format", "timm", "-o", out / "timm"),
        ("verify", FIXTURE_PATH, vit, "--report", out / "verify.json"),
        ("predict", vit, tmp_path / "img", "-o", out / "p.csv"),
        ("attention", vit, "--data", "digits", "--images", "8", "-o", out / "att"),
        ("plot", downloads / "run", "-o", out / "curves.png"),
        ("train", "phase1", *TINY, "--epochs", "1", "--seeds", "0,1", "--export-onnx", "-o", out / "run"),
    ]
    out.mkdir()
    for args in commands:
        WATCHING.append(True)
        try:
            r = invoke(*args)
        finally:
            WATCHING.clear()
        assert r.exit_code == 0, (args[0], r.output[-2000:])
    assert seen == []
    assert (out / "run" / "seed1" / "conv.onnx").is_file() and (out / "att" / "attention.png").is_file()


WATCHING: list[bool] = []
FIXTURE_PATH = ROOT / "fixtures" / "conv_digits.safetensors"
