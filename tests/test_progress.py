"""A run you can watch: a line (or a bar's update) at least every PROGRESS_SECONDS of wall time, not
only every ``--log-every`` steps; the device read for it at most that often; validation, ``eval``
and ``predict`` counted too; a ``--seeds`` run's shared notes said once. The clock is the test's
(``train.progress.clock``), so no test waits."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path

import pytest
from rich.console import Console

from conftest import FIXTURE, TINY_RUN, bench_script, invoke, tiny_config
from convit_convert.cli.progress import RichProgress
from convit_convert.train import progress as progress_module
from convit_convert.train.progress import PROGRESS_SECONDS, Paced, Progress
from convit_convert.train.run import run

CountOps = bench_script("ops_per_step").CountOps


def ticking(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[float]:
    """A clock that moves ``seconds`` on every read; the reads' times, as they happen."""
    times = itertools.count(0.0, seconds)
    seen: list[float] = []

    def clock() -> float:
        seen.append(next(times))
        return seen[-1]

    monkeypatch.setattr(progress_module, "clock", clock)
    return seen


STEP = re.compile(r"^epoch 1/1 step (\d+)/(\d+) .* about (\d+) s to go$")


def test_an_epoch_shorter_than_log_every_still_says_where_it_is(tmp_path: Path, monkeypatch) -> None:
    """16 steps, `--log-every` 1000: before, one line at the epoch's end, "about 0 s to go". With
    each clock read 4 s apart the epoch passes PROGRESS_SECONDS within a few steps: lines come
    before its end, each with the step, images/s and a nonzero estimate of the rest."""
    ticking(monkeypatch, 4.0)
    lines: list[str] = []
    run(
        tiny_config(tmp_path / "r", log_every=1000, device="cpu", workers=0, epochs=1, warmup_epochs=0),
        progress=Progress(lines.append),
    )
    steps = [STEP.match(line) for line in lines]
    early = [m for m in steps if m and int(m.group(1)) < int(m.group(2))]
    assert early, lines
    assert all(int(m.group(3)) > 0 for m in early), lines
    assert any("img/s" in line and "loss " in line for line in lines if STEP.match(line))


def test_no_glance_within_progress_seconds(tmp_path: Path, monkeypatch) -> None:
    """A clock that stands still: a 16-step epoch reads the device only at its end, as before
    (host reads counted as aten::_local_scalar_dense, as test_step's per-step check counts them),
    and prints its one step line there."""
    monkeypatch.setattr(progress_module, "clock", lambda: 0.0)
    counts, lines = {}, []
    for glances, seconds in (("still", None), ("ticking", 4.0)):
        if seconds is not None:
            ticking(monkeypatch, seconds)
        counter, said = CountOps(), []
        with counter:
            run(
                tiny_config(tmp_path / glances, device="cpu", workers=0, epochs=1, warmup_epochs=0),
                progress=Progress(said.append),
            )
        counts[glances], lines = counter.ops["aten._local_scalar_dense"], [*lines, said]
    assert len([line for line in lines[0] if STEP.match(line)]) == 1
    glanced = len([line for line in lines[1] if STEP.match(line)]) - 1
    assert glanced > 0 and counts["ticking"] == counts["still"] + glanced  # one read per glance


def test_a_glance_does_not_change_the_run(tmp_path: Path, monkeypatch) -> None:
    """The glance reads the loss tally without resetting it: the epoch's training loss and the
    weights are the same with glances after every step and with none."""
    from safetensors.torch import load_file

    monkeypatch.setattr(progress_module, "clock", lambda: 0.0)
    still = run(
        tiny_config(tmp_path / "still", device="cpu", workers=0, epochs=1, warmup_epochs=0),
        progress=Progress(None),
    )
    ticking(monkeypatch, PROGRESS_SECONDS)
    glanced = run(
        tiny_config(tmp_path / "glanced", device="cpu", workers=0, epochs=1, warmup_epochs=0),
        progress=Progress(None),
    )
    assert still.rows[-1]["train_loss"] == glanced.rows[-1]["train_loss"]
    a, b = (
        load_file(tmp_path / "still" / "conv.safetensors"),
        load_file(tmp_path / "glanced" / "conv.safetensors"),
    )
    assert all((a[k] == b[k]).all() for k in a)


def test_a_stack_glances_once_for_all_its_seeds(tmp_path: Path, monkeypatch) -> None:
    """`--seeds`: one line per glance or read-out (the lead seed's), never one per seed."""
    from convit_convert.train.stacked import run_seeds

    ticking(monkeypatch, 4.0)
    lines: list[str] = []
    cfg = tiny_config(tmp_path / "s", seeds=(0, 1, 2), device="cpu", workers=0, epochs=1, warmup_epochs=0)
    run_seeds(cfg, progress=Progress(lines.append))
    step_lines = [line for line in lines if " step " in line and "/16 " in line]
    assert step_lines and not any(line.startswith("seed ") for line in step_lines), lines


