"""Conversion cost and exactness on the paper's model.

    python bench/convert.py [--repeats 5] [--out bench/out] [--tiny]

The paper's phase-1 model: 224 px, P = 16, hidden_chans 3 (identity embedding, d = 768), depth 6,
MLP 3072, K = 5, 100 classes, random weights with non-trivial LayerNorm affines and biases.

1. Time: ``cmhsa convert --no-verify`` (load, check, convert, write the model and its report)
   against the floor of any converter: load the input and write an output of the same size with
   safetensors. Both are measured in-process and as whole processes (the command a user types,
   against ``python -c`` doing load + save; both pay Python and torch start-up), interleaved,
   the floor's output bytes coming from untouched memory (free to create),
   with dirty pages flushed before each run; median and best of ``--repeats``.
2. Exactness: the relative logit error max|Δ| / max|ref| of the converted model, float32 and
   float64, with and without the sink (``cmhsa verify``'s numbers, batch 4).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from sizes import add_size_flag, conv_config

from convit_convert.api import load_checkpoint, save_checkpoint
from convit_convert.config import ViTConfig
from convit_convert.construct import convert_state_dict
from convit_convert.model import VisionTransformer
from convit_convert.options.conversion import ConversionSpec
from convit_convert.verify import verify_models


def paper_conv(path: Path, cfg: ViTConfig) -> None:
    torch.manual_seed(0)
    model = VisionTransformer(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
    save_checkpoint(path, model.cfg, model.state_dict())


def interleaved(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """Seconds per run of each fn, alternating between them, with the page cache's dirty pages
    flushed before every run: this VM's disk write-back otherwise lands on whichever runs next."""
    runs: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for key, fn in fns.items():
            os.sync()
            t = time.perf_counter()
            fn()
            runs[key].append(time.perf_counter() - t)
    return runs


def summary(runs: dict[str, list[float]], label: str) -> None:
    med = {k: statistics.median(v) for k, v in runs.items()}
    best = {k: min(v) for k, v in runs.items()}
    print(
        f"{label}: cmhsa convert --no-verify median {med['cli']:.2f} s (best {best['cli']:.2f}), "
        f"load + save floor median {med['floor']:.2f} s (best {best['floor']:.2f}); "
        f"ratio of medians {med['cli'] / med['floor']:.2f}, of bests {best['cli'] / best['floor']:.2f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("bench/out"))
    add_size_flag(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    src, dst, floor_dst = (
        args.out / "conv.safetensors",
        args.out / "vit.safetensors",
        args.out / "floor.safetensors",
    )
    paper_conv(src, conv_config(args))

    from typer.testing import CliRunner

    from convit_convert.cli import app

    def convert_cli() -> None:
        r = CliRunner().invoke(app, ["convert", str(src), "-o", str(dst), "--no-verify"])
        assert r.exit_code == 0, r.output

    convert_cli()
    with safe_open(str(dst), framework="pt") as f:  # the converted model's tensor list, header only
        layout = {k: (f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    dtypes = {"F32": torch.float32, "F64": torch.float64, "F16": torch.float16, "BF16": torch.bfloat16}

    def floor() -> None:
        # the cheapest possible source of the output's bytes (untouched memory): the floor pays
        # only for loading the input and for safetensors writing an output of the same layout
        load_file(str(src))
        save_file({k: torch.empty(s, dtype=dtypes[d]) for k, (s, d) in layout.items()}, str(floor_dst))

    print(f"input {src.stat().st_size / 1e6:.1f} MB, output {dst.stat().st_size / 1e6:.1f} MB")
    summary(
        interleaved({"cli": convert_cli, "floor": floor}, args.repeats), f"in-process, {args.repeats} runs"
    )

    floor_cmd = (
        "import torch; from safetensors.torch import load_file, save_file; "
        f"dt = {{'F32': torch.float32, 'F64': torch.float64, 'F16': torch.float16, 'BF16': torch.bfloat16}}; "
        f"load_file({str(src)!r}); "
        "save_file({k: torch.empty(s, dtype=dt[d]) for k, (s, d) in "
        f"{layout!r}.items()}}, {str(floor_dst)!r})"
    )
    cmd_cli = [sys.executable, "-m", "convit_convert", "convert", str(src), "-o", str(dst), "--no-verify"]
    procs = {
        "cli": lambda: subprocess.run(cmd_cli, check=True, capture_output=True),
        "floor": lambda: subprocess.run([sys.executable, "-c", floor_cmd], check=True, capture_output=True),
    }
    summary(interleaved(procs, args.repeats), f"whole process, {args.repeats} runs")

    ckpt = load_checkpoint(src)
    print("\n| sink | dtype | worst mixer rel. error (all / border / interior) | logits rel. error |")
    print("|---|---|---|---|")
    for sink in (True, False):
        plan = ConversionSpec(sink=sink).plan(ckpt.config)
        sd, acfg = convert_state_dict(ckpt.tensors, plan), plan.config
        for dtype in (torch.float32, torch.float64):
            attn = VisionTransformer(acfg)
            attn.load_state_dict(sd)
            res = verify_models(ckpt.model(), attn, batch=4, dtype=dtype)
            worst = {
                region: max(e.rel for e in res.errors if e.region == region and e.tensor != "logits")
                for region in ("all", "border", "interior")
            }
            logits = next(e.rel for e in res.errors if e.tensor == "logits")
            print(
                f"| {'on' if sink else 'off (paper)'} | {res.dtype} | "
                f"{worst['all']:.1e} / {worst['border']:.1e} / {worst['interior']:.1e} | {logits:.1e} |",
                flush=True,
            )
    for p in (dst, floor_dst):
        p.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
