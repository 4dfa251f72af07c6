"""Where a compiled stack's first-epoch time goes on the CPU: torch.compile's seconds for a plain
phase-1 run (its default conv form, and the token form) against a stack of seeds, inductor's
caches off (issue 67: compiled phase 1 stacked was slower than separate runs with empty caches).

    python bench/stacked_compile.py [--seeds 2] [--data-dir DIR]

bench/stacked_host.py's model and recipe (``--preset cpu``, the device loader), 8 steps of batch 8,
``--compile``, 2 threads, each case in a fresh process with ``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``
(every graph compiled from nothing) and its own inductor cache folder. Prints the run's wall seconds
and dynamo's total compile seconds (``torch._dynamo.utils.compile_times``: tracing, AOT autograd,
inductor's code generation and the C++ compiler), both from the process's own clock, and the C++
kernels inductor compiled (the shared libraries it wrote into that folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = [("one plain run, its default conv form", 0, None), ("one plain run, token form", 0, "tokens")]


def one(seeds: int, form: str | None, data_dir: str | None) -> dict[str, float]:
    """One compiled phase-1 run in this process: (wall s, compile s)."""
    import torch
    from ops_per_step import config

    from convit_convert.train.progress import Progress
    from convit_convert.train.run import run
    from convit_convert.train.stacked import run_seeds

    with tempfile.TemporaryDirectory() as tmp:
        cfg = config("phase1", 8, 8, Path(tmp) / "o", data_dir).replace(compile=True, threads=2)
        cfg = cfg.replace(conv_form=form) if form else cfg
        t0 = time.perf_counter()
        if seeds:
            run_seeds(cfg.replace(seeds=tuple(range(seeds)), seeds_step="batched"), progress=Progress(None))
        else:
            run(cfg, progress=Progress(None))
        wall = time.perf_counter() - t0
    table = torch._dynamo.utils.compile_times(repr="csv", aggregate=True)
    compile_s = dict(zip(table[0], table[1], strict=True)).get("_compile.compile_inner", 0.0)
    return {"wall_s": wall, "compile_s": float(compile_s)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    ap.add_argument("--one", nargs=2, metavar=("SEEDS", "FORM"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:  # a case, in the fresh process main started
        seeds, form = int(args.one[0]), None if args.one[1] == "default" else args.one[1]
        print(json.dumps(one(seeds, form, args.data_dir)))
        return
    print("| phase 1, compiled, caches off | wall s | compile s | C++ kernels compiled |")
    print("|---|---:|---:|---:|")
    for name, seeds, form in [*CASES, (f"{args.seeds} seeds stacked (token form)", args.seeds, None)]:
        command = [sys.executable, __file__, "--one", str(seeds), form or "default"]
        command += ["--data-dir", args.data_dir] if args.data_dir else []
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1", "TORCHINDUCTOR_CACHE_DIR": cache}
            done = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
            kernels = sum(1 for _ in Path(cache).rglob("*.so"))
        row = json.loads(done.stdout.strip().splitlines()[-1])
        print(f"| {name} | {row['wall_s']:.1f} | {row['compile_s']:.1f} | {kernels} |", flush=True)


if __name__ == "__main__":
    main()
