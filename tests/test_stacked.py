"""`--seeds`: several seeds of one run trained as one stacked model (train/stacked.py), against the
separate `--seed N` runs it stands for.

The reference is the separate runs themselves (train/run.py's own step, one model, no vmap): each
seed's losses, weights, optimizer moments and saved RNG states must be theirs. In float64 the only
difference is the batched kernels' rounding, so 1e-10 is a wide bound (measured: 4e-15 on the
weights after 16 steps); a lost or misordered draw (a drop-path mask, a Mixup lambda, a batch)
moves the weights by 1e-3 or more at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import TINY_FLAGS, invoke, one_error_line
from convit_convert.errors import CheckFailed, CmhsaError
from convit_convert.options.training import TrainConfig
from convit_convert.train import held
from convit_convert.train.profiling import STEP, OpCounter, eager_step, steps_recorded
from convit_convert.train.progress import Progress
from convit_convert.train.run import run
from convit_convert.train.stacked import run_seeds, seed_configs

QUIET = Progress(None)
# the experiments' recipe (--preset cpu) with Mixup and CutMix on and drop path in the second block:
# every draw a step makes from the global RNGs
TINY = dict(
    preset="cpu",
    data="synthetic",
    img_size=16,
    patch_size=4,
    depth=2,
    kernel_size=3,
    batch_size=32,
    workers=0,
    epochs=2,
    warmup_epochs=0,
    device="cpu",
    drop_path=0.1,
    mixup=0.8,
    cutmix=1.0,
    threads=1,
    amp="none",
    train_samples=256,
    val_samples=64,
    seeds_step="batched",  # the GPU's form, held here on the CPU; Interleaved's tests name theirs
)


@pytest.fixture
def float64(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Models built in float64, and the device loader's images handed over in it."""
    prepare, batches = held.HeldLoader.prepare, held.HeldEvalLoader.__iter__
    monkeypatch.setattr(held.HeldLoader, "prepare", lambda self, b: prepare(self, b).double())
    monkeypatch.setattr(
        held.HeldEvalLoader, "__iter__", lambda self: ((x.double(), y) for x, y in batches(self))
    )
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def config(out: Path, **flags: Any) -> TrainConfig:
    return TrainConfig.from_flags(out=str(out), **{**TINY, **flags})


def saved(folder: Path) -> dict[str, Any]:
    return torch.load(folder / "checkpoint-last.pt", weights_only=False)


