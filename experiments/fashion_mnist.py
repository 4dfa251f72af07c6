"""The paper's comparisons on real data at CPU scale: Fashion-MNIST, equal total epochs, several seeds.

    python experiments/fashion_mnist.py [--epochs 8] [--seeds 0 1] [--train-samples 4000]
                                        [--out experiments/out/fmnist] [--data-dir DIR] [--compile]
                                        [--device auto|cpu|cuda] [--loader auto|device|workers]
                                        [--parallel N] [--time-budget SECONDS]

Fashion-MNIST (Debian's dataset-fashion-mnist: 60k / 10k, 28×28 grey, 10 classes), a fixed seeded
subset of the training images, the full 10k validation images. The model: 28 px, P = 4 (a 7×7 grid),
linear patch embedding to hidden_chans 3 (d = 48), 2 blocks, MLP ratio 4, K = 5, so 9 heads. At
equal total epochs E, each with and without the recipe's warm-up (Section 4.3):

- phase 1 only: the conv ViT for E epochs;
- phase 2 only: the attention ViT from random init for E epochs;
- both phases, then one of (E/2 epochs of phase 1, conversion, E/2 epochs of phase 2):
  hard pinning (the exact construction), free extra heads (--heads 12), gated pinning
  (--pinning gated), and the ablation with attention frozen (hard pinning, --freeze-attention:
  only W_V, W_O and the MLPs train).

Every run keeps its run folder (metrics.csv with the per-epoch attention metrics, config.json,
checkpoint-last.pt, log.txt): a run that finished is skipped, one that was stopped is resumed, so a
long table can be completed in several sittings (convit_convert/train/arms.py): ``--parallel N``
runs N arms at once, ``--time-budget S`` stops every arm cleanly before S seconds (exit code 3:
run the same command again). Prints a markdown table of mean ± spread over seeds once all are done.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from arms_cli import add_arm_flags, run_or_exit

from convit_convert.options.training import PEAK_LR, TrainConfig
from convit_convert.train.arms import DONE, Arm, run_arms

# the model and recipe: `cmhsa train --preset cpu` (options/training.py PRESETS: 28 px, P 4, d 48, 2 blocks,
# K 5; no RandAugment, Mixup/CutMix or random erasing, which need far more epochs), on grey images
LR_SCRATCH, LR_PHASE2 = PEAK_LR["cpu"]  # the preset's: the paper's 10:1 between its phase peaks
ATTN_LR_MULT = 10.0
# name -> phase-2 settings after the same phase-1 half (explicit: the defaults follow this table)
SECOND_PHASE = {
    "hard": {"pinning": "hard", "attn_lr_mult": 1.0},
    "free heads": {"pinning": "hard", "heads": 12, "attn_lr_mult": ATTN_LR_MULT},
    "gated": {"pinning": "gated", "attn_lr_mult": ATTN_LR_MULT},
    "frozen attention": {"pinning": "hard", "freeze_attention": True, "attn_lr_mult": 1.0},
}


def arms_for(args: argparse.Namespace) -> tuple[list[Arm], dict[tuple[str, int], list[str]]]:
    """Every run of the table as an arm, and which arms make each table row (one per seed)."""
    e, half = args.epochs, args.epochs // 2
    arms: list[Arm] = []
    rows: dict[tuple[str, int], list[str]] = {}

    def add(row: str, warm: int, name: str, after: tuple[str, ...] = (), **kw) -> None:
        arms.append(Arm(name, config(args.out / name, **kw), after))
        if row:
            rows.setdefault((row, warm), []).append(name)

    for warm in dict.fromkeys((args.warmup, 0)):  # --warmup 0: one setting, not two
        for seed in args.seeds:
            d = f"warmup{warm}/seed{seed}"
            common = dict(
                seed=seed,
                warmup_epochs=warm,
                train_samples=args.train_samples,
                compile=args.compile,
                data_dir=args.data_dir,
                device=args.device,
                loader=args.loader,
            )
            add("phase 1 only", warm, f"{d}/phase1-only", phase="phase1", epochs=e, lr=LR_SCRATCH, **common)
            add(
                "phase 2 only (random init)",
                warm,
                f"{d}/phase2-only",
                phase="phase2",
                init="random",
                epochs=e,
                lr=LR_SCRATCH,
                **common,
            )
            add(
                "phase 1 half (before conversion)",
                warm,
                f"{d}/both-p1",
                phase="phase1",
                epochs=half,
                lr=LR_SCRATCH,
                **common,
            )
            conv = str(args.out / d / "both-p1" / "conv.safetensors")
            for name, extra in SECOND_PHASE.items():
                add(
                    f"both phases, {name}",
                    warm,
                    f"{d}/both-p2-{name.replace(' ', '-')}",
                    (f"{d}/both-p1",),
                    phase="phase2",
                    init=conv,
                    epochs=e - half,
                    lr=LR_PHASE2,
                    **common,
                    **extra,
                )
    return arms, rows


def config(out: Path, **kw) -> TrainConfig:
    """A run of this script's model and recipe on Fashion-MNIST."""
    return TrainConfig.from_flags(
        out=str(out), preset="cpu", data="fashion-mnist", in_chans=1, log_every=10_000, **kw
    )


