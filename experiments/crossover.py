"""Where two-phase training starts to pay: every scale measured, read together from the raw runs.

    python experiments/crossover.py [--plot experiments/results/crossover.png] [--json OUT.json]

The scales (Fashion-MNIST, the `--preset cpu` model at depth 2: 28 px, P 4, d 48, K 5; top-1 on
the 10k validation images at each run's last epoch):

- 1,000 images, E = 200, 2 seeds, CPU, batch 64 (experiments/init_comparison.py's restart run:
  results/init_comparison_cpu_e200_n1000_restart.json, each final model evaluated on the 10k);
- 4,000 and 16,000 images, E = 200, 2 seeds, CPU, batch 256 (experiments/plateau_stacked.py:
  results/plateau_e200_n4000_cpu/, results/plateau_e200_n16000_cpu/);
- 60,000 images, E = 200, 3 seeds, an H100, batch 256 (plateau_stacked.py:
  results/plateau_e200_n60000_h100/).

For each scale: each start's top-1 (mean ± half-range over its seeds), and two-phase's gain over
its phase-1 half taken apart by the restart control, each step a difference per seed (the seeds
pair: each seed's arms start from its own phase-1 half), mean ± half-range: the restart (phase 1
restarted at phase 2's rate and warm-up, no conversion, over the half), the reparameterisation
(hard pinning, the same convolution in attention's parameters, over the restart), attention's
freedom (gated over hard), and phase 1 alone over gated; then how far phase 1 alone and the
two-phase arms still climbed over the last fifth and the last tenth of E; then each earlier run
of a scale on a shorter schedule (16,000 images, E = 100: results/plateau_e100_n16000_cpu/) beside
the scale's run, and what the longer schedule changed, seed by seed. With --plot, top-1 against
training images (log scale), one line per start with its seeds' range; --json writes the figure's
points.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from convit_convert.train.arms import metrics_rows

RESULTS = Path(__file__).resolve().parent / "results"
# start -> the arm folder (plateau_stacked.py) or run name (init_comparison.py) that holds it
STARTS = {
    "phase 1 only": "p1",
    "phase-1 half": "half-p1",
    "phase 1, restarted": "p1-restart",
    "two-phase, hard pinning": "hard",
    "two-phase, gated pinning": "gated",
    "phase 2 only, impulse init": "impulse",
}
# (label, training images, epochs, seeds' source: a plateau_stacked folder or init_comparison JSON)
SCALES = [
    ("1k", 1000, 200, "init_comparison_cpu_e200_n1000_restart.json"),
    ("4k", 4000, 200, "plateau_e200_n4000_cpu"),
    ("16k", 16000, 200, "plateau_e200_n16000_cpu"),
    ("60k", 60000, 200, "plateau_e200_n60000_h100"),
]
# earlier runs of a scale on a shorter schedule, shown beside it: (label, images, epochs, folder)
EARLIER = [("16k", 16000, 100, "plateau_e100_n16000_cpu")]
# two-phase's gain over its half, taken apart: (step, from, to)
STEPS = [
    ("restart", "phase-1 half", "phase 1, restarted"),
    ("reparameterisation", "phase 1, restarted", "two-phase, hard pinning"),
    ("attention", "two-phase, hard pinning", "two-phase, gated pinning"),
    ("phase 1 alone − gated", "two-phase, gated pinning", "phase 1 only"),
]


HALVES = ("half-p1", "p1-restart", "hard", "gated")  # arms that run E/2 epochs (two-phase's halves)


def arm_epochs(arm: str, epochs: int) -> int:
    """The epochs an arm of a setting of E epochs runs: E/2 for a half, E for the others."""
    return epochs // 2 if arm in HALVES else epochs


def seed_folders(source: str, arm: str) -> list[Path]:
    """A plateau_stacked.py arm's seed folders, in seed order (files beside them left out)."""
    found = (f for f in (RESULTS / source / arm).glob("seed*") if f.is_dir())
    return sorted(found, key=lambda f: int(f.name[4:]))


