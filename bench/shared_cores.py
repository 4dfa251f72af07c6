"""Two training runs at once on the same cores, each with T torch threads: what oversubscribing
costs (docs/development.md, BENCHMARKS.md).

    python bench/shared_cores.py [--threads 2 1] [--repeats 1]

Each case starts two ``cmhsa train phase2`` processes together (the shipped fixture on digits,
256 images, 2 epochs, the device loader) with ``--threads T`` and reports each one's wall time,
then one run alone with 2 threads for scale. With more threads than cores torch's threads wait on
each other at every operation, which a tiny model does thousands of times per epoch.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = (
    "--data digits --init fixtures/conv_digits.safetensors --train-samples 256 --val-samples 64 "
    "--epochs 2 --batch-size 32 --warmup-epochs 0 --lr 1e-3 --lr-base-batch 32 --workers 0 "
    "--device cpu --log-every 1000 --pinning hard"
).split()


def start(out: Path, threads: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "convit_convert", "train", "phase2", *FLAGS, "--threads", str(threads)]
    return subprocess.Popen([*cmd, "-o", str(out)], cwd=ROOT, stdout=subprocess.DEVNULL)


def timed(runs: int, threads: int, scratch: Path) -> list[float]:
    """Wall seconds of each of ``runs`` runs started together, set-up included."""
    began = time.perf_counter()
    procs = [start(scratch / f"t{threads}-{i}-{time.monotonic_ns()}", threads) for i in range(runs)]
    ended = []
    for proc in procs:
        if proc.wait() != 0:
            raise SystemExit(f"a run exited with {proc.returncode}")
        ended.append(time.perf_counter() - began)
    return ended


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        for _ in range(args.repeats):
            for threads in args.threads:
                both = timed(2, threads, Path(scratch))
                print(f"two at once, {threads} thread(s) each: " + ", ".join(f"{s:.1f} s" for s in both))
            print(f"one alone, 2 threads: {timed(1, 2, Path(scratch))[0]:.1f} s")


if __name__ == "__main__":
    main()
