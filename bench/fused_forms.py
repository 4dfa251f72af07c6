"""Forms of the fused attention's per-head products, timed in the paper-size model's inference.

    PYTHONPATH=. python bench/fused_forms.py [--batch 128] [--steps 8] [--no-compile]

Each form computes the fused attention's [P_1 X̃, ..., P_h X̃] its own way: "model" is the
model's custom op (convit_convert.kernels.head_products), which torch.compile keeps whole;
"plain_loop" is the same loop as plain torch code that inductor traces into; "cat" concatenates
the heads' products. The model is the attention ViT at the paper's size (qk_dim 64), fused, bf16 autocast,
inference_mode, against timm's deit_base_patch16_224 run the same way. Needs a CUDA device.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from gpu_suite import cuda_ms, print_top_kernels  # bench/gpu_suite.py, beside this script

import convit_convert.deploy as deploy_mod
from convit_convert.config import ViTConfig
from convit_convert.deploy import fuse_attention
from convit_convert.kernels import head_products_loop
from convit_convert.model import VisionTransformer


def cat(p: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The heads' products concatenated (inductor may write them into the result in place)."""
    return torch.cat([torch.bmm(p[:, i], x) for i in range(p.shape[1])], -1)


FORMS: dict[str, Callable] = {
    "model": deploy_mod.head_products,
    "plain_loop": head_products_loop,
    "cat": cat,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--profile", action="store_true", help="Also the top CUDA kernels of each compiled run.")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"Comma list of {', '.join(FORMS)}.")
    args = ap.parse_args()
    import timm

    torch.backends.cuda.matmul.allow_tf32 = True
    x = torch.randn(args.batch, 3, 224, 224, device="cuda")
    cfg = ViTConfig.build().with_attention(9, qk_dim=64)
    ref = None
    for compiled in (False,) if args.no_compile else (False, True):
        runs = [
            (name, lambda: fuse_attention(VisionTransformer(cfg)), FORMS[name])
            for name in args.forms.split(",")
        ]
        runs.append(("deit_base", lambda: timm.create_model("deit_base_patch16_224", num_classes=100), None))
        for name, make, form in runs:
            deploy_mod.head_products = form or FORMS["model"]
            torch._dynamo.reset()  # compiled code is cached by code object, not by the patched function
            torch.manual_seed(0)
            model = make().cuda().eval()
            fn = torch.compile(model) if compiled else model

            @torch.inference_mode()
            def fwd(fn=fn) -> torch.Tensor:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    return fn(x)

            out = fwd().float()
            if form is not None:
                ref = out if ref is None else ref
                err = ((out - ref).abs().max() / ref.abs().max()).item()
            ms = cuda_ms(fwd, 3, args.steps)
            tag = "compiled" if compiled else "eager"
            print(
                f"{name:20s} {tag:8s} {ms:7.2f} ms  {args.batch / ms * 1e3:7.0f} img/s"
                + (f"  logits vs the first form eager {err:.1e}" if form is not None else ""),
                flush=True,
            )
            if args.profile and compiled:
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(3):
                        fwd()
                    torch.cuda.synchronize()
                print_top_kernels(prof, 3, "pass")
            del model, fn
            torch.cuda.empty_cache()
    deploy_mod.head_products = FORMS["model"]


if __name__ == "__main__":
    main()
