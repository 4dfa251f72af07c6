"""Every flag and argument of every command at and past its edges (the numeric ones generated from
options/values.py's BOUNDS), an empty or unusable path, and a failed check's advice: one line on
stderr naming the flag and the fix, exit 2 (1 for a failed check), no traceback, nothing written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import get_args

import pytest

from conftest import (
    FIXTURE,
    TINY_FLAGS,
    check_outcome,
    invoke,
    leaf_commands,
    leftovers,
    one_error_line,
    snapshot,
)
from convit_convert.options.values import BOUNDS, num

# every numeric flag, out of range ----------------------------------------------------------------


def required_args(path: list[str], folder: Path) -> list[str]:
    """Just enough positional arguments and required options for the command to parse."""
    f = str(FIXTURE)
    return {
        "convert": [f, "-o", str(folder / "out.safetensors")],
        "verify": [f, f],
        "inspect": [f],
        "export": [f, "-o", str(folder / "out.onnx")],
        "eval": [f],
        "predict": [f, str(FIXTURE.parent / "digits" / "1.png")],
        "attention": [f, "-o", str(folder / "att")],
        "plot": [str(folder)],
        "train phase1": ["-o", str(folder / "run")],
        "train phase2": ["-o", str(folder / "run")],
    }.get(" ".join(path), [])


def out_of_range(name: str, is_int: bool, not_numbers: bool) -> list[str]:
    """Just past each end of the flag's bound; with ``not_numbers``, the values of its type that are
    no number in range (one flag of each type per command: every flag goes through the one parser
    and the one bound check, which the ends already show it is wired to)."""
    b = BOUNDS[name]
    below = b.lo if b.lo_open else b.lo - 1
    above = b.hi if b.hi_open else b.hi + 1
    values = [num(below), num(above)]
    if not_numbers and not is_int:
        values += ["nan", "inf", "-inf"]
    elif not_numbers:
        values += ["1.5", "x"]  # not integers: the parser's own one-line refusal
    return values


def number_type(p: object) -> type | None:
    """int or float for a numeric option (a pair of them included), else None."""
    ann = p.type_descriptor.annotation  # type: ignore[attr-defined]
    base = (get_args(ann) or (ann,))[0]
    return base if base in (int, float) else None


def flag_cases() -> list[tuple[list[str], str, int, str]]:
    cases = []
    for path, cmd in leaf_commands():
        typed: set[object] = set()  # the number types whose non-numbers this command was given
        for p in cmd.params:  # type: ignore[attr-defined]
            if p.name in BOUNDS and p.opts and p.opts[0].startswith("--"):
                kind = (number_type(p), p.nargs)
                for v in out_of_range(p.name, kind[0] is int, kind not in typed):
                    cases.append((path, p.opts[0], p.nargs, v))
                typed.add(kind)
    return cases


FLAG_CASES = flag_cases()


def test_every_command_s_numeric_flags_are_declared() -> None:
    """The generator sees the flags: every numeric option of every command has a bound."""
    unbounded = []
    for path, cmd in leaf_commands():
        for p in cmd.params:  # type: ignore[attr-defined]
            if number_type(p) is not None and p.name not in BOUNDS:
                unbounded.append(f"{' '.join(path)} {p.opts[0]}")
    assert unbounded == []
    assert len(FLAG_CASES) > 150


@pytest.mark.parametrize(("path", "flag", "nargs", "value"), FLAG_CASES, ids=lambda v: str(v))
def test_out_of_range_flag(tmp_path: Path, path: list[str], flag: str, nargs: int, value: str) -> None:
    before = snapshot(tmp_path)
    r = invoke(*path, *required_args(path, tmp_path), flag, *([value] * nargs))
    check_outcome(r, tmp_path, before, allow_ok=False)
    assert r.exit_code == 2 and flag in r.stderr, r.stderr


@pytest.mark.parametrize("command", ["train", "convert", "export", "attention"])
def test_an_empty_output_path_is_refused(tmp_path: Path, monkeypatch, command: str) -> None:
    # catches: `train -o ""` trained into the current folder; `convert -o ""` an internal error (exit 3)
    monkeypatch.chdir(tmp_path)
    args = {
        "train": ["train", "phase1", *TINY_FLAGS],
        "convert": ["convert", FIXTURE],
        "export": ["export", FIXTURE],
        "attention": ["attention", FIXTURE, "--data", "digits"],
    }[command]
    for form in (["-o", ""], ["--output="]):
        one_error_line(invoke(*args, *form), 2, "is empty")
    assert list(tmp_path.iterdir()) == []


def test_help_shows_every_range_on_every_command() -> None:
    # catches: `[range: …]` only in train's help
    missing = []
    for path, cmd in leaf_commands():
        text = invoke([*path, "--help"], env={"COLUMNS": "500"}).stdout
        for p in cmd.params:  # type: ignore[attr-defined]
            if (
                p.name in BOUNDS
                and p.opts[0].startswith("--")
                and f"[range: {BOUNDS[p.name].text()}]" not in " ".join(text.split())
            ):
                missing.append(f"{' '.join(path)} {p.opts[0]}")
    assert missing == []


# errors that name the right fix ------------------------------------------------------------------


def test_errors_name_the_fix_the_command_can_take(tmp_path: Path, tiny_run: Path, monkeypatch) -> None:
    """Each message used to name a fix the command does not take: --out (train's hidden old
    spelling), --img-size/--patch-size for eval, --data cifar100 (train's hidden default)."""
    r = invoke("eval", tiny_run / "checkpoint-last.pt", "--data", "digits")
    one_error_line(r, 2, "training checkpoint", "conv.safetensors", "--resume")
    assert "--img-size" not in r.stderr
    (tmp_path / "file").write_text("x")
    one_error_line(invoke("train", "phase1", *TINY_FLAGS, "-o", tmp_path / "file"), 2, "-o/--output")
    monkeypatch.chdir(tmp_path)
    no_data = [a for a in TINY_FLAGS if a not in ("--data", "synthetic")]
    r = invoke("train", "phase1", *no_data, "-o", tmp_path / "run")
    one_error_line(r, 2, "--data not given", "cifar100", "--data-dir")
    assert not (tmp_path / "run").exists()


def test_an_approximate_conversion_that_fails_its_check_says_which_tol_writes_it(tmp_path: Path) -> None:
    from convit_convert.cli.convert import rounded_up

    for x in (0.2234, 0.22, 0.0999, 3.98e-7, 1.0, 12345.0):  # never below the error it must pass
        assert x <= float(rounded_up(x)) <= x * 1.1, x
    r = invoke(
        "convert",
        FIXTURE,
        "-o",
        tmp_path / "a.safetensors",
        *"--heads 4 --approximate --calib-images 16 --heldout-images 16".split(),
    )
    assert r.exit_code == 1 and "pass --tol" in " ".join(r.stdout.split()), r.output
    tol = re.search(r"pass --tol (\S+)", " ".join(r.stdout.split())).group(1)  # type: ignore[union-attr]
    r = invoke(
        "convert",
        FIXTURE,
        "-o",
        tmp_path / "a.safetensors",
        *"--heads 4 --approximate --calib-images 16 --heldout-images 16 --tol".split(),
        tol,
    )
    assert r.exit_code == 0 and (tmp_path / "a.safetensors").is_file(), r.output


def test_a_name_as_long_as_the_folder_allows_is_written(tmp_path: Path) -> None:
    # catches: a legal 236-250 character name failed after all the work: "File name too long" (the temp name)
    out = tmp_path / ("v" * 235 + ".safetensors")
    r = invoke("convert", FIXTURE, "-o", out, "--report", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    assert out.is_file() and leftovers(tmp_path) == []
    one_error_line(
        invoke("convert", FIXTURE, "-o", tmp_path / ("v" * 250 + ".safetensors")),
        2,
        "File name too long",
    )


def test_edges_of_flags_and_arguments_are_one_line(
    tmp_path: Path, tiny_run: Path, attn_model: Path, monkeypatch
) -> None:
    # catches: plot RUN RUN: ValueError (zip); --opt adahessian: "does not require grad"; --aa rand-n1000000
    # ran past 10 minutes; --crop-pct 1e-300: OverflowError in a worker; a failed download: URLError
    one_error_line(invoke("plot", tiny_run, tiny_run, "-o", tmp_path / "c.png"), 2, "given twice")
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--opt", "adahessian", "-o", tmp_path / "a"), 2, "second-order"
    )
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--aa", "rand-n1000000-m9", "-o", tmp_path / "b"),
        2,
        "n must be",
    )
    one_error_line(
        invoke("eval", attn_model, "--data", "digits", "--crop-pct", "1e-300"), 2, "--crop-pct must be"
    )
    import urllib.error
    import urllib.request

    def offline(*a, **k):  # no network: what urllib says then
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    r = invoke("eval", attn_model, "--data", "cifar10", "--data-dir", tmp_path / "dl" / "c10", "--download")
    one_error_line(r, 2, "cannot download cifar10 from https://", "--data-dir")
    assert not (tmp_path / "dl").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", ["ENOTDIR", "ELOOP", "ENAMETOOLONG"])