def test_validation_that_takes_long_says_how_far_it_is(tmp_path: Path, monkeypatch) -> None:
    ticking(monkeypatch, 4.0)
    lines: list[str] = []
    run(
        tiny_config(
            tmp_path / "r", device="cpu", workers=0, epochs=1, warmup_epochs=0, val_samples=128, batch_size=16
        ),
        progress=Progress(lines.append),
    )
    assert any(
        re.match(r"validating: \d+/8 batches, [\d.]+ batches/s, about \d+ s to go", line) for line in lines
    ), lines


def test_a_count_says_nothing_for_quick_work_and_a_line_per_interval_for_slow(monkeypatch) -> None:
    seen = ticking(monkeypatch, 1.0)
    lines: list[str] = []
    count = Paced("evaluating", 100, lines.append, "images")
    for _ in range(5):
        count(1)
    assert lines == []  # 5 s: quick
    for _ in range(50):
        count(1)
    assert len(lines) == 5 and lines[0].startswith("evaluating: 10/100 images"), lines
    assert seen[-1] - seen[0] >= 50


def test_on_a_terminal_the_bar_moves_with_every_step() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    p = RichProgress(console)
    p.open(epochs=1, log_every=1000)
    p.start_epoch(0, steps=16)
    for done in range(1, 4):
        p.advance(done)
        assert p.bars.tasks[1].completed == done  # type: ignore[union-attr]
    count = p.counting("validating", 8)
    count(3)
    assert [t.completed for t in p.bars.tasks if t.description == "validating"] == [3]  # type: ignore[union-attr]
    count(5)
    assert [t for t in p.bars.tasks if t.description == "validating"] == []  # type: ignore[union-attr]
    p.close()


def test_eval_in_a_log_says_how_far_it_is(monkeypatch) -> None:
    ticking(monkeypatch, 4.0)
    r = invoke("eval", FIXTURE, "--data", "digits", "--batch-size", "32")
    assert r.exit_code == 0, r.output
    assert re.search(r"^evaluating: \d+/12 batches", r.output, re.M), r.output


def test_predict_in_a_log_says_how_far_it_is(tmp_path: Path, monkeypatch) -> None:
    from PIL import Image

    for i in range(20):
        Image.new("L", (8, 8), 10 * i).save(tmp_path / f"{i:02}.png")
    ticking(monkeypatch, 4.0)
    r = invoke("predict", FIXTURE, tmp_path, "--batch-size", "4")
    assert r.exit_code == 0, r.output
    assert re.search(r"^predicting: \d+/20 images", r.output, re.M), r.output


def test_a_note_every_seed_gives_is_said_once(tmp_path: Path) -> None:
    """Grey digits on 3 channels: the note is each seed's, and the run says it once, unlabelled."""
    flags = ["--data", "digits", "--train-samples", "128", "--img-size", "16", "--patch-size", "4"]
    flags += ["--depth", "1", "--kernel-size", "3", "--epochs", "1", "--batch-size", "32", "--device", "cpu"]
    r = invoke("train", "phase1", *flags, "--seeds", "0,1", "-o", tmp_path / "s")
    assert r.exit_code == 0, r.output
    grey = [line for line in r.output.splitlines() if "images are grey" in line]
    assert len(grey) == 1 and grey[0].startswith("note: "), grey


def test_evals_table_shows_top5_only_for_more_than_5_classes(tmp_path: Path) -> None:
    from PIL import Image

    for split in ("train", "val"):
        for name in ("a", "b", "c"):
            (tmp_path / "three" / split / name).mkdir(parents=True)
            for i in range(4):
                Image.new("L", (32, 32), 60 * "abc".index(name) + i).save(
                    tmp_path / "three" / split / name / f"{i}.png"
                )
    flags = ["--data", "imagefolder", "--data-dir", tmp_path / "three", "--device", "cpu"]
    trained = ["--img-size", "16", "--patch-size", "4", "--depth", "1", "--kernel-size", "3", "--epochs", "1"]
    r = invoke("train", "phase1", *flags, *trained, "--batch-size", "4", "-o", tmp_path / "r")
    assert r.exit_code == 0, r.output
    r = invoke("eval", tmp_path / "r" / "conv.safetensors", *flags)
    assert r.exit_code == 0 and "top-1 %" in r.output and "top-5 %" not in r.output, r.output
    r = invoke("eval", FIXTURE, "--data", "digits")  # 10 classes
    assert r.exit_code == 0 and "top-5 %" in r.output, r.output


assert TINY_RUN["log_every"] > 16  # the tiny run's epoch is shorter than its --log-every
