"""Every GPU check in one command: CUDA tests, exactness, throughput and MFU, an end-to-end run.

    python bench/gpu_suite.py OUT [--sections env,tests,exact,attention,train,infer,e2e]
    python bench/gpu_suite.py OUT --dry-run        # what it would run (works without a GPU)

Writes ``OUT/results.json`` and ``OUT/results.md`` after every section, so a run stopped by a time
limit keeps what it measured. Needs only what the GPU image has (torch, timm, onnx, onnxruntime,
typer, rich, safetensors, scikit-learn, pytest): run it from the repository root with
``PYTHONPATH=.`` where cmhsa is not installed. Sections:

- env: device, versions, the dense bf16 peak MFU is measured against.
- tests: ``pytest -m cuda tests/test_cuda.py`` (conversion with TF32 off, bf16/fp16 error, AMP
  steps of both phases, --compile, bit-exact resume, DDP over NCCL under torchrun).
- exact: the paper-size model converted and checked on the GPU, fp32 (TF32 off) and bf16.
- attention: forward + backward of one paper-size attention layer in each implementation form.
- train: training images/s and MFU at the paper's size, batch 128, bf16, eager and compiled, for
  phase 1 in both conv forms (pixels: F.conv2d; tokens: Theorem 1's products; MFU also on the
  convolution's own FLOPs), phase 2 (qk_dim 768 and 64) and timm's DeiT-base / DeiT-small.
- infer: inference images/s, attention model as trained and fused, against DeiT-base / -small.
- step: the EXPERIMENTS.md model's images/s at batch 256 and 1024, eager and
  compiled, both phases (phase 1 in both conv forms), and the wall time of six init-comparison
  arms run at once.
- e2e: phase 1 -> convert -> verify -> phase 2 -> eval -> ONNX export on scikit-learn's digits.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("env", "tests", "exact", "attention", "train", "profile", "infer", "step", "e2e")
# dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, from NVIDIA's data sheets; matched in order
PEAKS = (("H200", 989.4), ("H100 PCIe", 756.0), ("H100", 989.4), ("A100", 312.0), ("L40S", 362.0))
PAPER = "224 px, P = 16, d = 768, depth 6, MLP 3072, K = 5, 100 classes"


def dense_bf16_peak(device_name: str) -> tuple[float | None, str]:
    """(TFLOP/s, the data-sheet row it came from) for a CUDA device name, or (None, why)."""
    for key, tflops in PEAKS:
        if key in device_name:
            return tflops, f"{key} dense bf16 ({tflops:g} TFLOP/s, NVIDIA data sheet)"
    return None, f"no peak known for {device_name!r}: MFU not reported"


class Suite:
    """Results by section, written to OUT after each one."""

    def __init__(self, out: Path, args: argparse.Namespace) -> None:
        self.out, self.args = out, args
        self.results: dict[str, Any] = {"command": " ".join(sys.argv), "sections": {}}
        out.mkdir(parents=True, exist_ok=True)

    def run(self, name: str, fn: Callable[[], Any]) -> None:
        print(f"== {name}", flush=True)
        t = time.perf_counter()
        try:
            res = {"ok": True, **fn()}
        except Exception as e:  # a failed section is a result; the next one still runs
            res = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-3000:],
            }
            print(res["traceback"], flush=True)
        res["seconds"] = round(time.perf_counter() - t, 1)
        self.results["sections"][name] = res
        self.write()

    def write(self) -> None:
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2, default=str) + "\n")
        (self.out / "results.md").write_text(markdown(self.results))


# sections -----------------------------------------------------------------------------------------


def env_section() -> dict[str, Any]:
    import onnxruntime as ort
    import timm
    import torch

    name = torch.cuda.get_device_name()
    peak, peak_src = dense_bf16_peak(name)
    return {
        "device": name,
        "capability": ".".join(map(str, torch.cuda.get_device_capability())),
        "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1),
        "peak_bf16_tflops": peak,
        "peak_source": peak_src,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "timm": timm.__version__,
        "onnxruntime": ort.__version__,
        "onnxruntime_providers": ort.get_available_providers(),
        "python": platform.python_version(),
    }


def tests_section(out: Path) -> dict[str, Any]:
    xml = out / "cuda_tests.xml"
    cmd = [
        sys.executable,
        *"-m pytest -m cuda -q -p no:cacheprovider tests/test_cuda.py".split(),
        f"--junitxml={xml}",
    ]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=child_env(), timeout=480)
    cases = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            status = "passed"
            for tag in ("failure", "error", "skipped"):
                node = case.find(tag)
                if node is not None:
                    status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    msg = (node.get("message") or "")[:400]
                    break
            else:
                msg = ""
            cases.append(
                {
                    "test": case.get("name"),
                    "status": status,
                    "seconds": float(case.get("time", 0)),
                    "message": msg,
                }
            )
    return {
        "ok": r.returncode == 0,
        "returncode": r.returncode,
        "command": "pytest -m cuda tests/test_cuda.py",
        "cases": cases,
        "tail": (r.stdout + r.stderr)[-2500:],
    }


def exact_section() -> dict[str, Any]:
    """The paper's model (random weights) converted; errors against the conv model in float64."""
    import torch

    from convit_convert.config import ViTConfig
    from convit_convert.construct import convert_state_dict
    from convit_convert.model import VisionTransformer
    from convit_convert.options.conversion import ConversionSpec
    from convit_convert.verify import exact_matmul, relative_error, verify_models

    torch.manual_seed(0)
    conv = VisionTransformer(ViTConfig.build()).eval()
    conv_sd = {k: v.clone() for k, v in conv.state_dict().items()}  # on the CPU, as converted
    rows = []
    for qk in (768, 64):
        plan = ConversionSpec(qk_dim=qk).plan(conv.cfg)
        sd, mcfg = convert_state_dict(conv_sd, plan), plan.config
        attn = VisionTransformer(mcfg).eval()
        attn.load_state_dict(sd)
        t = time.perf_counter()
        v = verify_models(conv, attn, batch=8, device="cuda", dtype=torch.float32, tol=1e-5)
        row = {
            "qk_dim": qk,
            "verify_fp32_passed": v.passed,
            "verify_fp32_worst_rel": v.worst.rel,
            "verify_fp32_worst_at": f"{v.worst.tensor} ({v.worst.region})",
            "verify_s": time.perf_counter() - t,
        }
        x = torch.randn(8, 3, 224, 224, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        with torch.no_grad(), exact_matmul():
            ref = conv.double()(x.double())
            conv.float()
            for dt in (torch.bfloat16, torch.float16):
                with torch.autocast("cuda", dtype=dt):
                    a, c = attn(x).double(), conv(x).double()
                tag = str(dt).removeprefix("torch.")
                row[f"{tag}_attn_rel"] = relative_error((a - ref).abs().max().item(), ref.abs().max().item())
                row[f"{tag}_conv_rel"] = relative_error((c - ref).abs().max().item(), ref.abs().max().item())
            a = attn(x).double()
            row["fp32_attn_rel"] = relative_error((a - ref).abs().max().item(), ref.abs().max().item())
        rows.append(row)
        conv.float()
    conv.cpu()
    torch.cuda.empty_cache()
    return {"model": PAPER, "reference": "conv model in float64 on the GPU", "rows": rows}


def attention_forms() -> dict[str, Callable]:
    """One paper-size attention layer's softmax(q k^T / sqrt(d) + B) v with a sink, written each
    way the model could: q (B, h, N, qk), k (B, h, N, qk), v (B, h, N, vd), bias (h, N, N), sink (h,)."""
    import torch
    import torch.nn.functional as F

    def pad_sdpa(q, k, v, bias, sink):  # the sink as a padded zero key and value (the first form)
        _, h, n, _ = q.shape
        full = torch.cat([bias, sink.view(h, 1, 1).expand(h, n, 1)], -1).to(q.dtype)
        return F.scaled_dot_product_attention(
            q, F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1)), attn_mask=full
        )

    def sink_lse(q, k, v, bias, sink):  # the model's previous form: the sink joins the log-sum-exp only
        d = q.shape[-1]
        s = (q @ k.transpose(-2, -1)) * d**-0.5 + bias
        lse = torch.logaddexp(s.logsumexp(-1, keepdim=True), sink.view(1, -1, 1, 1))
        return (s - lse).exp().to(v.dtype) @ v

    def explicit(q, k, v, bias, sink):  # logits, sink column, softmax, drop the sink's column
        b, h, n, d = q.shape
        s = (q @ k.transpose(-2, -1)) * d**-0.5 + bias
        s = torch.cat([s, sink.view(1, h, 1, 1).expand(b, h, n, 1).to(s.dtype)], -1)
        return s.softmax(-1)[..., :n].to(v.dtype) @ v

    def sdpa_lse(q, k, v, bias, sink):  # SDPA over the N keys, then scale by the sink's share
        d = q.shape[-1]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        lse = torch.logsumexp((q @ k.transpose(-2, -1)).float() * d**-0.5 + bias, -1, keepdim=True)
        return out * torch.sigmoid(lse - sink.view(1, -1, 1, 1)).to(out.dtype)

    def padded(q, k, v, bias, sink):  # the model's form now: keys padded to N_pad = 8·ceil((N+1)/8),
        _, h, n, d = q.shape  # the sink the first padded key, the others at -inf: aligned rows for cuBLAS
        npad = -(-(n + 1) // 8) * 8
        full = torch.cat(
            [bias, sink.view(h, 1, 1).expand(h, n, 1), bias.new_full((h, n, npad - n - 1), float("-inf"))], -1
        )
        s = (q @ F.pad(k, (0, 0, 0, npad - n)).transpose(-2, -1)) * d**-0.5 + full
        return s.softmax(-1).to(v.dtype) @ F.pad(v, (0, 0, 0, npad - n))

    forms = {
        "pad_sdpa": pad_sdpa,
        "explicit": explicit,
        "sink_lse": sink_lse,
        "sdpa_lse": sdpa_lse,
        "padded": padded,
    }
    try:
        from torch.nn.attention.flex_attention import flex_attention

        def flex(q, k, v, bias, sink):  # relative-position bias as a score_mod, sink through the lse
            def score_mod(score, b, h, qi, ki):
                return score + bias[h, qi, ki]

            # small tiles: with v_dim 768 the default tiles need 0.5-1 MB of shared memory (H100: 227 KB)
            opts = {"BLOCK_M": 32, "BLOCK_N": 32, "num_stages": 1}
            out, lse = flex_attention(q, k, v, score_mod=score_mod, return_lse=True, kernel_options=opts)
            return out * torch.sigmoid(lse.unsqueeze(-1) - sink.view(1, -1, 1, 1)).to(out.dtype)

        forms["flex"] = flex
    except ImportError:
        pass
    return forms


def attention_section(batch: int) -> dict[str, Any]:
    import torch

    forms = attention_forms()
    h, n, vd = 9, 196, 768
    rows = []
    for qk in (64, 768):
        g = torch.Generator("cuda").manual_seed(0)
        q, k = (torch.randn(batch, h, n, qk, device="cuda", generator=g, dtype=torch.bfloat16) for _ in "qk")
        v = torch.randn(batch, h, n, vd, device="cuda", generator=g, dtype=torch.bfloat16)
        bias = torch.randn(h, n, n, device="cuda", generator=g) * 3
        sink = torch.randn(h, device="cuda", generator=g)
        ref = forms["explicit"](q.float(), k.float(), v.float(), bias, sink)
        for name, fn in forms.items():
            for compiled in (False, True):
                if name == "flex" and not compiled:
                    continue  # flex_attention is meant to run compiled
                row = {"form": name, "qk_dim": qk, "compiled": compiled}
                try:
                    f = torch.compile(fn) if compiled else fn
                    qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
                    bb, ss = bias.clone().requires_grad_(), sink.clone().requires_grad_()
                    out = f(qq, kk, vv, bb, ss)
                    row["max_rel_err"] = ((out.float() - ref).abs().max() / ref.abs().max()).item()
                    go = torch.randn_like(out)

                    def step(f=f, inputs=(qq, kk, vv, bb, ss), go=go):
                        f(*inputs).backward(go)

                    row["ms"] = cuda_ms(step, warmup=3, iters=10)
                    row["peak_mem_gib"] = torch.cuda.max_memory_allocated() / 2**30
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
                torch.cuda.reset_peak_memory_stats()
                rows.append(row)
                print(row, flush=True)
    return {"shape": f"B={batch}, heads={h}, N={n}, v_dim={vd}, bf16, forward+backward", "rows": rows}


def cuda_ms(fn: Callable[[], Any], warmup: int, iters: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events."""
    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_models(
    kinds: list[str], exclude: tuple[str, ...] = ("gated", "free")
) -> dict[str, Callable[[], Any]]:
    """Paper-size models by label (those whose label contains one of ``kinds`` and none of
    ``exclude``); timm's DeiTs at 100 classes."""
    import timm

    from convit_convert.config import ViTConfig
    from convit_convert.model import VisionTransformer

    conv = ViTConfig.build()
    made = {
        # the two conv forms (conv_mixer.py): the same model, the same convolution
        "phase 1: ConvViT K=5, pixels": lambda: VisionTransformer(
            conv, drop_path_rate=0.1, conv_form="pixels"
        ),
        "phase 1: ConvViT K=5, tokens": lambda: VisionTransformer(
            conv, drop_path_rate=0.1, conv_form="tokens"
        ),
        "phase 2: AttnViT qk_dim 768": lambda: VisionTransformer(conv.with_attention(9), drop_path_rate=0.1),
        "phase 2: AttnViT qk_dim 64": lambda: VisionTransformer(
            conv.with_attention(9, qk_dim=64), drop_path_rate=0.1
        ),
        "phase 2: AttnViT qk_dim 768, gated pinning": lambda: VisionTransformer(
            conv.with_attention(9, pinning="gated"), drop_path_rate=0.1
        ),
        "phase 2: AttnViT qk_dim 64, gated pinning": lambda: VisionTransformer(
            conv.with_attention(9, qk_dim=64, pinning="gated"), drop_path_rate=0.1
        ),
        "phase 2: AttnViT qk_dim 64, 12 heads (3 free)": lambda: VisionTransformer(
            conv.with_attention(12, qk_dim=64), drop_path_rate=0.1
        ),
        "timm deit_base_patch16_224": lambda: timm.create_model(
            "deit_base_patch16_224", num_classes=100, drop_path_rate=0.1
        ),
        "timm deit_small_patch16_224": lambda: timm.create_model(
            "deit_small_patch16_224", num_classes=100, drop_path_rate=0.1
        ),
    }
    return {k: v for k, v in made.items() if any(s in k for s in kinds) and not any(e in k for e in exclude)}


def train_section(args: argparse.Namespace, peak: float | None) -> dict[str, Any]:
    import torch
    from train_step import time_steps  # bench/train_step.py, beside this script

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    modes = {"both": (False, True), "eager": (False,), "compiled": (True,)}[args.train_compile]
    for compiled in modes:
        for label, make in bench_models(args.train_models.split(","), exclude=args.train_exclude).items():
            torch.manual_seed(0)
            row: dict[str, Any] = {"model": label, "compiled": compiled}
            try:
                t = time_steps(
                    make(),
                    img_size=(224, 224),
                    num_classes=100,
                    batch=args.batch,
                    steps=args.steps,
                    warmup=args.warmup,
                    compile=compiled,
                    dev=torch.device("cuda"),
                    dtype=torch.bfloat16,
                )
                med = statistics.median(t.times)
                row.update(
                    s_per_step=med,
                    img_per_s=args.batch / med,
                    gflop_per_img=t.flops / args.batch / 1e9,
                    tflops=t.flops / med / 1e12,
                    mfu=None if peak is None else t.flops / med / (peak * 1e12),
                    first_step_s=t.first_step_s,
                    peak_mem_gib=torch.cuda.max_memory_allocated() / 2**30,
                )
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            rows.append(row)
            print(row, flush=True)
    conv_flops(rows, args.batch, peak)
    return {
        "settings": f"{PAPER}; batch {args.batch}, bf16 autocast, AdamW, "
        "SoftTargetCrossEntropy, drop path 0.1, "
        f"TF32 on; median of {args.steps} steps after {args.warmup} warm-up; "
        "FLOPs by torch.utils.flop_counter",
        "rows": rows,
        "goals": train_goals(rows),
    }


def conv_flops(rows: list[dict[str, Any]], batch: int, peak: float | None) -> None:
    """Phase 1's useful arithmetic is the convolution's: the pixel form's FLOP count. Each phase-1
    row gets it (``conv_gflop_per_img``) and its MFU on it (``conv_mfu``), whichever form ran."""
    counted = [r["gflop_per_img"] for r in rows if r["model"].endswith("pixels") and "gflop_per_img" in r]
    if not counted:
        return
    for r in rows:
        if r["model"].startswith("phase 1") and "s_per_step" in r:
            r["conv_gflop_per_img"] = counted[0]
            if peak is not None:
                r["conv_mfu"] = counted[0] * 1e9 * batch / r["s_per_step"] / (peak * 1e12)


def train_goals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The GPU goals BENCHMARKS.md states, from the measured rows (None where a row is missing)."""

    def get(label: str, compiled: bool, key: str) -> float | None:
        for r in rows:
            if label in r["model"] and r["compiled"] == compiled and key in r:
                return r[key]
        return None

    goals: dict[str, Any] = {}
    for compiled in (False, True):
        tag = "compiled" if compiled else "eager"
        p2, deit = get("qk_dim 64", compiled, "img_per_s"), get("deit_base", compiled, "img_per_s")
        p1_t, p2_t = get("phase 1", compiled, "s_per_step"), get("qk_dim 64", compiled, "s_per_step")
        p2_768 = get("qk_dim 768", compiled, "s_per_step")
        p1 = {f: get(f"K=5, {f}", compiled, "img_per_s") for f in ("pixels", "tokens")}
        goals[tag] = {
            "phase2_qk64_vs_deit_base (goal >= 0.5)": None if not (p2 and deit) else p2 / deit,
            "phase2_qk64_mfu (goal >= 0.40 compiled)": get("qk_dim 64", compiled, "mfu"),
            "phase2_qk64_over_phase1_step (goal <= 3)": None if not (p1_t and p2_t) else p2_t / p1_t,
            "phase2_qk768_over_phase1_step": None if not (p1_t and p2_768) else p2_768 / p1_t,
        }
        for form, v in p1.items():  # the goal: phase 1 >= 2.5x phase 2 qk_dim 64 and >= 2x DeiT-base
            goals[tag][f"phase1_{form}_over_phase2_qk64 (goal >= 2.5 compiled)"] = (
                None if not (v and p2) else v / p2
            )
            goals[tag][f"phase1_{form}_over_deit_base (goal >= 2 compiled)"] = (
                None if not (v and deit) else v / deit
            )
    return goals


def top_kernels(prof: Any, count: int = 12, passes: int = 1) -> list[dict[str, Any]]:
    """The ``count`` CUDA kernels with the most self time in a torch.profiler run over ``passes``
    steps or passes: calls and milliseconds per pass, and share of all kernel time."""
    events = sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)
    total = sum(e.self_device_time_total for e in events) or 1.0
    return [
        {
            "kernel": e.key[:90],
            "calls": e.count // passes,
            "self_ms": e.self_device_time_total / 1e3 / passes,
            "share": e.self_device_time_total / total,
        }
        for e in events[:count]
    ]


def print_top_kernels(prof: Any, passes: int, unit: str) -> None:
    """:func:`top_kernels` (14 of them) as indented lines, per ``unit`` ('pass', 'step')."""
    for k in top_kernels(prof, 14, passes):
        print(f"    {k['self_ms']:7.3f} ms/{unit} {k['calls']:4d} calls  {k['kernel']}")


def profile_section(args: argparse.Namespace) -> dict[str, Any]:
    """torch.profiler over training steps of the phase-2 model (qk_dim 64), eager and compiled:
    the CUDA kernels that take the time."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from train_step import time_steps

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    tables = {}
    for label, make in bench_models(["qk_dim 64", "phase 1"]).items():
        for compiled in (False, True):
            torch.manual_seed(0)
            model = make().cuda()  # before profiling: the weights' upload is not a training cost
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                time_steps(
                    model,
                    img_size=(224, 224),
                    num_classes=100,
                    batch=args.batch,
                    steps=3,
                    warmup=2,
                    compile=compiled,
                    dev=torch.device("cuda"),
                    dtype=torch.bfloat16,
                )
            tables[f"{label}, {'compiled' if compiled else 'eager'}"] = top_kernels(prof)
            del model
            torch.cuda.empty_cache()
    from convit_convert.deploy import fuse_attention

    for label, make in bench_models(["qk_dim 64", "deit_base"]).items():  # inference, compiled
        model = make().cuda().eval()
        if "AttnViT" in label:
            model, label = fuse_attention(model), label.replace("phase 2: ", "") + ", fused"
        fn, x = torch.compile(model), torch.randn(args.batch, 3, 224, 224, device="cuda")
        with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
            for _ in range(3):
                fn(x)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(3):
                    fn(x)
                torch.cuda.synchronize()
        tables[f"inference: {label}, compiled (3 passes)"] = top_kernels(prof)
        del model, fn
        torch.cuda.empty_cache()
    return {
        "settings": "6 profiled steps (2 warm-up + 3 timed + the counted one), batch 128, bf16",
        "tables": tables,
    }


def infer_section(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from convit_convert.deploy import fuse_attention

    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    models = bench_models(["phase", "deit"])
    variants: list[tuple[str, Callable[[], Any]]] = []
    for label, make in models.items():
        variants.append((label.replace("phase 1: ", "").replace("phase 2: ", ""), make))
        if "AttnViT" in label:
            variants.append(
                (label.replace("phase 2: ", "") + ", fused", lambda make=make: fuse_attention(make()))
            )
    x = torch.randn(args.batch, 3, 224, 224, device="cuda")
    runs = [(label, make, False) for label, make in variants]
    if args.train_compile != "eager":  # compiled: the models the goals name
        runs += [
            (label, make, True) for label, make in variants if "qk_dim 64" in label or "deit_base" in label
        ]
    for label, make, compiled in runs:
        row: dict[str, Any] = {"model": label, "compiled": compiled}
        try:
            model = make().cuda().eval()
            fn = torch.compile(model) if compiled else model

            @torch.inference_mode()
            def fwd(fn=fn):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    fn(x)

            ms = cuda_ms(fwd, warmup=3, iters=args.steps)
            row.update(ms=ms, img_per_s=args.batch / ms * 1e3)
            del model, fn
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
        torch.cuda.empty_cache()
        rows.append(row)
        print(row, flush=True)
    for r in rows:  # against DeiT-base run the same way (eager or compiled)
        deit = next(
            (
                d.get("img_per_s")
                for d in rows
                if "deit_base" in d["model"] and d["compiled"] == r["compiled"]
            ),
            None,
        )
        if deit and "img_per_s" in r:
            r["vs_deit_base"] = r["img_per_s"] / deit
    return {
        "settings": f"{PAPER}; batch {args.batch}, bf16 autocast, inference_mode, eager and "
        f"compiled; median of {args.steps}",
        "rows": rows,
    }


E2E_FLAGS = [
    *"--data digits --img-size 32 --patch-size 4 --depth 4 --kernel-size 3 "
    "--batch-size 128 --lr-base-batch 128 --warmup-epochs 2 --aa none "
    "--mixup 0 --cutmix 0 --reprob 0 --workers 4".split(),
]


STEP_ARMS = ("p1", "half-p1", "gated", "hard", "impulse", "random")  # the init comparison's six arms


def step_section(
    out: Path,
    device: str = "cuda",
    batches: tuple[int, ...] = (256, 1024),
    train_samples: int = 60000,
    arm_epochs: int = 40,
    data_dir: str | None = None,
    conv_forms: tuple[str, ...] = ("pixels", "tokens"),
) -> dict[str, Any]:
    """Issue 41: the EXPERIMENTS.md model (``--preset cpu``, Fashion-MNIST, device loader) in one
    process, both phases (phase 1 in each of ``conv_forms``; phase 2: impulse init, gated), each
    batch size, eager and --compile:
    images/s of the second of 2 epochs (the first pays for compiling; learning rate as at batch
    64, so the large batches do not diverge). Then (unless ``arm_epochs`` is 0) the wall time of
    the six init-comparison arms (seed 0, ``arm_epochs`` epochs, batch 256, all six at once).
    Targets: >= 60,000 images/s in phase 1 and >= 40,000 in phase 2 at batch 256; the six arms in
    <= 90 s."""
    from convit_convert.options.training import TrainConfig
    from convit_convert.train.progress import Progress
    from convit_convert.train.run import run

    rows = []
    runs = [("phase1", f) for f in conv_forms] + [("phase2", "auto")]
    for phase, form in runs:
        extra = dict(init="impulse", pinning="gated") if phase == "phase2" else dict(conv_form=form)
        for batch in batches:
            for compiled in (False, True):
                cfg = TrainConfig.from_flags(
                    phase=phase,
                    preset="cpu",
                    data="fashion-mnist",
                    data_dir=data_dir,
                    in_chans=1,
                    loader="device",
                    device=device,
                    batch_size=batch,
                    lr_base_batch=batch,
                    train_samples=train_samples,
                    val_samples=1000,
                    epochs=2,
                    compile=compiled,
                    overwrite=True,
                    out=str(out / "step" / f"{phase}-{form}-b{batch}-{'compiled' if compiled else 'eager'}"),
                    **extra,
                )
                result = run(cfg, progress=Progress(None))
                rows.append(
                    {
                        "phase": phase,
                        "conv_form": form if phase == "phase1" else "",
                        "batch": batch,
                        "compile": compiled,
                        "images_per_s": round(result.rows[-1]["images_per_s"]),
                    }
                )
                print(rows[-1], flush=True)
    by = {(r["phase"], r["batch"], r["compile"]): r["images_per_s"] for r in rows}
    first = batches[0]  # the targets' batch: 256
    best = {p: max(v for (ph, b, _), v in by.items() if ph == p and b == first) for p in ("phase1", "phase2")}
    goals: dict[str, Any] = {
        f"phase 1 at batch {first}": {
            "images_per_s": best["phase1"],
            "target": 60000,
            "met": best["phase1"] >= 60000,
        },
        f"phase 2 at batch {first}": {
            "images_per_s": best["phase2"],
            "target": 40000,
            "met": best["phase2"] >= 40000,
        },
    }
    settings = f"--preset cpu, {train_samples} Fashion-MNIST images, device loader, {device}"
    if not arm_epochs:
        return {"rows": rows, "settings": settings, "goals": goals}
    sys.path.insert(0, str(ROOT / "experiments"))
    from init_comparison import seed_arms

    from convit_convert.train.arms import run_arms

    args = argparse.Namespace(
        epochs=arm_epochs,
        out=out / "step" / "arms",
        train_samples=train_samples,
        val_samples=1000,
        batch_size=256,
        compile=False,
        data_dir=data_dir,
        device=device,
        loader="device",
    )
    arms = [a for a in seed_arms(args, 0) if a.name.split("/")[-1] in STEP_ARMS]
    t = time.perf_counter()
    run_arms(arms, parallel=len(arms))
    arms_s = time.perf_counter() - t
    goals["six arms"] = {"seconds": round(arms_s, 1), "target": 90, "met": arms_s <= 90}
    return {
        "rows": rows,
        "settings": settings,
        "arms": {
            "seconds": round(arms_s, 1),
            "status": {a.name: a.status for a in arms},
            "epochs": arm_epochs,
        },
        "goals": goals,
    }


def e2e_section(out: Path, device: str, epochs: int) -> dict[str, Any]:
    """The two-phase pipeline through the command line, on real images (scikit-learn's digits)."""
    import csv
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="cmhsa-e2e-"))
    conv, vit = work / "p1" / "conv.safetensors", work / "p2" / "vit.safetensors"
    common = [*E2E_FLAGS, "--epochs", str(epochs), "--device", device]
    steps = [
        ("phase 1", ["train", "phase1", *common, "--lr", "2e-3", "-o", str(work / "p1")]),
        ("convert", ["convert", str(conv), "-o", str(work / "vit0.safetensors"), "--device", device]),
        (
            "verify",
            ["verify", str(conv), str(work / "vit0.safetensors"), "--device", device, "--tol", "1e-5"],
        ),
        (
            "phase 2",
            ["train", "phase2", *common, "--lr", "5e-4", "--init", str(conv), "-o", str(work / "p2")],
        ),
        ("eval phase 2", ["eval", str(vit), "--data", "digits", "--workers", "4", "--device", device]),
        (
            "export, CUDA provider",
            ["export", str(vit), "-o", str(work / "vit_cuda.onnx"), "--device", "cuda"],
        ),
        ("export, CPU provider", ["export", str(vit), "-o", str(work / "vit.onnx"), "--device", "cpu"]),
    ]
    results = []
    for name, argv in steps:
        t = time.perf_counter()
        r = subprocess.run(
            [sys.executable, "-m", "convit_convert", *argv],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=child_env(),
            timeout=300,
        )
        results.append(
            {
                "step": name,
                "command": "cmhsa " + " ".join(argv).replace(str(work), "WORK"),
                "returncode": r.returncode,
                "seconds": time.perf_counter() - t,
                "tail": (r.stdout + r.stderr)[-1200:],
            }
        )
        print(f"{name}: exit {r.returncode} in {results[-1]['seconds']:.1f} s", flush=True)
    final = {}
    for phase in ("p1", "p2"):
        f = work / phase / "metrics.csv"
        if f.exists():
            rows = list(csv.DictReader(f.open()))
            final[phase] = {k: rows[-1][k] for k in ("epoch", "top1", "val_loss", "images_per_s")}
    onnx_report = {}
    for name in ("vit.onnx.report.json", "vit_cuda.onnx.report.json"):
        p = work / name
        if p.exists():
            doc = json.loads(p.read_text())
            onnx_report[name] = {
                "passed": doc.get("passed"),
                "providers": doc.get("check", {}).get("providers"),
            }
    required_ok = all(r["returncode"] == 0 for r in results if r["step"] != "export, CUDA provider")
    return {"ok": required_ok, "workdir": str(work), "steps": results, "final": final, "onnx": onnx_report}


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# report -------------------------------------------------------------------------------------------


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 or abs(v) >= 1e4 else f"{v:.3f}".rstrip("0").rstrip(".")
    return "" if v is None else str(v)


def table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def markdown(results: dict[str, Any]) -> str:
    s = results["sections"]
    out = [f"# GPU suite\n\n`{results['command']}`\n"]
    if "env" in s:
        e = s["env"]
        out.append("\n".join(f"- {k}: {fmt(v)}" for k, v in e.items() if k not in ("traceback",)) + "\n")
    for name in SECTIONS[1:]:
        if name not in s:
            continue
        sec = s[name]
        out.append(f"## {name} ({'ok' if sec.get('ok') else 'FAILED'}, {sec.get('seconds')} s)\n")
        if "error" in sec:
            out.append(f"error: `{sec['error']}`\n")
        if name == "tests" and "cases" in sec:
            out.append(table(sec["cases"], ["test", "status", "seconds", "message"]) + "\n")
        elif name == "exact" and "rows" in sec:
            out.append(table(sec["rows"], list(sec["rows"][0])) + "\n")
        elif name in ("attention", "train", "infer", "step") and "rows" in sec:
            cols = sorted(
                {c for r in sec["rows"] for c in r},
                key=lambda c: list(sec["rows"][0]).index(c) if c in sec["rows"][0] else 99,
            )
            out.append(sec.get("settings", sec.get("shape", "")) + "\n\n" + table(sec["rows"], cols) + "\n")
            if "goals" in sec:
                out.append(
                    "\n".join(f"- {t} {k}: {fmt(v)}" for t, g in sec["goals"].items() for k, v in g.items())
                    + "\n"
                )
        elif name == "profile" and "tables" in sec:
            for label, rows in sec["tables"].items():
                out.append(f"{label}:\n\n" + table(rows, ["kernel", "calls", "self_ms", "share"]) + "\n")
        elif name == "e2e" and "steps" in sec:
            out.append(table(sec["steps"], ["step", "returncode", "seconds", "command"]) + "\n")
            out.append(f"final: {json.dumps(sec.get('final'))}\n\nonnx: {json.dumps(sec.get('onnx'))}\n")
    return "\n".join(out)


def plan(sections: list[str]) -> str:
    lines = [f"would run, in order: {', '.join(sections)}"]
    if "tests" in sections:
        lines.append("  tests: pytest -m cuda tests/test_cuda.py")
    if "e2e" in sections:
        lines += [
            f"  e2e: cmhsa {' '.join(a for a in argv)}"
            for argv in (
                ["train", "phase1", "..."],
                ["convert", "..."],
                ["verify", "..."],
                ["train", "phase2", "--init", "..."],
                ["eval", "..."],
                ["export", "--device", "cuda|cpu", "..."],
            )
        ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="Folder for results.json, results.md and the test report.")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"Comma list of {', '.join(SECTIONS)}.")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10, help="Timed steps per measurement.")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--train-compile",
        choices=("both", "eager", "compiled"),
        default="both",
        help="Train section's modes.",
    )
    ap.add_argument(
        "--train-exclude",
        type=lambda s: tuple(x for x in s.split(",") if x),
        default=(),
        help="Train section: leave out models whose label contains one of these (comma list).",
    )
    ap.add_argument("--step-batches", default="256,1024", help="Step section: batch sizes (comma list).")
    ap.add_argument(
        "--arm-epochs", type=int, default=40, help="Step section: the six arms' epochs (0: skip)."
    )
    ap.add_argument(
        "--train-models",
        default="phase,deit",
        help="Train section: models whose label contains one of these.",
    )
    ap.add_argument("--e2e-epochs", type=int, default=15)
    ap.add_argument(
        "--data-dir", default=None, help="Step section: Fashion-MNIST's IDX files (default: Debian's)."
    )
    ap.add_argument("--e2e-device", default="cuda")
    ap.add_argument("--dry-run", action="store_true", help="Print the plan and exit (no GPU needed).")
    args = ap.parse_args()
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        ap.error(f"unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    import torch

    if args.dry_run or not torch.cuda.is_available():
        if not args.dry_run:
            print("no CUDA device here: nothing measured.")
        print(plan(sections))
        return 0
    suite = Suite(args.out, args)
    peak = None
    if "env" in sections:
        suite.run("env", env_section)
        peak = suite.results["sections"]["env"].get("peak_bf16_tflops")
    else:
        peak = dense_bf16_peak(torch.cuda.get_device_name())[0]
    jobs = {
        "tests": lambda: tests_section(args.out),
        "exact": exact_section,
        "attention": lambda: attention_section(args.batch),
        "train": lambda: train_section(args, peak),
        "profile": lambda: profile_section(args),
        "infer": lambda: infer_section(args),
        "step": lambda: step_section(
            args.out,
            batches=tuple(int(b) for b in args.step_batches.split(",")),
            arm_epochs=args.arm_epochs,
            data_dir=args.data_dir,
        ),
        "e2e": lambda: e2e_section(args.out, args.e2e_device, args.e2e_epochs),
    }
    for name in sections:
        if name != "env":
            suite.run(name, jobs[name])
    failed = [n for n, r in suite.results["sections"].items() if not r.get("ok")]
    print(f"wrote {args.out / 'results.json'} and results.md; failed sections: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
