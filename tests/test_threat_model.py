"""The threat model's rules that no other file holds (docs/reliability.md, its table): nothing is
written outside the outputs a command names but the library caches the model lists, and a signal
while cmhsa starts ends it with 130 / 143 and no traceback. (Each foreign kind's one bounded
reader: tests/test_foreign_text.py, test_onnx_sizes.py, test_bad_files.py; each sink:
test_foreign_text.py; outputs through a held folder: test_folders.py.)"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from conftest import FIXTURE, in_a_process

# what the commands below may leave under $HOME: matplotlib's font cache (plot, attention), as
# the threat model names it; onnxruntime's device id and telemetry database never
LIBRARY_CACHES = (".cache/matplotlib/",)

COMMANDS = """
import sys
from typer.testing import CliRunner
import convit_convert
from convit_convert.cli import app

out, digits = sys.argv[1], sys.argv[2]
for args in (
    ["convert", sys.argv[3], "-o", f"{out}/vit.safetensors"],
    ["verify", sys.argv[3], f"{out}/vit.safetensors"],
    ["export", f"{out}/vit.safetensors", "-o", f"{out}/vit.onnx"],
    ["export", sys.argv[3], "-o", f"{out}/conv.onnx"],
    ["inspect", f"{out}/conv.onnx"],
    ["predict", f"{out}/vit.onnx", f"{digits}/3.png"],
    ["eval", f"{out}/vit.onnx", "--data", "digits"],
    ["export", f"{out}/vit.safetensors", "--format", "timm", "-o", f"{out}/timm"],
    ["attention", f"{out}/vit.safetensors", "--data", "digits", "-o", f"{out}/att"],
):
    r = CliRunner().invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, (args, r.output)
"""


@pytest.mark.slow
def test_no_command_writes_under_home_but_the_caches_the_model_names(tmp_path: Path) -> None:
    """convert, verify, export (ONNX and timm), inspect, predict and eval of ONNX files (every one an
    onnxruntime session) and attention, in a process whose $HOME is empty: onnxruntime's telemetry
    (a device id and an event database under ~/.cache/Microsoft) is off, so $HOME holds at most
    matplotlib's font cache afterwards."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("ORT_DISABLE_TELEMETRY", "XDG_CACHE_HOME")}
    env["HOME"] = str(home)
    env.pop("MPLCONFIGDIR", None)
    r = in_a_process("-c", COMMANDS, tmp_path, FIXTURE.parent / "digits", FIXTURE, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    written = [p.relative_to(home).as_posix() for p in home.rglob("*") if p.is_file()]
    assert [p for p in written if not p.startswith(LIBRARY_CACHES)] == [], written


def test_onnxruntime_s_telemetry_is_off_unless_the_user_turned_it_on() -> None:
    """Set where the package is imported, before anything of cmhsa imports onnxruntime; a user's
    own setting stays."""
    script = "import os, convit_convert; print(os.environ['ORT_DISABLE_TELEMETRY'])"
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    assert in_a_process("-c", script, env=env).stdout.strip() == "1"
    assert in_a_process("-c", script, env={**env, "ORT_DISABLE_TELEMETRY": "0"}).stdout.strip() == "0"


SIGNAL_WHILE_IMPORTING = """
import builtins, os, signal, sys
real = builtins.__import__

def importing(name, *args, **kwargs):
    if name == "typer":  # the CLI's first import: cmhsa is still starting
        os.kill(os.getpid(), {signum})
    return real(name, *args, **kwargs)

builtins.__import__ = importing
sys.argv = ["cmhsa", "heads", "--kernel-size", "3", "--patch-size", "2"]
from convit_convert import main
main()
"""


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_while_cmhsa_starts_ends_it_quietly(signum: int) -> None:
    """Ctrl-C or SIGTERM while the command's modules are imported (before the CLI's error boundary
    takes the signals over): exit 130 / 143 at once, nothing printed (never a KeyboardInterrupt's
    traceback, never death by the signal)."""
    r = in_a_process("-c", SIGNAL_WHILE_IMPORTING.format(signum=int(signum)))
    assert (r.returncode, r.stderr, r.stdout) == (128 + signum, "", "")


def test_the_entry_point_is_the_one_that_takes_the_signals_first() -> None:
    """`cmhsa` and `python -m convit_convert` both start at convit_convert.main."""
    import tomllib

    from conftest import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"cmhsa": "convit_convert:main"}
    assert (ROOT / "convit_convert" / "__main__.py").read_text().startswith("from . import main\n")