def largest_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def moments(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter tensors (AdamW's moments), by parameter index and name."""
    return {f"{i}.{k}": v for i, s in state["optimizer"]["state"].items() for k, v in s.items()}


# what each seed gets is its own run's --------------------------------------------------------------


@pytest.mark.parametrize(
    "flags",
    [
        dict(phase="phase1"),
        dict(phase="phase1", conv_form="tokens"),
        dict(phase="phase2", init="impulse", clip_grad=0.05),
        dict(
            phase="phase2",
            init="impulse",
            data="digits",
            in_chans=1,
            model_ema=True,
            epochs=1,
            train_samples=64,
        ),
    ],
    ids=["phase1-pixels", "phase1-tokens", "phase2-impulse-clipped", "phase2-shared-validation-ema"],
)
def test_each_seed_is_its_separate_run_in_float64(
    tmp_path: Path, float64: None, flags: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Weights, moments and every metric. Synthetic data draws each seed's validation images from
    its seed, so each seed evaluates alone; digits' are the same for every seed, so the stack
    evaluates all seeds (and their EMAs) in one batched forward (on the CPU too, here)."""
    from convit_convert.train import stacked

    monkeypatch.setattr(stacked, "BATCHED_EVALUATION", {"cpu"})
    for s in (0, 1):
        run(config(tmp_path / f"alone{s}", seed=s, **flags), progress=QUIET)
    run_seeds(config(tmp_path / "stack", seeds=(0, 1), **flags), progress=QUIET)
    keys = ["train_loss", "val_loss", "top1", "top5"]
    keys += ["ema_val_loss", "ema_top1", "ema_top5"] if flags.get("model_ema") else []
    for s in (0, 1):
        a, b = saved(tmp_path / f"alone{s}"), saved(tmp_path / "stack" / f"seed{s}")
        assert a["model"]["head.weight"].dtype == torch.float64
        assert largest_difference(a["model"], b["model"]) < 1e-10
        assert largest_difference(moments(a), moments(b)) < 1e-10
        for ra, rb in zip(a["metrics"], b["metrics"], strict=True):
            for key in keys:
                assert abs(ra[key] - rb[key]) < 1e-10, (s, key)
        assert (a["epoch"], a["step"], a["global_step"]) == (b["epoch"], b["step"], b["global_step"])
        # the seeds' streams are not each other's: the two seeds' weights differ
    other = saved(tmp_path / "stack" / "seed1")["model"]["head.weight"]
    assert not torch.allclose(saved(tmp_path / "stack" / "seed0")["model"]["head.weight"], other)


@pytest.mark.slow
def test_compiled_each_seed_is_its_compiled_separate_run_in_float64(tmp_path: Path, float64: None) -> None:
    """Under --compile too (on the CPU: inductor's C++ kernels; the same code on CUDA adds CUDA
    graphs): the separate run's compiled step is given the drop-path masks drawn outside its graph
    from the global RNG, as the stack's are, so every draw is shared. 1e-10: both graphs fuse and
    reorder float64 sums differently from eager and from each other (measured: 8e-16 on the
    weights; with the masks drawn inside the separate run's graph, as before, 1e-2)."""
    flags = dict(phase="phase2", init="impulse", clip_grad=0.05, compile=True, epochs=1)
    for s in (0, 1):
        run(config(tmp_path / f"alone{s}", seed=s, **flags), progress=QUIET)
    run_seeds(config(tmp_path / "stack", seeds=(0, 1), **flags), progress=QUIET)
    for s in (0, 1):
        a, b = saved(tmp_path / f"alone{s}"), saved(tmp_path / "stack" / f"seed{s}")
        assert largest_difference(a["model"], b["model"]) < 1e-10
        assert abs(a["metrics"][0]["train_loss"] - b["metrics"][0]["train_loss"]) < 1e-10


# interleaved (the CPU's form): each seed's own step in turn ---------------------------------------


def rows_without_timings(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("epoch_seconds", "images_per_s")} for r in rows]


@pytest.mark.parametrize(
    "flags",
    [
        dict(phase="phase1"),
        dict(phase="phase2", init="impulse", clip_grad=0.05, model_ema=True, model_ema_decay=0.9),
        dict(phase="phase1", opt="lamb"),  # refused batched: interleaved, each seed keeps its optimizer
    ],
    ids=["phase1", "phase2-clipped-ema", "phase1-lamb"],
)
def test_interleaved_seeds_are_their_separate_runs_bit_for_bit(tmp_path: Path, flags: dict) -> None:
    """Interleaved runs each seed's own step, so no rounding separates it from its run: weights,
    EMA, moments, metrics and saved RNG states are equal, not close (Mixup, CutMix and drop path
    on: a draw from another seed's stream would move them)."""
    flags = {**flags, "seeds_step": "interleaved"}
    alone = [run(config(tmp_path / f"alone{s}", seed=s, **flags), progress=QUIET) for s in (0, 1)]
    together = run_seeds(config(tmp_path / "stack", seeds=(0, 1), **flags), progress=QUIET)
    for s in (0, 1):
        a, b = saved(tmp_path / f"alone{s}"), saved(tmp_path / "stack" / f"seed{s}")
        for part in ("model", *(("ema",) if flags.get("model_ema") else ())):
            assert all(torch.equal(a[part][k], b[part][k]) for k in a[part]), (s, part)
        ma, mb = moments(a), moments(b)
        assert ma.keys() == mb.keys() and all(torch.equal(ma[k], mb[k]) for k in ma)
        assert rows_without_timings(alone[s].rows) == rows_without_timings(together[s].rows)
        assert torch.equal(a["rng"]["torch"], b["rng"]["torch"]) and a["rng"]["python"] == b["rng"]["python"]


@pytest.mark.parametrize(
    ("form", "device", "seeds", "steps"),
    [
        ("auto", "cpu", 3, "interleaved"),
        ("auto", "cuda", 3, "batched"),
        ("auto", "cuda", 1, "interleaved"),  # one seed: its plain run
        ("batched", "cpu", 1, "batched"),
        ("interleaved", "cuda", 3, "interleaved"),
    ],
)
def test_auto_batches_seeds_on_a_gpu_and_interleaves_them_on_the_cpu_or_alone(
    form: str, device: str, seeds: int, steps: str
) -> None:
    from convit_convert.train.stacked import seeds_step

    assert seeds_step(form, torch.device(device), seeds) == steps


def test_a_seeds_run_says_how_it_steps_its_seeds(tmp_path: Path) -> None:
    said: list[str] = []
    run_seeds(
        config(tmp_path / "s", seeds=(0, 1), epochs=1, seeds_step="auto"), progress=Progress(said.append)
    )
    assert any(
        "2 seeds in one process (0, 1; each seed's own step in turn, `seeds_step`)" in line for line in said
    )


@pytest.mark.slow
def test_compiled_interleaved_seeds_run_one_graph_and_are_their_compiled_runs(tmp_path: Path) -> None:
    """Under --compile every seed's step runs the graph compiled for the first: dynamo compiles
    as many frames for 3 seeds as for one run (a recompile per seed would be each seed's own
    compile, what interleaving exists to share), and each seed is its compiled run, bit for bit."""
    from torch._dynamo.utils import counters

    flags = dict(phase="phase1", compile=True, epochs=1, seeds_step="interleaved")
    torch._dynamo.reset()
    counters.clear()
    run(config(tmp_path / "alone2", seed=2, **flags), progress=QUIET)
    one = sum(counters["frames"].values())
    torch._dynamo.reset()
    counters.clear()
    run_seeds(config(tmp_path / "stack", seeds=(0, 1, 2), **flags), progress=QUIET)
    assert one > 0 and sum(counters["frames"].values()) == one, (one, dict(counters["frames"]))
    a, b = saved(tmp_path / "alone2"), saved(tmp_path / "stack" / "seed2")
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


def test_a_seeds_folder_reads_as_its_separate_runs_but_for_the_seeds_note(tmp_path: Path) -> None:
    run(config(tmp_path / "alone1", seed=1, epochs=1), progress=QUIET)
    run_seeds(config(tmp_path / "stack", seeds=(0, 1), epochs=1), progress=QUIET)
    alone, stacked = tmp_path / "alone1", tmp_path / "stack" / "seed1"
    assert sorted(p.name for p in alone.iterdir()) == sorted(p.name for p in stacked.iterdir())
    # its files hold its own weights alone: a slice of the stack saved whole would be twice the size
    assert (alone / "conv.safetensors").stat().st_size == (stacked / "conv.safetensors").stat().st_size
    sizes = [(f / "checkpoint-last.pt").stat().st_size for f in (alone, stacked)]
    assert abs(sizes[0] - sizes[1]) < 0.02 * sizes[0], sizes
    a, b = (json.loads((f / "config.json").read_text()) for f in (alone, stacked))
    differ = {k for k in a if a[k] != b[k]}  # where each ran may differ in the thread's CPU path
    assert {"out", "seeds"} <= differ <= {"out", "seeds", "environments"}
    assert b["seeds"] == [0, 1] and a["seeds"] == []
    assert a["seed"] == b["seed"] == 1
    # its checkpoint: the same RNG states as the separate run saved, every one of them
    ra, rb = saved(alone)["rng"], saved(stacked)["rng"]
    assert ra["python"] == rb["python"] and torch.equal(ra["torch"], rb["torch"])
    assert all(
        torch.equal(x, y) if torch.is_tensor(x) else x == y
        for x, y in zip(ra["numpy"], rb["numpy"], strict=True)
    )


@pytest.mark.parametrize("form", ["batched", "interleaved"])
def test_a_stacked_resume_is_bit_for_bit(tmp_path: Path, form: str) -> None:
    """Stopped mid-epoch 2 (8 steps/epoch) and resumed: every seed's rows and weights, exactly."""
    flags = dict(seeds=(0, 1, 2), epochs=3, model_ema=True, model_ema_decay=0.9, seeds_step=form)
    straight = run_seeds(config(tmp_path / "a", **flags), progress=QUIET)
    first = run_seeds(config(tmp_path / "b", **flags), progress=QUIET, stop_after_steps=12)
    assert [r.stopped for r in first] == ["limit"] * 3 and all(len(r.rows) == 1 for r in first)
    assert saved(tmp_path / "b" / "seed2")["step"] == 4
    resumed = run_seeds(config(tmp_path / "b", resume=True, **flags), progress=QUIET)

    def strip(rows: list[dict]) -> list[dict]:  # all but the timings
        return [{k: v for k, v in r.items() if k not in ("epoch_seconds", "images_per_s")} for r in rows]

    for s, (x, y) in enumerate(zip(straight, resumed, strict=True)):
        assert strip(x.rows) == strip(y.rows)
        a, b = saved(tmp_path / "a" / f"seed{s}"), saved(tmp_path / "b" / f"seed{s}")
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])


def test_a_stack_stopped_batched_resumes_interleaved(tmp_path: Path) -> None:
    """`seeds_step` is a runtime choice: each seed's checkpoint is its own run's, whichever form
    wrote it, so a resume may take the other form and finishes every seed's epochs."""
    run_seeds(config(tmp_path / "s", seeds=(0, 1), epochs=2), progress=QUIET, stop_after_steps=4)
    assert saved(tmp_path / "s" / "seed1")["step"] == 4
    flags = dict(seeds=(0, 1), epochs=2, resume=True, seeds_step="interleaved")
    done = run_seeds(config(tmp_path / "s", **flags), progress=QUIET)
    assert [len(r.rows) for r in done] == [2, 2] and not any(r.stopped for r in done)
    assert [saved(tmp_path / "s" / f"seed{s}")["global_step"] for s in (0, 1)] == [16, 16]


def test_seed_n_of_a_template_init_starts_from_seed_ns_checkpoint(tmp_path: Path) -> None:
    run_seeds(config(tmp_path / "p1", seeds=(3, 4), epochs=1), progress=QUIET)
    init = str(tmp_path / "p1" / "seed{seed}" / "conv.safetensors")
    configs = seed_configs(config(tmp_path / "p2", phase="phase2", init=init, seeds=(3, 4), epochs=1))
    assert [c.start.init for c in configs] == [
        str(tmp_path / "p1" / f"seed{s}" / "conv.safetensors") for s in (3, 4)
    ]
    run_seeds(config(tmp_path / "p2", phase="phase2", init=init, seeds=(3, 4), epochs=1), progress=QUIET)
    for s in (3, 4):
        doc = json.loads((tmp_path / "p2" / f"seed{s}" / "config.json").read_text())
        assert doc["init"] == str(tmp_path / "p1" / f"seed{s}" / "conv.safetensors")


# what cannot be stacked is refused, in one line ----------------------------------------------------


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--seeds", "0,0"], "--seeds names a seed twice: 0 0"),
        (["--seeds", "0,x"], "--seeds must be integers separated by commas"),
        (["--seeds", "0,-1"], "--seeds must be integers separated by commas"),
        (["--seed", "1", "--seeds", "0,1"], "give --seed (one run) or --seeds (several, stacked), not both"),
        (["--seeds", "0,1", "--loader", "workers"], "use --loader device"),
        (
            ["--seeds", "0,1", "--seeds-step", "batched", "--opt", "lamb"],
            "--opt lamb: one optimizer steps the stacked weights",
        ),
        (
            ["--seeds", "0,1", "--seeds-step", "fused"],
            "--seeds-step must be one of auto, batched, interleaved",
        ),
    ],
)
def test_what_cannot_be_stacked_is_refused(tmp_path: Path, flags: list[str], words: str) -> None:
    r = invoke("train", "phase1", *TINY_FLAGS, *flags, "-o", tmp_path / "run")
    one_error_line(r, 2, words)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*.pt"))


