"""What an approximate conversion and the heads sweep cost, on the digits fixture.

    python bench/approximate.py [--heads 4] [--rounds 3] [--images 256] [--heldout 512]

``fixtures/conv_digits.safetensors`` (16 px, P 4, d 48, depth 4, K 5), N(0, 1) calibration
(``--images``, ``--heldout`` held out), CPU, float32, 2 threads: the seconds of
``convert --heads N --approximate`` without verification (``api.convert_checkpoint``), and of
``cmhsa heads --checkpoint``'s sweep over N = 1 … 9 (``api.heads_sweep``). One warm-up, then the
minimum of ``--rounds``.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import torch

from convit_convert.api import convert_checkpoint, heads_sweep, load_checkpoint
from convit_convert.approximate import noise_calibration
from convit_convert.options.conversion import ConversionSpec

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors"


def best(fn: Callable[[], object], rounds: int) -> float:
    fn()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--images", type=int, default=256, help="calibration images")
    ap.add_argument("--heldout", type=int, default=512, help="held-out images")
    args = ap.parse_args()
    torch.set_num_threads(2)
    ckpt = load_checkpoint(FIXTURE)
    calib = noise_calibration(ckpt.config, args.images, args.heldout)
    spec = ConversionSpec(heads=args.heads, approximate=True)
    convert_s = best(lambda: convert_checkpoint(ckpt, spec, calibration=calib, verify=False), args.rounds)
    sweep_s = best(lambda: heads_sweep(ckpt, calib), args.rounds)
    print("| operation | seconds (min of rounds) |")
    print("|---|---:|")
    print(f"| convert --heads {args.heads} --approximate (no verify) | {convert_s:.2f} |")
    print(f"| heads --checkpoint sweep, N = 1 … 9 | {sweep_s:.2f} |")


if __name__ == "__main__":
    main()
