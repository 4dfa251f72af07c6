"""The host's work per step of S stacked seeds (``--seeds``) against S separate runs: aten ops
dispatched per step and CPU seconds per step, both per seed (bench/ops_per_step.py's instrument).

    python bench/stacked_host.py [--batch 8] [--stacks 1 3 6] [--data-dir DIR]

A GPU runs a small model as fast as the host dispatches its kernels, so the ops a step
dispatches per seed are what stacking has to cut for S seeds to train faster together than
apart. The EXPERIMENTS.md model and recipe (``--preset cpu``, drop path 0.1), both phases (phase 2
from impulse init, gated), the device loader, on the CPU at a small batch, 1 thread. Ops: the slope
between 1-epoch runs of 16 and 48 steps (set-up and evaluation cancel). Seconds: the 48-step
run's epoch time (metrics.csv) over its steps, median of ``--repeats``.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
from pathlib import Path

import torch
from ops_per_step import CountOps, config

from convit_convert.train.progress import Progress
from convit_convert.train.run import run
from convit_convert.train.stacked import run_seeds


def one(
    phase: str, seeds: int, steps: int, batch: int, out: Path, data_dir: str | None, count: bool
) -> tuple[int, float]:
    """(aten ops, epoch seconds) of one run: ``seeds`` 0 = a plain run, else that many stacked."""
    cfg = config(phase, steps, batch, out, data_dir)
    stacked = seeds > 0
    if stacked:
        cfg = cfg.replace(seeds=tuple(range(seeds)), seeds_step="batched")
    counter = CountOps()
    with counter if count else contextlib.nullcontext():
        results = run_seeds(cfg, progress=Progress(None)) if stacked else [run(cfg, progress=Progress(None))]
    return sum(counter.ops.values()), float(results[0].rows[-1]["epoch_seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stacks", type=int, nargs="+", default=[1, 3, 6])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, batch {args.batch} per seed, device loader\n")
    print("| phase | form | aten ops per step, per seed | CPU ms per step, per seed |")
    print("|---|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("phase1", "phase2"):
            for seeds in (0, *args.stacks):
                n = max(seeds, 1)
                ops = {
                    steps: one(
                        phase,
                        seeds,
                        steps,
                        args.batch,
                        Path(tmp) / f"{phase}-{seeds}-{steps}",
                        args.data_dir,
                        True,
                    )[0]
                    for steps in (16, 48)
                }
                per_step = (ops[48] - ops[16]) / 32
                times = [
                    one(
                        phase,
                        seeds,
                        48,
                        args.batch,
                        Path(tmp) / f"{phase}-{seeds}-t{i}",
                        args.data_dir,
                        False,
                    )[1]
                    for i in range(args.repeats)
                ]
                form = f"{seeds} seeds stacked" if seeds else "one run (no --seeds)"
                ms = 1000 * statistics.median(times) / 48
                print(f"| {phase} | {form} | {per_step / n:.0f} | {ms / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