def seeds_top1(source: str, epochs: int) -> dict[str, list[float]]:
    """start -> each seed's top-1 at its last epoch (seeds in order), for the arms that finished."""
    path = RESULTS / source
    out: dict[str, list[float]] = {}
    if path.suffix == ".json":
        runs = json.loads(path.read_text())["runs"]
        seeds = sorted({name.split("/")[0] for name in runs})
        for start, arm in STARTS.items():
            tops = [runs[f"{s}/{arm}"]["final"]["top1"] for s in seeds if f"{s}/{arm}" in runs]
            if len(tops) == len(seeds):
                out[start] = tops
        return out
    for start, arm in STARTS.items():
        folders = seed_folders(source, arm)
        tops = []
        for folder in folders:
            rows = metrics_rows(folder)
            if len(rows) < arm_epochs(arm, epochs) or "top1" not in rows[-1]:
                break  # not finished: the start is left out at this scale
            tops.append(float(rows[-1]["top1"]))
        if folders and len(tops) == len(folders):
            out[start] = tops
    return out


def paired(xs: list[float] | None, ys: list[float] | None) -> list[float] | None:
    """ys − xs seed by seed (a seed's runs share its training subset); None unless both ran."""
    return [y - x for x, y in zip(xs, ys, strict=True)] if xs and ys else None


def spread(values: list[float]) -> tuple[float, float]:
    """(mean, half-range), as every table of EXPERIMENTS.md reports seeds."""
    return statistics.mean(values), (max(values) - min(values)) / 2


