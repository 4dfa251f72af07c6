"""A stop request is answered wherever the run is: said at once in one line, acted on after the
current step or, in a validation (the model's, the EMA's, a stack's), after its current batch;
the run saved, and resumed to the same result as a run never stopped (the validation redone). A
second Ctrl-C abandons the run at once and says what that leaves; during the exports, with the
model written, the first one stops at once."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_config
from convit_convert import signals
from convit_convert.train.progress import Lines, Progress
from convit_convert.train.run import run

QUIET = Progress(None)
FLAGS = dict(
    device="cpu", workers=0, epochs=2, warmup_epochs=0, val_samples=128, batch_size=16, train_samples=64
)
VALIDATIONS = ("validating", "validating the EMA", "validating 2 seeds")


def interrupted_in(monkeypatch: pytest.MonkeyPatch, what: str, at: int) -> list[int]:
    """SIGINT sent to this process after batch ``at`` of the first count named ``what``; the list
    of batches each validation counted after the signal (what answered it)."""
    after: list[int] = []
    count = Lines.count
    sent = [False]

    def counting(self: Lines, name: str, total: int, unit: str) -> Any:
        inner, done = count(self, name, total, unit), [0]

        def counted(n: int) -> None:
            inner(n)
            done[0] += n
            if sent[0]:
                after.append(done[0])
            elif name.endswith(what) and done[0] == at:
                sent[0] = True
                os.kill(os.getpid(), signal.SIGINT)

        return counted

    monkeypatch.setattr(Lines, "count", counting)
    return after


def same_run(a: Path, b: Path) -> None:
    """The two runs' metrics (but their wall times) and weights are the same, bit for bit."""
    import csv

    rows = [list(csv.DictReader((d / "metrics.csv").open())) for d in (a, b)]
    timeless = [
        [{k: v for k, v in r.items() if k not in ("epoch_seconds", "images_per_s")} for r in rs]
        for rs in rows
    ]
    assert timeless[0] == timeless[1]
    wa, wb = (load_file(d / "conv.safetensors") for d in (a, b))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.sends_signals
@pytest.mark.parametrize("what", ["validating", "validating the EMA"])
def test_a_stop_during_validation_is_answered_within_a_batch_and_resumes_to_the_same_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], what: str
) -> None:
    """SIGINT at the 2nd of 8 validation batches: no batch counted after it, one line saying the
    stop at once, the run saved with its first epoch's steps done and no metrics row; resumed, it
    validates again and ends as the run that was never stopped."""
    ema = what.endswith("EMA")
    run(tiny_config(tmp_path / "whole", **FLAGS, model_ema=ema), progress=QUIET)
    after = interrupted_in(monkeypatch, what, at=2)
    stopped = run(tiny_config(tmp_path / "cut", **FLAGS, model_ema=ema), progress=QUIET)
    signals.clear()
    assert stopped.stopped == "SIGINT" and after == []
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith("SIGINT:")]
    assert said == [
        "SIGINT: stopping after the current step (a validation: after its current batch), then saving the "
        "run to resume; Ctrl-C again abandons it"
    ]
    state = torch.load(tmp_path / "cut" / "checkpoint-last.pt", weights_only=True)
    assert (state["epoch"], state["step"], state["metrics"]) == (0, 4, [])
    monkeypatch.undo()
    resumed = run(tiny_config(tmp_path / "cut", **FLAGS, model_ema=ema, resume=True), progress=QUIET)
    assert resumed.stopped is None
    same_run(tmp_path / "whole", tmp_path / "cut")


@pytest.mark.sends_signals
def test_a_stack_stopped_in_its_validation_resumes_to_the_same_runs(tmp_path: Path, monkeypatch) -> None:
    """`--seeds 0,1` interleaved: a stop in seed 1's validation leaves both seeds at the same step
    (seed 0's finished validation is not kept alone), and the resumed stack ends as the whole one."""
    from convit_convert.train.stacked import run_seeds

    run_seeds(tiny_config(tmp_path / "whole", **FLAGS, seeds=(0, 1)), progress=QUIET)
    after = interrupted_in(monkeypatch, "seed 1: validating", at=3)
    results = run_seeds(tiny_config(tmp_path / "cut", **FLAGS, seeds=(0, 1)), progress=QUIET)
    signals.clear()
    assert [r.stopped for r in results] == ["SIGINT", "SIGINT"] and after == []
    for seed in ("seed0", "seed1"):
        state = torch.load(tmp_path / "cut" / seed / "checkpoint-last.pt", weights_only=True)
        assert (state["epoch"], state["step"], state["metrics"]) == (0, 4, []), seed
    monkeypatch.undo()
    run_seeds(tiny_config(tmp_path / "cut", **FLAGS, seeds=(0, 1), resume=True), progress=QUIET)
    for seed in ("seed0", "seed1"):
        same_run(tmp_path / "whole" / seed, tmp_path / "cut" / seed)


def interrupt_twice_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """Two SIGINTs, one after the other, as the run's ``step``-th step (counted over the run) begins."""
    from convit_convert.train.loop import Loop

    real, steps = Loop.step, [0]

    def twice(self: Loop, batch: Any) -> None:
        steps[0] += 1
        if steps[0] == step:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        real(self, batch)

    monkeypatch.setattr(Loop, "step", twice)


@pytest.mark.sends_signals
def test_a_second_ctrl_c_abandons_the_run_and_says_what_it_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """After a checkpoint: the checkpoint stays, named, with the epoch it holds. Before the first:
    nothing is saved, and the run folder it made is gone, as the line says."""
    interrupt_twice_at(monkeypatch, 6)  # epoch 2, step 2 (4 steps an epoch)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tmp_path / "later", **FLAGS), progress=QUIET)
    err = capfd.readouterr().err
    line = next(x for x in err.splitlines() if x.startswith("second SIGINT:"))
    assert line == (
        f"second SIGINT: the run is abandoned without a save: its last checkpoint, "
        f"{tmp_path / 'later' / 'checkpoint-last.pt'} after epoch 1, stays; continue from it with the same "
        "command and `resume`"
    )
    assert torch.load(tmp_path / "later" / "checkpoint-last.pt", weights_only=True)["epoch"] == 1
    monkeypatch.undo()
    interrupt_twice_at(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tmp_path / "early", **FLAGS), progress=QUIET)
    signals.clear()
    assert "nothing of it is saved" in capfd.readouterr().err
    assert not (tmp_path / "early").exists()


@pytest.mark.sends_signals
def test_a_stop_during_the_exports_stops_at_once_with_the_model_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    from convit_convert.train import run as run_module

    def slow_export(*args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        raise AssertionError("the export went on after the stop")

    monkeypatch.setattr(run_module, "export_trained", slow_export)
    with pytest.raises(KeyboardInterrupt):
        run(tiny_config(tmp_path / "r", **FLAGS, export_onnx=True), progress=QUIET)
    signals.clear()
    model = tmp_path / "r" / "conv.safetensors"
    assert model.exists()
    assert (
        f"SIGINT: stopped while exporting; {model} is written; export it with `cmhsa export`"
        in capfd.readouterr().err
    )