@pytest.mark.parametrize(
    ("seeds", "words"),
    [
        ((0, 2**32), "`seeds` must be 0 ≤ x ≤ 4294967295, got 4294967296"),
        ((0, 1.5), "`seeds` must be integers"),
    ],
)
def test_the_library_holds_seeds_to_the_seed_range(tmp_path: Path, seeds: tuple, words: str) -> None:
    with pytest.raises(CmhsaError, match=words):
        config(tmp_path, seeds=seeds)


def test_seeds_at_different_points_are_refused_naming_both(tmp_path: Path) -> None:
    run_seeds(config(tmp_path / "s", seeds=(0, 1), epochs=2), progress=QUIET, stop_after_steps=4)
    run(config(tmp_path / "s" / "seed1", seed=1, epochs=2, resume=True), progress=QUIET, stop_after_steps=6)
    with pytest.raises(CmhsaError, match=r"seed1 is at epoch 1, step 6 and .*seed0 at epoch 1, step 4"):
        run_seeds(config(tmp_path / "s", seeds=(0, 1), epochs=2, resume=True), progress=QUIET)


# --eval-every -----------------------------------------------------------------------------------


def test_eval_every_leaves_the_epochs_between_unevaluated(tmp_path: Path) -> None:
    r = run(config(tmp_path / "run", phase="phase2", init="impulse", epochs=3, eval_every=2), progress=QUIET)
    assert ["top1" in row for row in r.rows] == [False, True, True]  # the 2nd, and the last
    lines = (tmp_path / "run" / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    first = dict(zip(header, lines[1].split(","), strict=True))
    assert first["top1"] == first["val_loss"] == "" and first["train_loss"] != ""
    assert any(h.startswith("attn") for h in header)  # the attention columns, from the evaluated rows
    assert invoke("plot", tmp_path / "run", "-o", tmp_path / "curves.png").exit_code == 0


def test_a_non_finite_loss_in_a_seed_stops_every_seed_naming_its_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Seed 1's images turn to nan in epoch 2: the run stops there, naming seed 1's folder, and
    every seed keeps its first epoch's checkpoint (nothing of epoch 2 reaches a file)."""
    from convit_convert.train import stacked

    augmented = stacked.Stack.augmented  # every seed's images, (S, B, C, H, W)

    def poisoned(self: stacked.Stack, inputs: Any) -> torch.Tensor:
        images = augmented(self, inputs)
        bad = torch.tensor([1.0, float("nan") if self.loops[1].state.epoch == 1 else 1.0])
        return images * bad.view(2, 1, 1, 1, 1)

    monkeypatch.setattr(stacked.Stack, "augmented", poisoned)
    with pytest.raises(CheckFailed, match=r"non-finite loss \(nan\) at epoch 2, step 1: .*seed1"):
        run_seeds(config(tmp_path / "s", seeds=(0, 1), epochs=2, log_every=1), progress=QUIET)
    assert [saved(tmp_path / "s" / f"seed{s}")["epoch"] for s in (0, 1)] == [1, 1]


def test_seeds_of_different_architectures_are_refused_naming_both(tmp_path: Path) -> None:
    """`{seed}` in --init naming phase-1 models of two depths: phase 2 cannot stack them."""
    run(config(tmp_path / "p1" / "seed0", seed=0, epochs=1), progress=QUIET)
    run(config(tmp_path / "p1" / "seed1", seed=1, epochs=1, depth=1), progress=QUIET)
    init = str(tmp_path / "p1" / "seed{seed}" / "conv.safetensors")
    flags = {k: v for k, v in TINY.items() if k not in ("img_size", "patch_size", "depth", "kernel_size")}
    cfg = TrainConfig.from_flags(
        out=str(tmp_path / "p2"), phase="phase2", init=init, seeds=(0, 1), given=frozenset(flags), **flags
    )
    with pytest.raises(CmhsaError, match=r"seed1 holds another architecture than .*seed0"):
        run_seeds(cfg, progress=QUIET)
    assert not (tmp_path / "p2").exists()  # nothing written, no folder left


def test_a_stacked_run_reads_as_one_result(tmp_path: Path) -> None:
    """A finished stack ends with one line and seeds.json: each seed's final and best top-1 (as its
    own metrics.csv has them) and their mean ± half-range; `cmhsa plot` on its folder draws every
    seed and their mean."""
    import csv

    said: list[str] = []
    run_seeds(config(tmp_path / "s", seeds=(0, 1), epochs=2), progress=Progress(said.append))
    summary = json.loads((tmp_path / "s" / "seeds.json").read_text())
    for seed, row in zip((0, 1), summary["seeds"], strict=True):
        with open(tmp_path / "s" / f"seed{seed}" / "metrics.csv", newline="") as f:
            top1 = [float(r["top1"]) for r in csv.DictReader(f)]
        assert row["folder"] == f"seed{seed}" and row["final_top1"] == pytest.approx(top1[-1], abs=1e-4)
        assert row["best_top1"] == pytest.approx(max(top1), abs=1e-4)
    finals = [row["final_top1"] for row in summary["seeds"]]
    assert summary["final_top1"]["mean"] == pytest.approx(sum(finals) / 2)
    assert summary["final_top1"]["half_range"] == pytest.approx(abs(finals[0] - finals[1]) / 2)
    assert next(line for line in said if line.startswith("2 seeds: top-1 ")).endswith("seeds.json")
    assert invoke("plot", tmp_path / "s", "-o", tmp_path / "c.png").exit_code == 0
    from convit_convert.train.plot import curves_figure, pyplot

    fig, _ = curves_figure([tmp_path / "s"])
    top1 = fig.axes[1]
    mean = next(line for line in top1.lines if "mean of 2 seeds" in line.get_label())
    seeds = [line.get_ydata() for line in top1.lines if line.get_label().startswith("_")]
    averaged = [(a + b) / 2 for a, b in zip(*seeds, strict=True)]
    assert len(seeds) == 2 and list(mean.get_ydata()) == pytest.approx(averaged)
    pyplot().close(fig)
    # a stack that restarts each seed from the first stack's seed is drawn after it
    init = str(tmp_path / "s" / "seed{seed}" / "conv.safetensors")
    run_seeds(config(tmp_path / "r", seeds=(0, 1), epochs=1, init=init), progress=QUIET)
    fig, _ = curves_figure([tmp_path / "s", tmp_path / "r"])
    after = next(line for line in fig.axes[1].lines if line.get_label().startswith("r: mean of 2 seeds"))
    assert list(after.get_xdata()) == [3] and "(after s)" in after.get_label()
    pyplot().close(fig)


@pytest.mark.parametrize("planted", ["link", "file"])
def test_a_seed_folder_name_taken_by_a_link_or_file_is_refused_untouched(
    tmp_path: Path, planted: str
) -> None:
    """`out/seed0` is cmhsa's name in the user's folder: a link there (to a folder someone else
    chose) or a file is refused before anything is written, and left as it was."""
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    if planted == "link":
        (out / "seed0").symlink_to(elsewhere)
    else:
        (out / "seed0").write_text("not a folder")
    r = invoke("train", "phase1", *TINY_FLAGS, "--seeds", "0,1", "-o", out)
    one_error_line(r, 2, "seed0", "symbolic link" if planted == "link" else "names an existing file")
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in out.iterdir()) == ["seed0"]
    assert (
        (out / "seed0").is_symlink() if planted == "link" else (out / "seed0").read_text() == "not a folder"
    )


