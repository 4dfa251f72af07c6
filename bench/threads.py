"""Threads on a busy machine: what the default thread count and 1 and 2 threads cost, idle and beside
processes that keep CPUs busy at the same priority, for the quick start's two phases and the
paper's model.

    python bench/threads.py [--busy 0 2] [--threads default 1 2] [--sizes cpu paper] [--phases 1 2]
                            [--epochs 3] [--paper-steps 2] [--out DIR]

Each case is one ``cmhsa train`` process, timed whole (start-up, data, steps, validation, save):
wall seconds, CPU seconds (user + system, its own and its workers'), and the threads it chose
(its first line says). ``cpu``: the README's quick start (``--preset cpu`` on the digits, 32 px)
for ``--epochs`` epochs, phase 2 from ``fixtures/conv_digits.safetensors``. ``paper``: the
paper's model (224 px, P 16, d 768, depth 6; no ``--preset``) for ``--paper-steps`` steps at batch
8, phase 2 from impulse init. ``--busy N``: N processes spinning in Python beside it (``nice`` 0,
as the run), started before it and stopped after. OMP_NUM_THREADS is unset in every run.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_RUN = (
    "--preset cpu --data digits --in-chans 1 --img-size 32 --warmup-epochs 1 --hflip 0 --scale 0.6 1".split()
)
PAPER_RUN = "--data digits --in-chans 1 --batch-size 8 --val-samples 8 --warmup-epochs 0".split()
THREADS = re.compile(r"(\d+) threads?\b")


def command(size: str, phase: str, threads: str, args: argparse.Namespace, out: Path) -> list[str]:
    words = [
        sys.executable,
        "-m",
        "convit_convert",
        "train",
        f"phase{phase}",
        "--device",
        "cpu",
        "-o",
        str(out),
    ]
    if size == "cpu":
        words += [*CPU_RUN, "--epochs", str(args.epochs)]
        if phase == "2" and not args.tiny:
            words += ["--init", str(ROOT / "fixtures" / "conv_digits.safetensors"), "--lr", "5e-4"]
    else:
        words += [*PAPER_RUN, "--epochs", "1", "--train-samples", str(8 * args.paper_steps)]
    if args.tiny:  # tests/test_bench.py: a tiny model, one epoch of a few steps
        words += ["--img-size", "16", "--patch-size", "4", "--depth", "1", "--kernel-size", "3"]
        words += ["--train-samples", "32", "--val-samples", "16", "--epochs", "1", "--batch-size", "16"]
    return words + ([] if threads == "default" else ["--threads", threads])


def timed(words: list[str], busy: int) -> tuple[float, float, str]:
    """Wall and CPU seconds of one run beside ``busy`` spinning processes, and the threads it chose."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        time.sleep(0.5 if busy else 0)  # they are running before the run looks
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        r = subprocess.run(words, capture_output=True, text=True, env=env, cwd=ROOT)
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    if r.returncode != 0:
        raise SystemExit(f"failed: {' '.join(words)}\n{r.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    chose = THREADS.search(r.stdout)
    return wall, cpu, chose.group(1) if chose else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--threads", nargs="+", default=["default", "1", "2"])
    ap.add_argument("--sizes", nargs="+", default=["cpu", "paper"], choices=["cpu", "paper"])
    ap.add_argument("--phases", nargs="+", default=["1", "2"], choices=["1", "2"])
    ap.add_argument("--epochs", type=int, default=3, help="the quick start's epochs per run")
    ap.add_argument("--paper-steps", type=int, default=2, help="the paper's model's steps per run")
    ap.add_argument("--tiny", action="store_true", help="a tiny model: checks the script runs")
    ap.add_argument("--out", type=Path, default=None, help="run folders here (default: a temporary one)")
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="cmhsa-threads-"))
    print(f"{os.cpu_count()} CPUs, this process may use {len(os.sched_getaffinity(0))}\n")
    print("| size | phase | busy processes | --threads | threads used | wall s | CPU s |")
    print("|---|---|---:|---|---:|---:|---:|")
    for size in args.sizes:
        for phase in args.phases:
            for busy in args.busy:
                for threads in args.threads:
                    folder = out / f"{size}-p{phase}-b{busy}-t{threads}"
                    wall, cpu, used = timed(command(size, phase, threads, args, folder), busy)
                    print(
                        f"| {size} | {phase} | {busy} | {threads} | {used} | {wall:.1f} | {cpu:.1f} |",
                        flush=True,
                    )


if __name__ == "__main__":
    main()
