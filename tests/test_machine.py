"""A run on the machine it runs on: eval and predict take `--threads` as training does, and on a
CPU a model whose step would take long is said before the first step, with the run's time and
memory (the default thread count itself: tests/test_train.py)."""

from __future__ import annotations

from pathlib import Path

import torch

from conftest import tiny_config
from convit_convert.train.progress import Progress
from convit_convert.train.run import run

FLAGS = dict(device="cpu", workers=0, epochs=2, warmup_epochs=0, batch_size=16, train_samples=64)


def test_a_cpu_step_that_would_take_long_is_said_before_the_first(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    """On a CPU a step estimated past the progress interval (here: 60 s, as the paper's model's at
    its batch) is said before the first step, with the epoch's and the run's time, its memory and
    `--preset cpu`; a quick one says nothing. The probe leaves the run as it was: the RNG state,
    the weights, no gradient."""
    from convit_convert.cli.common import as_flags
    from convit_convert.train import build
    from convit_convert.train.step import probe_seconds

    lines: list[str] = []
    monkeypatch.setattr(build, "probe_seconds", lambda model, image, batch: 60.0)
    run(tiny_config(tmp_path / "slow", **FLAGS), progress=Progress(lines.append))
    said = [as_flags(line) for line in lines if "on this CPU a step" in line]
    assert said == [
        "note: on this CPU a step of this model (0.0 M parameters, batch 16) takes about 60 s: an epoch of 4 "
        "steps about 4.0 min, the run's 2 epochs about 8.0 min, in about 0.0 GiB; --preset cpu trains a "
        "model sized for a CPU (28 px, d 48, 2 blocks: docs/training.md), a GPU this one"
    ]
    monkeypatch.undo()
    lines.clear()
    run(tiny_config(tmp_path / "quick", **FLAGS), progress=Progress(lines.append))
    assert not [line for line in lines if "on this CPU a step" in line]
    from conftest import conv_model

    model = conv_model(dtype=torch.float32).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert probe_seconds(model, (3, 12, 8), 256) > 0
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_eval_and_predict_take_threads(monkeypatch) -> None:
    """`--threads N`: torch's threads during the command (and onnxruntime's, for an ONNX file), the
    caller's after."""
    from conftest import FIXTURE, invoke

    seen: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n) or real(n))
    before = torch.get_num_threads()
    r = invoke("eval", FIXTURE, "--data", "digits", "--threads", "1")
    assert r.exit_code == 0, r.output
    r = invoke("predict", FIXTURE, FIXTURE.parent / "digits" / "3.png", "--threads", "1")
    assert r.exit_code == 0, r.output
    assert seen == [1, before, 1, before] and torch.get_num_threads() == before
    r = invoke("predict", FIXTURE, FIXTURE.parent / "digits" / "3.png", "--threads", "0")
    assert r.exit_code == 2 and "--threads" in r.output


def test_a_resume_keeps_its_runs_threads_and_says_another_processor(tmp_path: Path, monkeypatch) -> None:
    """A run of 2 threads resumed where the default would be 1 keeps its 2 (results depend on the
    count; config.json's environments say so), unless `--threads` is given; a resume on another
    processor model says so, as one on another CPU code path does."""
    import json

    from convit_convert.train import run as run_module
    from convit_convert.train import state

    run(tiny_config(tmp_path / "r", **FLAGS, threads=2), progress=Progress(None), stop_after_steps=2)
    monkeypatch.setattr(run_module, "default_threads", lambda: 1)
    monkeypatch.setattr(state, "cpu_name", lambda: "Another CPU(R) 9000")
    lines: list[str] = []
    run(tiny_config(tmp_path / "r", **FLAGS, resume=True), progress=Progress(lines.append))
    environments = json.loads((tmp_path / "r" / "config.json").read_text())["environments"]
    assert [e["threads"] for e in environments] == [2, 2]
    moved = [line for line in lines if line.startswith("resuming in another environment")]
    assert len(moved) == 1 and "cpu " in moved[0] and "-> Another CPU(R) 9000" in moved[0], lines
    assert "threads" not in moved[0]
    run(tiny_config(tmp_path / "r2", **FLAGS), progress=Progress(None), stop_after_steps=2)
    run(tiny_config(tmp_path / "r2", **FLAGS, resume=True, threads=1), progress=Progress(None))
    environments = json.loads((tmp_path / "r2" / "config.json").read_text())["environments"]
    assert environments[-1]["threads"] == 1
