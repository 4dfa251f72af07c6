"""The paper's comparisons (Table 1's last rows, Figure 2) at small scale, on CPU, on digits.

    python experiments/digits.py [--epochs 30] [--seed 0] [--out experiments/out]

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
About 17 minutes on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import torch

from convit_convert.train.config import TrainConfig
from convit_convert.train.run import run

MODEL = dict(img_size=32, patch_size=4, hidden_chans=3, depth=2, mlp_ratio=4.0, kernel_size=5)


def train(out: Path, **kw) -> dict:
    cfg = TrainConfig(
        out=str(out),
        data="digits",
        batch_size=64,
        lr_base_batch=64,
        workers=0,
        log_every=10_000,
        **MODEL,
        **kw,
    )
    t = time.perf_counter()
    result = run(cfg)
    rows = result.rows
    return {
        "rows": rows,
        "seconds": time.perf_counter() - t,
        "final": rows[-1],
        "best_top1": max(r["top1"] for r in rows),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=30, help="total epochs per setting")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up epochs of the 'with warm-up' runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("experiments/out"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    shutil.rmtree(args.out, ignore_errors=True)
    e, half = args.epochs, args.epochs // 2
    results = []
    for warm in (args.warmup, 0):
        tag = f"warmup{warm}"
        common = dict(seed=args.seed, warmup_epochs=warm)
        p1_only = train(args.out / tag / "phase1-only", phase="phase1", epochs=e, lr=2e-3, **common)
        p2_only = train(
            args.out / tag / "phase2-only", phase="phase2", init="random", epochs=e, lr=2e-3, **common
        )
        p1 = train(args.out / tag / "both-p1", phase="phase1", epochs=half, lr=2e-3, **common)
        conv = str(args.out / tag / "both-p1" / "conv.safetensors")
        hard = dict(pinning="hard", attn_lr_mult=1.0)  # the exact construction, as this table measured it
        p2 = train(
            args.out / tag / "both-p2", phase="phase2", init=conv, epochs=e - half, lr=2e-4, **hard, **common
        )
        soft = train(
            args.out / tag / "both-p2-soft", phase="phase2", init=conv, epochs=e - half, lr=2e-4,
            margin=8.0, qk_init_std=0.02, verify_tol=0.05, **hard, **common,
        )  # fmt: skip
        for name, res, secs in (
            ("phase 1 only (conv)", p1_only, p1_only["seconds"]),
            ("phase 2 only (attention, random init)", p2_only, p2_only["seconds"]),
            (f"both phases ({half} + {e - half})", p2, p1["seconds"] + p2["seconds"]),
            (f"both phases ({half} + {e - half}), soft pinning", soft, p1["seconds"] + soft["seconds"]),
        ):
            f = res["final"]
            results.append(
                {"setting": name, "warmup": warm, "top1": f["top1"], "top5": f["top5"], "val_loss": f["val_loss"],
                 "best_top1": res["best_top1"], "seconds": secs}
            )  # fmt: skip
        results.append({"setting": "phase 1 half (before conversion)", "warmup": warm, "top1": p1["final"]["top1"],
                        "top5": p1["final"]["top5"], "val_loss": p1["final"]["val_loss"],
                        "best_top1": p1["best_top1"], "seconds": p1["seconds"]})  # fmt: skip
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    print(f"\ndigits, 32 px, P 4, d 48, depth 2, K 5, {e} epochs in all, seed {args.seed}\n")
    print("| setting | warm-up epochs | top-1 % (final) | best top-1 % | top-5 % | val loss | CPU time |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['setting']} | {r['warmup']} | {r['top1']:.2f} | {r['best_top1']:.2f} | {r['top5']:.2f} | "
            f"{r['val_loss']:.4f} | {r['seconds']:.0f} s |"
        )


if __name__ == "__main__":
    main()
