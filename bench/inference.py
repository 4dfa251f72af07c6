"""CPU inference throughput of the paper-size models beside timm's DeiT-base.

    python bench/inference.py [--batch 8] [--threads 2] [--iters 5]

Paper size: 224 px, P = 16, hidden_chans 3 (identity embedding, d = 768), depth 6, MLP 3072,
K = 5, 100 classes; the attention models have 9 heads (qk_dim 768 = the paper's, and 64), as
trained (``AttnViT``) and re-parameterised for inference (``convit_convert.deploy.fuse_attention``).
DeiT-base (12 layers, d = 768) is built by timm without weights. Random weights: throughput does
not depend on them. Prints a markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
from sizes import add_size_flag, conv_config

from convit_convert.deploy import fuse_attention
from convit_convert.model import VisionTransformer

SIDE = [224]  # the images' side: the paper's, or the tiny model's with --tiny


def images_per_s(model: torch.nn.Module, batch: int, iters: int, warmup: int = 2) -> tuple[float, float]:
    """(mean images/s, best images/s) over ``iters`` timed forward passes."""
    x = torch.randn(batch, 3, SIDE[0], SIDE[0])
    model.eval()
    times = []
    with torch.inference_mode():
        for _ in range(warmup):
            model(x)
        for _ in range(iters):
            t = time.perf_counter()
            model(x)
            times.append(time.perf_counter() - t)
    return batch * len(times) / sum(times), batch / min(times)


def gflops(model: torch.nn.Module, batch: int) -> float:
    """Multiply-adds per image (GMAC), counted by torch's FLOP counter."""
    from torch.utils.flop_counter import FlopCounterMode

    with torch.inference_mode(), FlopCounterMode(display=False) as fc:
        model(torch.randn(1, 3, SIDE[0], SIDE[0]))
    return fc.get_total_flops() / 2 / 1e9


# with --tiny, DeiT-base's architecture at the tiny model's size (so the table still has its row)
TINY_DEIT = {"img_size": 16, "patch_size": 4, "embed_dim": 48, "depth": 1, "num_heads": 3}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    add_size_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    import timm

    cfg = conv_config(args)  # the paper's model
    SIDE[0] = cfg.img_size[0]
    models = {
        "ConvViT (phase 1, K=5)": VisionTransformer(cfg),
        "AttnViT 9 heads, qk_dim 768 (paper)": VisionTransformer(cfg.with_attention(9)),
        "AttnViT 9 heads, qk_dim 64": VisionTransformer(cfg.with_attention(9, qk_dim=64)),
        "AttnViT qk_dim 768, fused for inference": fuse_attention(VisionTransformer(cfg.with_attention(9))),
        "AttnViT qk_dim 64, fused for inference": fuse_attention(
            VisionTransformer(cfg.with_attention(9, qk_dim=64))
        ),
        "timm deit_base_patch16_224": timm.create_model(
            "deit_base_patch16_224",
            pretrained=False,
            num_classes=cfg.num_classes,
            **(TINY_DEIT if args.tiny else {}),
        ),
    }
    results = {}
    for name, model in models.items():
        mean, best = images_per_s(model, args.batch, args.iters)
        weights = [
            *model.parameters(),
            *(b for b in model.buffers() if b.is_floating_point()),
        ]  # fused: buffers
        results[name] = (mean, best, gflops(model, 1), sum(w.numel() for w in weights) / 1e6)
        print(f"{name}: {mean:.2f} img/s (best {best:.2f})", flush=True)
    deit = results["timm deit_base_patch16_224"][0]
    print(
        f"\ntorch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"batch {args.batch}, {args.threads} threads, float32, mean of {args.iters} passes after 2 warm-up\n"
    )
    print("| model | weights (M) | GMAC/img | img/s | best img/s | vs DeiT-base |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, (mean, best, g, params) in results.items():
        print(f"| {name} | {params:.1f} | {g:.1f} | {mean:.2f} | {best:.2f} | {mean / deit:.2f}x |")


if __name__ == "__main__":
    main()
