"""The paper's comparisons on real data at CPU scale: Fashion-MNIST, equal total epochs, several seeds.

    python experiments/fashion_mnist.py [--epochs 8] [--seeds 0 1] [--train-samples 4000] [--out experiments/out/fmnist]
                                        [--data-dir DIR] [--compile]

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
checkpoint-last.pt): a run that finished is skipped, one that was stopped is resumed, so a long
table can be completed in several sittings. Prints a markdown table of mean ± spread over seeds.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import torch

from convit_convert.train.config import TrainConfig
from convit_convert.train.run import run

MODEL = dict(img_size=28, in_chans=1, patch_size=4, hidden_chans=3, depth=2, mlp_ratio=4.0, kernel_size=5)
# cut to fit 2 cores: no RandAugment, Mixup/CutMix or random erasing (they need far more epochs)
RECIPE = dict(aa="none", mixup=0.0, cutmix=0.0, reprob=0.0, scale=(0.5, 1.0), hflip=0.5, smoothing=0.1,
              drop_path=0.1, batch_size=64, lr_base_batch=64, workers=0, log_every=10_000)  # fmt: skip
LR_SCRATCH, LR_PHASE2, ATTN_LR_MULT = 2e-3, 2e-4, 10.0  # the paper's 10:1 between its phase peaks
SECOND_PHASE = {  # name -> phase-2 settings after the same phase-1 half (explicit: the defaults follow this table)
    "hard": {"pinning": "hard", "attn_lr_mult": 1.0},
    "free heads": {"pinning": "hard", "heads": 12, "attn_lr_mult": ATTN_LR_MULT},
    "gated": {"pinning": "gated", "attn_lr_mult": ATTN_LR_MULT},
    "frozen attention": {"pinning": "hard", "freeze_attention": True, "attn_lr_mult": 1.0},
}


def train(out: Path, **kw) -> dict:
    """Run (or resume, or skip if finished) one training run; its final row and CPU seconds."""
    model_file = out / ("conv.safetensors" if kw["phase"] == "phase1" else "vit.safetensors")
    if not model_file.is_file():
        t = time.process_time()
        run(TrainConfig(out=str(out), data="fashion-mnist", resume=(out / "checkpoint-last.pt").is_file(),
                        **MODEL, **RECIPE, **kw))  # fmt: skip
        (out / "cpu_seconds.txt").write_text(f"{time.process_time() - t:.1f}\n")
    with open(out / "metrics.csv", newline="") as f:
        rows = [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    return {"final": rows[-1], "first": rows[0], "seconds": float((out / "cpu_seconds.txt").read_text())}


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
    args = ap.parse_args()
    torch.set_num_threads(2)
    e, half = args.epochs, args.epochs // 2
    results: dict[tuple[str, int], list[dict]] = {}
    t0 = time.time()
    for warm in (args.warmup, 0):
        for seed in args.seeds:
            d = args.out / f"warmup{warm}" / f"seed{seed}"
            common = dict(
                seed=seed, warmup_epochs=warm, train_samples=args.train_samples, compile=args.compile,
                data_dir=args.data_dir,
            )  # fmt: skip
            res = {
                "phase 1 only": train(d / "phase1-only", phase="phase1", epochs=e, lr=LR_SCRATCH, **common),
                "phase 2 only (random init)": train(
                    d / "phase2-only", phase="phase2", init="random", epochs=e, lr=LR_SCRATCH, **common
                ),
            }
            p1 = train(d / "both-p1", phase="phase1", epochs=half, lr=LR_SCRATCH, **common)
            conv = str(d / "both-p1" / "conv.safetensors")
            for name, extra in SECOND_PHASE.items():
                p2 = train(d / f"both-p2-{name.replace(' ', '-')}", phase="phase2", init=conv, epochs=e - half,
                           lr=LR_PHASE2, **common, **extra)  # fmt: skip
                p2["seconds"] += p1["seconds"]
                res[f"both phases, {name}"] = p2
            res["phase 1 half (before conversion)"] = p1
            for name, r in res.items():
                results.setdefault((name, warm), []).append(r)
            print(f"done warm-up {warm}, seed {seed}: {time.time() - t0:.0f} s", flush=True)

    def stat(vals: list[float], fmt: str = ".2f") -> str:
        if not vals:
            return ""
        spread = (max(vals) - min(vals)) / 2
        return f"{statistics.mean(vals):{fmt}} ± {spread:{fmt}}"

    print(f"\nFashion-MNIST, {args.train_samples} training images, 10k val, 28 px, P 4, d 48, depth 2, K 5; "
          f"{e} epochs in all; seeds {' '.join(map(str, args.seeds))} (mean ± half-range)\n")  # fmt: skip
    print(
        "| setting | warm-up | top-1 % | pinned share, block 0 / 1 | distance px, block 0 / 1 | gate, block 0 / 1 | CPU s |"
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
