"""What reaches the terminal: control characters in any path shown as escapes, an ASCII locale,
library warnings and onnxruntime's log lines only where asked for, a closed or broken stdout, a
signal to the process group, and a word before a long compile.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import (
    FIXTURE,
    ROOT,
    TINY_FLAGS,
    in_a_process,
    invoke,
)

# the terminal, the locale and signals


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_an_ascii_locale_prints_escapes_never_crashes(tmp_path: Path) -> None:
    # catches: UnicodeEncodeError on ≥ or Δ after the outputs were written (exit 3)
    env = {**os.environ, "PYTHONIOENCODING": "ascii", "COLUMNS": "100"}
    for args in (["inspect", FIXTURE], ["convert", FIXTURE, "-o", tmp_path / "v.safetensors"]):
        p = in_a_process("-m", "convit_convert", *args, env=env, text=False)
        assert p.returncode == 0 and p.stderr == b"", p.stderr[-2000:]
        assert b"\\u0394" in p.stdout or b"\\u2265" in p.stdout


def test_escape_sequences_in_paths_never_reach_the_terminal(tmp_path: Path, tiny_run: Path) -> None:
    # catches: `-o $'run\e]0;X\a'` and plot's run folders printed raw
    evil = tmp_path / "run\x1b]0;X\x07"
    r = invoke("train", "phase1", *TINY_FLAGS, "-o", evil)
    assert r.exit_code == 0 and "\x1b" not in r.output and "\\x1b]0;X\\x07" in r.output, r.output
    r = invoke("plot", evil, tiny_run)
    assert r.exit_code == 0 and "\x1b" not in r.output and r.stderr == "", r.output


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_library_warnings_reach_the_terminal_only_with_debug() -> None:
    # catches: torch's and matplotlib's warnings printed on a successful run; and torch's log
    # records, such as `--compile --device cpu`'s "W1126 ... No CUDA runtime is found, using
    # CUDA_HOME=...". A subprocess: pytest records warnings itself, which would hide them from a
    # CliRunner's stderr
    program = (
        "import logging, sys, warnings\n"
        "import convit_convert.api as api\n"
        "real = api.inspect_file\n"
        "def noisy(*a, **k):\n"
        '    warnings.warn("a library\'s warning", UserWarning, stacklevel=1)\n'
        "    logging.getLogger('torch.utils.cpp_extension').warning('No CUDA runtime is found')\n"
        "    return real(*a, **k)\n"
        "api.inspect_file = noisy\n"
        "from convit_convert.cli import main\n"
        "sys.argv = ['cmhsa', *sys.argv[1:]]\n"
        "main()\n"
    )
    for debug in ([], ["--debug"]):
        p = in_a_process("-c", program, *debug, "inspect", FIXTURE, timeout=240)
        assert p.returncode == 0, p.stderr[-2000:]
        assert ("a library's warning" in p.stderr) == bool(debug), p.stderr[-2000:]
        assert ("No CUDA runtime is found" in p.stderr) == bool(debug), p.stderr[-2000:]


def signalled_training(tmp_path: Path, sig: int, after: str) -> tuple[int, str, Path]:
    """`cmhsa train` with loader workers, in its own process group, sent `sig` (to the whole group,
    as Ctrl-C in a terminal does) once its output shows `after`."""
    out = tmp_path / f"run-{sig}-{after.split()[0]}"
    args = [
        *"train phase1 --data digits --img-size 16 --in-chans 1 --hidden-chans 1 "
        "--patch-size 4 --depth 1 --kernel-size 3 --batch-size 16 --epochs 3 "
        "--train-samples 320 --val-samples 64 "  # 20 steps an epoch: step 10 is mid-epoch
        "--warmup-epochs 0 --device cpu --loader workers --workers 2 --log-every "
        "5 -o".split(),
        str(out),
    ]
    p = subprocess.Popen(
        [sys.executable, "-m", "convit_convert", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=ROOT,
        start_new_session=True,
        text=True,
    )
    assert p.stdout is not None and p.stderr is not None
    for line in p.stdout:
        if after in line:
            os.killpg(p.pid, sig)
            break
    rest = p.communicate(timeout=240)
    return p.returncode, rest[1], out


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sig", "after"),
    [
        (signal.SIGTERM, "step 10/"),
        (signal.SIGTERM, "epoch 1/3 "),
        (signal.SIGTERM, "wrote"),
        (signal.SIGINT, "step 10/"),
        (signal.SIGINT, "wrote"),
    ],
)
def test_a_signal_to_the_process_group_is_an_interruption(tmp_path: Path, sig: int, after: str) -> None:
    # catches: loader workers killed by a SIGTERM made the loader raise: an internal error (exit 3) mid-epoch,
    # a traceback between epochs; a signal while the finished run's workers shut down printed a
    # traceback or killed the process (-15, -2)
    code, err, out = signalled_training(tmp_path, sig, after)
    assert "Traceback" not in err and "internal error" not in err, err[-2000:]
    if after != "wrote":  # mid-run: saved and stopped, resumable
        assert code == 128 + sig and (out / "checkpoint-last.pt").is_file(), (code, err[-2000:])
    else:  # the run was done: it exits 0, or with the signal's code, never killed by it
        assert code in (0, 128 + sig), (code, err[-2000:])
        assert (out / "conv.safetensors").is_file()


@pytest.mark.slow
def test_a_closed_or_broken_stdout_never_fails_finished_work(tmp_path: Path, attn_model: Path) -> None:
    # catches: `export ... >&-`: AttributeError (exit 3); `convert ... | head -c1`: exit 1 with both written.
    # A closed stdout is said (exit 2), but the files written stay written, whole
    cmd = [sys.executable, "-m", "convit_convert"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = tmp_path / "vit.onnx"
    p = subprocess.run(
        ["bash", "-c", '"$@" >&-', "_", *cmd, "export", str(attn_model), "-o", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 2 and out.is_file() and (tmp_path / "vit.onnx.report.json").is_file()
    assert p.stderr.strip() == "error: cannot write the output to standard output (it is closed)", p.stderr
    target = tmp_path / "v.safetensors"
    p = subprocess.run(
        [
            "bash",
            "-c",
            '"$@" | head -c1; exit "${PIPESTATUS[0]}"',
            "_",
            *cmd,
            "convert",
            str(FIXTURE),
            "-o",
            str(target),
        ],
        env=env,
        capture_output=True,
        timeout=600,
    )
    assert p.returncode == 0 and target.is_file() and b"Traceback" not in p.stderr, p.stderr[-2000:]


def test_onnxruntime_s_own_log_lines_never_reach_stderr(tmp_path: Path) -> None:
    # catches: a graph listing an initializer as an input printed onnxruntime's colour-escaped warning
    code = (
        "from onnx import helper as h, TensorProto as T\n"
        "from pathlib import Path\n"
        "from convit_convert.onnx.load import ort_session\n"
        "w = h.make_tensor('w', T.FLOAT, [1], [2.0])\n"
        "g = h.make_graph([h.make_node('Mul', ['x', 'w'], ['y'])], 'g', "
        "[h.make_tensor_value_info('x', T.FLOAT, [1]),\n"
        "    h.make_tensor_value_info('w', T.FLOAT, [1])], "
        "[h.make_tensor_value_info('y', T.FLOAT, [1])], [w])\n"
        "m = h.make_model(g, opset_imports=[h.make_opsetid('', 17)])\n"
        "m.ir_version = 8\n"
        "ort_session(m, Path('x.onnx'), batch=1)\n"
        "import onnxruntime\n"
        "onnxruntime.InferenceSession(m.SerializeToString(), providers=['CPUExecutionProvider'])\n"
    )
    r = in_a_process("-c", code, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0 and r.stderr == "", r.stderr[-2000:]


def test_compile_says_it_is_compiling_before_the_first_step(tmp_path: Path, monkeypatch) -> None:
    # catches: nothing for over 90 s on 2 cores, then a raw torch log line
    import torch

    monkeypatch.setattr(torch, "compile", lambda fn, **k: fn)  # the line, not the compile, is tested
    r = invoke("train", "phase1", *TINY_FLAGS, "--compile", "-o", tmp_path / "run")
    assert r.exit_code == 0, r.output[-2000:]
    lines = r.stdout.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("compile: torch.compile builds"))
    assert "about a minute the first time" in lines[at] and "BENCHMARKS.md" in lines[at]
    assert at < next(i for i, line in enumerate(lines) if line.startswith("epoch 1/1"))
