"""Small-data training speed: the workers loader (timm's per-image transforms) against the device
loader (data held as a tensor, augmented per batch), whole runs of the EXPERIMENTS.md model.

    python bench/train_small.py [--data-dir DIR] [--recipe deit|experiments] [--device cpu|cuda] [--compile]
                                [--rows main|threads|all|accuracy] [--repeat N] [--epochs 2]
                                [--train-samples 4096]

Fashion-MNIST (Debian's dataset-fashion-mnist, or --data-dir), 28 px, P 4, d 48, depth 2, K 5,
batch 128, 4,096 training images, the 10k validation images evaluated after every epoch. Each row
is one ``run()`` of ``--epochs`` epochs in this process (imports already paid): phase 1 from
random init, then phase 2 (gated pinning) from the device run's phase-1 model. Reported: training
images/s of each epoch (metrics.csv: images over the training steps' seconds, evaluation
excluded), and the run's wall seconds (data loading, every epoch's training and evaluation,
checkpoints). ``--rows threads`` adds the sweep behind the defaults: threads 1 and 2 with the
device loader, workers 0, 1 and 2 with the workers loader.

``--rows accuracy`` answers whether the device loader trains as well as the workers loader: phase
1, 6 epochs, seeds 0 and 1 (``--seeds``), each loader, with the experiments recipe (lr 2e-3 at batch 64) and
the DeiT recipe at the same learning rate, run through convit_convert.train.arms (``--parallel``,
resumable in ``--out``); it prints the final top-1 of each run and each loader's mean ± half-range.

Recipes: ``deit`` is the paper's (RandAugment rand-m9-mstd0.5-inc1, random erasing 0.25,
Mixup/CutMix, smoothing); ``experiments`` is experiments/fashion_mnist.py's (crop, flip and colour
jitter only).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from statistics import median

import torch

from convit_convert.options.training import TrainConfig
from convit_convert.train.run import run

MODEL = dict(img_size=28, in_chans=1, patch_size=4, hidden_chans=3, depth=2, mlp_ratio=4.0, kernel_size=5)
RECIPES = {
    "deit": {},
    "experiments": dict(aa="none", mixup=0.0, cutmix=0.0, reprob=0.0, scale=(0.5, 1.0)),
}


def one_run(out: Path, phase: str, loader: str, threads: int, workers: int, args, **kw) -> dict:
    cfg = TrainConfig.from_flags(
        out=str(out),
        phase=phase,
        data="fashion-mnist",
        data_dir=args.data_dir,
        train_samples=args.train_samples,
        epochs=args.epochs,
        warmup_epochs=1,
        batch_size=128,
        loader=loader,
        threads=threads,
        workers=workers,
        device=args.device,
        compile=args.compile,
        log_every=10_000,
        **MODEL,
        **RECIPES[args.recipe],
        **kw,
    )
    t = time.perf_counter()
    res = run(cfg)
    wall = time.perf_counter() - t
    return {"ips": [r["images_per_s"] for r in res.rows], "top1": res.rows[-1]["top1"], "wall": wall}


def ceilings(args: argparse.Namespace) -> list[str]:
    """What bounds a run's speed: each phase's bare training step (fixed batch, no loader, no
    Mixup) and forward pass at batch 128, and the device loader's batch augmentation alone."""
    from timm.loss import SoftTargetCrossEntropy

    from convit_convert.config import ViTConfig
    from convit_convert.data import build_data
    from convit_convert.loaders import EpochSampler, channel_stats
    from convit_convert.model import VisionTransformer
    from convit_convert.train.augment import augment_spec
    from convit_convert.train.held import HeldLoader, hold

    def rate(fn, images: int, n: int = 10) -> float:
        for _ in range(3):
            fn()
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return n * images / (time.perf_counter() - t)

    lines = []
    conv = ViTConfig.build(
        img_size=(28, 28), num_classes=10, **{k: v for k, v in MODEL.items() if k != "img_size"}
    )
    for name, cfg in (("phase 1", conv), ("phase 2 (gated)", conv.with_attention(9, pinning="gated"))):
        model = VisionTransformer(cfg, 0.1)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x, y = torch.randn(128, 1, 28, 28), torch.softmax(torch.randn(128, 10), 1)

        def step(model=model, opt=opt, x=x, y=y) -> None:
            loss = SoftTargetCrossEntropy()(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()

        train = rate(step, 128)
        model.eval()
        with torch.inference_mode():
            fwd = rate(lambda model=model, x=x: model(x), 128)
        lines.append(
            f"{name}: bare training step {train:.0f} images/s, forward {fwd:.0f} images/s (batch 128)"
        )
    spec = build_data("fashion-mnist", args.data_dir, (28, 28), train_samples=args.train_samples)
    images, labels = hold(spec.train, 1, torch.device(args.device), 64)
    mean, std = channel_stats(1)
    for recipe in ("deit", "experiments"):
        sampler = EpochSampler(len(labels), rank=0, world=1, batch_size=128, seed=0, shuffle=True)
        aug = augment_spec(TrainConfig.from_flags(**RECIPES[recipe]).recipe, (28, 28), mean, std)
        loader = HeldLoader(images, labels, sampler, aug, seed=0)
        lines.append(
            f"device loader, recipe {recipe}: augmentation alone "
            f"{rate(lambda loader=loader: list(loader), args.train_samples, 3):.0f} images/s"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--recipe", choices=sorted(RECIPES), default="deit")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile the models (a GPU run: bf16 by default)"
    )
    ap.add_argument("--rows", choices=("main", "threads", "all", "accuracy"), default="main")
    ap.add_argument("--parallel", type=int, default=2, help="--rows accuracy: runs at once")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="--rows accuracy: seeds")
    ap.add_argument("--recipes", nargs="+", default=["experiments", "deit"], help="--rows accuracy: recipes")
    ap.add_argument(
        "--out", type=Path, default=Path("bench/out/loader_accuracy"), help="--rows accuracy: run folders"
    )
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=1, help="repetitions of every row (this VM's timings vary)")
    ap.add_argument("--train-samples", type=int, default=4096)
    args = ap.parse_args()
    if args.rows == "accuracy":
        accuracy(args)
        return
    cpus = torch.get_num_threads()
    settings = []
    if args.rows in ("main", "all"):
        settings += [("workers", cpus, min(4, cpus)), ("device", cpus, 0)]
    if args.rows in ("threads", "all"):
        settings += [("device", 1, 0)] + [("workers", cpus, w) for w in range(0, min(4, cpus) + 1)]
    settings = list(dict.fromkeys(settings))
    results: dict[tuple[str, str], list[dict]] = {}  # (setting, phase) -> one result per repetition
    for rep in range(args.repeat):
        root = Path(tempfile.mkdtemp(prefix="train_small-"))
        try:
            conv = None
            for phase in ("phase 1", "phase 2 (gated)"):
                for i, (loader, threads, workers) in enumerate(settings):
                    name = f"{loader}" + (f", {workers} workers" if loader == "workers" else "")
                    name += f", {threads} threads"
                    kw = {} if phase == "phase 1" else {"init": str(conv), "pinning": "gated"}
                    out = root / f"{phase[:7].replace(' ', '')}-{i}"
                    run_phase = "phase1" if phase == "phase 1" else "phase2"
                    r = one_run(out, run_phase, loader, threads, workers, args, **kw)
                    results.setdefault((name, phase), []).append(r)
                    print(f"repetition {rep + 1}: {name}, {phase}: {r}", flush=True)
                    if phase == "phase 1" and (conv is None or (loader == "device" and threads == cpus)):
                        conv = out / "conv.safetensors"
        finally:
            shutil.rmtree(root, ignore_errors=True)
    if args.rows in ("main", "all"):
        print("\n" + "\n".join(ceilings(args)))
    print(
        f"\n{args.device}, {cpus} threads available, torch {torch.__version__}; {args.epochs} epochs, "
        f"{args.train_samples} training images, 10k validation images, batch 128, recipe {args.recipe}; "
        f"{args.repeat} repetition(s), each cell one per repetition, then the median\n"
    )
    print("| loader | phase | train images/s (mean of the epochs) | median | run wall s | median | top-1 % |")
    print("|---|---|---:|---:|---:|---:|---:|")

    def ips(r: dict) -> float:
        return sum(r["ips"]) / len(r["ips"])

    for (name, phase), rs in results.items():
        a, w = [ips(r) for r in rs], [r["wall"] for r in rs]
        print(
            f"| {name} | {phase} | {' / '.join(f'{v:.0f}' for v in a)} | {median(a):.0f} | "
            f"{' / '.join(f'{v:.1f}' for v in w)} | {median(w):.1f} | {rs[0]['top1']:.2f} |"
        )
    base_name, dev_name = f"workers, {min(4, cpus)} workers, {cpus} threads", f"device, {cpus} threads"
    for phase in ("phase 1", "phase 2 (gated)"):
        b, d = results.get((base_name, phase)), results.get((dev_name, phase))
        if b and d:
            ratio = [ips(y) / ips(x) for x, y in zip(b, d, strict=True)]
            faster = [x["wall"] / y["wall"] for x, y in zip(b, d, strict=True)]
            print(
                f"{phase}: device / workers: training images/s {' / '.join(f'{v:.2f}' for v in ratio)}x "
                f"(median {median(ratio):.2f}x); run wall time {' / '.join(f'{v:.2f}' for v in faster)}x "
                f"faster (median {median(faster):.2f}x)"
            )