def test_every_os_error_of_a_path_is_bad_input(tmp_path: Path, attn_model: Path, kind: str) -> None:
    # catches: a symlink loop gave exit 3 (RuntimeError from pathlib); every path error is exit 2, one line
    (tmp_path / "afile").write_text("x")
    (tmp_path / "loop").symlink_to("loop")
    base = {
        "ENOTDIR": tmp_path / "afile" / "x",
        "ELOOP": tmp_path / "loop" / "x",
        "ENAMETOOLONG": tmp_path / ("d" * 300) / "x",
    }[kind]
    before = snapshot(tmp_path)
    for args in (
        ["convert", FIXTURE, "-o", f"{base}.safetensors"],
        ["convert", FIXTURE, "-o", tmp_path / "o.safetensors", "--report", f"{base}.json"],
        ["verify", FIXTURE, attn_model, "--report", f"{base}.json"],
        ["export", attn_model, "-o", f"{base}.onnx"],
        ["inspect", f"{base}.safetensors"],
        ["verify", FIXTURE, f"{base}.safetensors"],
        ["eval", f"{base}.safetensors", "--data", "digits"],
        ["plot", base],
        ["attention", attn_model, "--data", "digits", "--images", "10", "-o", base],
        ["train", "phase1", *TINY_FLAGS, "-o", base],
        ["train", "phase2", *TINY_FLAGS, "--init", f"{base}.safetensors", "-o", tmp_path / "r"],
        ["eval", attn_model, "--data", "imagefolder", "--data-dir", base],
    ):
        one_error_line(invoke(*args), 2)
    assert snapshot(tmp_path) == before
