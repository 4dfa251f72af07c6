"""The CLI through typer's CliRunner: the happy paths, the exit codes, every bad input."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import FIXTURE, invoke, one_error_line


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from conftest import FIXTURE

    out = tmp_path_factory.mktemp("conv") / "vit.safetensors"
    r = invoke("convert", FIXTURE, "-o", out)
    assert r.exit_code == 0, r.output
    return FIXTURE, out


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_convert_writes_model_and_report(converted: tuple[Path, Path]) -> None:
    src, out = converted
    report = json.loads(out.with_name("vit.report.json").read_text())
    assert report["passed"] is True
    assert report["input"]["sha256"] == sha(src) and report["output"]["sha256"] == sha(out)
    assert report["config"]["num_heads"] == 9 and report["config"]["sink"] is True
    errs = report["verification"]["errors"]
    assert {e["region"] for e in errs} == {"all", "border", "interior"}
    assert max(e["rel"] for e in errs) <= 1e-5
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]


def test_verify_pass_and_fail(converted: tuple[Path, Path], tmp_path: Path) -> None:
    src, out = converted
    r = invoke("verify", src, out, "--dtype", "float64", "--tol", "1e-12", "--report", tmp_path / "r.json")
    assert r.exit_code == 0, r.output
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["conv"]["sha256"] == sha(src) and rep["attn"]["sha256"] == sha(out)
    assert rep["verification"]["dtype"] == "float64" and "cmhsa" in rep["environment"]
    # nudge one output weight: still a valid file, no longer the same function
    t = load_file(str(out))
    t["blocks.2.attn.proj.weight"][0, 0] += 1e-2
    from safetensors import safe_open

    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
    save_file(t, str(tmp_path / "bad.safetensors"), metadata=meta)
    r = invoke("verify", src, tmp_path / "bad.safetensors")
    assert r.exit_code == 1
    assert "FAIL" in r.output


def test_no_sink_reports_border_apart(fixture_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "paper.safetensors"
    r = invoke("convert", fixture_path, "-o", out, "--no-sink")
    assert r.exit_code == 0, r.output
    errs = json.loads((tmp_path / "paper.report.json").read_text())["verification"]["errors"]
    border = [e for e in errs if e["region"] == "border"]
    interior = [e for e in errs if e["region"] == "interior"]
    assert min(e["rel"] for e in border) > 1e-3 and not any(e["judged"] for e in border)
    assert all(e["passed"] is None for e in errs if not e["judged"])  # reported, not judged
    assert all(e["passed"] is True for e in errs if e["judged"])
    assert max(e["rel"] for e in interior) <= 1e-5
    assert "info" in r.output
    said = " ".join(r.output.split())
    assert "PASS (interior only:" in said and "not judged)" in said
    assert invoke("verify", fixture_path, out).exit_code == 0  # judged on the interior only


def test_convert_options(fixture_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "v.safetensors"
    r = invoke(
        "convert",
        fixture_path,
        "-o",
        out,
        *"--heads 10 --qk-dim 8 --qk-init-std 1e-3 --no-verify".split(),
    )
    assert r.exit_code == 0, r.output
    t = load_file(str(out))
    assert t["blocks.0.attn.q.weight"].shape == (80, 48)
    rep = json.loads((tmp_path / "v.report.json").read_text())
    assert rep["verification"] is None
    assert rep["output"]["sha256"] == hashlib.sha256(out.read_bytes()).hexdigest()
    assert invoke("verify", fixture_path, out, "--dtype", "float64", "--tol", "1e-12").exit_code == 0


def test_inspect_and_heads(converted: tuple[Path, Path]) -> None:
    src, out = converted
    r = invoke("inspect", out)
    assert r.exit_code == 0, r.output
    assert "-1,-1" in r.output and "+1,+1" in r.output and sha(out) in r.output
    r = invoke("inspect", src)
    n_params = sum(t.numel() for t in load_file(str(src)).values())
    assert r.exit_code == 0 and "conv (phase 1: convolutional ViT)" in r.output, r.output
    assert f"{n_params:,}" in r.output
    r = invoke("heads", "--kernel", "5", "--patch", "16")
    assert r.exit_code == 0 and "Theorem 6" in r.output and "25" in r.output


# ---- bad input: one line on stderr naming the file, exit 2, nothing written -------------------


def corrupt(kind: str, src: Path, dst: Path) -> Path:
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        meta = dict(f.metadata())
    t = load_file(str(src))
    cfg = json.loads(meta["cmhsa.config"])
    if kind == "truncated":
        dst.write_bytes(src.read_bytes()[:-1000])
    elif kind == "garbage":
        dst.write_bytes(os.urandom(4096))
    elif kind == "empty":
        dst.write_bytes(b"")
    elif kind == "nan":
        t["blocks.1.conv.weight"][0, 0, 0, 0] = float("nan")
        save_file(t, str(dst), metadata=meta)
    elif kind == "inf":
        t["head.bias"][0] = float("inf")
        save_file(t, str(dst), metadata=meta)
    elif kind == "missing":
        del t["blocks.3.mlp.fc2.weight"]
        save_file(t, str(dst), metadata=meta)
    elif kind == "extra":
        t["blocks.0.conv.extra"] = torch.zeros(1)
        save_file(t, str(dst), metadata=meta)
    elif kind == "misshaped":
        t["blocks.0.mlp.fc1.weight"] = torch.zeros(10, 48)
        save_file(t, str(dst), metadata=meta)
    elif kind == "no_metadata":
        save_file(t, str(dst))
    elif kind == "bad_json":
        save_file(t, str(dst), metadata={**meta, "cmhsa.config": "{not json"})
    elif kind == "inconsistent":
        save_file(t, str(dst), metadata={**meta, "cmhsa.config": json.dumps({**cfg, "depth": 3})})
    elif kind == "missing_key":
        save_file(
            t,
            str(dst),
            metadata={
                **meta,
                "cmhsa.config": json.dumps({k: v for k, v in cfg.items() if k != "kernel_size"}),
            },
        )
    elif kind == "stride":
        save_file(t, str(dst), metadata={**meta, "cmhsa.config": json.dumps({**cfg, "stride": 2})})
    elif kind == "padding_mode":
        save_file(
            t, str(dst), metadata={**meta, "cmhsa.config": json.dumps({**cfg, "padding_mode": "reflect"})}
        )
    elif kind == "bad_kind":
        save_file(t, str(dst), metadata={**meta, "cmhsa.kind": "mlp"})
    elif kind == "nonsquare":
        t = {k: v for k, v in t.items()}
        for i in range(4):
            t[f"blocks.{i}.conv.weight"] = torch.zeros(3, 3, 5, 3)
        save_file(t, str(dst))  # bare: inferred, then refused
    elif kind == "int_dtype":
        t["head.bias"] = torch.zeros(10, dtype=torch.int64)
        save_file(t, str(dst), metadata=meta)
    return dst


BAD = (
    "truncated garbage empty nan inf missing extra misshaped no_metadata "
    "bad_json inconsistent missing_key stride padding_mode bad_kind "
    "nonsquare int_dtype"
).split()
EXPECT = {
    "truncated": "not a readable safetensors",
    "garbage": "not a readable safetensors",
    "empty": "empty",
    "nan": "NaN or Inf",
    "inf": "NaN or Inf",
    "missing": "missing tensor",
    "extra": "unexpected tensor",
    "misshaped": "has shape",
    "no_metadata": "--img-size",
    "bad_json": "not valid JSON",
    "inconsistent": "unexpected tensor",
    "missing_key": "kernel_size",
    "stride": "stride 2",
    "padding_mode": "reflect",
    "bad_kind": "'mlp'",
    "nonsquare": "non-square",
    "int_dtype": "dtype",
}


def assert_bad_input(result, path: Path | None, expect: str, out_dir: Path) -> None:
    """Exit 2, one line naming ``path`` (None: a flag's problem, no file) and the problem, nothing written."""
    one_error_line(result, 2, expect, *([] if path is None else [str(path)]))
    assert not [
        p
        for p in out_dir.iterdir()
        if p.suffix in (".safetensors", ".json", ".tmp") or p.name.startswith(".")
    ]


@pytest.mark.parametrize("kind", BAD)
def test_bad_input_files(kind: str, fixture_path: Path, tmp_path: Path) -> None:
    (tmp_path / "in").mkdir()
    bad = corrupt(kind, fixture_path, tmp_path / "in" / "bad.safetensors")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["--img-size", "32", "--patch-size", "4"] if kind == "nonsquare" else []
    assert_bad_input(
        invoke("convert", bad, "-o", out_dir / "vit.safetensors", *args), bad, EXPECT[kind], out_dir
    )
    if kind != "nonsquare":
        assert_bad_input(invoke("inspect", bad), bad, EXPECT[kind], out_dir)


def test_bad_paths(fixture_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src_dir = tmp_path / "src"
    src_dir.mkdir()
    out = tmp_path / "vit.safetensors"
    assert_bad_input(
        invoke("convert", tmp_path / "nope.safetensors", "-o", out),
        tmp_path / "nope.safetensors",
        "no such file",
        tmp_path,
    )
    assert_bad_input(invoke("convert", src_dir, "-o", out), src_dir, "directory", tmp_path)
    copy = src_dir / "in.safetensors"
    copy.write_bytes(fixture_path.read_bytes())
    r = invoke("convert", copy, "-o", copy)
    assert r.exit_code == 2 and "is an input of this command" in r.stderr
    assert sha(copy) == sha(fixture_path)
    nodir = tmp_path / "missing" / "vit.safetensors"
    assert_bad_input(invoke("convert", copy, "-o", nodir), nodir, "does not exist", tmp_path)
    # tests may run as root, whom chmod does not stop: pretend the folder is read-only
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: not mode & os.W_OK)
    assert_bad_input(invoke("convert", copy, "-o", out), out, "not writable", tmp_path)


def test_too_few_heads_and_wrong_kinds(converted: tuple[Path, Path], tmp_path: Path) -> None:
    src, attn = converted
    out = tmp_path / "x.safetensors"
    r = invoke("convert", src, "-o", out, "--heads", "8")
    assert r.exit_code == 2 and "Theorem 6" in r.stderr and "9 patch offsets" in r.stderr
    assert not out.exists()
    r = invoke("convert", attn, "-o", out)
    assert r.exit_code == 2 and "already" in r.stderr
    r = invoke("verify", attn, src)
    assert r.exit_code == 2 and "is an attn checkpoint; the first argument" in r.stderr


def test_convert_and_export_refuse_bad_tol_report_and_suffix(
    converted: tuple[Path, Path], tmp_path: Path
) -> None:
    src, attn = converted
    out = tmp_path / "v.safetensors"
    for tol in ("-1", "nan"):
        assert_bad_input(
            invoke("convert", src, "-o", out, "--tol", tol),
            None,
            f"--tol must be 0 ≤ x ≤ 1000000, got {tol}",
            tmp_path,
        )
        assert_bad_input(
            invoke("verify", src, attn, "--tol", tol),
            None,
            f"--tol must be 0 ≤ x ≤ 1000000, got {tol}",
            tmp_path,
        )
    (tmp_path / "in").mkdir()
    copy = tmp_path / "in" / "conv.safetensors"
    shutil.copy(src, copy)
    r = invoke("convert", copy, "-o", out, "--report", copy)
    assert_bad_input(r, copy, "is an input of this command", tmp_path)
    assert_bad_input(
        invoke("convert", copy, "-o", tmp_path / "x.onnx"),
        tmp_path / "x.onnx",
        "suffix .safetensors",
        tmp_path,
    )
    r = invoke("export", attn, "-o", tmp_path / "x.safetensors")
    assert_bad_input(r, tmp_path / "x.safetensors", "suffix .onnx", tmp_path)


def test_unsafe_pickle_input(tmp_path: Path) -> None:
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    path = tmp_path / "evil.pth"
    path.write_bytes(pickle.dumps(Evil()))
    r = invoke("convert", path, "-o", tmp_path / "v.safetensors", "--img-size", "32", "--patch-size", "4")
    assert r.exit_code == 2 and "weights_only=True" in r.stderr
    assert "weights_only=False" not in r.stderr and "will likely succeed" not in r.stderr
    # a torch.save of something holding a non-tensor class: the message names the blocked global
    import argparse

    torch.save({"model": {"w": torch.zeros(1)}, "args": argparse.Namespace(lr=1)}, tmp_path / "args.pth")
    r = invoke(
        "convert",
        tmp_path / "args.pth",
        "-o",
        tmp_path / "v.safetensors",
        *"--img-size 32 --patch-size 4".split(),
    )
    assert r.exit_code == 2 and "the global argparse.Namespace" in r.stderr, r.stderr
    assert "weights_only=False" not in r.stderr


# ---- start-up: what each command imports --------------------------------------------------------


def imported_after(args: list[str]) -> set[str]:
    code = (
        "import sys\nfrom typer.testing import CliRunner\nfrom convit_convert.cli import app\n"
        f"r = CliRunner().invoke(app, {args!r})\nassert r.exit_code == 0, r.output\n"
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_help_and_heads_do_not_import_torch() -> None:
    for args in (["--help"], ["heads", "--kernel", "5", "--patch", "16"]):
        mods = imported_after(args)
        assert "torch" not in mods, args


def test_conversion_path_does_not_import_timm(fixture_path: Path, tmp_path: Path) -> None:
    mods = imported_after(["convert", str(fixture_path), "-o", str(tmp_path / "v.safetensors")])
    assert "torch" in mods and not mods & {"timm", "torchvision"}


@pytest.mark.slow
def test_output_to_a_file_is_not_wrapped(converted: tuple[Path, Path], tmp_path: Path) -> None:
    """Printed to a file or a pipe, a line ends where its text does (rich would wrap it at 80
    columns, splitting what a reader greps); COLUMNS still sets a width. A path of 150 characters
    makes the line long."""
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    src = shutil.copy(converted[0], deep / "conv.safetensors")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    cmd = [sys.executable, "-m", "convit_convert", "verify", src, converted[1]]
    with open(tmp_path / "out.txt", "w") as f:
        assert subprocess.run(cmd, stdout=f, stdin=subprocess.DEVNULL, env=env).returncode == 0
    lines = (tmp_path / "out.txt").read_text().splitlines()
    assert any(str(src) in ln for ln in lines), lines
    narrow = subprocess.run(
        cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL, env={**env, "COLUMNS": "80"}
    )
    assert max(len(ln) for ln in narrow.stdout.splitlines()) <= 80 and str(src) not in narrow.stdout


def test_an_existing_output_is_replaced_and_said(tmp_path: Path) -> None:
    """convert (and export, through the same print_written) replace the file they are told to
    write, never silently: the line and the report say so."""
    out = tmp_path / "vit.safetensors"
    first = invoke("convert", FIXTURE, "-o", out)
    assert first.exit_code == 0 and "replaced" not in first.output
    assert json.loads(out.with_name("vit.report.json").read_text())["output"]["replaced"] is False
    again = invoke("convert", FIXTURE, "-o", out)
    assert again.exit_code == 0 and f"Wrote {out} (it replaced the file there) and" in again.output
    assert json.loads(out.with_name("vit.report.json").read_text())["output"]["replaced"] is True
