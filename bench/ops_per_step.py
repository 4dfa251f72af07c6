"""The host's work per training step: aten ops dispatched and CPU steps/s (issue 41's instrument).

    python bench/ops_per_step.py [--batch 8] [--data-dir DIR]

The EXPERIMENTS.md model and recipe (``--preset cpu``: 28 px, P 4, d 48, depth 2, K 5), both
phases (phase 2 from impulse init, gated pinning, 9 heads), the device loader, on the CPU, at a
small batch, where the fixed cost of a step dominates. Ops: every aten op dispatched (a
TorchDispatchMode counts them) during a 1-epoch run of 16 steps and one of 48; the per-step count
is the slope, so set-up and the epoch's evaluation (the same in both) cancel. A count is the same
on every machine with the same torch. Steps/s: the 48-step run again without the counter, its
epoch's training seconds (metrics.csv) over its steps, median of 3.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from convit_convert.train.config import TrainConfig
from convit_convert.train.progress import Progress
from convit_convert.train.run import run


class CountOps(TorchDispatchMode):
    """Every aten op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def config(phase: str, steps: int, batch: int, out: Path, data_dir: str | None) -> TrainConfig:
    extra = dict(init="impulse", pinning="gated") if phase == "phase2" else {}
    return TrainConfig.from_flags(
        phase=phase, preset="cpu", data="fashion-mnist", data_dir=data_dir, in_chans=1, loader="device",
        device="cpu", threads=1, batch_size=batch, train_samples=steps * batch, val_samples=64, epochs=1,
        log_every=10**6, out=str(out), **extra,
    )  # fmt: skip


def one_run(cfg: TrainConfig, count: bool) -> tuple[Counter[str], float]:
    """(ops by name, training seconds of the epoch) of one run of ``cfg``."""
    counter = CountOps()
    if count:
        with counter:
            result = run(cfg, progress=Progress(None))
    else:
        result = run(cfg, progress=Progress(None))
    return counter.ops, float(result.rows[-1]["epoch_seconds"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, CPU, 1 thread, batch {args.batch}, device loader\n")
    print("| phase | aten ops per step | CPU steps/s (median of 3) |\n|---|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("phase1", "phase2"):
            counts = {}
            for steps in (16, 48):
                cfg = config(phase, steps, args.batch, Path(tmp) / f"{phase}-{steps}", args.data_dir)
                counts[steps], _ = one_run(cfg, count=True)
            per_step = (sum(counts[48].values()) - sum(counts[16].values())) / 32
            rates = []
            for i in range(args.repeats):
                cfg = config(phase, 48, args.batch, Path(tmp) / f"{phase}-t{i}", args.data_dir)
                rates.append(48 / one_run(cfg, count=False)[1])
            print(f"| {phase} | {per_step:.0f} | {statistics.median(rates):.1f} |")
            top = Counter({k: (counts[48][k] - counts[16][k]) / 32 for k in counts[48]}).most_common(8)
            print("|  | most frequent: " + ", ".join(f"{k} {v:.0f}" for k, v in top) + " | |")


if __name__ == "__main__":
    main()
