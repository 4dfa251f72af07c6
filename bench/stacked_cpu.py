"""On a CPU: S seeds stacked in one process (``--seeds``) against the same S runs one after another
(what a user with one machine does instead), wall seconds, start-up and first epoch included.

    python bench/stacked_cpu.py [--seeds 2] [--epochs 10] [--phases phase1 phase2] [--compile]
                                [--seeds-step auto|batched|interleaved]

docs/training.md's example ("Several seeds in one process"): ``--preset cpu --data digits
--in-chans 1``, phase 2 from each seed's phase-1 model, every thread of the machine for each
process, nothing else running. Eager, or with ``--compile``: then twice, with inductor's caches
empty (a fresh TORCHINDUCTOR_CACHE_DIR for the stack, one for the runs one after another, which
the second run finds filled by the first) and again with each filled. ``--seeds-step``: how the
stack steps its seeds (default auto, what ``--seeds`` does: interleaved on a CPU).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def train(phase: str, epochs: int, out: Path, *flags: str, cache: Path | None = None) -> float:
    """Wall seconds of one ``cmhsa train`` (its output discarded); ``cache``: inductor's cache
    folder, with ``--compile``."""
    cmd = [sys.executable, "-m", "convit_convert", "train", phase, "--preset", "cpu", "--data", "digits"]
    cmd += ["--in-chans", "1", "--epochs", str(epochs), *flags, "-o", str(out), "--overwrite"]
    env = {**os.environ, **({"TORCHINDUCTOR_CACHE_DIR": str(cache)} if cache else {})}
    began = time.perf_counter()
    subprocess.run(
        [*cmd, *(["--compile"] if cache else [])], cwd=ROOT, check=True, stdout=subprocess.DEVNULL, env=env
    )
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--phases", nargs="+", default=["phase1", "phase2"])
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--seeds-step", default="auto", choices=("auto", "batched", "interleaved"))
    args = ap.parse_args()
    seeds = list(range(args.seeds))
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        for phase, caches in [
            (p, c) for c in (("empty", "filled") if args.compile else ("",)) for p in args.phases
        ]:
            stack_cache = t / f"cache-stack-{phase}" if args.compile else None
            apart_cache = t / f"cache-apart-{phase}" if args.compile else None
            init = {"phase1": [], "phase2": ["--init"]}[phase]
            stack_init = [*init, str(t / "stack-phase1" / "seed{seed}" / "conv.safetensors")] if init else []
            together = ",".join(map(str, seeds))
            stacked = train(
                phase,
                args.epochs,
                t / f"stack-{phase}",
                "--seeds",
                together,
                "--seeds-step",
                args.seeds_step,
                *stack_init,
                cache=stack_cache,
            )
            apart = []
            for s in seeds:
                own_init = [*init, str(t / f"apart-phase1-{s}" / "conv.safetensors")] if init else []
                apart.append(
                    train(
                        phase,
                        args.epochs,
                        t / f"apart-{phase}-{s}",
                        "--seed",
                        str(s),
                        *own_init,
                        cache=apart_cache,
                    )
                )
            print(
                f"{phase}{f' compiled, caches {caches}' if caches else ''}: {args.seeds} seeds in one "
                f"process ({args.seeds_step}) "
                f"{stacked:.1f} s; one after another "
                f"{sum(apart):.1f} s ({' + '.join(f'{a:.1f}' for a in apart)})",
                flush=True,
            )


if __name__ == "__main__":
    main()
