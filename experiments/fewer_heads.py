"""Fewer heads than the theorem needs, measured on Fashion-MNIST (the paper's open problem).

    python experiments/fewer_heads.py [--seeds 0 1] [--finetune-epochs 1] [--out experiments/out/fewer_heads]

The phase-1 models are experiments/fashion_mnist.py's "phase 1 only" runs (28 px, P = 4, d = 48,
depth 2, K = 5: 9 offsets, 6 epochs on 4000 training images, warm-up 1), trained here with the same
settings if missing. For every N = 1 … 9 heads and three ways to build N heads:

- greedy + refit: cmhsa's ``convert --approximate`` (offsets dropped one at a time by measured
  mixer error on 256 calibration images from the training split, kept heads' W_O refit);
- greedy + taps (plain dropping): the same offsets, the kernel's taps kept (``--no-refit``);
- corner-first + taps (plain dropping): the fixed rule (diagonals first, then the sides);

it reports top-1 on the 10k validation images right after conversion, and after a short phase-2
fine-tune of the converted model (``--finetune-epochs``, lr 2e-4, no warm-up, hard pinning, the
fashion_mnist.py recipe). Prints the markdown table for EXPERIMENTS.md and writes results.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fashion_mnist import LR_PHASE2, LR_SCRATCH, train

from convit_convert.api import convert_checkpoint, load_checkpoint, save_checkpoint
from convit_convert.api.on_data import calibration_from_data, evaluate_checkpoint
from convit_convert.construct import pinned_offsets
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.operations import CalibrationSource, EvalOptions
from convit_convert.theory import offset_tap_share

METHODS = {  # name -> (rule, refit)
    "greedy + refit": ("greedy", True),
    "greedy + taps": ("greedy", False),
    "corner-first + taps": ("corner", False),
}


def top1(path: Path) -> float:
    options = EvalOptions("fashion-mnist", workers=0, batch_size=500, device="cpu")
    return evaluate_checkpoint(path, options).top1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--finetune-epochs", type=int, default=1)
    ap.add_argument(
        "--finetune",
        default="greedy + refit,corner-first + taps",
        help="methods to fine-tune (comma list; N = 9 always is)",
    )
    ap.add_argument("--heads", type=int, nargs="+", default=list(range(1, 10)))
    ap.add_argument("--fmnist-out", type=Path, default=Path("experiments/out/fmnist"))
    ap.add_argument("--out", type=Path, default=Path("experiments/out/fewer_heads"))
    ap.add_argument("--summarize", action="store_true", help="only print the table from OUT/results.json")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.out, args.seeds, args.finetune_epochs)
        return
    torch.set_num_threads(2)
    t0 = time.time()
    rows: dict[tuple[str, int], dict[str, list[float]]] = {}
    for seed in args.seeds:
        p1 = args.fmnist_out / "warmup1" / f"seed{seed}" / "phase1-only"
        train(p1, phase="phase1", epochs=6, lr=LR_SCRATCH, seed=seed, warmup_epochs=1, train_samples=4000)
        conv_file = p1 / "conv.safetensors"
        ckpt = load_checkpoint(conv_file)
        calib = calibration_from_data(
            ckpt.config, CalibrationSource("fashion-mnist", calib_images=256, heldout_images=1, seed=seed)
        )
        conv_top1 = top1(conv_file)
        for n in args.heads:
            for name, (rule, refit) in METHODS.items():
                if n == 9 and name != "greedy + refit":
                    continue  # 9 heads: the exact conversion, whatever the method
                d = args.out / f"seed{seed}" / f"n{n}-{rule}-{'refit' if refit else 'drop'}"
                d.mkdir(parents=True, exist_ok=True)
                vit = d / "vit.safetensors"
                if not vit.is_file():
                    spec = ConversionSpec(heads=n, approximate=True, rule=rule, refit=refit, seed=seed)
                    c = convert_checkpoint(ckpt, spec, calibration=calib, verify=False)
                    save_checkpoint(vit, c.config, c.tensors)
                r = rows.setdefault((name, n), {"conv": [], "converted": [], "finetuned": []})
                r["conv"].append(conv_top1)
                r["converted"].append(top1(vit))
                if name in args.finetune.split(",") or n == 9:
                    ft = train(
                        d / "finetune",
                        phase="phase2",
                        init=str(vit),
                        epochs=args.finetune_epochs,
                        lr=LR_PHASE2,
                        seed=seed,
                        warmup_epochs=0,
                        train_samples=4000,
                        attn_lr_mult=1.0,
                    )
                    r["finetuned"].append(ft["final"]["top1"])
                print(
                    f"seed {seed} N {n} {name}: {r['converted'][-1]:.2f}"
                    + (f" -> {r['finetuned'][-1]:.2f}" if r["finetuned"] else "")
                    + f"  ({time.time() - t0:.0f} s)",
                    flush=True,
                )

    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(
        json.dumps({f"{k[0]} | N={k[1]}": v for k, v in rows.items()}, indent=2)
    )
    summarize(args.out, args.seeds, args.finetune_epochs)


def taps_dropped(vit: Path) -> float:
    """Percent of the kernel's (pixel, tap) pairs whose offsets the file's heads no longer read,
    mean over blocks (offsets read back from the pinning biases)."""
    ckpt = load_checkpoint(vit)
    cfg = ckpt.config
    share = offset_tap_share(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    lost = []
    for i in range(cfg.depth):
        kept = set(
            pinned_offsets(
                ckpt.tensors[f"blocks.{i}.attn.rel_pos_bias"], ckpt.tensors.get(f"blocks.{i}.attn.sink")
            )
        )
        lost.append(100 * sum(v for o, v in share.items() if o not in kept))
    return statistics.mean(lost)


def summarize(out: Path, seeds: list[int], epochs: int) -> None:
    """The markdown table from results.json and the converted files."""
    rows = json.loads((out / "results.json").read_text())

    def stat(v: list[float], fmt: str = ".2f") -> str:
        return "" if not v else f"{statistics.mean(v):{fmt}} ± {(max(v) - min(v)) / 2:{fmt}}"

    conv = sorted({v for r in rows.values() for v in r["conv"]})
    print(
        f"\nFashion-MNIST phase-1 models (seeds {' '.join(map(str, seeds))}): conv top-1 {stat(conv)}; "
        f"fine-tune: {epochs} epoch(s) of phase 2 on 4000 images; mean ± half-range over seeds\n"
    )
    print("| heads N | method | kernel taps dropped % | top-1 % after conversion | after fine-tune |")
    print("|---:|---|---:|---:|---:|")
    for key, r in sorted(
        rows.items(), key=lambda kv: (int(kv[0].split("N=")[1]), list(METHODS).index(kv[0].split(" | ")[0]))
    ):
        name, n = key.split(" | ")[0], int(key.split("N=")[1])
        rule, refit = METHODS[name]
        vits = [
            out / f"seed{s}" / f"n{n}-{rule}-{'refit' if refit else 'drop'}" / "vit.safetensors"
            for s in seeds
        ]
        taps = stat([taps_dropped(v) for v in vits], ".1f")
        label = "exact (Theorem 1)" if n == 9 else name
        print(f"| {n} | {label} | {taps} | {stat(r['converted'])} | {stat(r['finetuned'])} |")


if __name__ == "__main__":
    main()
