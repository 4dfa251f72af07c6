"""What `--resume` and `--overwrite` read back from a run folder (the checkpoint's config and
counters, the environment it ran in, the list of files still to remove) is checked like a flag
before anything is trained, written or removed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from conftest import (
    TINY_FLAGS,
    copy_run,
    invoke,
    one_error_line,
    snapshot,
    tree,
)


def crafted_resume(tiny_run: Path, folder: Path, change: Any) -> Path:
    import torch

    run = copy_run(tiny_run, folder)
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    change(saved)
    torch.save(saved, run / "checkpoint-last.pt")
    return run


def _set_config(**values: Any) -> Any:
    return lambda s: s["config"].update(values)


def _exp_avg_shape(s: dict) -> None:
    import torch

    state = next(iter(s["optimizer"]["state"].values()))
    state["exp_avg"] = torch.zeros(3)


def _model_config(**values: Any) -> Any:
    return lambda s: s["model_config"].update(values)


RESUME_CASES = {
    # each was an internal error (exit 3), a silent skip, a runaway, or a skipped memory estimate
    "optimizer state shape": (_exp_avg_shape, "exp_avg"),
    "optimizer betas": (lambda s: s["optimizer"]["param_groups"][0].update(betas=(1.5, 0.9)), "betas"),
    "optimizer lr type": (lambda s: s["optimizer"]["param_groups"][0].update(lr="fast"), "lr"),
    "scheduler field": (lambda s: s["scheduler"].update(t_initial="x"), "scheduler.t_initial"),
    "scheduler keys": (lambda s: s["scheduler"].clear(), "scheduler"),
    "partial state": (lambda s: s.update(partial={"loss_sum": "x", "seconds": 0.0, "images": 0}), "partial"),
    "step past the epoch": (lambda s: s.update(step=10**9), "step 1000000000"),
    "seed": (_set_config(seed=2**40), "--seed must be"),
    "config betas": (_set_config(opt_betas=[0.9, 2.0]), "--opt-betas must be"),
    "epochs 10^12": (_set_config(epochs=10**12), "--epochs must be"),
    "img_size 0": (_model_config(img_size=[0, 0]), "img_size must be positive"),
    "model beyond memory": (
        _model_config(
            depth=1024, hidden_chans=4096, embed_dim=4096 * 16, mlp_hidden_dim=1 << 22, patch_embed="linear"
        ),
        "more than cmhsa loads",  # ViTConfig's cap on a config read from a file (before: "would need about")
    ),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_every_value_a_resume_reads_is_checked_like_a_flag(tmp_path: Path, tiny_run: Path, case: str) -> None:
    change, fragment = RESUME_CASES[case]
    run = crafted_resume(tiny_run, tmp_path / "run", change)
    before = snapshot(run)
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", run)
    one_error_line(r, 2, fragment)
    assert snapshot(run) == before


def test_a_stop_after_an_epoch_s_last_step_resumes(tmp_path: Path, tiny_run: Path) -> None:
    """The one step count past the last that is a real state: stopped after the epoch's last step,
    before its evaluation (the bound above must not refuse it)."""
    import torch

    steps = torch.load(tiny_run / "checkpoint-last.pt", weights_only=True)["global_step"]  # one epoch's
    run = crafted_resume(tiny_run, tmp_path / "run", lambda s: s.update(step=steps))
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", run)
    assert r.exit_code == 0, r.output
    assert epochs_in(run) == [1, 2]


def epochs_in(run: Path) -> list[int]:
    return [int(line.split(",")[0]) for line in (run / "metrics.csv").read_text().splitlines()[1:]]


def test_a_run_resumes_on_a_machine_with_fewer_cores(tmp_path: Path, tiny_run: Path) -> None:
    # catches: `--threads must be 1 <= x <= 8, got 16` (exit 2) on a 2-core machine, whatever --threads said
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    assert {"threads", "cpu_capability", "torch", "timm", "device"} <= set(saved["environments"][0])
    saved["config"]["threads"] = 10_000
    saved["environments"][0]["threads"] = 10_000
    torch.save(saved, run / "checkpoint-last.pt")
    r = invoke(
        "train",
        "phase1",
        *TINY_FLAGS,
        "--epochs",
        "2",
        "--resume",
        "--threads",
        "1",
        "--deterministic",
        "-o",
        run,
    )
    one_error_line(r, 2, "--deterministic", "threads 10000 -> 1")
    r = invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "--threads", "1", "-o", run)
    assert r.exit_code == 0, r.output
    assert "resuming in another environment (threads 10000 -> 1" in r.output
    envs = json.loads((run / "config.json").read_text())["environments"]
    assert [(e["epoch"], e["threads"]) for e in envs] == [(0, 10_000), (1, 1)]


def test_a_counter_no_run_reaches_is_refused_on_resume(tmp_path: Path, tiny_run: Path) -> None:
    # catches: a global_step of 10^30 accepted
    import torch

    run = copy_run(tiny_run, tmp_path / "run")
    saved = torch.load(run / "checkpoint-last.pt", weights_only=True)
    for value, fragment in ((10**30, "beyond any run's"), (10**6, "global step 1000000")):
        saved["global_step"] = value
        torch.save(saved, run / "checkpoint-last.pt")
        one_error_line(
            invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", run), 2, fragment
        )


def test_a_pending_removal_list_is_checked_before_anything_is_removed(tmp_path: Path, tiny_run: Path) -> None:
    """The list is a file in a folder anyone may have written: only a previous run's removable
    files are taken from it, never the checkpoint being resumed or a path out of the folder."""
    run = copy_run(tiny_run, tmp_path / "run")
    (tmp_path / "victim").write_text("kept\n")
    for names in (["../victim"], ["checkpoint-last.pt"], "conv.safetensors", [["conv.safetensors"]]):
        (run / "overwrite-pending.json").write_text(json.dumps(names))
        before = tree(tmp_path)
        one_error_line(
            invoke("train", "phase1", *TINY_FLAGS, "--epochs", "2", "--resume", "-o", run),
            2,
            "overwrite-pending.json",
        )
        assert tree(tmp_path) == before


def test_a_stacked_resume_checks_each_seed_folder_as_its_own_resume_would(tmp_path: Path) -> None:
    """`--seeds 0,1,2 --resume` on a folder whose seed2 holds a copy of seed 0's run is refused,
    naming seed2, as `--seed 2 --resume` on that folder alone is; nothing is trained or written
    (seed 2 never continues seed 0's run)."""
    import shutil

    out = tmp_path / "s"
    r = invoke("train", "phase1", *TINY_FLAGS, "--seeds", "0,1,2", "-o", out)
    assert r.exit_code == 0, r.output
    shutil.rmtree(out / "seed2")
    shutil.copytree(out / "seed0", out / "seed2")
    before = snapshot(out / "seed2")
    extend = [*TINY_FLAGS, "--epochs", "2", "--resume"]
    alone = invoke("train", "phase1", *extend, "--seed", "2", "-o", out / "seed2")
    one_error_line(alone, 2, "--seed", "differs from the run's 0")
    stacked = invoke("train", "phase1", *extend, "--seeds", "0,1,2", "-o", out)
    one_error_line(stacked, 2, str(out / "seed2"), "--seed", "differs from the run's 0")
    assert snapshot(out / "seed2") == before
    assert all(len((out / f"seed{s}" / "metrics.csv").read_text().splitlines()) == 2 for s in range(3))
