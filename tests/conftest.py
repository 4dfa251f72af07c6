"""Shared helpers. References here are independent of the code under test: torch.nn.functional
convolutions with explicit padding, explicit loops, impulse responses."""

from __future__ import annotations

import contextlib
import functools
import gzip
import hashlib
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import typer.testing
from typer.testing import CliRunner, Result

if os.environ.get("PYTEST_XDIST_WORKER"):  # `pytest -n 2` (README, "Tests")
    # xdist's workers get COLUMNS=80, which cmhsa's console honours: without it, as in one process,
    # output to CliRunner's pipe is unwrapped (a long temporary path would break a line a test reads)
    os.environ.pop("COLUMNS", None)
    # two workers on 2 cores: a thread each, in this process and (OMP_NUM_THREADS, which cmhsa's
    # default --threads and torch honour) in every run and subprocess a test starts. Two threads
    # each wait on each other: two tiny runs at once took 15 to 73 s each, 10 s with one thread
    # each (BENCHMARKS.md, "Investigations": two runs sharing two cores)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
# the hundreds of `python` processes the tests start (commands, arms, loader workers) each compile
# cmhsa's modules again where an environment says not to keep the compiled files: 0.3 of the 4.6
# CPU seconds a training process takes to import what it needs (__pycache__/ is git-ignored)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

from convit_convert.cli import app
from convit_convert.config import ViTConfig
from convit_convert.model import VisionTransformer
from convit_convert.options.training import TrainConfig

# typer's CliRunner builds the whole command tree from `app` on every invoke, reading each command's
# signature and evaluating its annotations (about 70 ms a call on the 2-core VM, against 3 ms for
# the command itself, such as `heads`); the tree does not change, so it is built once per process.
# `_get_command` is the name typer.testing calls it by (typer 0.16, the floor, and 0.29); without
# it the tests only run slower.
if callable(getattr(typer.testing, "_get_command", None)):
    typer.testing._get_command = functools.cache(typer.testing._get_command)

ROOT = Path(__file__).resolve().parent.parent  # the repository
FIXTURE = ROOT / "fixtures" / "conv_digits.safetensors"
# The smallest training run the tests train (TrainConfig.from_flags' flags): seconds on a CPU
TINY_RUN = dict(
    data="synthetic",
    img_size=16,
    patch_size=4,
    depth=1,
    kernel_size=3,
    batch_size=32,
    lr=4e-3,
    lr_base_batch=32,
    log_every=1000,
)


def tiny_config(out: Path, *flag_sets: dict[str, Any], **flags: Any) -> TrainConfig:
    """The TrainConfig of a tiny run into ``out``: TINY_RUN, then each of ``flag_sets`` (a test
    file's own tiny flags), then ``flags``, each over the one before."""
    merged: dict[str, Any] = {**TINY_RUN}
    for more in (*flag_sets, flags):
        merged.update(more)
    return TrainConfig.from_flags(out=str(out), **merged)


# Ctrl-C stops the suite --------------------------------------------------------------------------
# A training run takes SIGINT and SIGTERM as a request to save and stop, and the CLI's boundary turns
# them into an exit status: right for a user, but in the suite a Ctrl-C would then end one run and
# let the test (and the next test) go on. Here a signal from outside ends the session: the run's
# stop request also raises KeyboardInterrupt (unless the test sends the signal itself, marked
# sends_signals), no command starts after one, and the session exits after the test it hit.
# torch.compile compiles in this process (one thread), so an interrupted compile leaves no worker
# pool behind: its g++ is a subprocess.run child, killed when the interrupt reaches it.
INTERRUPTED: list[int] = []  # the signals from outside this session received
_SIGNALS_ARE_THE_TEST = [False]


