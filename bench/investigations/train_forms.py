"""Forms of the training attention's products, timed in training steps of the paper-size phase-2 model.

    PYTHONPATH=. python bench/investigations/train_forms.py --device cuda [--batch 128] [--no-compile]
                                                            [--profile]
    PYTHONPATH=. python bench/investigations/train_forms.py                 # CPU: batch 8, 2 threads
    PYTHONPATH=. python bench/investigations/train_forms.py --model digits  # README demo's: batch 64

Each form is a convit_convert.attention.AttentionForm (chosen per model by ``VisionTransformer(cfg,
attention_form=name)``): "padded" splits the heads out of the (B, N, h·e) projections, pads the keys
and values to N_pad and multiplies all heads in one batched product per side, which costs copies of
q, k and the values (and their gradients) between the (B, N, h·e) and (B, h, N, e) layouts;
"by_head" is the custom ops convit_convert.kernels.head_logits and head_values, each head's product
read and written in place. The model is the attention ViT at the paper's size, qk_dim 64 (and 768
with --qk-dims), or with --model digits the README demo's; one step = forward,
SoftTargetCrossEntropy, backward, AdamW (bench/train_step.py); on CUDA bf16 autocast and TF32, MFU
against the H100's dense bf16 peak. Each form's mean log-sum-exp of a fresh model's logits on one
fixed batch is printed beside the first form's: the forms compute one function.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path as _Path

import torch

sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))  # bench/: the benchmarks these read
from gpu_suite import print_top_kernels
from train_step import H100_BF16_TFLOPS, time_steps

from convit_convert.attention import FORMS
from convit_convert.config import ViTConfig
from convit_convert.model import VisionTransformer


def logits_lse(cfg: ViTConfig, form: str, dev: torch.device, dtype: torch.dtype | None, batch: int) -> float:
    """The mean log-sum-exp of the logits of the freshly initialised model (seed 0) on one fixed
    batch: a fingerprint of the function the form computes."""
    torch.manual_seed(0)
    model = VisionTransformer(cfg, attention_form=form).to(dev)
    x = torch.randn(batch, 3, *cfg.img_size, generator=torch.Generator().manual_seed(1)).to(dev)
    with torch.no_grad(), torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
        return model(x).float().logsumexp(-1).mean().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=None, help="Default: 128 on CUDA, 8 on CPU.")
    ap.add_argument("--steps", type=int, default=None, help="Timed steps. Default: 10 on CUDA, 3 on CPU.")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads.")
    ap.add_argument("--no-compile", action="store_true", help="Eager only (always so on CPU).")
    ap.add_argument(
        "--model",
        choices=("paper", "digits"),
        default="paper",
        help="paper: 224 px, P 16, d 768, depth 6, K 5; digits: the README demo's (32 px, P 4, "
        "d 48, depth 2, K 5, gated pinning, 10 classes).",
    )
    ap.add_argument("--qk-dims", default="64", help="Comma list of the models' qk_dim (paper model).")
    ap.add_argument("--forms", default=",".join(FORMS), help=f"Comma list of {', '.join(FORMS)}.")
    ap.add_argument("--profile", action="store_true", help="CUDA: also the top kernels of each compiled run.")
    args = ap.parse_args()
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    digits = args.model == "digits"
    batch = args.batch or (64 if digits else 128 if cuda else 8)
    steps = args.steps or (20 if digits else 10 if cuda else 3)
    dtype = torch.bfloat16 if cuda else None
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        print(f"device: {torch.cuda.get_device_name(dev)}, torch {torch.__version__}")
    else:
        torch.set_num_threads(args.threads)
        print(f"device: CPU, {args.threads} threads, torch {torch.__version__}")
    unknown = [f for f in args.forms.split(",") if f not in FORMS]
    if unknown:
        ap.error(f"unknown form(s) {unknown}; choose from {', '.join(FORMS)}")
    small = ViTConfig.build(img_size=32, patch_size=4, depth=2, num_classes=10)
    for qk in [48] if digits else [int(q) for q in args.qk_dims.split(",")]:
        cfg = (
            small.with_attention(9, pinning="gated")
            if digits
            else ViTConfig.build().with_attention(9, qk_dim=qk)
        )
        for compiled in (False, True) if cuda and not args.no_compile else (False,):
            ref = None
            for name in args.forms.split(","):
                torch._dynamo.reset()
                lse = logits_lse(cfg, name, dev, dtype, min(batch, 8))
                ref = lse if ref is None else ref
                torch.manual_seed(0)
                t = time_steps(
                    VisionTransformer(cfg, drop_path_rate=0.1, attention_form=name),
                    img_size=cfg.img_size,
                    num_classes=cfg.num_classes,
                    batch=batch,
                    steps=steps,
                    warmup=args.warmup,
                    compile=compiled,
                    dev=dev,
                    dtype=dtype,
                )
                med = statistics.median(t.times)
                mfu = f", MFU {100 * t.flops / med / (H100_BF16_TFLOPS * 1e12):.1f}%" if cuda else ""
                print(
                    f"qk_dim {qk:3d} {name:8s} {'compiled' if compiled else 'eager':8s} "
                    f"{med * 1e3:8.1f} ms/step  {batch / med:7.1f} img/s{mfu}  "
                    f"logits lse {lse:.6f} (first form {ref:.6f})",
                    flush=True,
                )
                if args.profile and compiled:
                    profile(cfg, name, dev, batch)
                if cuda:
                    torch.cuda.empty_cache()


def profile(cfg: ViTConfig, form: str, dev: torch.device, batch: int) -> None:
    """The top CUDA kernels over 3 compiled training steps (after 2 warm-up) of the current form."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    torch.manual_seed(0)
    model = VisionTransformer(cfg, drop_path_rate=0.1, attention_form=form).to(dev)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        time_steps(
            model,
            img_size=cfg.img_size,
            num_classes=cfg.num_classes,
            batch=batch,
            steps=3,
            warmup=2,
            compile=True,
            dev=dev,
            dtype=torch.bfloat16,
        )
    print_top_kernels(prof, 6, "step")  # 6 steps profiled: the counted one, 2 warm-up, 3 timed


if __name__ == "__main__":
    main()
