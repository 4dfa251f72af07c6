"""A stack's evaluation (``--seeds``): every seed in one batched forward (``Stack.validation``)
against each seed's own evaluation one after another, wall seconds on one device.

    python bench/investigations/stacked_eval.py [--device cpu] [--seeds 2 6] [--val 2048]
                                                [--batch 256] [--data-dir DIR]

bench/ops_per_step.py's model (``--preset cpu``, Fashion-MNIST, the device loader; phase 2 from
impulse init, gated), a stack trained for 2 steps, then at its epoch's end its validation split of
``--val`` images evaluated both ways, 3 times each (the median; the first of the six calls also
warms the device): the batched forward (what ``train.stacked.BATCHED_EVALUATION``'s devices run)
and ``evaluate`` of each seed's model (what the others run). Prints the seconds, their ratio and
the largest difference between the two of a seed's validation loss (the batched kernels' rounding:
float32 on the CPU, bf16 autocast on CUDA).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from pathlib import Path as _Path
from typing import Any

import torch

sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))  # bench/: the benchmarks these read
from ops_per_step import config

from convit_convert.api.on_data import evaluate
from convit_convert.train import stacked
from convit_convert.train.progress import Progress


def seconds(call: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Median wall seconds of 3 calls (the device synchronised around each), and the last result."""
    times, result = [], None
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        result = call()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
    return statistics.median(times), result


def measured(phase: str, seeds: int, args: argparse.Namespace, out: Path) -> tuple[float, float, float]:
    """(batched s, one-after-another s, the largest difference of a seed's validation loss between
    the two) of one stack's evaluation."""
    got: list[tuple[float, float, float]] = []

    def both(stack: stacked.Stack, checked: object) -> list:
        device = stack.ctx.device
        stack.batched_validation = True  # as on a device of BATCHED_EVALUATION
        batched, scores = seconds(lambda: validation(stack, checked), device)

        def one_by_one() -> list[dict[str, float]]:
            return [evaluate(loop.state.model, loop.val_loader, device, stack.dtype) for loop in stack.loops]

        apart, own = seconds(one_by_one, device)
        gap = max(abs(a.model["val_loss"] - b["val_loss"]) for a, b in zip(scores, own, strict=True))
        got.append((batched, apart, gap))
        return scores

    validation = stacked.Stack.validation
    stacked.Stack.validation = both  # type: ignore[method-assign]
    try:
        cfg = config(phase, 2, args.batch, out, args.data_dir)
        cfg = cfg.replace(device=args.device, val_samples=args.val, threads=torch.get_num_threads())
        stacked.run_seeds(
            cfg.replace(seeds=tuple(range(seeds)), seeds_step="batched"), progress=Progress(None)
        )
    finally:
        stacked.Stack.validation = validation  # type: ignore[method-assign]
    return got[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seeds", type=int, nargs="+", default=[2, 6])
    ap.add_argument("--phases", nargs="+", default=["phase1", "phase2"])
    ap.add_argument("--val", type=int, default=2048, help="validation images")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.device}, {torch.get_num_threads()} threads, {args.val} images\n")
    print("| phase | seeds | one batched forward s | each seed's own s | batched / own | val-loss gap |")
    print("|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for phase in args.phases:
            for seeds in args.seeds:
                batched, apart, gap = measured(phase, seeds, args, Path(tmp) / f"{phase}-{seeds}")
                row = (
                    f"| {phase} | {seeds} | {batched:.3f} | {apart:.3f} | {batched / apart:.2f} | {gap:.1e} |"
                )
                print(row, flush=True)


if __name__ == "__main__":
    main()
