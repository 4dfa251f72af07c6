"""ONNX export of the paper-size models: export time, file size, and onnxruntime CPU throughput
against PyTorch eager on the same batch and thread count.

    python bench/onnx_speed.py [--batches 1 8] [--threads 2] [--iters 8] [--exporters dynamo legacy]
                               [--forms fused trained] [--models conv attn768 attn64]

Paper size: 224 px, P = 16, d = 768, depth 6, K = 5, 100 classes; the attention models have 9
heads with qk_dim 768 (the paper's) or 64, as converted (W_Q = W_K = 0). Export goes through
``cmhsa export``'s own path (``export_and_check``: export, checker, onnxruntime vs PyTorch at batch
1 and 3), in each of ``cmhsa export``'s attention forms (``--form fused``, the default, with W_V·W_O
folded; ``--form trained``, the projections as trained). Both runtimes get ``--threads`` intra-op
threads (onnxruntime: one inter-op thread, default graph optimisations); each figure is the mean of
``--iters`` timed passes after 3 warm-up passes. Prints a markdown table for BENCHMARKS.md, with
``session.get_providers()``.
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import torch
from sizes import add_size_flag, conv_config

from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.onnx.export import export_and_check
from convit_convert.options.conversion import ConversionSpec


def mean_seconds(fn: Callable[[], object], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):  # onnxruntime sizes its memory arena on the first runs
        fn()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) / iters


def models(cfg: ViTConfig) -> dict[str, Callable[[], VisionTransformer]]:
    """The models of conv config ``cfg`` (the paper's CMHSA-5, or --tiny's), by key."""
    conv = VisionTransformer(cfg).eval()

    def attn(qk: int) -> Callable[[], VisionTransformer]:
        def build() -> VisionTransformer:
            plan = ConversionSpec(qk_dim=qk).plan(cfg)
            state, acfg = convert_state_dict(conv.state_dict(), plan), plan.config
            model = VisionTransformer(acfg)
            model.load_state_dict(state)
            return model.eval()

        return build

    def conv_copy() -> VisionTransformer:
        model = VisionTransformer(cfg)
        model.load_state_dict(conv.state_dict())
        return model.eval()

    return {
        "conv": ("ConvViT (phase 1)", conv_copy),
        "attn768": ("AttnViT qk_dim 768 (paper)", attn(768)),
        "attn64": ("AttnViT qk_dim 64", attn(64)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--exporters", nargs="+", default=["dynamo", "legacy"])
    ap.add_argument(
        "--forms", nargs="+", default=["fused", "trained"], help="Attention models' export forms."
    )
    ap.add_argument("--models", nargs="+", default=["conv", "attn768", "attn64"])
    add_size_flag(ap)
    args = ap.parse_args()
    cfg = conv_config(args)
    side = cfg.img_size[0]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    providers = None
    for key in args.models:
        name, build = models(cfg)[key]
        eager: dict[int, float] = {}
        model = build()
        with torch.inference_mode():
            for b in args.batches:
                x = torch.randn(b, 3, side, side)
                eager[b] = b / mean_seconds(lambda m=model, x=x: m(x), args.iters)
        del model
        forms = args.forms if key != "conv" else ["fused"]  # a conv model has one form
        for exporter, form in [(e, f) for e in args.exporters for f in forms]:
            ex = export_and_check(build(), exporter=exporter, form=form)
            assert ex.check.passed, ex.check
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.inter_op_num_threads = args.threads, 1
            session = ort.InferenceSession(ex.data, opts, providers=["CPUExecutionProvider"])
            providers = session.get_providers()
            size = len(ex.data) / 1e6
            for b in args.batches:
                x = np.random.default_rng(0).standard_normal((b, 3, side, side)).astype(np.float32)
                ips = b / mean_seconds(
                    lambda s=session, x=x: s.run(["logits"], {"pixel_values": x}), args.iters
                )
                rows.append(
                    (
                        name,
                        ex.form or "-",
                        exporter,
                        ex.timings["export_s"],
                        size,
                        b,
                        eager[b],
                        ips,
                        ex.check.worst.rel,
                    )
                )
                print(
                    f"{name} {ex.form or '-'} {exporter} batch {b}: eager {eager[b]:.2f} "
                    f"img/s, onnxruntime {ips:.2f} img/s",
                    flush=True,
                )
            del session, ex
    print(
        f"\ntorch {torch.__version__}, onnx {onnx.__version__}, onnxruntime {ort.__version__} "
        f"(providers {providers}), {platform.processor() or platform.machine()}, {args.threads} threads, "
        f"float32, mean of {args.iters} passes after 3 warm-up\n"
    )
    print(
        "| model | form | exporter | export (s) | file (MB) | batch | PyTorch "
        "eager img/s | onnxruntime img/s | ORT / eager | check rel. error |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, form, exporter, export_s, size, b, e, o, err in rows:
        print(
            f"| {name} | {form} | {exporter} | {export_s:.1f} | {size:.0f} | {b} | "
            f"{e:.2f} | {o:.2f} | {o / e:.2f}x | {err:.1e} |"
        )


if __name__ == "__main__":
    main()
