"""The 60k Fashion-MNIST init comparison run on an H100: its table and curves from the raw files.

    python experiments/gpu_60k_report.py [--results DIR] [--plot PNG]

Reads experiments/results/init_comparison_gpu_e40_n60000/init60k-call*.json (every run's metrics
rows and final evaluation, as experiments/init_comparison.py's arms wrote them: seeds 0, 1, 2, the
six arms p1, half-p1, gated, hard, impulse and random, 40 epochs in all, 60,000 training images,
batch 256, one call per seed) and prints the table in EXPERIMENTS.md: final top-1 on the 10,000
validation images per seed, mean ± half-range, and the gain over the last fifth (init_comparison's
``plateau_gain``); writes the curves (mean over seeds, the band their range).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from init_comparison import plateau_gain, plot

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = [  # (setting, its runs: a phase-1 half first for two-phase)
    ("phase 1 only", ("p1",)),
    ("phase 2 only, impulse init", ("impulse",)),
    ("phase 2 only, random init", ("random",)),
    ("two-phase, hard pinning", ("half-p1", "hard")),
    ("two-phase, gated pinning", ("half-p1", "gated")),
]
SEEDS = (0, 1, 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--results", type=Path, default=ROOT / "experiments/results/init_comparison_gpu_e40_n60000"
    )
    ap.add_argument("--plot", type=Path, default=ROOT / "docs/images/init_comparison_gpu_e40_n60000.png")
    args = ap.parse_args()
    runs: dict = {}
    for f in sorted(args.results.glob("init60k-call*.json")):
        runs.update(json.loads(f.read_text()))
    fifth = 8  # of 40 epochs
    print("| setting | top-1 %, seeds 0 / 1 / 2 | mean ± half-range | gain over the last 8 epochs |")
    print("|---|---|---:|---:|")
    rows = []
    for setting, names in SETTINGS:
        curves, top1 = [], []
        for s in SEEDS:
            metrics = [r for n in names for r in runs[f"seed{s}/{n}"]["rows"]]
            curves.append((list(range(1, len(metrics) + 1)), [r["top1"] for r in metrics]))
            top1.append(runs[f"seed{s}/{names[-1]}"]["final"]["top1"])
        gains = [plateau_gain(ys, fifth) for _, ys in curves]
        spread = (max(top1) - min(top1)) / 2
        print(
            f"| {setting} | {' / '.join(f'{t:.2f}' for t in top1)} | "
            f"{statistics.mean(top1):.2f} ± {spread:.2f} "
            f"| {statistics.mean(gains):+.2f} ({', '.join(f'{g:+.2f}' for g in gains)}) |"
        )
        rows.append((setting, curves))
    title = "Fashion-MNIST, 60,000 training images, 40 epochs, H100 (3 seeds)"
    plot(rows, args.plot, title, "top-1 % (all 10,000 validation images)")
    print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
