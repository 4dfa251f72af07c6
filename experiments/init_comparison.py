"""Every way to start a ViT with a convolution's bias, side by side on Fashion-MNIST, at equal total epochs.

    python experiments/init_comparison.py [--epochs 40] [--seeds 0 1] [--train-samples 2000]
                                          [--val-samples 2000]
                                          [--batch-size 64] [--out experiments/out/init] [--data-dir DIR]
                                          [--device auto|cpu|cuda] [--compile] [--loader auto|device|workers]
                                          [--parallel N] [--time-budget SECONDS]

The EXPERIMENTS.md model and recipe (experiments/fashion_mnist.py: 28 px, P 4, d 48, depth 2, K 5,
9 heads; crop, flip, colour jitter, label smoothing; no RandAugment, Mixup or erasing). Per seed,
at E epochs in all:

- phase 1 only (E); phase 2 only from random init (E); ``--init mimetic`` (E); ``--init impulse``
  (E, heads pinned to the conversion's offsets) and with random offsets (E);
- two-phase: phase 1 for E/2, converted, then phase 2 for E/2 with hard pinning, gated pinning
  (the default) or 3 free extra heads (12 heads, hard);
- the restart control: phase 1 for E/2, then phase 1 again for E/2 from it (``--init``) at phase 2's
  learning rate and warm-up: the two-phase protocol with the conversion left out;
- Section 4.3's warm-up claim: phase 2 from random init and two-phase gated, each without warm-up.

Warm-up is a tenth of each run's epochs (0 in the no-warm-up arms). Learning rates as
fashion_mnist.py: 2e-3 from scratch, 2e-4 after conversion (the paper's 10:1), W_Q, W_K, gates and
biases at 10× after conversion. Each epoch is evaluated on the first ``--val-samples`` validation
images (the curves); each final model on all 10k (the table), with its attention measured on
1,000 of them. Runs are arms (convit_convert/train/arms.py): finished ones are skipped, stopped
ones resumed; exit code 3 until all are done. Then it writes, in ``--out``: results.json (every
run's metrics rows, final evaluation and attention), curves.png (top-1 against epoch, one line per
setting, seeds shaded min to max) and prints the markdown table. Its gain column is the plateau
test: top-1 on the per-epoch images over the last fifth of the epochs, 5-epoch means at both
ends (:func:`plateau_gain`).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arms_cli import add_arm_flags, chosen_settings, needed, run_or_exit
from fashion_mnist import ATTN_LR_MULT, LR_PHASE2, LR_SCRATCH, config, stat

from convit_convert.train.arms import Arm

SETTINGS = [  # (setting, run names it is made of: a phase-1 half first for two-phase)
    ("phase 1 only", ("p1",)),
    ("phase 2 only, random init", ("random",)),
    ("phase 2 only, mimetic init", ("mimetic",)),
    ("phase 2 only, impulse init (conversion's offsets)", ("impulse",)),
    ("phase 2 only, impulse init (random offsets)", ("impulse-random",)),
    ("two-phase, hard pinning", ("half-p1", "hard")),
    ("two-phase, gated pinning", ("half-p1", "gated")),
    ("two-phase, free extra heads", ("half-p1", "free-heads")),
    ("phase 1, restarted (phase 2's rate and warm-up, no conversion)", ("half-p1", "p1-restart")),
    ("phase 2 only, random init, no warm-up", ("random-nowarm",)),
    ("two-phase, gated pinning, no warm-up in phase 2", ("half-p1", "gated-nowarm")),
]


def arms_for(args: argparse.Namespace) -> list[Arm]:
    arms = [arm for seed in args.seeds for arm in seed_arms(args, seed)]
    return needed(arms, chosen_settings(SETTINGS, args))


def run_flags(args: argparse.Namespace) -> dict:
    """The flags every run of the comparison shares, from the script's."""
    return dict(
        train_samples=args.train_samples,
        val_samples=args.val_samples,
        batch_size=args.batch_size,
        compile=args.compile,
        data_dir=args.data_dir,
        device=args.device,
        loader=args.loader,
    )


