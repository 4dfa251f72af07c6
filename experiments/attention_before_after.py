"""Attention before and after phase 2, for the both-phases runs of experiments/fashion_mnist.py.

    python experiments/attention_before_after.py [--out experiments/out/fmnist] [--images 1000]

"Before" is the converted model at the start of phase 2 (the phase-1 half converted as that run
converted it); "after" is the trained ``vit.safetensors``. Both are measured on the first 1000
Fashion-MNIST validation images, as ``cmhsa attention`` does. Prints a markdown table: per
setting, warm-up and seed, the mean over blocks of the pinned share (pinned heads), of the
attention distance (all heads) and of the gate (gated heads).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from convit_convert.api import convert_checkpoint, load_checkpoint, save_checkpoint
from convit_convert.api.on_data import attention_on_data
from convit_convert.options.conversion import ConversionSpec
from convit_convert.options.operations import AttentionOptions


def summary(report) -> tuple[str, str, str]:
    means = report.block_means()

    def avg(key: str) -> float | None:
        vals = [v for k, v in means.items() if k.endswith(key)]
        return sum(vals) / len(vals) if vals else None

    return tuple("" if v is None else f"{v:.3f}" for v in (avg("_share"), avg("_dist_px"), avg("_gate")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("experiments/out/fmnist"))
    ap.add_argument("--images", type=int, default=1000)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print(
        "| setting | warm-up | seed | pinned share before → after | distance px "
        "before → after | gate before → after |"
    )
    print("|---|---:|---:|---|---|---|")
    for run in sorted(args.out.glob("warmup*/seed*/both-p2-*")):
        cfg = json.loads((run / "config.json").read_text())
        conv = load_checkpoint(cfg["init"])
        spec = ConversionSpec(
            heads=cfg["model"]["num_heads"], pinning=cfg["model"]["pinning"], seed=cfg["seed"]
        )
        start = convert_checkpoint(conv, spec, verify=False)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "start.safetensors"
            save_checkpoint(path, start.config, start.tensors)
            options = AttentionOptions("fashion-mnist", images=args.images, device="cpu")
            before = summary(attention_on_data(path, options))
        after = summary(
            attention_on_data(
                run / "vit.safetensors", AttentionOptions("fashion-mnist", images=args.images, device="cpu")
            )
        )
        warm, seed, name = (
            run.parent.parent.name.removeprefix("warmup"),
            run.parent.name.removeprefix("seed"),
            run.name,
        )
        cells = [f"{b} → {a}" if b or a else "" for b, a in zip(before, after, strict=True)]
        print(
            f"| {name.removeprefix('both-p2-')} | {warm} | {seed} | " + " | ".join(cells) + " |", flush=True
        )


if __name__ == "__main__":
    main()