def train(out: Path, **kw) -> dict:
    """One run, run, resumed or skipped as an arm (fewer_heads.py uses it); its :func:`result`."""
    arm = Arm(out.name, config(out, **kw))
    run_arms([arm])
    if arm.status != DONE:
        raise SystemExit(f"{out}: {arm.status} {arm.note}")
    return result(arm)


def result(arm: Arm, before: Arm | None = None) -> dict:
    """A finished arm's final and first metrics rows and its CPU seconds (plus ``before``'s)."""
    rows = arm.rows()
    seconds = arm.cpu_seconds() + (before.cpu_seconds() if before is not None else 0.0)
    return {"final": rows[-1], "first": rows[0], "seconds": seconds}


def stat(vals: list[float], fmt: str = ".2f") -> str:
    """Mean ± half-range, or "" for no values."""
    if not vals:
        return ""
    return f"{statistics.mean(vals):{fmt}} ± {(max(vals) - min(vals)) / 2:{fmt}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8, help="total epochs per setting")
    ap.add_argument("--warmup", type=int, default=1, help="warm-up epochs of the 'with warm-up' runs")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--train-samples", type=int, default=4000)
    ap.add_argument("--out", type=Path, default=Path("experiments/out/fmnist"))
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the models (on a GPU; the device is auto)"
    )
    ap.add_argument(
        "--data-dir", default=None, help="Folder of the four IDX .gz files (default: Debian's package's)."
    )
    ap.add_argument("--device", default="auto", help="auto, cpu, cuda")
    add_arm_flags(ap)
    args = ap.parse_args()
    arms, table_rows = arms_for(args)
    run_or_exit(arms, args)
    by_name = {a.name: a for a in arms}
    results = {
        key: [result(by_name[n], by_name[by_name[n].after[0]] if by_name[n].after else None) for n in names]
        for key, names in table_rows.items()
    }
    e = args.epochs
    print(
        f"\nFashion-MNIST, {args.train_samples} training images, 10k val, 28 px, P 4, d 48, depth 2, K 5; "
        f"{e} epochs in all; seeds {' '.join(map(str, args.seeds))} (mean ± half-range)\n"
    )
    print(
        "| setting | warm-up | top-1 % | pinned share, block 0 / 1 | distance "
        "px, block 0 / 1 | gate, block 0 / 1 | CPU s |"
    )
    print("|---|---:|---:|---|---|---|---:|")
    for (name, warm), rs in results.items():
        cols = [stat([r["final"]["top1"] for r in rs])]
        for key, fmt in (("share", ".3f"), ("dist_px", ".2f"), ("gate", ".3f")):
            cells = [
                stat([r["final"][f"attn{b}_{key}"] for r in rs if f"attn{b}_{key}" in r["final"]], fmt)
                for b in (0, 1)
            ]
            cols.append(" / ".join(cells) if any(cells) else "")
        cols.append(f"{statistics.mean(r['seconds'] for r in rs):.0f}")
        print(f"| {name} | {warm} | " + " | ".join(cols) + " |")
    summary = {f"{n} | warmup {w}": [r["final"] for r in rs] for (n, w), rs in results.items()}
    (args.out / "results.json").write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
