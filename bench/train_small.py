"""Small-data training speed: the workers loader (timm's per-image transforms) against the device
loader (data held as a tensor, augmented per batch), whole runs of the EXPERIMENTS.md model.

    python bench/train_small.py [--data-dir DIR] [--recipe deit|experiments] [--device cpu|cuda]
                                [--rows main|threads|all] [--epochs 2] [--train-samples 4096]

Fashion-MNIST (Debian's dataset-fashion-mnist, or --data-dir), 28 px, P 4, d 48, depth 2, K 5,
batch 128, 4,096 training images, the 10k validation images evaluated after every epoch. Each row
is one ``run()`` of ``--epochs`` epochs in this process (imports already paid): phase 1 from
random init, then phase 2 (gated pinning) from the device run's phase-1 model. Reported: training
images/s of each epoch (metrics.csv: images over the training steps' seconds, evaluation
excluded), and the run's wall seconds (data loading, every epoch's training and evaluation,
checkpoints). ``--rows threads`` adds the sweep behind the defaults: threads 1 and 2 with the
device loader, workers 0, 1 and 2 with the workers loader.

Recipes: ``deit`` is the paper's (RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25,
Mixup/CutMix, smoothing); ``experiments`` is experiments/fashion_mnist.py's (crop and flip only).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from convit_convert.train.config import TrainConfig
from convit_convert.train.run import run

MODEL = dict(img_size=28, in_chans=1, patch_size=4, hidden_chans=3, depth=2, mlp_ratio=4.0, kernel_size=5)
RECIPES = {
    "deit": {},
    "experiments": dict(aa="none", mixup=0.0, cutmix=0.0, reprob=0.0, scale=(0.5, 1.0)),
}


def one_run(out: Path, phase: str, loader: str, threads: int, workers: int, args, **kw) -> dict:
    cfg = TrainConfig(
        out=str(out), phase=phase, data="fashion-mnist", data_dir=args.data_dir, train_samples=args.train_samples,
        epochs=args.epochs, warmup_epochs=1, batch_size=128, loader=loader, threads=threads, workers=workers,
        device=args.device, log_every=10_000, **MODEL, **RECIPES[args.recipe], **kw,
    )  # fmt: skip
    t = time.perf_counter()
    res = run(cfg)
    wall = time.perf_counter() - t
    return {"ips": [r["images_per_s"] for r in res.rows], "top1": res.rows[-1]["top1"], "wall": wall}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="deit")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rows", choices=("main", "threads", "all"), default="main")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--train-samples", type=int, default=4096)
    args = ap.parse_args()
    cpus = torch.get_num_threads()
    root = Path(tempfile.mkdtemp(prefix="train_small-"))
    rows: list[tuple[str, str, str, dict]] = []
    try:
        conv = None
        settings = []
        if args.rows in ("main", "all"):
            settings += [("workers", cpus, min(4, cpus)), ("device", cpus, 0)]
        if args.rows in ("threads", "all"):
            settings += [("device", 1, 0)] + [("workers", cpus, w) for w in range(0, min(4, cpus) + 1)]
        for i, (loader, threads, workers) in enumerate(dict.fromkeys(settings)):
            name = (
                f"{loader}" + (f", {workers} workers" if loader == "workers" else "") + f", {threads} threads"
            )
            r1 = one_run(root / f"p1-{i}", "phase1", loader, threads, workers, args)
            rows.append((name, "phase 1", args.recipe, r1))
            print(f"{name}, phase 1: {r1}", flush=True)
            if conv is None or (loader == "device" and threads == cpus):
                conv = root / f"p1-{i}" / "conv.safetensors"
        for i, (loader, threads, workers) in enumerate(dict.fromkeys(settings)):
            name = (
                f"{loader}" + (f", {workers} workers" if loader == "workers" else "") + f", {threads} threads"
            )
            r2 = one_run(
                root / f"p2-{i}", "phase2", loader, threads, workers, args, init=str(conv), pinning="gated"
            )
            rows.append((name, "phase 2 (gated)", args.recipe, r2))
            print(f"{name}, phase 2: {r2}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.device}, {cpus} threads available, torch {torch.__version__}; {args.epochs} epochs, "
          f"{args.train_samples} training images, 10k validation images, batch 128, recipe {args.recipe}\n")  # fmt: skip
    print("| loader | phase | train images/s, epoch 1 / 2 | run wall s | top-1 % |")
    print("|---|---|---:|---:|---:|")
    for name, phase, _, r in rows:
        ips = " / ".join(f"{v:.0f}" for v in r["ips"])
        print(f"| {name} | {phase} | {ips} | {r['wall']:.1f} | {r['top1']:.2f} |")
    base = {
        ph: r for n, ph, _, r in rows if n.startswith("workers") and f"{min(4, cpus)} workers, {cpus}" in n
    }
    dev = {ph: r for n, ph, _, r in rows if n == f"device, {cpus} threads"}
    for ph in base.keys() & dev.keys():
        b, d = base[ph], dev[ph]
        print(f"{ph}: device / workers: training images/s {d['ips'][-1] / b['ips'][-1]:.2f}x (last epoch), "
              f"run wall time {b['wall'] / d['wall']:.2f}x faster")  # fmt: skip


if __name__ == "__main__":
    main()