def seed_arms(args: argparse.Namespace, seed: int) -> list[Arm]:
    """One seed's runs; the phase-1 half first, as four runs wait for it."""
    e, half, d = args.epochs, args.epochs // 2, args.out / f"seed{seed}"
    common = dict(seed=seed, **run_flags(args))
    arms = []

    def add(name: str, epochs: int, warm: bool = True, after: tuple[str, ...] = (), **kw) -> None:
        cfg = config(d / name, epochs=epochs, warmup_epochs=epochs // 10 if warm else 0, **common, **kw)
        arms.append(Arm(f"seed{seed}/{name}", cfg, tuple(f"seed{seed}/{a}" for a in after)))

    scratch = dict(phase="phase2", lr=LR_SCRATCH)
    after = dict(
        phase="phase2", init=str(d / "half-p1" / "conv.safetensors"), lr=LR_PHASE2, after=("half-p1",)
    )
    add("half-p1", half, phase="phase1", lr=LR_SCRATCH)
    add("random", e, init="random", **scratch)
    add("mimetic", e, init="mimetic", **scratch)
    add("impulse", e, init="impulse", **scratch)
    add("impulse-random", e, init="impulse", impulse_offsets="random", **scratch)
    add("random-nowarm", e, warm=False, init="random", **scratch)
    add("hard", half, pinning="hard", attn_lr_mult=1.0, **after)
    add("gated", half, pinning="gated", attn_lr_mult=ATTN_LR_MULT, **after)
    add("free-heads", half, pinning="hard", heads=12, attn_lr_mult=ATTN_LR_MULT, **after)
    add("gated-nowarm", half, warm=False, pinning="gated", attn_lr_mult=ATTN_LR_MULT, **after)
    # the restart control: phase 2's half exactly (epochs, rate, warm-up), the model left a convolution
    add("p1-restart", half, **{**after, "phase": "phase1"})
    add("p1", e, phase="phase1", lr=LR_SCRATCH)
    return arms


def final_eval(arm: Arm, args: argparse.Namespace) -> dict:
    """The final model on the whole validation set, and (attention) its heads on 1,000 images;
    cached in the run folder as final.json."""
    cache = arm.out / "final.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    from convit_convert.api.on_data import attention_on_data, evaluate_checkpoint
    from convit_convert.options.operations import AttentionOptions, EvalOptions

    dev = "cpu" if args.device == "auto" else args.device
    r = evaluate_checkpoint(arm.model, EvalOptions("fashion-mnist", args.data_dir, device=dev, workers=0))
    out: dict = {"top1": r.top1, "top5": r.top5, "val_loss": r.val_loss, "images": r.images}
    if arm.config.phase == "phase2":
        att = attention_on_data(
            arm.model, AttentionOptions("fashion-mnist", args.data_dir, images=1000, device=dev)
        )
        out["attention"] = [
            {
                key: statistics.mean(h[key] for h in block["heads"] if h[key] is not None)
                for key in ("pinned_share", "mean_distance_px", "entropy", "gate")
                if any(h[key] is not None for h in block["heads"])
            }
            for block in att.to_dict()["blocks"]
        ]
    cache.write_text(json.dumps(out, indent=2))
    return out


PLATEAU_WINDOW = 5  # epochs averaged at each end of the plateau test's last fifth


def plateau_gain(ys: list[float], fifth: int, window: int = PLATEAU_WINDOW) -> float:
    """Top-1 gained over the last ``fifth`` epochs of a curve: the mean of its last ``window``
    epochs minus the mean of the ``window`` epochs that end ``fifth`` epochs earlier (``window``
    at most ``fifth``, so the two never overlap). Means, not single epochs: near a plateau one
    epoch's top-1 on a 2,000-image subset moves by up to a point from the next (EXPERIMENTS.md),
    more than the 0.5 the plateau test allows."""
    w = max(1, min(window, fifth, len(ys) - fifth))
    end = len(ys) - fifth
    return statistics.mean(ys[-w:]) - statistics.mean(ys[end - w : end])


def curve(runs: list[Arm]) -> tuple[list[int], list[float]]:
    """Top-1 (val subset) against total epoch, a two-phase setting's halves joined."""
    xs, ys, offset = [], [], 0
    for arm in runs:
        rows = arm.rows()
        xs += [offset + int(r["epoch"]) for r in rows]
        ys += [r["top1"] for r in rows]
        offset += len(rows)
    return xs, ys


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=40, help="total epochs per setting (E)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--train-samples", type=int, default=2000)
    ap.add_argument("--val-samples", type=int, default=2000, help="per-epoch evaluation images (the curves)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("experiments/out/init"))
    ap.add_argument("--data-dir", default=None, help="Folder of the four IDX .gz files (default: Debian's).")
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    ap.add_argument("--compile", action="store_true", help="torch.compile the models (on a GPU)")
    add_arm_flags(ap)
    args = ap.parse_args()
    arms = arms_for(args)
    run_or_exit(arms, args)
    by_name = {a.name: a for a in arms}
    results: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": {}}
    for a in arms:
        results["runs"][a.name] = {
            "rows": a.rows(),
            "final": final_eval(a, args),
            "cpu_seconds": a.cpu_seconds(),
            "environments": a.environments(),
        }

    e, fifth = args.epochs, max(1, args.epochs // 5)
    print(
        f"\nFashion-MNIST, {args.train_samples} training images, 28 px, P 4, d "
        f"48, depth 2, K 5; {e} epochs in "
        f"all; seeds {' '.join(map(str, args.seeds))} (mean ± half-range); top-1 "
        "of the final model on the 10k "
        f"validation images; gain: top-1 on the first {args.val_samples} over the "
        f"last {fifth} epochs (means of "
        f"{max(1, min(PLATEAU_WINDOW, fifth))} epochs)\n"
    )
    print(
        "| setting | top-1 % | gain, last fifth | pinned share | distance px | entropy nats | gate | CPU s |"
    )
    print("|---|---:|---:|---|---|---|---|---:|")
    plt_rows = []
    for setting, names in chosen_settings(SETTINGS, args):
        per_seed = [[by_name[f"seed{s}/{n}"] for n in names] for s in args.seeds]
        top1 = [results["runs"][runs[-1].name]["final"]["top1"] for runs in per_seed]
        curves = [curve(runs) for runs in per_seed]
        gains = [plateau_gain(ys, fifth) for _, ys in curves if len(ys) > fifth]
        cols = [stat(top1), stat(gains)]
        atts = [results["runs"][runs[-1].name]["final"].get("attention") for runs in per_seed]
        for key, fmt in (
            ("pinned_share", ".3f"),
            ("mean_distance_px", ".2f"),
            ("entropy", ".2f"),
            ("gate", ".2f"),
        ):
            blocks = [
                stat([a[b][key] for a in atts if a and key in a[b]], fmt) for b in range(len(atts[0] or []))
            ]
            cols.append(" / ".join(blocks) if any(blocks) else "")
        seconds = [sum(r.cpu_seconds() for r in runs) for runs in per_seed]
        cols.append(f"{statistics.mean(seconds):.0f}")
        print(f"| {setting} | " + " | ".join(cols) + " |")
        plt_rows.append((setting, curves))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    plot(
        plt_rows, args.out / "curves.png", f"Fashion-MNIST, {args.train_samples} training images, {e} epochs"
    )
    print(f"\nwrote {args.out / 'results.json'} and {args.out / 'curves.png'}")


def plot(rows: list, path: Path, title: str, ylabel: str = "top-1 % (validation subset)") -> None:
    from convit_convert.train.plot import pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    for setting, curves in rows:
        n = min(len(xs) for xs, _ in curves)
        xs = curves[0][0][:n]
        ys = [c[1][:n] for c in curves]
        mean = [statistics.mean(v) for v in zip(*ys, strict=True)]
        style = "--" if "no warm-up" in setting else "-"
        (line,) = ax.plot(xs, mean, style, label=setting, linewidth=1.4)
        ax.fill_between(
            xs,
            [min(v) for v in zip(*ys, strict=True)],
            [max(v) for v in zip(*ys, strict=True)],
            color=line.get_color(),
            alpha=0.15,
        )
    ax.set_xlabel("epoch (two-phase: phase 1, then phase 2)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
