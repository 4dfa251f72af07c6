"""What ``cmhsa attention`` costs against a plain forward pass over the same images, at the paper's size.

    python bench/attention_cost.py [--batch 8] [--batches 3] [--pinning hard|gated]

The paper's attention model (224 px, P = 16, d = 768, depth 6, 9 heads, qk_dim 768) on CPU, float32,
2 threads: the seconds of ``model(x)`` over the batches, then of ``attention_stats`` over the same
batches (the forward pass records the weights; the statistics are sums over them). Target: at most
1.3x. Interleaved, median of 3 rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from sizes import add_size_flag, conv_config

from convit_convert.analysis import attention_stats
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--batches", type=int, default=3)
    ap.add_argument("--pinning", default="hard")
    add_size_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = conv_config(args)
    plan = ConversionSpec(pinning=args.pinning).plan(cfg)
    sd, acfg = convert_state_dict(VisionTransformer(cfg).state_dict(), plan), plan.config
    model = VisionTransformer(acfg)
    model.load_state_dict(sd)
    model.eval()
    batches = [torch.randn(args.batch, 3, *cfg.img_size) for _ in range(args.batches)]
    with torch.no_grad():
        model(batches[0])  # warm-up
    plain, stats = [], []
    for _ in range(3):
        t = time.perf_counter()
        with torch.no_grad():
            for x in batches:
                model(x)
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        attention_stats(model, batches)
        stats.append(time.perf_counter() - t)
    p, s = statistics.median(plain), statistics.median(stats)
    n = args.batch * args.batches
    size = "tiny" if args.tiny else "paper-size"
    print(f"{size} attention model, pinning {args.pinning}, {n} images, batch {args.batch}, 2 threads, CPU")
    print(f"plain forward {p:.2f} s, attention_stats {s:.2f} s: {s / p:.2f}x (rounds: {plain} / {stats})")


if __name__ == "__main__":
    main()
