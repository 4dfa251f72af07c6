"""Shared helpers. References here are independent of the code under test: torch.nn.functional
convolutions with explicit padding, explicit loops, impulse responses."""

from __future__ import annotations

import gzip
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from typer.testing import CliRunner, Result

from convit_convert.cli import app
from convit_convert.config import ViTConfig
from convit_convert.model import VisionTransformer

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors"
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
    signal.signal(signal.SIGTERM, _interrupt)  # SIGINT: Python's KeyboardInterrupt already
    from convit_convert.train import run as train_run

    handle = train_run.StopRequest._handle

    def handle_in_the_suite(self: Any, signum: int, frame: Any) -> None:
        handle(self, signum, frame)
        if not _SIGNALS_ARE_THE_TEST[0]:
            _interrupt(signum, frame)

    train_run.StopRequest._handle = handle_in_the_suite


@pytest.fixture(autouse=True)
def _stop_the_session_on_a_signal(request: pytest.FixtureRequest) -> Any:
    _SIGNALS_ARE_THE_TEST[0] = request.node.get_closest_marker("sends_signals") is not None
    yield
    _SIGNALS_ARE_THE_TEST[0] = False
    if INTERRUPTED:  # the CLI's boundary turned it into an exit status: the session still ends
        pytest.exit(f"interrupted by {signal.Signals(INTERRUPTED[0]).name}", returncode=130)


def invoke(*args: Any, env: dict[str, str] | None = None, **kwargs: Any) -> Result:
    """``cmhsa ARGS`` through typer's CliRunner, in this process: the tests' one way to run a command
    (each argument str()-ed; a list or tuple argument is spread). None starts after an interrupt."""
    if INTERRUPTED:
        raise KeyboardInterrupt("the test session was interrupted")
    words = [str(w) for a in args for w in (a if isinstance(a, (list, tuple)) else (a,))]
    return CliRunner().invoke(app, words, env=env, **kwargs)


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
