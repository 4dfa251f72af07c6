"""experiments' arms runner (train/arms.py): parallel processes, dependencies, skip what is done,
a time budget that stops arms cleanly and a second call that resumes them."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import TINY_RUN, write_idx
from convit_convert.errors import CmhsaError
from convit_convert.options.training import TrainConfig
from convit_convert.train.arms import BLOCKED, DONE, FAILED, STOPPED, Arm, run_arms

TINY = {**TINY_RUN, "warmup_epochs": 0, "device": "cpu"}


def epochs_done(out: Path) -> list[int]:
    """The epochs metrics.csv lists ([] before the first has finished)."""
    if not (out / "metrics.csv").is_file():
        return []
    with open(out / "metrics.csv", newline="") as f:
        return [int(r["epoch"]) for r in csv.DictReader(f)]


@pytest.mark.slow
def test_parallel_arms_with_a_dependency_and_skipping_what_is_done(tmp_path: Path) -> None:
    a = Arm("a", TrainConfig.from_flags(out=str(tmp_path / "a"), phase="phase1", epochs=2, **TINY))
    init = str(tmp_path / "a" / "conv.safetensors")
    b = Arm(
        "b",
        TrainConfig.from_flags(out=str(tmp_path / "b"), phase="phase2", init=init, epochs=1, **TINY),
        after=("a",),
    )
    c = Arm("c", TrainConfig.from_flags(out=str(tmp_path / "c"), phase="phase1", epochs=1, seed=3, **TINY))
    bad = Arm(
        "bad",
        TrainConfig.from_flags(
            out=str(tmp_path / "bad"), phase="phase1", epochs=1, **{**TINY, "img_size": 15}
        ),
    )
    after_bad = Arm(
        "after", TrainConfig.from_flags(out=str(tmp_path / "x"), phase="phase1", epochs=1, **TINY), ("bad",)
    )
    seen: list[str] = []
    run_arms(
        [a, b, c, bad, after_bad], parallel=2, report=lambda arm: seen.append(f"{arm.name} {arm.status}")
    )
    assert [x.status for x in (a, b, c, bad, after_bad)] == [DONE, DONE, DONE, FAILED, BLOCKED]
    assert "img_size" in bad.note and "Traceback" not in (tmp_path / "bad" / "log.txt").read_text()
    assert seen.index("a done") < seen.index("b done")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["init"] == init
    assert json.loads((tmp_path / "c" / "config.json").read_text())["threads_used"] == 1  # 2 CPUs / 2 arms
    for bad in (dict(parallel=0), dict(time_budget=float("nan")), dict(time_budget=-1.0)):
        with pytest.raises(CmhsaError, match=r"`(parallel|time_budget)` must be"):
            run_arms([a], **bad)
    outputs = [p for arm in (a, b, c) for p in sorted(arm.out.iterdir())]
    stamps = [p.stat().st_mtime_ns for p in outputs]
    again = run_arms([a, b, c], parallel=2)
    # nothing re-run: no file of a finished arm rewritten, none added (not a wall-clock bound)
    assert [x.status for x in again] == [DONE] * 3
    assert [p for arm in (a, b, c) for p in sorted(arm.out.iterdir())] == outputs
    assert [p.stat().st_mtime_ns for p in outputs] == stamps


@pytest.mark.slow
class EpochClock:
    """arms.py's clock, driven by the run instead of the wall: it stands at 0 until the run's
    metrics.csv holds one epoch more than when the call began, then jumps past any budget. A call
    then stops the run after at least one epoch, however loaded the machine."""

    def __init__(self, out: Path) -> None:
        self.out, self.start = out, len(epochs_done(out))

    def monotonic(self) -> float:
        return 0.0 if len(epochs_done(self.out)) <= self.start else 1e9


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_time_budget_stops_cleanly_and_the_next_call_resumes(tmp_path: Path, monkeypatch) -> None:
    """A run far longer than the budget: a budgeted call stops it cleanly when the budget's clock
    runs out (SIGTERM: checkpoint saved, status stopped, nothing lost), and the next call resumes it
    where it stopped. The clock is the run's epochs, not the wall's (EpochClock)."""
    import types

    import convit_convert.train.arms as arms_module

    out = tmp_path / "long"
    arm = Arm("long", TrainConfig.from_flags(out=str(out), phase="phase1", epochs=5000, **TINY))
    done: list[list[int]] = []
    for _ in range(2):
        clock = EpochClock(out)
        monkeypatch.setattr(
            arms_module, "time", types.SimpleNamespace(monotonic=clock.monotonic, sleep=time.sleep)
        )
        run_arms([arm], time_budget=60, margin=4)
        assert arm.status == STOPPED and (out / "checkpoint-last.pt").is_file()
        done.append(epochs_done(out))
    assert 0 < len(done[0]) < len(done[1]) < 5000
    assert done[1] == list(range(1, len(done[1]) + 1))  # continued, nothing repeated or skipped
    assert "resumed" in (out / "log.txt").read_text()


def tiny_fashion_mnist(tmp_path: Path) -> Path:
    """A folder of Fashion-MNIST's four IDX files holding 128 training and 64 validation images of noise."""
    rng = np.random.default_rng(0)
    data = tmp_path / "fm"
    data.mkdir()
    for split, n in (("train", 128), ("t10k", 64)):
        write_idx(data / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(data / f"{split}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    return data


def experiment_command(name: str, data: Path, flags: str, out: Path) -> list[str]:
    """experiments/``name`` on the IDX files in ``data`` with ``flags``, writing into ``out``."""
    script = Path(__file__).resolve().parent.parent / "experiments" / name
    return [sys.executable, str(script), "--data-dir", str(data), *flags.split(), "--out", str(out)]


@pytest.mark.slow
def test_fashion_mnist_experiment_in_budgeted_calls(tmp_path: Path) -> None:
    """experiments/fashion_mnist.py on tiny IDX files: a call whose budget is too short stops its
    arms and exits 3, the next call finishes the table from where it stopped."""
    data = tiny_fashion_mnist(tmp_path)
    flags = "--epochs 2 --seeds 0 --warmup 0 --train-samples 128 --device cpu --parallel 2"
    cmd = experiment_command("fashion_mnist.py", data, flags, tmp_path / "out")
    first = subprocess.run([*cmd, "--time-budget", "8"], capture_output=True, text=True, timeout=120)
    assert first.returncode == 3, first.stdout[-2000:] + first.stderr[-2000:]
    assert "run the same command again" in first.stdout
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    assert "| phase 1 only | 0 |" in second.stdout and "| both phases, gated | 0 |" in second.stdout
    assert json.loads((tmp_path / "out" / "results.json").read_text())


@pytest.mark.slow
def test_init_comparison_runs_every_start_and_writes_table_curves_and_raw_results(tmp_path: Path) -> None:
    """experiments/init_comparison.py on tiny IDX files, 2 epochs: every setting in the table, each
    final model evaluated on the whole (64-image) validation split, the curves and raw results written."""
    data = tiny_fashion_mnist(tmp_path)
    out = tmp_path / "out"
    flags = "--epochs 2 --seeds 0 --train-samples 128 --val-samples 32 --device cpu --parallel 2"
    cmd = experiment_command("init_comparison.py", data, flags, out)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    for setting in (
        "phase 1 only",
        "phase 2 only, mimetic init",
        "phase 2 only, impulse init (random offsets)",
        "two-phase, free extra heads",
        "two-phase, gated pinning, no warm-up in phase 2",
        "phase 1, restarted (phase 2's rate and warm-up, no conversion)",
    ):
        assert f"| {setting} |" in r.stdout, r.stdout
    results = json.loads((out / "results.json").read_text())
    assert len(results["runs"]) == 12
    halves = ("/hard", "/gated", "/free-heads", "/gated-nowarm", "/p1-restart")
    for name, run in results["runs"].items():
        assert run["final"]["images"] == 64 and len(run["rows"]) == (
            1 if "half" in name or name.endswith(halves) else 2
        ), name
    restart = json.loads((out / "seed0" / "p1-restart" / "config.json").read_text())
    assert restart["phase"] == "phase1" and restart["init"] == str(
        out / "seed0" / "half-p1" / "conv.safetensors"
    )
    # --settings: only the runs a setting is made of
    r = subprocess.run([*cmd, "--settings", "restarted"], capture_output=True, text=True, timeout=600)
    assert (
        r.returncode == 0
        and r.stdout.count("| phase 1, restarted") == 1
        and "| phase 1 only |" not in r.stdout
    )
    assert results["runs"]["seed0/impulse"]["final"]["attention"][0]["pinned_share"] > 0.5
    assert (out / "curves.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_plateau_stacked_runs_each_arms_seeds_as_one_process_in_budgeted_calls(tmp_path: Path) -> None:
    """experiments/plateau_stacked.py (issue 57's command) on tiny IDX files: a call too short for
    it stops its stacked arms (each seed saved) and exits 3; the next call resumes and finishes
    every arm, each seed in its own folder; the report has every setting, seed by seed."""
    data = tiny_fashion_mnist(tmp_path)
    out = tmp_path / "out"
    flags = "--epochs 4 --seeds 0 1 --train-samples 128 --val-samples 32 --eval-every 2 --batch-size 32"
    cmd = experiment_command("plateau_stacked.py", data, flags + " --device cpu --figure2 --parallel 2", out)
    first = subprocess.run([*cmd, "--time-budget", "10"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 3, first.stdout[-2000:] + first.stderr[-2000:]
    second = subprocess.run(
        [*cmd, "--plot", str(tmp_path / "curves.png")], capture_output=True, text=True, timeout=600
    )
    assert second.returncode == 0, second.stdout[-2000:] + second.stderr[-2000:]
    for setting in ("phase 1 only", "two-phase, gated pinning", "phase 2 only, random init, no warm-up"):
        assert f"| {setting} | " in second.stdout, second.stdout
    assert "| two-phase, hard pinning | 2 / 2 of 2 |" in second.stdout
    for arm, epochs in (("p1", 4), ("half-p1", 2), ("gated", 2), ("random-nowarm", 4)):
        for seed in (0, 1):
            rows = list(csv.DictReader((out / arm / f"seed{seed}" / "metrics.csv").read_text().splitlines()))
            assert [r["epoch"] for r in rows] == [str(e) for e in range(1, epochs + 1)], (arm, seed)
            assert [bool(r["top1"]) for r in rows] == [e % 2 == 0 for e in range(1, epochs + 1)]
    gated = json.loads((out / "gated" / "seed1" / "config.json").read_text())
    assert gated["init"] == str(out / "half-p1" / "seed1" / "conv.safetensors") and gated["seeds"] == [0, 1]
    assert (tmp_path / "curves-zoom.png").read_bytes()[:4] == b"\x89PNG"


def test_plateau_gain_compares_means_of_epochs_a_fifth_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    """init_comparison's plateau test, against hand-computed means: the last 5 epochs against the 5
    that end a fifth earlier; one epoch's jitter, which decided the single-epoch test, averages out."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "experiments"))
    from init_comparison import plateau_gain

    ramp = [70.0 + 0.1 * i for i in range(60)]  # 0.1 point an epoch; a fifth is 12 epochs
    assert plateau_gain(ramp, 12) == pytest.approx(1.2)  # means of epochs 56-60 and 44-48: 75.7, 74.5
    flat = [81.0, 80.0] * 27 + [81.0]  # 55 epochs of a plateau with one point of epoch-to-epoch jitter
    assert flat[-1] - flat[-1 - 11] == 1.0  # the single-epoch test would call it still climbing
    assert plateau_gain(flat, 11) == pytest.approx(0.2)  # 5-epoch means 80.6 and 80.4
    assert plateau_gain(flat, 11, window=4) == 0.0
    assert plateau_gain([60.0, 61.5], 1) == 1.5  # E = 2: one epoch against the one before


def test_tuned_comparison_tunes_every_arm_alike_then_trains_the_chosen_values(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """experiments/tuned_comparison.py's stages, on made-up finished runs: the two-phase grids wait
    for phase 1's choice, each arm's choice is its best held-out score (mean of the last 5 epochs,
    not the last one), tuning runs evaluate on held-out training images and the full runs on
    the validation split, at the chosen values."""
    import argparse

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "experiments"))
    import tuned_comparison as tc

    args = argparse.Namespace(
        depth=6,
        epochs=200,
        tune_epochs=50,
        seeds=[0, 1],
        train_samples=1000,
        holdout=2000,
        val_samples=2000,
        batch_size=64,
        out=tmp_path,
        data_dir=None,
        device="cpu",
        loader="auto",
        compile=False,
        record=tmp_path / "sweep.json",
    )

    def finish(arm, last5: float, last: float) -> None:
        arm.out.mkdir(parents=True, exist_ok=True)
        tops = [last5] * 4 + [last]
        rows = "\n".join(f"{e},1.0,{t}" for e, t in enumerate([0.0] * 45 + tops, start=1))
        (arm.out / "metrics.csv").write_text("epoch,val_loss,top1\n" + rows + "\n")
        arm.model.write_bytes(b"")

    first, _, _ = tc.stages(args)
    assert [a.name for a in first][:3] == ["tune/p1/lr0.00063", "tune/p1/lr0.002", "tune/p1/lr0.0063"]
    assert len(first) == 9 and all(a.config.data.holdout == 2000 and a.config.seed == 0 for a in first)
    # p1: 6.3e-3 ends highest on its last epoch, 2e-3 on the mean of its last 5
    for arm, (m, last) in zip(first[:3], ((70, 70), (80, 76), (75, 90)), strict=True):
        finish(arm, m, last)
    finish(first[3], 50, 50)
    tc.stages(args)  # what the runner does after every call, finished or stopped: records the scores
    # every score is recorded as it comes: on a new machine (no tune/ folder) the scored runs are not
    # run again, the phase-1 half the two-phase grids start from is (it is deterministic)
    shutil.copytree(tmp_path / "tune", tmp_path / "tune-copy")
    shutil.rmtree(tmp_path / "tune")
    elsewhere, _, _ = tc.stages(args)
    assert [a.name for a in elsewhere] == [a.name for a in first[4:]] + ["tune/half-p1"] + [
        f"tune/{p}/{tc.tag(lr, m)}" for p in ("gated", "hard") for lr in tc.AFTER for m in tc.MULT
    ]
    shutil.copytree(tmp_path / "tune-copy", tmp_path / "tune")
    second, _, _ = tc.stages(args)
    assert len(second) == 9 + 1 + 12 and not any(a.name.startswith("seed") for a in second)
    half = next(a for a in second if a.name == "tune/half-p1")
    assert half.config.recipe.lr == 2e-3 and half.config.recipe.epochs == 25
    for arm in second:
        kind = arm.name.split("/")[1]
        if not arm.model.is_file():
            lr, mult = arm.config.recipe.lr, arm.config.recipe.attn_lr_mult
            best = {
                "impulse": lr == 6.3e-3,
                "random": lr == 6.3e-4,
                "gated": (lr, mult) == (6.3e-5, 10.0),
                "hard": (lr, mult) == (6.3e-4, 1.0),
            }.get(kind, False)
            finish(arm, 85 if best else 60, 60)
    full, chosen, grid = tc.stages(args)
    assert len(full) == 2 * 9
    cfg = {a.name: a.config for a in full}
    assert all(c.data.holdout is None and c.data.val_samples == 2000 for c in cfg.values())
    assert cfg["seed1/p1"].recipe.lr == 2e-3 and cfg["seed1/p1"].recipe.epochs == 200
    assert cfg["seed0/impulse"].recipe.lr == 6.3e-3 and cfg["seed0/random"].recipe.lr == 6.3e-4
    gated, hard = cfg["seed0/gated"], cfg["seed0/hard"]
    assert (gated.recipe.lr, gated.recipe.attn_lr_mult, gated.conversion.pinning) == (6.3e-5, 10.0, "gated")
    assert (hard.recipe.lr, hard.recipe.attn_lr_mult, hard.conversion.pinning) == (6.3e-4, 1.0, "hard")
    assert gated.start.init == str(tmp_path / "seed0" / "half-p1" / "conv.safetensors")
    restart = cfg["seed0/p1-restart"]  # gated's half exactly, the conversion left out
    assert (restart.phase, restart.start.init, restart.recipe.lr) == (
        "phase1",
        gated.start.init,
        gated.recipe.lr,
    )
    assert (restart.recipe.epochs, restart.recipe.warmup_epochs) == (
        gated.recipe.epochs,
        gated.recipe.warmup_epochs,
    )
    long_p1, short = cfg["seed0/long-p1"].recipe.epochs, cfg["seed0/short-gated"].recipe.epochs
    ratio = tc.macs_per_image("phase2", args) / tc.macs_per_image("phase1", args)
    assert long_p1 > 100 and long_p1 + short * ratio <= 200 < long_p1 + 1 + short * ratio  # compute-matched
    # the sweep is recorded: without the tuning folders (a new machine), the same full runs
    assert chosen["p1"]["score"] == pytest.approx(79.2) and len(grid["gated"]) == 6  # (4 x 80 + 76) / 5
    shutil.rmtree(tmp_path / "tune")
    again, chosen_again, _ = tc.stages(args)
    assert [(a.name, a.config) for a in again] == [
        (a.name, a.config) for a in full
    ] and chosen_again == chosen


def test_tuned_comparison_records_each_score_as_its_run_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A machine lost in the middle of a stage loses no finished run's score: the runner writes the
    sweep's record after every run that ends, not only once the stage's call returns."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "experiments"))
    import arms_cli
    import tuned_comparison as tc

    record = tmp_path / "sweep.json"
    seen: list[dict] = []

    def first_run_then_machine_lost(arms, *, report, **_):
        arm = arms[0]
        arm.out.mkdir(parents=True, exist_ok=True)
        rows = "\n".join(f"{e},1.0,{70 + e}" for e in range(1, 51))
        (arm.out / "metrics.csv").write_text("epoch,val_loss,top1\n" + rows + "\n")
        arm.model.write_bytes(b"")
        arm.status = DONE
        report(arm)
        seen.append(json.loads(record.read_text()))  # before the stage's call returns
        raise SystemExit(143)

    monkeypatch.setattr(arms_cli, "run_arms", first_run_then_machine_lost)
    monkeypatch.setattr(sys, "argv", ["tuned_comparison.py", "--out", str(tmp_path), "--record", str(record)])
    with pytest.raises(SystemExit):
        tc.main()
    (scored,) = [r for runs in seen[0]["grid"].values() for r in runs if r["score"] is not None]
    assert scored["run"] == "tune/p1/lr0.00063" and scored["score"] == pytest.approx(118.0)  # 116..120


def test_tuned_comparison_beyond_adds_one_step_past_each_top_choice_and_reruns_one_chosen_point(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--beyond (the supplementary check): one tuning run a grid step past the top for every arm
    that chose its grid's top rate (none for an arm that peaked inside), each judged as the sweep
    judges (seed 0, held-out images, the tuning epochs); the two-phase ones after the phase-1 half
    at phase 1's chosen rate, with the chosen gated point run again to check the remade half."""
    import argparse

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "experiments"))
    import tuned_comparison as tc

    assert (tc.step_beyond(tc.SCRATCH), tc.step_beyond(tc.AFTER)) == (2e-2, 2e-3)
    args = argparse.Namespace(
        depth=6,
        tune_epochs=50,
        train_samples=1000,
        holdout=2000,
        batch_size=64,
        out=tmp_path,
        data_dir=None,
        device="cpu",
        loader="auto",
    )
    chosen = {
        "p1": {"lr": 6.3e-3, "attn_lr_mult": None},
        "impulse": {"lr": 2e-3, "attn_lr_mult": None},
        "random": {"lr": 6.3e-3, "attn_lr_mult": None},
        "gated": {"lr": 6.3e-4, "attn_lr_mult": 10.0},
        "hard": {"lr": 6.3e-4, "attn_lr_mult": 1.0},
    }
    arms = {a.name: a for a in tc.beyond_arms(args, chosen)}
    assert list(arms) == [
        *"tune/beyond/p1/lr0.02 tune/beyond/random/lr0.02 tune/half-p1 "
        "tune/gated/lr0.00063-mult10 tune/beyond/gated/lr0.002-mult10 "
        "tune/beyond/hard/lr0.002-mult1".split(),
    ]
    for arm in arms.values():
        c = arm.config
        assert (c.seed, c.data.holdout, c.data.val_samples) == (0, 2000, None)
    p1, random = arms["tune/beyond/p1/lr0.02"].config, arms["tune/beyond/random/lr0.02"].config
    assert (p1.phase, p1.recipe.lr, p1.recipe.epochs) == ("phase1", 2e-2, 50)
    assert (random.phase, random.start.init, random.recipe.lr) == ("phase2", "random", 2e-2)
    half = arms["tune/half-p1"].config
    assert (half.recipe.lr, half.recipe.epochs) == (6.3e-3, 25)
    for name, pinning, lr, mult in (
        ("tune/gated/lr0.00063-mult10", "gated", 6.3e-4, 10.0),
        ("tune/beyond/gated/lr0.002-mult10", "gated", 2e-3, 10.0),
        ("tune/beyond/hard/lr0.002-mult1", "hard", 2e-3, 1.0),
    ):
        c = arms[name].config
        assert arms[name].after == ("tune/half-p1",) and c.recipe.epochs == 25
        assert (c.conversion.pinning, c.recipe.lr, c.recipe.attn_lr_mult) == (pinning, lr, mult)
        assert c.start.init == str(tmp_path / "tune" / "half-p1" / "conv.safetensors")
    inside = {
        **chosen,
        "p1": {"lr": 2e-3},
        "random": {"lr": 2e-3},
        "gated": {"lr": 2e-4, "attn_lr_mult": 1.0},
        "hard": {"lr": 6.3e-5, "attn_lr_mult": 1.0},
    }
    assert tc.beyond_arms(args, inside) == []


def test_tuned_comparison_sweep_only_stops_before_the_full_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    """--sweep-only on a complete sweep (the committed depth-6 record) prints the sweep's table,
    the choices in bold, and starts no run."""
    experiments = Path(__file__).resolve().parent.parent / "experiments"
    monkeypatch.syspath_prepend(str(experiments))
    import arms_cli
    import tuned_comparison as tc

    record = tmp_path / "sweep.json"
    shutil.copy(experiments / "results" / "tuned_comparison_d6_sweep.json", record)
    started: list[str] = []
    monkeypatch.setattr(arms_cli, "run_arms", lambda arms, **_: started.extend(a.name for a in arms))
    monkeypatch.setattr(
        sys,
        "argv",
        ["tuned_comparison.py", "--sweep-only", "--out", str(tmp_path / "out"), "--record", str(record)],
    )
    tc.main()
    out = capsys.readouterr().out
    assert started == [] and not (tmp_path / "out").exists()
    chosen = json.loads(record.read_text())["chosen"]
    assert f"| p1 | **{tc.value_text(chosen['p1'])}** | **{chosen['p1']['score']:.2f}** |" in out
    assert out.count("**") == 2 * 2 * 5  # the five choices, value and score each
