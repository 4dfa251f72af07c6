"""Nothing left behind: a SIGTERM during a write removes its temp file, and the temp file of a writer
killed with -9 is removed by the next write to the same target (while a live writer's is kept)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, atomic_write
from convit_convert.io.atomic import remove_stale_temps
from convit_convert.io.folder import Folder

# a writer that creates its temp file, says so, then waits to be killed
SLOW_WRITER = """
import sys, time
from pathlib import Path
from convit_convert.cli.boundary import exit_on_sigterm
from conftest import atomic_write
if sys.argv[2] == "handler":
    exit_on_sigterm()
def write(tmp):
    tmp.write_bytes(b"partial")
    print("writing", flush=True)
    time.sleep(60)
atomic_write(Path(sys.argv[1]), write)
"""


def start_writer(target: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}"}
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITER, str(target), mode], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    return proc


def temps(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.name.endswith(".tmp"))


def test_sigterm_during_a_write_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "vit.safetensors"
    proc = start_writer(target, "handler")
    assert len(temps(tmp_path)) == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []  # no temp, no partial target


@pytest.mark.slow
def test_the_cli_installs_the_sigterm_cleanup(tmp_path: Path, fixture_path: Path) -> None:
    """The real command: SIGTERM while cmhsa convert writes its output."""
    code = (
        "import sys, time\nimport convit_convert.io.checkpoint as c\nreal = c.write_safetensors\n"
        "def slow(path, *a, **k):\n    print('writing', flush=True)\n    time.sleep(60)\n"
        "c.write_safetensors = slow\nfrom convit_convert.cli import "
        "main\nsys.argv = ['cmhsa'] + sys.argv[1:]\nmain()\n"
    )
    out = tmp_path / "vit.safetensors"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, "convert", str(fixture_path), "-o", str(out), "--no-verify"],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout is not None
    while (line := proc.stdout.readline()) and line.strip() != "writing":
        pass
    assert len(temps(tmp_path)) == 2  # the model and its report, written together
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    assert temps(tmp_path) == [] and not out.exists()


@pytest.mark.slow
def test_a_kill_9_temp_is_removed_by_the_next_write(tmp_path: Path) -> None:
    target = tmp_path / "vit.safetensors"
    proc = start_writer(target, "no-handler")
    proc.kill()  # SIGKILL: no handler runs, the temp file stays
    proc.wait(timeout=30)
    (stale,) = temps(tmp_path)
    assert f".{proc.pid}." in stale.name
    live = start_writer(target, "no-handler")  # the next write to the target: it removes the stale temp
    try:
        (mine,) = temps(tmp_path)
        assert f".{live.pid}." in mine.name and not stale.exists()
        atomic_write(target, lambda tmp: tmp.write_bytes(b"complete"))  # a concurrent write
        assert target.read_bytes() == b"complete"
        assert temps(tmp_path) == [mine]  # the live writer's temp is kept
    finally:
        live.kill()
        live.wait(timeout=30)
    with Folder.open(tmp_path) as folder:
        assert remove_stale_temps(folder, target.name) == [mine.name] and temps(tmp_path) == []


@pytest.mark.parametrize("name", ["a[1].safetensors", "weird*name.onnx"])
def test_stale_temps_of_other_targets_are_not_touched(tmp_path: Path, name: str) -> None:
    other = tmp_path / f".other.safetensors.{2**22 + 12345}.abcdefgh.tmp"  # a pid no system uses
    other.write_bytes(b"x")
    time.sleep(0.01)
    atomic_write(tmp_path / name, lambda tmp: tmp.write_bytes(b"y"))
    assert other.exists() and (tmp_path / name).read_bytes() == b"y"