def test_a_seeds_value_no_seed_can_be_is_one_line_before_it_is_read_as_a_number() -> None:
    """A 5,000-digit value is one line, never a ValueError (an internal error)."""
    huge = "9" * 5000
    one_error_line(
        invoke("train", "phase1", *TINY_FLAGS, "--seeds", f"0,{huge}", "-o", "x"), 2, "--seeds must"
    )


def test_a_run_and_a_stack_train_through_the_one_epoch_loop() -> None:
    """One epoch loop (loop.train_one_epoch) and one loop over epochs (run.train_epochs) serve a
    run and a stack: nothing else in the training package walks an epoch's batches or its epochs,
    and both steppers (a run's Loop, the Stack) have the interface the loop drives."""
    import ast
    import inspect

    import convit_convert.train as package
    from convit_convert.train import loop, stacked

    walkers = set()
    for path in sorted(Path(package.__file__).parent.glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for fn in ast.walk(tree):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                calls = {
                    n.func.id
                    for n in ast.walk(node)
                    if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                }
                if isinstance(node, ast.For) and "until_stopped" in calls:
                    walkers.add(f"{path.stem}.{fn.name}")  # a loop over an epoch's batches
                if isinstance(node, ast.While) and "train_one_epoch" in calls:
                    walkers.add(f"{path.stem}.{fn.name}")  # a loop over epochs
    assert walkers == {"loop.train_one_epoch", "run.train_epochs"}, walkers
    wanted = {n for n, _ in inspect.getmembers(loop.Stepper) if not n.startswith("_")}
    assert wanted == {"loops", "stream", "batches", "step", "settle", "validation"}
    for stepper in (loop.Loop, stacked.Stack):
        assert all(hasattr(stepper, n) or n == "loops" for n in wanted), stepper


# one batched step: its work does not grow with the seeds -------------------------------------------


def ops_per_step(tmp_path: Path, seeds: int, **flags: Any) -> float:
    """Aten ops dispatched per training step of a stack of ``seeds`` (bench/ops_per_step.py's
    counter): the slope between 1-epoch runs of 2 and 6 steps, so set-up and evaluation cancel."""
    counts = []
    for steps in (2, 6):
        cfg = config(tmp_path / f"s{seeds}-{steps}", seeds=tuple(range(seeds)), epochs=1, **flags)
        cfg = cfg.replace(train_samples=steps * cfg.recipe.batch_size)
        with OpCounter() as counter:
            run_seeds(cfg, progress=QUIET)
        counts.append(sum(counter.ops.values()))
    return (counts[1] - counts[0]) / 4


@pytest.mark.parametrize(
    "flags",
    [dict(phase="phase1"), dict(phase="phase2", init="impulse", clip_grad=0.05, mixup=0.0, cutmix=0.0)],
    ids=["phase1-mixup", "phase2-clipped"],
)
def test_a_steps_ops_barely_grow_with_the_seeds(tmp_path: Path, flags: dict) -> None:
    """What predicts a GPU's speed-up: the kernels a step launches. Six seeds dispatch at most 1.2
    times one seed's aten ops per step (augmentation, forward, loss, gradients, clipping, tally
    and optimizer once for all; what each seed still draws alone: its drop-path masks and Mixup's
    mixing). Before the augmentation and the tally were batched: 2.1 times (phase 1)."""
    one, six = ops_per_step(tmp_path, 1, **flags), ops_per_step(tmp_path, 6, **flags)
    assert six <= 1.2 * one, (one, six)


def test_a_stacks_evaluation_is_one_batched_forward_of_every_seed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the seeds validate on the same images (digits) and the device gains by it (CUDA; the
    CPU here), the stack evaluates them (and their EMAs) together: six seeds' evaluation
    dispatches at most 1.2 times two seeds' aten ops, where evaluations one after another would
    dispatch three times (each seed's scores against its own run's:
    test_each_seed_is_its_separate_run_in_float64). A stack of one evaluates as its run does."""
    from convit_convert.train import stacked

    monkeypatch.setattr(stacked, "BATCHED_EVALUATION", {"cpu"})
    counted: dict[int, float] = {}
    validation = stacked.Stack.validation

    def measured(self: Any, checked: Any) -> list:
        with OpCounter() as counter:
            scores = validation(self, checked)
        counted[len(self.loops)] = sum(counter.ops.values())
        assert all((s is not None and s.ema is not None) == (len(scores) > 1) for s in scores)
        return scores

    monkeypatch.setattr(stacked.Stack, "validation", measured)
    for seeds in (1, 2, 6):
        flags = dict(data="digits", in_chans=1, model_ema=True, epochs=1, train_samples=64)
        run_seeds(config(tmp_path / f"s{seeds}", seeds=tuple(range(seeds)), **flags), progress=QUIET)
    assert counted[1] == 0 and counted[6] <= 1.2 * counted[2], counted


def test_no_op_of_a_stacked_step_falls_back_to_a_loop_over_the_seeds(tmp_path: Path) -> None:
    """torch's vmap runs an op without a batching rule as a loop over the seeds, and warns once per
    op: no such warning in either phase, with Mixup, CutMix, drop path and clipping."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_seeds(config(tmp_path / "p1", seeds=(0, 1), epochs=1), progress=QUIET)
        p2 = config(tmp_path / "p2", seeds=(0, 1), epochs=1, phase="phase2", init="impulse", clip_grad=0.05)
        run_seeds(p2, progress=QUIET)
    fallbacks = [str(w.message) for w in caught if "batching rule" in str(w.message)]
    assert not fallbacks, fallbacks


def test_a_stacks_mixing_is_timms_mixup_of_each_seed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train/mixing.py replays timm's Mixup/CutMix draws and mixes every seed at once; timm's own
    call, seed by seed (what a stack does with a timm whose draw method is gone), is the reference:
    the same weights bit for bit after an epoch of Mixup and CutMix."""
    from safetensors.torch import load_file

    from convit_convert.train import mixing

    run_seeds(config(tmp_path / "batched", seeds=(0, 1), epochs=1), progress=QUIET)
    monkeypatch.setattr(mixing, "drawable", lambda mixup: False)
    run_seeds(config(tmp_path / "timm", seeds=(0, 1), epochs=1), progress=QUIET)
    for seed in (0, 1):
        a, b = (
            load_file(str(tmp_path / f / f"seed{seed}" / "conv.safetensors")) for f in ("batched", "timm")
        )
        assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]


# what a compiled stacked step is on a GPU ---------------------------------------------------------


@pytest.mark.parametrize("aa", ["none", "rand-m9-mstd0.5-inc1"])
def test_without_randaugment_a_batchs_parameters_are_all_on_the_images_device(aa: str) -> None:
    """A stack concatenates every field of its seeds' augmentation parameters inside its compiled
    step; one CPU tensor in that graph makes inductor skip CUDA graphs for the whole step (the step
    then pays a launch per kernel: on an H100, 4.0 ms a step at 1 and 3 seeds alike). Without
    RandAugment every field is on the images' device (the meta device here stands for a GPU); with
    it, RandAugment's choices stay on the CPU, where its per-op selection reads them."""
    from convit_convert.loaders import EpochSampler, channel_stats
    from convit_convert.train.augment import PARAM_FIELDS, augment_spec

    mean, std = channel_stats(1)
    spec = augment_spec(TrainConfig.from_flags(preset="cpu", aa=aa).recipe, (16, 16), mean, std)
    sampler = EpochSampler(32, rank=0, world=1, batch_size=8, seed=1, shuffle=True)
    sampler.set_epoch(0)
    images = torch.empty((32, 1, 16, 16), dtype=torch.uint8, device="meta")
    loader = held.HeldLoader(images, torch.zeros(32, dtype=torch.long), sampler, spec, seed=1)
    params = loader.chunk(0, 4)[0]
    on_cpu = {name for name in PARAM_FIELDS if getattr(params, name).device.type == "cpu"}
    assert on_cpu == (set() if aa == "none" else {"ra_op", "ra_apply", "ra_arg"})


@pytest.mark.slow  # compiles a step (dynamo's explain) for each phase
@pytest.mark.parametrize(
    "flags",
    [dict(phase="phase1", conv_form="tokens"), dict(phase="phase2", init="impulse")],
    ids=["p1", "p2"],
)
def test_a_compiled_step_is_one_graph_with_static_weights_for_a_run_and_a_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, flags: dict
) -> None:
    """What CUDA graphs need of a compiled step, for a run and a stack alike:

    - one graph. Without Mixup the augmentation runs inside the compiled step, a stack's for all
      seeds at once: dynamo traces the whole step without a graph break (a break splits the step
      into graphs with the Python between them run eagerly on every step; dataclasses.fields in
      Params.cat was one);
    - its weights static inputs (dynamo's static-address mark): a replay reads them in place,
      where it copies every other input into the graph's memory first. A plain run's module
      parameters are; a stack's weights go in as arguments and were plain tensors, copied on
      every replay.

    Traced by dynamo with the eager backend: the graph breaks and the marks are dynamo's, whatever
    the backend, and tracing alone takes seconds where inductor takes a minute."""
    from torch._dynamo.utils import counters, get_static_address_type

    from convit_convert.train import stacked, step

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    weights: dict[str, list[torch.Tensor]] = {}
    for name, cls, field in [("run", step.CompiledStep, "params"), ("stack", stacked.Stack, "weights")]:

        def kept(
            self: Any, *args: Any, _init: Any = cls.__init__, _n: str = name, _f: str = field, **kw: Any
        ):
            _init(self, *args, **kw)
            weights.setdefault(_n, getattr(self, _f))  # the run's (each seed of the stack builds one too)

        monkeypatch.setattr(cls, "__init__", kept)
    torch._dynamo.reset()
    counters.clear()
    unmixed = dict(mixup=0.0, cutmix=0.0, compile=True, epochs=1, **flags)
    run(config(tmp_path / "alone", **unmixed), progress=QUIET)
    run_seeds(config(tmp_path / "stack", seeds=(0, 1), **unmixed), progress=QUIET)
    torch._dynamo.reset()
    assert not counters["graph_break"], dict(counters["graph_break"])
    for name in ("run", "stack"):
        moving = [tuple(w.shape) for w in weights[name] if get_static_address_type(w) is None]
        assert weights[name] and not moving, (name, moving)


