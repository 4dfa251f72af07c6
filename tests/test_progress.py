"""A run you can watch: a line (or a bar's update) at least every PROGRESS_SECONDS of wall time, not
only every ``--log-every`` steps; the device read for it at most that often; each line's estimate of
the rest of the epoch and of the run, validations included; validation, ``eval`` and ``predict``
counted too; a ``--seeds`` run's lines and shared notes said once; on a terminal, bars that keep
their width, refresh their time with every step and leave when the run ends. The clock is the
test's (``train.progress.clock``), so no test waits."""

from __future__ import annotations

import io
import itertools
import re
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from conftest import FIXTURE, TINY_RUN, invoke, tiny_config
from convit_convert.cli.progress import BAR_CELLS, Bars
from convit_convert.train import progress as progress_module
from convit_convert.train.profiling import HOST_READ, OpCounter
from convit_convert.train.progress import PROGRESS_SECONDS, Estimate, Pace, Paced, Progress, StepLine
from convit_convert.train.run import run


def ticking(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[float]:
    """A clock that moves ``seconds`` on every read; the reads' times, as they happen."""
    times = itertools.count(0.0, seconds)
    seen: list[float] = []

    def clock() -> float:
        seen.append(next(times))
        return seen[-1]

    monkeypatch.setattr(progress_module, "clock", clock)
    return seen


STEP_LINE = re.compile(r"^epoch 1/1 step (\d+)/(\d+) .* about ([\d.]+) (?:s|min) to go; the run about")


def quiet_run(out: Path, **flags) -> dict:
    """The tiny run's flags on the CPU, one epoch, no warm-up: 16 steps."""
    return dict(device="cpu", workers=0, epochs=1, warmup_epochs=0) | flags


def test_an_epoch_shorter_than_log_every_still_says_where_it_is(tmp_path: Path, monkeypatch) -> None:
    """16 steps, `--log-every` 1000: with each clock read 4 s apart the epoch passes
    PROGRESS_SECONDS within a few steps: lines come before its end, each with the step, images/s
    and a nonzero estimate of the rest of the epoch and of the run."""
    ticking(monkeypatch, 4.0)
    lines: list[str] = []
    run(tiny_config(tmp_path / "r", log_every=1000, **quiet_run(tmp_path)), progress=Progress(lines.append))
    steps = [STEP_LINE.match(line) for line in lines]
    early = [m for m in steps if m and int(m.group(1)) < int(m.group(2))]
    assert early, lines
    assert all(float(m.group(3)) > 0 for m in early), lines
    assert any("img/s" in line and "loss " in line for line in lines if STEP_LINE.match(line))


def glanced_run(
    tmp_path: Path, name: str, monkeypatch, seconds: float | None
) -> tuple[list[str], int, object]:
    """A 16-step epoch under a clock that stands still (None) or ticks ``seconds`` a read: its lines,
    its host reads, its result."""
    if seconds is None:
        monkeypatch.setattr(progress_module, "clock", lambda: 0.0)
    else:
        ticking(monkeypatch, seconds)
    counter, lines = OpCounter(), []
    with counter:
        result = run(tiny_config(tmp_path / name, **quiet_run(tmp_path)), progress=Progress(lines.append))
    return lines, counter.ops[HOST_READ], result


def test_a_glance_reads_the_device_once_and_changes_nothing(tmp_path: Path, monkeypatch) -> None:
    """A clock that stands still: a 16-step epoch reads the device only at its end and prints its
    one step line there. A clock past PROGRESS_SECONDS at every read: a glance after every step,
    each one line and one host read more, and the run's loss and weights are the same."""
    from safetensors.torch import load_file

    still, still_reads, a = glanced_run(tmp_path, "still", monkeypatch, None)
    ticks, tick_reads, b = glanced_run(tmp_path, "ticking", monkeypatch, PROGRESS_SECONDS)
    assert len([line for line in still if STEP_LINE.match(line)]) == 1
    glances = len([line for line in ticks if STEP_LINE.match(line)]) - 1
    assert glances == 15, ticks  # every step but the last, whose read-out is the epoch's
    assert tick_reads == still_reads + glances  # one read per glance
    assert a.rows[-1]["train_loss"] == b.rows[-1]["train_loss"]
    wa, wb = (
        load_file(tmp_path / "still" / "conv.safetensors"),
        load_file(tmp_path / "ticking" / "conv.safetensors"),
    )
    assert all((wa[k] == wb[k]).all() for k in wa)


def test_a_stack_glances_once_for_all_its_seeds(tmp_path: Path, monkeypatch) -> None:
    """`--seeds`: one step line and one device read per glance (the lead seed's), never one per
    seed: with a glance after every step, one line per step of the 16, and 15 reads more than
    with none."""
    from convit_convert.train.stacked import run_seeds

    reads, lines = [], []
    for seconds in (None, PROGRESS_SECONDS):
        if seconds is None:
            monkeypatch.setattr(progress_module, "clock", lambda: 0.0)
        else:
            ticking(monkeypatch, seconds)
        said: list[str] = []
        cfg = tiny_config(tmp_path / f"s{seconds}", seeds=(0, 1, 2), **quiet_run(tmp_path))
        with OpCounter() as counter:
            run_seeds(cfg, progress=Progress(said.append))
        reads.append(counter.ops[HOST_READ])
        lines.append(said)
    step_lines = [line for line in lines[1] if re.search(r"\bstep \d+/16\b", line)]
    assert [int(re.search(r"step (\d+)/", line).group(1)) for line in step_lines] == list(range(1, 17)), lines
    assert reads[1] - reads[0] == 15, reads


def test_a_step_line_says_the_rest_of_the_epoch_and_of_the_run_validations_included(monkeypatch) -> None:
    """3 epochs of 100 steps, the 2nd and 3rd evaluated: the epoch's rest from its pace; the run's
    from it and the later epochs, their validations timed by the last one (said apart until one
    has run); a resumed epoch's pace from the steps it ran; a new epoch's first estimate from the
    last epoch's pace, never its "0 s to go"."""
    clock = [100.0]
    monkeypatch.setattr(progress_module, "clock", lambda: clock[0])
    pace = Pace(epochs=3, steps=100, evaluates=lambda epoch: epoch >= 1)
    pace.start_epoch(0, 0)
    assert pace.estimate(0).epoch_left is None  # nothing timed yet
    clock[0] += 30.0
    first = pace.estimate(10)  # 3 s a step: 90 more steps, then 2 epochs of 100
    assert (first.epoch_left, first.run_left, first.validations) == (270.0, 870.0, False)
    assert (
        first.text() == "30 s in this epoch, about 4.5 min to go; the run about 14.5 min and its validations"
    )
    clock[0] += 270.0
    pace.end_steps(100)
    pace.validated(20.0)  # not this epoch's (it has none), but the time a validation takes
    pace.start_epoch(1, 80)  # resumed at step 80, with the last epoch's pace to begin with
    opening = pace.estimate(80)
    assert opening.epoch_left == 3.0 * 20 + 20.0 and opening.validations
    clock[0] += 10.0
    resumed = pace.estimate(90)  # 1 s a step now: 10 steps, a validation, then an epoch and its validation
    assert (resumed.epoch_left, resumed.run_left) == (30.0, 30.0 + 100.0 + 20.0)
    assert resumed.text() == "10 s in this epoch, about 30 s to go; the run about 2.5 min"
    line = StepLine(1, 3, 90, 100, 0.5, 1e-3, 64.0, resumed)
    assert line.text().startswith("epoch 2/3 step 90/100  loss 0.5000  lr 1.00e-03  64.0 img/s  10 s in")


def test_a_step_longer_than_the_progress_interval_is_said_once(tmp_path: Path, monkeypatch) -> None:
    """Each step 12 s on the clock: one note that a line comes after every step, then a line per step."""
    from convit_convert.train.loop import Loop

    clock, step = [0.0], Loop.step

    def slow(self: Loop, batch: Any) -> None:
        clock[0] += 12.0
        step(self, batch)

    monkeypatch.setattr(progress_module, "clock", lambda: clock[0])
    monkeypatch.setattr(Loop, "step", slow)
    lines: list[str] = []
    run(tiny_config(tmp_path / "r", **quiet_run(tmp_path)), progress=Progress(lines.append))
    notes = [line for line in lines if "longer than the 10 s between progress lines" in line]
    assert len(notes) == 1 and notes[0].startswith("note: a step takes 12 s here"), lines
    assert len([line for line in lines if STEP_LINE.match(line)]) == 16


def test_validation_that_takes_long_says_how_far_it_is(tmp_path: Path, monkeypatch) -> None:
    ticking(monkeypatch, 4.0)
    lines: list[str] = []
    run(
        tiny_config(tmp_path / "r", **quiet_run(tmp_path, val_samples=128, batch_size=16)),
        progress=Progress(lines.append),
    )
    assert any(
        re.match(r"validating: \d+/8 batches, [\d.]+ batches/s, about \d+ s to go", line) for line in lines
    )


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


def bar_rows(bars: Bars) -> list[str]:
    """The bars' rows as a 100-column terminal shows them now."""
    screen = Console(file=io.StringIO(), width=100, record=True)
    screen.print(bars.bars.make_tasks_table(bars.bars.tasks))  # type: ignore[union-attr]
    return [row for row in screen.export_text().splitlines() if row.strip()]


def test_on_a_terminal_the_bars_keep_their_width_and_refresh_their_time(monkeypatch) -> None:
    """On a 100-column terminal: each bar keeps BAR_CELLS cells when the step text appears (the text
    is cut, not the bar), no column of rich's own time; the epoch's rest refreshes with every step
    between read-outs; epoch 2 opens without epoch 1's last estimate; a validation's bar comes and
    goes; the bars leave the screen at the end."""
    clock = [0.0]
    monkeypatch.setattr(progress_module, "clock", lambda: clock[0])
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    bars = Bars(console)
    p = Progress(bars)
    p.open(epochs=2, log_every=1000)
    pace = Pace(2, 16, lambda epoch: True)
    pace.start_epoch(0, 0)
    p.start_epoch(0, 16, 0, pace.estimate(0))
    clock[0] = 4.0
    line = StepLine(0, 2, 2, 16, 0.1234, 1e-3, 123.4, pace.estimate(2))
    p.step(line)
    info = bars.bars.tasks[1].fields["info"]  # type: ignore[union-attr]
    assert info.startswith("loss 0.1234  lr 1.00e-03  123.4 img/s  about 28 s to go"), info
    for done in range(3, 6):
        clock[0] = 2.0 * done
        p.moved(done, pace.estimate(done))
        assert bars.bars.tasks[1].completed == done  # type: ignore[union-attr]
    assert bars.bars.tasks[1].fields["info"].endswith("about 22 s to go")  # type: ignore[union-attr]
    rows = bar_rows(bars)
    assert len(rows) == 2, rows
    for row in rows:  # the description's 8 cells and a space, the bar, then done/total
        bar, after = row[9 : 9 + BAR_CELLS], row[9 + BAR_CELLS :]
        assert len(row) <= 100 and set(bar) <= set("━╸╺ ") and re.match(r" +\d+/\d+ ", after), row
        assert not re.search(r"\d:\d\d", row), row  # no rich time column
    count = p.counting("validating", 8)
    count(3)
    assert [t.completed for t in bars.bars.tasks if t.description == "validating"] == [3]  # type: ignore[union-attr]
    count(5)
    assert [t for t in bars.bars.tasks if t.description == "validating"] == []  # type: ignore[union-attr]
    clock[0] = 32.0  # 16 steps in 32 s
    pace.end_steps(16)
    pace.validated(2.0)
    pace.start_epoch(1, 0)
    p.start_epoch(1, 16, 0, pace.estimate(0))
    opening = bars.bars.tasks[1].fields["info"]  # type: ignore[union-attr]
    assert opening == "about 34 s to go", opening  # the last epoch's pace, and the validation
    assert bars.bars.live.transient  # type: ignore[union-attr]  # rich erases them when they stop
    p.close()
    assert bars.bars is None


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
    """Grey digits on 3 channels: the note is each seed's, and the run says it once, unlabelled; a
    note only one seed gives keeps its label."""
    flags = ["--data", "digits", "--train-samples", "128", "--img-size", "16", "--patch-size", "4"]
    flags += ["--depth", "1", "--kernel-size", "3", "--epochs", "1", "--batch-size", "32", "--device", "cpu"]
    r = invoke("train", "phase1", *flags, "--seeds", "0,1", "-o", tmp_path / "s")
    assert r.exit_code == 0, r.output
    grey = [line for line in r.output.splitlines() if "images are grey" in line]
    assert len(grey) == 1 and grey[0].startswith("note: "), grey
    said: list[str] = []
    run = Progress(said.append)
    one, two = run.for_seed(0, lead=True), run.for_seed(1, lead=False)
    for view in (one, two):
        view.log("note: every seed's")
    two.log("note: seed 1's alone")
    run.flush_notes(2)
    assert said == ["note: every seed's", "seed 1: note: seed 1's alone"]


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
assert Estimate(1.0, None, None, False).text() == "1 s in this epoch"
