"""The paper's comparisons (Table 1's last rows, Figure 2) at small scale, on CPU, on digits.

    python experiments/digits.py [--epochs 30] [--seed 0] [--out experiments/out]
                                 [--loader auto|device|workers]
                                 [--parallel N] [--time-budget SECONDS]

scikit-learn's 8×8 digits upsampled to 32×32, 4-pixel patches (an 8×8 grid), identity patch
embedding (d = 48), 2 blocks, MLP ratio 4, K = 5 (so 9 heads), DeiT's augmentation and
regularisation as in the paper. At equal total epochs E:

- phase 1 only: the conv ViT for E epochs;
- phase 2 only: the attention ViT from random init for E epochs (the paper's "CMHSA (2nd phase)");
- both phases: E/2 epochs of phase 1, exact conversion, E/2 epochs of phase 2;
- both phases, soft pinning: as above, but converted with a smaller pinning margin and a small
  random W_Q, W_K so the attention pattern can move in phase 2 (see EXPERIMENTS.md);

each with the recipe's warm-up (3 epochs at this scale) and without (Section 4.3). Learning rates
at this scale: 2e-3 when training from scratch, 2e-4 for phase 2 after phase 1 (the paper's 10:1
ratio between its phase-1 and phase-2 peaks); batch 64. Prints a markdown table (EXPERIMENTS.md).
About 17 minutes on 2 CPU cores with the per-image loader (``--loader workers``, which measured the
table). Runs are kept in ``--out``: finished ones are skipped, stopped ones resumed
(``--parallel``, ``--time-budget``: convit_convert/train/arms.py); delete ``--out`` to start over.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from arms_cli import add_arm_flags, run_or_exit

from convit_convert.options.training import TrainConfig
from convit_convert.train.arms import Arm

MODEL = dict(img_size=32, patch_size=4, hidden_chans=3, depth=2, mlp_ratio=4.0, kernel_size=5)


def arm(out: Path, name: str, after: tuple[str, ...] = (), **kw) -> Arm:
    cfg = TrainConfig.from_flags(
        out=str(out / name),
        data="digits",
        batch_size=64,
        lr_base_batch=64,
        workers=0,
        log_every=10_000,
        **MODEL,
        **kw,
    )
    return Arm(name, cfg, after)


def result(a: Arm) -> dict:
    """A finished run's final row, best top-1 and CPU seconds."""
    rows = a.rows()
    return {"final": rows[-1], "seconds": a.cpu_seconds(), "best_top1": max(r["top1"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30, help="total epochs per setting")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up epochs of the 'with warm-up' runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("experiments/out"))
    add_arm_flags(ap)
    args = ap.parse_args()
    e, half = args.epochs, args.epochs // 2
    arms = []
    for warm in dict.fromkeys((args.warmup, 0)):
        t = f"warmup{warm}"
        common = dict(seed=args.seed, warmup_epochs=warm, loader=args.loader)
        hard = dict(pinning="hard", attn_lr_mult=1.0)  # the exact construction, as this table measured it
        conv = str(args.out / t / "both-p1" / "conv.safetensors")
        arms += [
            arm(args.out, f"{t}/phase1-only", phase="phase1", epochs=e, lr=2e-3, **common),
            arm(args.out, f"{t}/phase2-only", phase="phase2", init="random", epochs=e, lr=2e-3, **common),
            arm(args.out, f"{t}/both-p1", phase="phase1", epochs=half, lr=2e-3, **common),
            arm(
                args.out,
                f"{t}/both-p2",
                (f"{t}/both-p1",),
                phase="phase2",
                init=conv,
                epochs=e - half,
                lr=2e-4,
                **hard,
                **common,
            ),
            arm(
                args.out,
                f"{t}/both-p2-soft",
                (f"{t}/both-p1",),
                phase="phase2",
                init=conv,
                epochs=e - half,
                lr=2e-4,
                margin=8.0,
                qk_init_std=0.02,
                verify_tol=0.05,
                **hard,
                **common,
            ),
        ]
    run_or_exit(arms, args)
    by_name = {a.name: a for a in arms}
    results = []
    for warm in dict.fromkeys((args.warmup, 0)):
        r = {
            name: result(by_name[f"warmup{warm}/{name}"])
            for name in ("phase1-only", "phase2-only", "both-p1", "both-p2", "both-p2-soft")
        }
        p1 = r["both-p1"]
        for name, res, secs in (
            ("phase 1 only (conv)", r["phase1-only"], r["phase1-only"]["seconds"]),
            ("phase 2 only (attention, random init)", r["phase2-only"], r["phase2-only"]["seconds"]),
            (f"both phases ({half} + {e - half})", r["both-p2"], p1["seconds"] + r["both-p2"]["seconds"]),
            (
                f"both phases ({half} + {e - half}), soft pinning",
                r["both-p2-soft"],
                p1["seconds"] + r["both-p2-soft"]["seconds"],
            ),
            ("phase 1 half (before conversion)", p1, p1["seconds"]),
        ):
            f = res["final"]
            results.append(
                {
                    "setting": name,
                    "warmup": warm,
                    "top1": f["top1"],
                    "top5": f["top5"],
                    "val_loss": f["val_loss"],
                    "best_top1": res["best_top1"],
                    "seconds": secs,
                }
            )
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\ndigits, 32 px, P 4, d 48, depth 2, K 5, {e} epochs in all, seed {args.seed}\n")
    print("| setting | warm-up epochs | top-1 % (final) | best top-1 % | top-5 % | val loss | CPU s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['setting']} | {r['warmup']} | {r['top1']:.2f} | {r['best_top1']:.2f} | {r['top5']:.2f} | "
            f"{r['val_loss']:.4f} | {r['seconds']:.0f} |"
        )


if __name__ == "__main__":
    main()
