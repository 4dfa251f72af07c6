"""Images/s of S seeds trained as one stacked model in one process (``--seeds``) against S separate
processes sharing the device, for phase 1 and phase 2.

    python bench/stacked_seeds.py --device cuda --compile --data-dir DIR [--stacks 1 3 6] [--separate 3]

Each measurement is a `cmhsa train` of EXPERIMENTS.md's Fashion-MNIST model (``--preset cpu``,
28 px, P 4, d 48, depth 2; batch 256) on ``--train-samples`` images for ``--epochs`` epochs; the
figure is the images/s of every epoch after the first (which holds the compilation), summed over
the seeds (each seed's metrics.csv row counts its own images). ``--separate 1`` is one plain run,
the one-seed baseline. Prints one row per measurement and writes them to ``--out`` as JSON as
each ends; a run that fails is recorded with its last output and the rest go on. Run under
``TORCH_LOGS=perf_hints CMHSA_DEBUG=1`` (``cudagraphs`` in place of ``perf_hints`` on a torch that
logs there), each row keeps inductor's reasons for skipping CUDA graphs.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from convit_convert.train.names import seed_folder

MODEL = ["--preset", "cpu", "--data", "fashion-mnist", "--in-chans", "1", "--batch-size", "256"]
PHASE_FLAGS = {"phase1": [], "phase2": ["--init", "impulse"]}


class Failed(Exception):
    """A measured run exited non-zero; the message holds what it printed last."""


def epochs(folder: Path) -> list[dict[str, str]]:
    """A run's metrics.csv rows."""
    with open(folder / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def steady(folder: Path) -> float:
    """Images/s of a run's epochs after its first (mean)."""
    return statistics.mean(float(r["images_per_s"]) for r in epochs(folder)[1:])


def command(args: argparse.Namespace, phase: str, out: Path, seed_flags: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "convit_convert",
        "train",
        phase,
        *MODEL,
        *PHASE_FLAGS[phase],
        *(["--data-dir", args.data_dir] if args.data_dir else []),
        "--train-samples",
        str(args.train_samples),
        "--val-samples",
        str(args.val_samples),
        "--epochs",
        str(args.epochs),
        "--eval-every",
        str(args.epochs),
        "--device",
        args.device,
        *(["--compile"] if args.compile else []),
        *seed_flags,
        "-o",
        str(out),
    ]


def measure(args: argparse.Namespace, phase: str, stacked: int, separate: int, tmp: Path) -> dict:
    """One row: ``stacked`` seeds in one process, or ``separate`` processes of one seed each."""
    t0 = time.perf_counter()
    if stacked:
        out = tmp / f"{phase}-stack{stacked}"
        seeds = ",".join(map(str, range(stacked)))
        flags = ["--seeds", seeds, "--seeds-step", "batched"]  # the stack this bench measures, on any device
        done = subprocess.run(command(args, phase, out, flags), capture_output=True, text=True)
        if done.returncode:
            raise Failed(f"{phase}, {stacked} seeds stacked: exit {done.returncode}\n{done.stderr[-3000:]}")
        folders = [seed_folder(out, s) for s in range(stacked)]
        logs = [done.stderr]
    else:
        outs = [tmp / f"{phase}-sep{separate}-{s}" for s in range(separate)]
        errs = [tmp / f"{phase}-sep{separate}-{s}.err" for s in range(separate)]
        procs = [
            subprocess.Popen(
                command(args, phase, o, ["--seed", str(s)]), stdout=subprocess.DEVNULL, stderr=e.open("w")
            )
            for s, (o, e) in enumerate(zip(outs, errs, strict=True))
        ]
        if any(p.wait() != 0 for p in procs):
            raise Failed(f"{phase}: a separate process failed\n{errs[0].read_text()[-3000:]}")
        folders = outs
        logs = [e.read_text() for e in errs]
    per_seed = [steady(f) for f in folders]
    return {
        "phase": phase,
        "form": f"{stacked} seeds stacked, one process"
        if stacked
        else f"{separate} processes, one seed each",
        "images_per_s": sum(per_seed),
        "per_seed": per_seed,
        "wall_s": time.perf_counter() - t0,
        # the epoch that holds the compilation, each seed's (a stack's seeds share one)
        "first_epoch_s": [float(epochs(f)[0]["epoch_seconds"]) for f in folders],
        # inductor's reasons for running a graph without CUDA graphs (printed under
        # TORCH_LOGS=perf_hints): a step that skips them pays a launch per kernel
        "cudagraph_notes": sorted(
            {ln.strip()[-300:] for log in logs for ln in log.splitlines() if "cudagraph" in ln}
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--phases", nargs="+", default=["phase1", "phase2"])
    ap.add_argument("--stacks", type=int, nargs="*", default=[1, 3, 6])
    ap.add_argument("--separate", type=int, nargs="*", default=[3])
    ap.add_argument("--train-samples", type=int, default=30720)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--val-samples", type=int, default=1000, help="validation images, at the last epoch")
    ap.add_argument("--out", type=Path, default=Path("bench/results/stacked_seeds.json"))
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for phase in args.phases:
            plan = [(s, 0) for s in args.stacks] + [(0, n) for n in args.separate]
            for stacked, separate in plan:
                try:
                    row = measure(args, phase, stacked, separate, Path(tmp))
                    rate, wall = row["images_per_s"], row["wall_s"]
                    print(f"{phase}  {row['form']:36s} {rate:10.0f} img/s  ({wall:.0f} s)", flush=True)
                    for note in row["cudagraph_notes"]:
                        print(f"    {note}", flush=True)
                except Failed as e:  # the other rows still tell something: record it, go on
                    print(e, file=sys.stderr, flush=True)
                    row = {"phase": phase, "stacked": stacked, "separate": separate, "error": str(e)}
                rows.append(row)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
