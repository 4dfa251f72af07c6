"""Time per training step of phase 1 (conv ViT) and phase 2 (attention ViT) at the paper's size.

    python bench/train_step.py                                  # CPU, batch 8, 2 threads
    python bench/train_step.py --device cuda --batch 128 --amp bf16 [--compile]

The paper's model: 224 px, P = 16, d = 768, depth 6, MLP 3072, K = 5, 100 classes; phase 1 in
both conv forms (convit_convert/conv_mixer.py: "pixels", F.conv2d, and "tokens", Theorem 1's
products; the pixel form's FLOPs are the convolution's own, the MFU's numerator for both); phase 2 with
9 heads and qk_dim 768 (the paper's) and 64, and the trainable variants (gated pinning; 3 free extra
heads). One step = forward, SoftTargetCrossEntropy on
Mixup-style soft targets, backward, AdamW step (the training loop's work minus data loading).
Reports seconds per step, images/s, the phase-2 / phase-1 ratio (the paper measured the attention
phase about 3x slower per epoch), and on CUDA the model-FLOPs utilisation against --peak-tflops
(FLOPs counted by torch.utils.flop_counter on one step).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from sizes import add_size_flag, conv_config
from timm.loss import SoftTargetCrossEntropy
from torch.utils.flop_counter import FlopCounterMode

from convit_convert.config import ViTConfig
from convit_convert.model import VisionTransformer

H100_BF16_TFLOPS = 989.0  # dense bf16 peak of an H100 SXM


PHASE1 = "phase 1: ConvViT, K=5"


def models(conv: ViTConfig) -> dict[str, tuple[ViTConfig, dict[str, str]]]:
    """name -> (config, VisionTransformer keywords): phase 1 of ``conv`` in each conv form
    (conv_mixer.py), then the phase-2 variants."""
    return {
        f"{PHASE1}, pixels (F.conv2d)": (conv, {"conv_form": "pixels"}),
        f"{PHASE1}, tokens (W^O products)": (conv, {"conv_form": "tokens"}),
        "phase 2: AttnViT, 9 heads, qk_dim 768": (conv.with_attention(9), {}),
        "phase 2: AttnViT, 9 heads, qk_dim 64": (conv.with_attention(9, qk_dim=64), {}),
        "phase 2: AttnViT, 9 heads, qk_dim 768, gated pinning": (conv.with_attention(9, pinning="gated"), {}),
        "phase 2: AttnViT, 9 heads, qk_dim 64, gated pinning": (
            conv.with_attention(9, qk_dim=64, pinning="gated"),
            {},
        ),
        "phase 2: AttnViT, 12 heads (3 free), qk_dim 64": (conv.with_attention(12, qk_dim=64), {}),
    }


@dataclass
class StepTiming:
    times: list[float]  # seconds of each timed step
    flops: int  # FLOPs of one step (forward + backward), counted on the eager model
    first_step_s: float  # the first step through the timed module: compilation, when compiled


def time_steps(
    model: torch.nn.Module,
    *,
    img_size: tuple[int, int],
    num_classes: int,
    batch: int,
    steps: int,
    warmup: int,
    compile: bool,
    dev: torch.device,
    dtype: torch.dtype | None,
) -> StepTiming:
    """Time training steps of ``model`` (any classifier of (B, 3, H, W) images, timm's too)."""
    model = model.to(dev).train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-4, weight_decay=0.05)
    fwd = torch.compile(model) if compile else model
    crit = SoftTargetCrossEntropy()
    scaler = torch.amp.GradScaler(dev.type, enabled=dtype == torch.float16)
    x = torch.randn(batch, 3, *img_size, device=dev)
    y = torch.softmax(torch.randn(batch, num_classes, device=dev), dim=1)

    def step(m: torch.nn.Module) -> None:
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype is not None):
            loss = crit(m(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    with FlopCounterMode(display=False) as fc:
        step(model)  # counted on the eager model; doubles as a warm-up step
    sync()
    t = time.perf_counter()
    step(fwd)
    sync()
    first = time.perf_counter() - t
    for _ in range(max(warmup - 1, 0)):
        step(fwd)
    times = []
    for _ in range(steps):
        sync()
        t = time.perf_counter()
        step(fwd)
        sync()
        times.append(time.perf_counter() - t)
    return StepTiming(times, fc.get_total_flops(), first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--amp", choices=("none", "bf16", "fp16"), default="none")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--peak-tflops", type=float, default=H100_BF16_TFLOPS)
    ap.add_argument("--only", nargs="*", default=[], help="models whose name holds one of these words")
    add_size_flag(ap)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    dtype = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}[args.amp]
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        print(f"device: {torch.cuda.get_device_name(dev)}")
    print(
        f"torch {torch.__version__}, batch {args.batch}, amp {args.amp}, compile {args.compile}, "
        f"threads {args.threads}, {args.steps} timed steps after {args.warmup} warm-up"
    )
    results, useful = {}, {}
    for name, (cfg, forms) in models(conv_config(args)).items():
        if args.only and not any(o in name for o in args.only):
            continue
        torch.manual_seed(0)
        timing = time_steps(
            VisionTransformer(cfg, drop_path_rate=0.1, **forms),
            img_size=cfg.img_size,
            num_classes=cfg.num_classes,
            batch=args.batch,
            steps=args.steps,
            warmup=args.warmup,
            compile=args.compile,
            dev=dev,
            dtype=dtype,
        )
        times, flops = timing.times, timing.flops
        # a model's useful arithmetic: phase 1's is the convolution's (the pixel form's count),
        # whichever form computes it; MFU is reported against that
        work = useful.setdefault(PHASE1 if name.startswith(PHASE1) else name, flops)
        med = statistics.median(times)
        results[name] = med
        mfu = work / med / (args.peak_tflops * 1e12) if dev.type == "cuda" else None
        print(
            f"{name}: {med:.3f} s/step (best {min(times):.3f}), {args.batch / med:.1f} img/s, "
            f"{flops / args.batch / 1e9:.1f} GFLOP/img per step counted"
            + (f" ({work / args.batch / 1e9:.1f} the convolution's)" if work != flops else "")
            + (f", MFU {100 * mfu:.1f}% of {args.peak_tflops:g} TFLOPS" if mfu is not None else "")
        )
    base = next((t for n, t in results.items() if n.startswith(PHASE1)), None)
    for name, t in results.items():
        if base is not None:
            print(f"{name}: {t / base:.2f}x phase 1 (pixels)'s time per step")


if __name__ == "__main__":
    main()
