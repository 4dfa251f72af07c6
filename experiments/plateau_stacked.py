"""The paper's question at a plateau, every seed of an arm stacked in one process (issue 57).

    python experiments/plateau_stacked.py --epochs 200 --train-samples 60000 --val-samples 10000 \
        --batch-size 256 --device cuda --compile --parallel 8 --time-budget 540 --out experiments/out/plateau
    python experiments/plateau_stacked.py --report --out experiments/out/plateau   # the table, from the runs

init_comparison.py's model and recipe (experiments/fashion_mnist.py: 28 px, P 4, d 48, depth 2, K 5,
``--preset cpu``), its arms and learning rates, but each arm is one process training ``--seeds``
as one stacked model (``cmhsa train --seeds``, train/stacked.py), each seed in ARM/seedN:

- phase 1 only (E); phase 2 only from random init (E) and from impulse init (E);
- the phase-1 half (E/2), converted per seed, then phase 2 (E/2) with hard or gated pinning;
- the restart control: the phase-1 half, then phase 1 again for E/2 from it (``--init``, each seed
  from its own) at phase 2's learning rate and warm-up: two-phase with the conversion left out;
- Figure 2's pair (Section 4.3): phase 2 after conversion (gated) and from random init, each
  without warm-up (``--warmup-epochs 0``), with ``--figure2``.

Warm-up is a tenth of each run's epochs; every run is evaluated on the first ``--val-samples``
validation images every ``--eval-every`` epochs and at its last. Arms are resumable
(convit_convert/train/arms.py): the same command continues; exit 3 until all are done. ``--report``
prints the table (top-1 at the last epoch per seed, mean ± half-range) and the phase-2 dip: top-1
at the conversion, its lowest in the first 30 phase-2 epochs, and at the end.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arms_cli import add_arm_flags, chosen_settings, needed, run_or_exit
from fashion_mnist import ATTN_LR_MULT, LR_PHASE2, LR_SCRATCH, config
from init_comparison import run_flags

from convit_convert.train.arms import Arm, metrics_rows

SETTINGS = [  # (setting, the arms it is made of: a phase-1 half first for two-phase)
    ("phase 1 only", ("p1",)),
    ("phase-1 half alone (E/2)", ("half-p1",)),
    ("two-phase, gated pinning", ("half-p1", "gated")),
    ("two-phase, hard pinning", ("half-p1", "hard")),
    ("phase 1, restarted (phase 2's rate and warm-up, no conversion)", ("half-p1", "p1-restart")),
    ("phase 2 only, impulse init", ("impulse",)),
    ("phase 2 only, random init", ("random",)),
    ("two-phase, gated, no warm-up in phase 2", ("half-p1", "gated-nowarm")),
    ("phase 2 only, random init, no warm-up", ("random-nowarm",)),
]


def arms_for(args: argparse.Namespace) -> list[Arm]:
    """Every arm, each over all of ``args.seeds``; the phase-1 half first (three arms wait for it)."""
    e, half = args.epochs, args.epochs // 2
    common = dict(seeds=tuple(args.seeds), eval_every=args.eval_every, **run_flags(args))
    arms: list[Arm] = []

    def add(name: str, epochs: int, warm: bool = True, after: tuple[str, ...] = (), **kw) -> None:
        cfg = config(
            args.out / name, epochs=epochs, warmup_epochs=epochs // 10 if warm else 0, **common, **kw
        )
        arms.append(Arm(name, cfg, after))

    converted = dict(
        phase="phase2",
        init=str(args.out / "half-p1" / "seed{seed}" / "conv.safetensors"),  # each seed's own phase 1
        lr=LR_PHASE2,
        after=("half-p1",),
    )
    add("half-p1", half, phase="phase1", lr=LR_SCRATCH)
    add("gated", half, pinning="gated", attn_lr_mult=ATTN_LR_MULT, **converted)
    add("hard", half, pinning="hard", attn_lr_mult=1.0, **converted)
    add("p1-restart", half, **{**converted, "phase": "phase1"})  # phase 2's half, left a convolution
    add("impulse", e, phase="phase2", init="impulse", lr=LR_SCRATCH)
    add("random", e, phase="phase2", init="random", lr=LR_SCRATCH)
    add("p1", e, phase="phase1", lr=LR_SCRATCH)
    if args.figure2:
        add("gated-nowarm", half, warm=False, pinning="gated", attn_lr_mult=ATTN_LR_MULT, **converted)
        add("random-nowarm", e, warm=False, phase="phase2", init="random", lr=LR_SCRATCH)
    return needed(arms, chosen_settings(SETTINGS, args))


def report(args: argparse.Namespace) -> dict:
    """Per setting and seed: epochs reached, top-1 at the last evaluated epoch; for two-phase, the
    phase-2 dip. Printed as markdown, returned for results.json."""
    arms = {a.name: a for a in arms_for(args)}
    out: dict = {"settings": {}, "seeds": list(args.seeds), "epochs": args.epochs}
    seeds = " / ".join(map(str, args.seeds))
    print(f"| setting | epochs reached per seed | top-1 %, seeds {seeds} | mean ± half-range |")
    print("|---|---|---|---:|")
    for setting, names in SETTINGS:
        if names[-1] not in arms:
            continue
        arm = arms[names[-1]]
        per_seed = []
        for folder in arm.folders:
            rows = metrics_rows(folder)
            evald = [r for r in rows if "top1" in r]
            first = (
                metrics_rows(arms["half-p1"].folders[arm.folders.index(folder)]) if len(names) == 2 else []
            )
            per_seed.append(
                {
                    "epochs": len(rows),
                    "top1": evald[-1]["top1"] if evald else None,
                    "curve": [(r["epoch"], r["top1"]) for r in evald],
                    "converted_from": first[-1]["top1"] if first and "top1" in first[-1] else None,
                    # two-phase: the lowest top-1 of the first 30 phase-2 epochs (the dip after conversion)
                    "dip": min((r["top1"] for r in evald if r["epoch"] <= 30), default=None)
                    if first
                    else None,
                }
            )
        out["settings"][setting] = per_seed
        tops = [s["top1"] for s in per_seed if s["top1"] is not None]
        planned = arm.config.recipe.epochs
        spread = f"{statistics.mean(tops):.2f} ± {(max(tops) - min(tops)) / 2:.2f}" if tops else ""
        reached = " / ".join(str(s["epochs"]) for s in per_seed)
        top1 = " / ".join("" if s["top1"] is None else f"{s['top1']:.2f}" for s in per_seed)
        print(f"| {setting} | {reached} of {planned} | {top1} | {spread} |")
    return out


def curves(args: argparse.Namespace) -> list[tuple[str, list[tuple[list[float], list[float]]]]]:
    """Per finished setting, each seed's (epochs, top-1) over its evaluated epochs, two-phase
    settings as their phase-1 half followed by phase 2 (epochs counted on from the half's)."""
    arms = {a.name: a for a in arms_for(args)}
    out = []
    for setting, names in SETTINGS:
        last = arms.get(names[-1])
        if last is None or any(len(metrics_rows(f)) < last.config.recipe.epochs for f in last.folders):
            continue  # not run, or not finished
        per_seed = []
        for i in range(len(args.seeds)):
            xs, ys, shift = [], [], 0.0
            for name in names:
                rows = [r for r in metrics_rows(arms[name].folders[i]) if "top1" in r]
                xs += [shift + r["epoch"] for r in rows]
                ys += [r["top1"] for r in rows]
                shift = xs[-1]
            per_seed.append((xs, ys))
        out.append((setting, per_seed))
    return out


def plot_curves(args: argparse.Namespace, path: Path, zoom: bool = False) -> None:
    """Top-1 against epoch, the seeds' mean with their range shaded; ``zoom``: the second half."""
    from convit_convert.train.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for setting, per_seed in curves(args):
        xs = per_seed[0][0]
        ys = list(zip(*(y for _, y in per_seed), strict=True))
        style = "--" if "no warm-up" in setting else "-"
        (line,) = ax.plot(xs, [statistics.mean(v) for v in ys], style, label=setting, linewidth=1.4)
        ax.fill_between(xs, [min(v) for v in ys], [max(v) for v in ys], color=line.get_color(), alpha=0.15)
    if zoom:
        ax.set_xlim(args.epochs // 2 - 10, args.epochs + 2)
        ax.set_ylim(87.5, 91.8)
    ax.set_xlabel("epoch (two-phase: phase 1 up to E/2, then phase 2)")
    ax.set_ylabel(f"top-1 % ({args.val_samples} validation images)")
    ax.set_title(
        f"Fashion-MNIST, {args.train_samples} training images, E = {args.epochs}, seeds "
        f"{', '.join(map(str, args.seeds))}" + (" (second half)" if zoom else "")
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=200, help="total epochs per setting (E)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="stacked in each arm's process")
    ap.add_argument("--train-samples", type=int, default=60000)
    ap.add_argument("--val-samples", type=int, default=10000)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--out", type=Path, default=Path("experiments/out/plateau"))
    ap.add_argument("--data-dir", default=None, help="Folder of the four IDX .gz files (default: Debian's).")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--compile", action="store_true", help="torch.compile each arm's stacked step")
    ap.add_argument("--figure2", action="store_true", help="also the two arms without warm-up")
    ap.add_argument("--report", action="store_true", help="print the table from the runs and stop")
    ap.add_argument("--plot", type=Path, default=None, help="also draw the curves (PNG) here, and a zoom")
    ap.add_argument("--only", nargs="+", default=None, help="run these arms alone (and what they wait for)")
    add_arm_flags(ap)
    args = ap.parse_args()
    if not args.report:
        arms = arms_for(args)
        if args.only:
            keep = set(args.only) | {d for a in arms if a.name in args.only for d in a.after}
            arms = [a for a in arms if a.name in keep]
        try:
            run_or_exit(arms, args)
        except SystemExit as e:
            if e.code != 3:
                raise
            (args.out / "results.json").write_text(json.dumps(report(args), indent=1) + "\n")
            raise
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(report(args), indent=1) + "\n")
    if args.plot is not None:
        plot_curves(args, args.plot)
        plot_curves(args, args.plot.with_name(args.plot.stem + "-zoom" + args.plot.suffix), zoom=True)


if __name__ == "__main__":
    main()