@pytest.mark.slow
def test_a_stacked_steps_gradients_leave_its_graph_in_their_weights_layout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vmap's backward returns some stacked gradients permuted. Laid out inside the compiled step,
    that is one more output layout; after it, each was a copy of its own (one more launch on a GPU,
    outside the CUDA graph): 14 a step in phase 2 compiled by inductor, 13 here, counted by
    train/profiling.py's rule (ops the step dispatches outside the compiled region). None
    now, on the median step. Traced with
    the eager backend, as in the graph-break test."""
    from collections import Counter
    from statistics import median

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: compile_(fn, **{**kw, "backend": "eager"}))
    torch._dynamo.reset()
    flags = dict(
        phase="phase2", init="impulse", clip_grad=0.05, mixup=0.0, cutmix=0.0, compile=True, epochs=1
    )
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=cpu) as prof, steps_recorded():
        run_seeds(config(tmp_path / "stack", seeds=(0, 1), **flags), progress=QUIET)
    torch._dynamo.reset()
    events = prof.events()
    copies = Counter({e.id: 0 for e in events if e.name == STEP})
    copies.update(eager_step(e) for e in events if e.name == "aten::contiguous")
    del copies[None]
    assert len(copies) == 8 and median(copies.values()) == 0, copies


@pytest.mark.parametrize("kind", ["folder", "FIFO", "link"])
def test_a_seeds_json_cmhsa_cannot_write_is_refused_before_the_first_step(tmp_path: Path, kind: str) -> None:
    """RUN/seeds.json a folder, a FIFO or a link: a stack checks all of its outputs before its first
    step, as a run does, not after every seed has trained."""
    import os

    out = tmp_path / "s"
    out.mkdir()
    place = out / "seeds.json"
    {"folder": place.mkdir, "FIFO": lambda: os.mkfifo(place), "link": lambda: place.symlink_to(tmp_path)}[
        kind
    ]()
    r = invoke("train", "phase1", *TINY_FLAGS, "--seeds", "0,1", "--epochs", "50", "-o", out)
    one_error_line(r, 2, str(place))
    assert not (out / "seed0" / "metrics.csv").exists()  # no step was taken