def _interrupt(signum: int, frame: Any) -> None:
    INTERRUPTED.append(signum)
    raise KeyboardInterrupt(f"{signal.Signals(signum).name}: the test session stops")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sends_signals: the test signals its own process (a run's stop)")
    import torch._inductor.config as inductor

    inductor.compile_threads = 1
    for sig in (signal.SIGINT, signal.SIGTERM):  # KeyboardInterrupt, as Python's own SIGINT, noted
        signal.signal(sig, _interrupt)
    from convit_convert.train import run as train_run

    def end_the_session(signum: int) -> None:  # after a run noted its stop
        if not _SIGNALS_ARE_THE_TEST[0]:
            _interrupt(signum, None)

    train_run.StopRequest.also = end_the_session


LONGEST = "test_timm_suite.py::test_timm_model_suite_passes_on_every_registered_model"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The full tier starts with its slow tests, the longest (timm's own suite) first. Under
    `--dist worksteal` (README's command) each worker then begins on long work and ends on short
    tests it takes from the other's queue: in collection order the suite began 7 minutes in and
    one worker ran it alone for the last 5 (12:35 where the two workers' work was 10:20 each)."""
    items.sort(key=lambda item: (not item.nodeid.endswith(LONGEST), not item.get_closest_marker("slow")))


@pytest.fixture(autouse=True)
def _stop_the_session_on_a_signal(request: pytest.FixtureRequest) -> Any:
    _SIGNALS_ARE_THE_TEST[0] = request.node.get_closest_marker("sends_signals") is not None
    yield
    _SIGNALS_ARE_THE_TEST[0] = False
    if _signalled() and not _ENDING:  # the CLI's boundary made it an exit status: the session still ends
        # as pytest's own interrupt (its totals and -ra's skip reasons are printed for that status
        # alone); pytest_sessionfinish then makes the exit status 128 + the signal, as a shell's
        name = signal.Signals(INTERRUPTED[0]).name if INTERRUPTED else "a signal"
        pytest.exit(f"interrupted by {name}", returncode=pytest.ExitCode.INTERRUPTED)


_ENDING: list[bool] = []  # pytest is already ending the session on an interrupt


def pytest_keyboard_interrupt(excinfo: Any) -> None:
    _ENDING.append(True)  # a test's fixtures are then torn down inside pytest_sessionfinish


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A session a signal stopped exits 128 + the signal (130 for Ctrl-C, 143 for SIGTERM), once
    pytest has printed its totals for it."""
    if INTERRUPTED or exitstatus == pytest.ExitCode.INTERRUPTED:
        session.exitstatus = 128 + (INTERRUPTED[0] if INTERRUPTED else signal.SIGINT)


# A test the user's interrupt cut is reported as interrupted (a skip that says so), never as a
# failure: its subprocess may die of the same Ctrl-C before this process has raised its own
# KeyboardInterrupt (``assert 130 == 0``), and under xdist a worker the interrupt stopped is
# reported by the controller as "crashed while running" its test. Whether a signal came is a fact
# of this process (INTERRUPTED, or a signal still pending); the controller also knows it from the
# worker's exit status (2: keyboard-interrupt).
STOPPING = (signal.SIGINT, signal.SIGTERM)


def _signalled() -> bool:
    return bool(INTERRUPTED or _ENDING) or any(s in signal.sigpending() for s in STOPPING)


def _as_interrupted(report: pytest.TestReport) -> None:
    path, line = report.location[0], report.location[1]
    why = f"interrupted by {signal.Signals(INTERRUPTED[0]).name if INTERRUPTED else 'a signal'}"
    report.outcome = "skipped"
    report.longrepr = (path, 0 if line is None else line, f"Skipped: {why}: the test was cut, not failed")


SIGNAL_GRACE = 0.5  # seconds a failed test waits for a signal still on its way to this process


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failure is judged once a signal that may have caused it had time to arrive: the
    interrupt that killed a test's subprocess can reach this process just after the test saw the
    subprocess die (what a failing test waits: SIGNAL_GRACE; a passing one, nothing)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and not _signalled():
        with contextlib.suppress(KeyboardInterrupt):  # it came: INTERRUPTED says which
            time.sleep(SIGNAL_GRACE)
    if report.failed and _signalled():
        _as_interrupted(report)  # the session ends after the test (_stop_the_session_on_a_signal)


_REPORTED: set[str] = set()  # the controller: tests whose call phase a worker reported


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Under xdist, the controller: a failure that arrives once it was itself interrupted."""
    if report.failed and _signalled():
        _as_interrupted(report)
    if report.when == "call":
        _REPORTED.add(report.nodeid)


def pytest_handlecrashitem(crashitem: str, report: pytest.TestReport, sched: Any) -> None:
    """xdist's controller: the test a worker was running when it stopped on the interrupt (or
    after its call phase, already reported: then this report counts as its teardown's)."""
    node = getattr(report, "node", None)
    stopped = getattr(node, "workeroutput", {}).get("exitstatus") == pytest.ExitCode.INTERRUPTED
    if not (stopped or _signalled()):
        return
    if crashitem in _REPORTED:
        report.outcome, report.when, report.longrepr = "passed", "teardown", None
    else:
        _as_interrupted(report)


def invoke(*args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Result:
    """``cmhsa ARGS`` through typer's CliRunner, in this process: the tests' one way to run a command
    (each argument str()-ed; a list or tuple argument is spread). None starts after an interrupt."""
    if INTERRUPTED:
        raise KeyboardInterrupt("the test session was interrupted")
    words = [str(w) for a in args for w in (a if isinstance(a, (list, tuple)) else (a,))]
    return CliRunner().invoke(app, words, env=env, **kwargs)


def hub_cache(
    cache: Path, repo: str, folder: Path, commit: str = "0123456789abcdef0123456789abcdef01234567"
) -> Path:
    """``folder``'s files laid out in ``cache`` as huggingface_hub keeps a download of ``repo``
    (ORG/NAME) at ``commit``: blobs by their sha256, the snapshot's files linked to them, refs/main
    naming the commit. The snapshot's folder. Nothing is downloaded."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True)
    (root / "refs").mkdir(exist_ok=True)
    (root / "refs" / "main").write_text(commit)
    for f in folder.iterdir():
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / f.name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def in_a_process(*argv: object, **run: Any) -> subprocess.CompletedProcess:
    """``python ARGV...`` in a fresh interpreter, for what only a process of its own shows (its
    streams' encoding, its start-up, its own signals): output captured as text, from the
    repository's root, at most 300 s; ``run`` overrides any of these (subprocess.run's keywords)."""
    options: dict[str, Any] = {"capture_output": True, "text": True, "cwd": ROOT, "timeout": 300, **run}
    return subprocess.run([sys.executable, *map(str, argv)], **options)


def leaf_commands() -> list[tuple[tuple[str, ...], Any]]:
    """(path, click command) for every command that runs (``("train", "phase1")``), in the app's order."""
    import typer.main

    found: list[tuple[tuple[str, ...], Any]] = []

    def walk(cmd: Any, path: tuple[str, ...]) -> None:
        subs = getattr(cmd, "commands", None)
        if not subs:
            found.append((path, cmd))
        for name, sub in (subs or {}).items():
            walk(sub, (*path, name))

    walk(typer.main.get_command(app), ())
    return found


def one_error_line(r: Result | subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    """The error contract: exit ``code``, exactly one line on stderr, starting ``error: `` and holding
    every fragment, and no traceback anywhere (r: a CliRunner result or a finished subprocess).
    Returns the line."""
    exit_code = r.exit_code if isinstance(r, Result) else r.returncode
    output = r.output if isinstance(r, Result) else (r.stdout or "") + r.stderr
    err = [line for line in r.stderr.splitlines() if line.strip()]
    assert exit_code == code, (exit_code, output[-2000:])
    assert len(err) == 1 and err[0].startswith("error: "), r.stderr[-2000:]
    assert all(f in err[0] for f in fragments), (fragments, err[0])
    assert "Traceback" not in output, output[-2000:]
    return err[0]


def reference_conv(
    pixels: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, dilation: int
) -> torch.Tensor:
    """PyTorch 'same' convolution written out: zero-pad D(K-1)//2 before and the rest after, then a
    valid convolution."""
    k = weight.shape[-1]
    total = dilation * (k - 1)
    left, right = total // 2, total - total // 2
    return F.conv2d(F.pad(pixels, (left, right, left, right)), weight, bias, dilation=dilation)


def tokens_to_pixels(x: torch.Tensor, grid: tuple[int, int], p: int) -> torch.Tensor:
    """(B, N, P²C) -> (B, C, H, W) by explicit indexing of the documented layout."""
    b, _n, d = x.shape
    c = d // (p * p)
    gh, gw = grid
    out = torch.empty(b, c, gh * p, gw * p, dtype=x.dtype)
    for gy in range(gh):
        for gx in range(gw):
            patch = x[:, gy * gw + gx].reshape(b, p, p, c)  # index (py·P + px)·C + c
            out[:, :, gy * p : (gy + 1) * p, gx * p : (gx + 1) * p] = patch.permute(0, 3, 1, 2)
    return out


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Non-trivial LayerNorm affines and biases (a fresh model has ones and zeros there)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.copy_(
                    torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5
                    + (1.0 if name.endswith("norm1.weight") else 0.0)
                )
    return model


def conv_model(seed: int = 0, dtype: torch.dtype = torch.float64, **kw) -> VisionTransformer:
    torch.manual_seed(seed)
    cfg = ViTConfig.build(
        **{"img_size": (12, 8), "patch_size": 4, "depth": 2, "num_classes": 5, "kernel_size": 5, **kw}
    )
    return randomize(VisionTransformer(cfg), seed).to(dtype).eval()


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).abs().max() / ref.abs().max()).item()


@pytest.fixture
def fixture_path() -> Path:
    return FIXTURE


def write_idx(path: Path, array: np.ndarray) -> None:
    """An IDX file of unsigned bytes, the format Fashion-MNIST ships in (gzipped)."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


# What the test files of each mechanism share (test_bad_files, test_bad_flags, test_bad_runs,
# test_outputs, test_journal, test_streams): a finished tiny run, a converted model, a folder's
# contents as hashes. The session's fixtures are only ever copied, never changed.


def snapshot(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def check_outcome(r, inputs: Path, before: dict[str, str], allow_ok: bool = True) -> None:
    """The contract: exit 1/2 with one error line and no traceback (or 0 for a still-valid input);
    the inputs' folder exactly as it was."""
    assert r.exit_code in ((0, 1, 2) if allow_ok else (1, 2)), (r.exit_code, r.output[-2000:])
    assert "Traceback" not in r.output, r.output[-2000:]
    if r.exit_code != 0:
        one_error_line(r, r.exit_code)
    assert snapshot(inputs) == before


TINY_FLAGS = (
    "--data synthetic --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 "
    "--batch-size 32 --workers 0 --epochs 1 --warmup-epochs 0 --device cpu"
).split()


def copy_run(run: Path, to: Path) -> Path:
    to.mkdir()
    for p in run.iterdir():
        if p.is_file() and p.name != ".cmhsa.lock":
            (to / p.name).write_bytes(p.read_bytes())
    return to


def special_files(folder: Path) -> dict[str, Path]:
    """A FIFO, a symbolic link and (as root) a character device, each with a model file's name."""
    made = {}
    fifo = folder / "fifo.safetensors"
    os.mkfifo(fifo)
    made["FIFO"] = fifo
    target = folder / "target.safetensors"
    target.write_bytes(b"kept")
    link = folder / "link.safetensors"
    link.symlink_to(target)
    made["symbolic link"] = link
    if os.geteuid() == 0:  # a null device of our own: never /dev/null itself
        dev = folder / "dev.safetensors"
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        made["device"] = dev
    return made


def leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.endswith((".tmp", ".json", ".part")) and p.name.startswith(".")
    )


def tree(root: Path, skip: tuple[str, ...] = ()) -> dict[str, object]:
    """Every entry under `root` (links and special files by kind, files by content hash), but the
    relative paths in `skip` and anything under them."""
    out: dict[str, object] = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            continue
        st = os.lstat(p)
        if stat.S_ISREG(st.st_mode):
            out[rel] = (st.st_uid, hashlib.sha256(p.read_bytes()).hexdigest())
        elif stat.S_ISLNK(st.st_mode):
            out[rel] = ("link", os.readlink(p))
        else:
            out[rel] = stat.S_IFMT(st.st_mode)
    return out


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished one-epoch phase-1 run (checkpoint-last.pt, metrics.csv, config.json, conv.safetensors)."""
    out = tmp_path_factory.mktemp("tiny") / "run"
    r = invoke("train", "phase1", *TINY_FLAGS, "-o", out)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="session")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The digits fixture as a user ships it, each file made by cmhsa's CLI on its first use in a
    test session and shared after (read it, never change it): ``shipped(name)`` for ``attn`` (the
    attention conversion), ``conv.onnx``, ``attn.onnx``, ``conv-timm``, ``attn-timm`` (folders)."""
    root = tmp_path_factory.mktemp("shipped")
    made = {"conv": FIXTURE}

    def get(name: str) -> Path:
        if name not in made:
            if name == "attn":
                out, args = root / "vit.safetensors", ["convert", FIXTURE]
            else:
                kind, form = name.replace("-", ".").split(".")
                timm = ["--format", "timm"] if form == "timm" else []
                out, args = root / name, ["export", get(kind), *timm]
            r = invoke(*args, "-o", out)
            assert r.exit_code == 0, r.output
            made[name] = out
        return made[name]

    return get


@pytest.fixture(scope="session")
def attn_model(shipped: Callable[[str], Path]) -> Path:
    return shipped("attn")


@pytest.fixture(scope="session")
def downloads(
    tmp_path_factory: pytest.TempPathFactory, tiny_run: Path, shipped: Callable[[str], Path]
) -> Path:
    """What a researcher downloads: a conv checkpoint, its attention conversion (with its report), a
    timm folder and a run folder, in one folder (copied per test); the files are shipped()'s."""
    root = tmp_path_factory.mktemp("downloads")
    (root / "m.safetensors").write_bytes(FIXTURE.read_bytes())
    attn = shipped("attn")
    for name in (attn.name, attn.with_suffix(".report.json").name):
        (root / name).write_bytes((attn.parent / name).read_bytes())
    shutil.copytree(shipped("attn-timm"), root / "timm")
    copy_run(tiny_run, root / "run")
    return root


def atomic_write(path: str | Path, write: Any) -> None:
    """The tests' one-file writer, as a command writes: ``path``'s folder held (io/outputs.py),
    ``write(tmp)`` into a temp file there, then the rename (io/atomic.py)."""
    from convit_convert.io.atomic import atomic_names
    from convit_convert.io.outputs import held_outputs

    with held_outputs(path) as (target,), atomic_names(target) as (tmp,):
        write(tmp)