def accuracy(args: argparse.Namespace) -> None:
    from statistics import mean

    from convit_convert.train.arms import Arm, run_arms

    arms = []
    for recipe in args.recipes:
        for loader in ("workers", "device"):
            for seed in args.seeds:
                cfg = TrainConfig.from_flags(
                    out=str(args.out / recipe / loader / f"seed{seed}"),
                    phase="phase1",
                    data="fashion-mnist",
                    data_dir=args.data_dir,
                    train_samples=4000,
                    epochs=6,
                    warmup_epochs=1,
                    batch_size=64,
                    lr=2e-3,
                    lr_base_batch=64,
                    loader=loader,
                    seed=seed,
                    device=args.device,
                    log_every=10_000,
                    **MODEL,
                    **RECIPES[recipe],
                )
                arms.append(Arm(f"{recipe}/{loader}/seed{seed}", cfg))
    run_arms(
        arms,
        parallel=args.parallel,
        report=lambda a: print(f"{a.status} {a.name} {a.seconds:.0f} s", flush=True),
    )
    top1 = {a.name: a.rows()[-1]["top1"] for a in arms}
    seeds = " / ".join(map(str, args.seeds))
    print(f"\n| recipe | loader | top-1, seeds {seeds} | mean ± half-range |")
    print("|---|---|---:|---:|")
    for recipe in args.recipes:
        for loader in ("workers", "device"):
            v = [top1[f"{recipe}/{loader}/seed{s}"] for s in args.seeds]
            cells = " / ".join(f"{x:.2f}" for x in v)
            print(f"| {recipe} | {loader} | {cells} | {mean(v):.2f} ± {(max(v) - min(v)) / 2:.2f} |")


if __name__ == "__main__":
    main()