def spread_text(values: list[float] | None, sign: bool = False) -> str:
    if not values:
        return "–"
    mean, half = spread(values)
    return f"{mean:+.2f} ± {half:.2f}" if sign else f"{mean:.2f} ± {half:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--plot", type=Path, default=None, help="draw the figure here (PNG)")
    ap.add_argument("--json", type=Path, default=None, help="write the figure's points here")
    args = ap.parse_args()
    scales = [(label, n, e, seeds_top1(src, e)) for label, n, e, src in SCALES]

    def header(label: str, e: int, tops: dict[str, list[float]]) -> str:
        seeds = len(next(iter(tops.values()), []))
        return f"{label} (E {e}, {seeds} seeds)" if seeds else f"{label} (E {e}, not run)"

    print("| start | " + " | ".join(header(label, e, t) for label, _, e, t in scales) + " |")
    print("|---|" + "---:|" * len(scales))
    for start in STARTS:
        print(f"| {start} | " + " | ".join(spread_text(t.get(start)) for *_, t in scales) + " |")
    print()
    print("| step of two-phase's gain | " + " | ".join(label for label, *_ in scales) + " |")
    print("|---|" + "---:|" * len(scales))
    for step, a, b in STEPS:
        cells = []
        for *_, t in scales:
            cells.append(spread_text(paired(t.get(a), t.get(b)), sign=True))
        print(f"| {step} ({b} − {a}) | " + " | ".join(cells) + " |")

    # how near its plateau each arm ended: top-1 at its last epoch against at four fifths and at
    # nine tenths of E (the plateau_stacked.py scales, evaluated every 5 epochs; a two-phase arm's
    # phase 2 counts its own E/2 epochs, so four fifths of E is its epoch E/2 - E/5)
    print()
    print("| top-1 gained over the last fifth / tenth of E | " + " | ".join(s[0] for s in SCALES) + " |")
    print("|---|" + "---:|" * len(SCALES))
    for start in ("phase 1 only", "two-phase, hard pinning", "two-phase, gated pinning"):
        arm = STARTS[start]
        cells = []
        for _, _, e, src in SCALES:
            last = arm_epochs(arm, e)
            folders = seed_folders(src, arm)
            fifth, tenth = [], []
            for folder in folders:
                top1 = {int(r["epoch"]): float(r["top1"]) for r in metrics_rows(folder) if "top1" in r}
                if {last, last - e // 5, last - e // 10} <= set(top1):
                    fifth.append(top1[last] - top1[last - e // 5])
                    tenth.append(top1[last] - top1[last - e // 10])
            whole = folders and len(fifth) == len(folders)
            both = f"{spread_text(fifth, sign=True)} / {spread_text(tenth, sign=True)}"
            cells.append(both if whole else "–")
        print(f"| {start} | " + " | ".join(cells) + " |")

    # what a longer schedule changed at a scale: the same seeds, subsets and recipe, only E longer
    now = {label: (e, t) for label, _, e, t in scales}
    for label, _, e, src in EARLIER:
        before, (e_now, after) = seeds_top1(src, e), now[label]
        print()
        print(f"| start at {label} | E {e} (earlier) | E {e_now} | E {e_now} − E {e}, seed by seed |")
        print("|---|---:|---:|---:|")
        rows = [(start, before.get(start), after.get(start)) for start in STARTS]
        lead, a, b = STEPS[-1]  # phase 1 alone − gated: its sign is the answer
        gaps = (paired(t.get(a), t.get(b)) for t in (before, after))
        for start, was, got in [*rows, (lead, *gaps)]:
            if was or got:
                sign = start == lead
                cells = (spread_text(was, sign), spread_text(got, sign), spread_text(paired(was, got), True))
                print(f"| {start} | " + " | ".join(cells) + " |")

    points = {
        start: [
            {
                "images": n,
                "epochs": e,
                "mean": spread(t[start])[0],
                "min": min(t[start]),
                "max": max(t[start]),
                # against phase 1 alone, seed by seed (a seed's arms train on the same subset)
                "vs_phase1": (
                    [y - x for x, y in zip(t["phase 1 only"], t[start], strict=True)]
                    if "phase 1 only" in t
                    else None
                ),
            }
            for _, n, e, t in scales
            if start in t
        ]
        for start in STARTS
        if start != "phase-1 half"
    }
    if args.json is not None:
        args.json.write_text(json.dumps(points, indent=1) + "\n")
    if args.plot is not None:
        plot(points, args.plot)


def plot(points: dict[str, list[dict]], path: Path) -> None:
    """Left: top-1 against training images (log scale), each start's seeds' range as a band.
    Right: each start against phase 1 alone, seed by seed (mean and range): above 0 it leads."""
    from convit_convert.train.plot import pyplot

    plt = pyplot()
    fig, (ax, rel) = plt.subplots(1, 2, figsize=(13, 5))
    styles = {"phase 1 only": "o-", "phase 1, restarted": "s:", "phase 2 only, impulse init": "^--"}
    for start, pts in points.items():
        if not pts:
            continue
        xs, style = [p["images"] for p in pts], styles.get(start, "D-")
        (line,) = ax.plot(xs, [p["mean"] for p in pts], style, label=start, linewidth=1.5)
        colour = line.get_color()
        ax.fill_between(xs, [p["min"] for p in pts], [p["max"] for p in pts], color=colour, alpha=0.2)
        for p in pts:  # each seed's range at a scale, also where a start has one scale only
            ax.vlines(p["images"], p["min"], p["max"], color=colour, linewidth=1)
        diffs = [(p["images"], p["vs_phase1"]) for p in pts if p["vs_phase1"] is not None]
        if start == "phase 1 only" or not diffs:
            continue
        mid = [statistics.mean(d) for _, d in diffs]
        span = [[m - min(d) for m, (_, d) in zip(mid, diffs, strict=True)]]
        span.append([max(d) - m for m, (_, d) in zip(mid, diffs, strict=True)])
        rel.errorbar([x for x, _ in diffs], mid, yerr=span, fmt=style, color=colour, label=start, capsize=3)
    rel.axhline(0.0, color="0.3", linewidth=1)
    for a in (ax, rel):
        a.set_xscale("log")
        a.set_xticks([1000, 4000, 16000, 60000], ["1k", "4k", "16k", "60k"])
        a.set_xlabel("training images (log scale)")
        a.grid(alpha=0.3)
    ax.set_ylabel("top-1 % at the last epoch (10k validation images)")
    ax.set_title("Each start's top-1, its seeds' range shaded")
    rel.set_ylabel("top-1 points over phase 1 alone, seed by seed")
    rel.set_title("Against phase 1 alone: above 0, the start leads")
    ax.legend(fontsize=8, loc="lower right")
    rel.legend(fontsize=8, loc="lower right")
    fig.suptitle("Fashion-MNIST, depth 2: where two-phase training starts to pay")
    fig.text(
        0.01,
        0.01,
        "E = 200; 1k: batch 64, others 256; 1k-16k CPU, 60k an H100; two-phase: E/2 + E/2",
        fontsize=7,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
