"""Commit journals cmhsa did not begin (planted, forged, a dead or foreign writer's) are never
acted on by a reader, a writer into their folder, a resume or timm's loader; a pending commit is
rolled forward only within its own folder.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    FIXTURE,
    TINY_FLAGS,
    invoke,
    tree,
)


def dead_pids(n: int) -> list[int]:
    """Process numbers of processes that have exited (each reaped, so not running)."""
    pids = []
    for _ in range(n):
        p = subprocess.Popen(["true"])
        p.wait()
        pids.append(p.pid)
    return pids


JOURNAL_KINDS = (
    "absolute pair",
    "relative pair",
    "dot-dot pair",
    "not a temp",
    "linked temp",
    "foreign temp",
    "foreign journal",
    "link to /dev/zero",
    "FIFO",
    "folder",
    "huge PID",
    "deep nesting",
    "too deep within the size",
    "a hundred thousand pairs",
    "old format",
)


def plant_journal(folder: Path, kind: str, pid: int, victim: Path) -> Path:
    """A `.cmhsa-commit.*.json` in `folder` that cmhsa did not write, of `kind`, aimed at `victim` (a
    file outside `folder`) or at the model files beside it; its path."""
    journal = folder / f".cmhsa-commit.{pid}.json"
    temp = f".m.safetensors.{pid}.abcdefgh.tmp"
    payload = folder / "payload"
    payload.write_bytes(b"ATTACKER\n")

    def write(doc: object) -> Path:
        journal.write_text(json.dumps(doc))
        return journal

    if kind == "absolute pair":
        return write({"pairs": [[str(payload), str(victim)]]})
    if kind == "relative pair":
        return write({"pairs": [["payload", os.path.relpath(victim, folder)]]})
    if kind == "dot-dot pair":
        return write({"pairs": [["payload", ".."]]})
    if kind == "not a temp":
        return write({"pairs": [["payload", "m.safetensors"]]})
    if kind == "linked temp":
        (folder / temp).symlink_to(victim)
        return write({"pairs": [[temp, "m.safetensors"]]})
    if kind == "foreign temp":  # a valid pair, but another user's temp (cmhsa runs as this user)
        (folder / temp).write_bytes(b"ATTACKER\n")
        os.chown(folder / temp, 4242, 4242)
        return write({"pairs": [[temp, "m.safetensors"]]})
    if kind == "foreign journal":
        (folder / temp).write_bytes(b"ATTACKER\n")
        write({"pairs": [[temp, "m.safetensors"]]})
        os.chown(journal, 4242, 4242)
        return journal
    if kind == "link to /dev/zero":
        journal.symlink_to("/dev/zero")
        return journal
    if kind == "FIFO":
        os.mkfifo(journal)
        return journal
    if kind == "folder":
        journal.mkdir()
        return journal
    if kind == "huge PID":
        journal = folder / ".cmhsa-commit.99999999999999999999999.json"
        journal.write_text(json.dumps({"pairs": [[str(payload), str(victim)]]}))
        return journal
    if kind == "deep nesting":
        journal.write_text("[" * 100_000)
        return journal
    if kind == "too deep within the size":
        journal.write_text('{"pairs": [[[[[["payload", "m.safetensors"]]]]]]}')
        return journal
    if kind == "a hundred thousand pairs":  # the size alone refuses it (150 times the bound), never read
        with open(journal, "wb") as f:
            f.write(b'{"pairs": [')
            f.truncate(100_000 * 24)  # sparse; the tests hash every file before and after, so not more
        return journal
    if kind == "old format":  # main 939d132's journal: a list of absolute pairs
        return write([[str(payload), str(victim)]])
    raise AssertionError(kind)


def planted_everywhere(folders: list[Path], victim: Path) -> None:
    """Every kind of hostile journal in each of `folders` (that can be made here: chown needs root)."""
    kinds = [k for k in JOURNAL_KINDS if os.geteuid() == 0 or "foreign" not in k]
    for folder in folders:
        folder.mkdir(parents=True, exist_ok=True)
        for kind, pid in zip(kinds, dead_pids(len(kinds)), strict=True):
            plant_journal(folder, kind, pid, victim)  # all kinds side by side: one command meets them all


def ends_in_seconds(run: Any, seconds: int = 120) -> Any:
    """`run()`, failed (not hung) if it takes more than `seconds`: a FIFO must never block it."""

    def hung(signum: int, frame: object) -> None:
        raise AssertionError(f"still running after {seconds} s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        return run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def only_notes_and_one_error(r) -> None:
    """Exit 0 or 2; stderr: notes naming what was ignored, and at most one error line."""
    assert r.exit_code in (0, 2), (r.exit_code, r.output[-3000:])
    assert "Traceback" not in r.output
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if not line.startswith("note: ")]
    assert len(errors) == (r.exit_code != 0), lines
    assert all("nothing was renamed" in line for line in lines if line.startswith("note: ")), lines


def timm_local_dir(folder: Path) -> None:
    import timm

    import convit_convert.timm  # noqa: F401  (registers the architectures)

    timm.create_model(f"local-dir:{folder}", pretrained=True)


# (command, what it writes, relative to the test's folder); dl/ holds the downloads, out/ is new
JOURNAL_COMMANDS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "inspect": (["inspect", "dl/m.safetensors"], ()),
    "verify": (["verify", "dl/m.safetensors", "dl/vit.safetensors"], ()),
    "eval": (["eval", "dl/vit.safetensors", "--data", "digits", "--workers", "0"], ()),
    "attention": (
        ["attention", "dl/vit.safetensors", "--data", "digits", "--images", "10", "-o", "out/att"],
        ("out/att",),
    ),
    "export": (
        ["export", "dl/vit.safetensors", "-o", "out/v.onnx"],
        ("out/v.onnx", "out/v.onnx.report.json"),
    ),
    "export timm": (["export", "dl/vit.safetensors", "--format", "timm", "-o", "out/timm"], ("out/timm",)),
    "convert": (
        ["convert", "dl/m.safetensors", "-o", "out/v.safetensors"],
        ("out/v.safetensors", "out/v.report.json"),
    ),
    "convert into dl": (
        ["convert", "dl/m.safetensors", "-o", "dl/v.safetensors"],
        ("dl/v.safetensors", "dl/v.report.json"),
    ),
    "resume": (
        ["train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", "dl/run"],
        tuple(
            f"dl/run/{n}"
            for n in (
                "checkpoint-last.pt",
                "metrics.csv",
                "config.json",
                "conv.safetensors",
                "best.safetensors",
                ".cmhsa.lock",
            )
        ),
    ),
    "init": (["train", "phase2", *TINY_FLAGS, "--init", "dl/m.safetensors", "-o", "out/run"], ("out/run",)),
    "plot": (["plot", "dl/run", "-o", "out/c.png"], ("out/c.png",)),
}


# the default tier meets every hostile journal through every command but these three (2-5 s each on
# the VM; the others take under 1.5 s): the full tier through every one
SLOW_JOURNAL_COMMANDS = ("export", "eval", "attention")


@pytest.mark.parametrize(
    "command",
    [
        pytest.param(c, marks=pytest.mark.slow) if c in SLOW_JOURNAL_COMMANDS else c
        for c in (*JOURNAL_COMMANDS, "timm local-dir")
    ],
)
def test_a_journal_cmhsa_did_not_begin_is_never_acted_on(
    tmp_path: Path, downloads: Path, monkeypatch, command: str
) -> None:
    # catches: `inspect dl/m.safetensors` beside a journal naming [payload, victim] replaced the victim
    # (exit 0); a FIFO journal hung; /dev/zero grew without end; a huge PID or deep nesting: exit 3
    monkeypatch.chdir(tmp_path)
    shutil.copytree(downloads, tmp_path / "dl", symlinks=True)
    (tmp_path / "victim").mkdir()
    victim = tmp_path / "victim" / "bashrc"
    victim.write_text("ORIGINAL\n")
    args, writes = JOURNAL_COMMANDS.get(command, ([], ()))
    planted_everywhere(
        [tmp_path / "dl", tmp_path / "dl" / "run", tmp_path / "dl" / "timm", tmp_path / "out"], victim
    )
    before = tree(tmp_path, writes)
    if command == "timm local-dir":
        ends_in_seconds(lambda: timm_local_dir(tmp_path / "dl" / "timm"))
    else:
        only_notes_and_one_error(ends_in_seconds(lambda: invoke(*args)))
    assert victim.read_text() == "ORIGINAL\n"
    assert tree(tmp_path, writes) == before


@pytest.mark.parametrize("kind", JOURNAL_KINDS)
def test_each_hostile_journal_alone_is_ignored_by_a_writer_into_its_folder(tmp_path: Path, kind: str) -> None:
    # a writer into the folder is the one command that may roll a commit forward: it must not
    if "foreign" in kind and os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    dl = tmp_path / "dl"
    dl.mkdir()
    (dl / "m.safetensors").write_bytes(FIXTURE.read_bytes())
    victim = tmp_path / "victim"
    victim.write_text("ORIGINAL\n")
    journal = plant_journal(dl, kind, dead_pids(1)[0], victim)
    before = tree(tmp_path, ("dl/v.safetensors", "dl/v.report.json"))
    r = ends_in_seconds(lambda: invoke("convert", dl / "m.safetensors", "-o", dl / "v.safetensors"))
    assert r.exit_code == 0, r.output[-2000:]
    assert tree(tmp_path, ("dl/v.safetensors", "dl/v.report.json")) == before
    notes = [line for line in r.stderr.splitlines() if line.startswith("note: ")]
    assert len(notes) == 1 and journal.name in notes[0] and "nothing was renamed" in notes[0], r.stderr


def test_a_pending_commit_is_rolled_forward_only_within_its_folder_by_a_writer(tmp_path: Path) -> None:
    """The journal a killed cmhsa leaves (bare names, its own temps) is finished by the next writer;
    the same journal is ignored once its temp is not this user's or its target not a file."""
    from convit_convert.io import journal as jr

    pid = dead_pids(1)[0]
    (tmp_path / "a.json").write_text("old a\n")
    tmp = f".a.json.{pid}.k2_9xz0q.tmp"
    (tmp_path / tmp).write_text("new a\n")
    name = f".cmhsa-commit.{pid}.json"
    (tmp_path / name).write_text(json.dumps({"pairs": [[tmp, "a.json"]]}))
    scan = jr.scan(tmp_path)
    assert [j.targets for j in scan.pending] == [("a.json",)] and scan.foreign == ()
    with pytest.raises(jr.CmhsaError, match="cut short"):
        jr.check_settled(tmp_path / "a.json")
    jr.check_settled(tmp_path / "b.json")  # a file the commit does not name reads as it is
    from conftest import atomic_write

    # a writer into the folder finishes it first
    atomic_write(tmp_path / "b.json", lambda tmp: tmp.write_text("b\n"))
    assert (tmp_path / "a.json").read_text() == "new a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.json"]
    # a temp of another process than the journal's, or a target that is a folder: foreign
    for pairs in ([[f".a.json.{pid + 1}.k2_9xz0q.tmp", "a.json"]], [[f".d.{pid}.k2_9xz0q.tmp", "d"]]):
        (tmp_path / "d").mkdir(exist_ok=True)
        (tmp_path / name).write_text(json.dumps({"pairs": pairs}))
        assert jr.scan(tmp_path).pending == ()


def test_a_pid_no_process_can_have_is_a_dead_writer_never_an_error() -> None:
    # catches: OverflowError from os.kill (exit 3)
    from convit_convert.io.journal import alive

    assert not alive(10**23) and not alive(0) and not alive(-1) and alive(os.getpid())
