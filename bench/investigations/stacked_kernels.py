"""Kernels per compiled training step of S stacked seeds (``--seeds``) against a plain run, counted
by torch's profiler ("kernels per compiled step"): what a GPU pays a launch for.

    python bench/investigations/stacked_kernels.py [--device cpu] [--stacks 0 1 6] [--batch 8] [--conv-form F]
                                    [--data-dir DIR] [--tiny]
    python bench/investigations/stacked_kernels.py --device cuda --batch 256 ...

bench/stacked_host.py's model and recipe (``--preset cpu``, drop path 0.1; phase 2 from impulse
init, gated), the device loader, ``--compile``, the default AMP; a stack of 0 is a plain run (no
``--seeds``), the one-seed baseline. Two counts:

- **kernels per graph call** (on the CPU): the kernels inductor's compiled step calls, each
  generated kernel (``cpp.enable_kernel_profile`` names them) and each library call (matmuls:
  ``aten::mm``, ``bmm``, ``addmm``), over the calls of the compiled graph. This is the graph's
  size; the optimizer, EMA and the rest of a step run outside it. On CUDA the step replays a CUDA
  graph, whose kernels this column does not see: the next one counts them.
- **eager ops per step** (any device): the aten ops a step dispatches around its compiled graph
  (ops called by other ops, views and allocations not counted), the median over the steps: on a
  GPU each is one more launch, outside the CUDA graph.
- **device kernels per step** (CUDA only): every profiler event that ran on the GPU (kernels,
  copies, fills), the slope between 1-epoch runs of 16 and 48 steps, so set-up, compilation and
  evaluation cancel.
- **host ms per step** (any device): the step's wall time on the host, the median over the steps
  (under the profiler, which adds some microseconds an op). On a CPU it holds the arithmetic; on a
  GPU, where launches return at once, it is the host's pace.
- **device ms per step** (CUDA only): the time those GPU events ran, by the same slope. Below the
  host's ms, the host sets the pace of a step; near it, the GPU does.
- **MB moved per graph call** (any device): the bytes the compiled graph's generated kernels read
  and write, by inductor's own count (``GraphLowering.count_bytes``; library matmuls not counted),
  each case's graph compiled into an empty cache. On a GPU a step whose launches are few is bound by
  these bytes: at 6 seeds the stack shares the launches, not the traffic.
- **CUDA-graph skips** (CUDA only): inductor's count of compiled graphs it ran without CUDA graphs
  (``counters["inductor"]["cudagraph_skips"]``); each such graph launches its kernels one by one.

On CUDA, after the table, each case's 12 longest GPU kernels per step (by the same slope).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path
from pathlib import Path as _Path
from typing import NamedTuple

import torch
import torch._inductor.compile_fx as compile_fx
import torch._inductor.config as inductor_config
import torch._inductor.metrics as inductor_metrics

sys.path.insert(0, str(_Path(__file__).resolve().parent.parent))  # bench/: the benchmarks these read
from ops_per_step import config
from sizes import add_size_flag
from torch._dynamo.utils import counters

from convit_convert.train.profiling import GRAPH_CALL, NOT_KERNELS, STEP, eager_step, steps_recorded
from convit_convert.train.progress import Progress
from convit_convert.train.run import run
from convit_convert.train.stacked import run_seeds

MATMULS = ("aten::mm", "aten::bmm", "aten::addmm", "aten::baddbmm")


class Counted(NamedTuple):
    graph_calls: int
    graph_kernels: int  # kernels and library calls inside those calls
    graph_matmuls: int  # of which the library's matmuls
    device_events: int
    steps: int
    eager_ops: float  # aten ops a step dispatched outside the compiled graph, median over the steps
    host_ms: float  # a step's wall time on the host, median over the steps
    device_ms: float  # the GPU events' time, all steps together
    graph_skips: int  # compiled graphs inductor ran without CUDA graphs
    device_kernels: Counter[str]  # the GPU events' ms by name, all steps together
    moved_mb: float  # bytes the compiled graph's generated kernels move per call, by inductor's count


def eager_ops_per_step(events: list) -> tuple[int, float]:
    """(steps, the median over them of the aten ops each dispatched outside the compiled graph)
    from a profile taken under :func:`steps_recorded`. The median: the first step also holds
    dynamo's tracing (about a thousand ops)."""
    per_step = Counter({e.id: 0 for e in events if e.name == STEP})
    per_step.update(step for step in map(eager_step, events) if step is not None)
    return len(per_step), statistics.median(per_step.values()) if per_step else 0.0


def counted(phase: str, seeds: int, steps: int, args: argparse.Namespace, out: Path) -> Counted:
    """One compiled run of ``seeds`` stacked seeds (0: a plain run) for ``steps`` steps, profiled."""
    cfg = config(phase, steps, args.batch, out, args.data_dir, tiny=args.tiny)
    cfg = cfg.replace(device=args.device, compile=True, amp="auto")
    cfg = cfg.replace(conv_form=args.conv_form) if args.conv_form else cfg
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    skips = counters["inductor"]["cudagraph_skips"]
    inductor_metrics.reset()
    with torch.profiler.profile(activities=activities) as prof, steps_recorded():
        if seeds:
            run_seeds(cfg.replace(seeds=tuple(range(seeds)), seeds_step="batched"), progress=Progress(None))
        else:
            run(cfg, progress=Progress(None))
    events = prof.events()
    calls = sum(1 for e in events if e.name.startswith(GRAPH_CALL))
    inside = [
        e.name
        for e in events
        if e.cpu_parent is not None
        and e.cpu_parent.name.startswith(GRAPH_CALL)
        and not e.name.startswith(NOT_KERNELS)
    ]
    matmuls = sum(1 for name in inside if name in MATMULS)
    on_device = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    steps, eager = eager_ops_per_step(events)
    host = statistics.median(e.time_range.elapsed_us() for e in events if e.name == STEP) / 1000
    device_ms = sum(e.time_range.elapsed_us() for e in on_device) / 1000
    skipped = counters["inductor"]["cudagraph_skips"] - skips
    by_name: Counter[str] = Counter()
    for e in on_device:
        by_name[e.name[:90]] += e.time_range.elapsed_us() / 1000
    moved = inductor_metrics.num_bytes_accessed / 1e6
    return Counted(
        calls, len(inside), matmuls, len(on_device), steps, eager, host, device_ms, skipped, by_name, moved
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--stacks", type=int, nargs="+", default=[0, 1, 6], help="seeds stacked; 0: a plain run")
    ap.add_argument("--phases", nargs="+", default=["phase1", "phase2"])
    ap.add_argument(
        "--conv-form", default=None, help="phase 1's conv form for every case (default: each one's own)"
    )
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    add_size_flag(ap)
    args = ap.parse_args()
    inductor_config.cpp.enable_kernel_profile = True  # the CPU's generated kernels as profiler records
    # inductor counts a graph's bytes as it compiles it, where its metrics log is on (enabled here
    # but written nowhere); each case's first run compiles into an empty cache (main's), its
    # second finds the graph there
    quiet = logging.getLogger(compile_fx.inductor_metrics_log.name)
    quiet.setLevel(logging.INFO)
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    print(f"torch {torch.__version__}, {args.device}, compiled, batch {args.batch} per seed\n")
    columns = ["kernels per graph call", "of which matmuls", "eager ops per step", "device kernels per step"]
    columns += ["MB moved per graph call", "host ms per step", "device ms per step", "CUDA-graph skips"]
    print("| phase | seeds | " + " | ".join(columns) + " |")
    print("|---|---|" + "---:|" * len(columns))
    tops: dict[str, list[str]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tmp) / "inductor")
        for phase in args.phases:
            for seeds in args.stacks:
                # a fresh dynamo per stack size: a second size in one process would make the seed
                # axis a symbolic size, which vmap's batched tensors cannot trace
                torch._dynamo.reset()
                sizes = (16, 48) if args.device == "cuda" else (16,)  # the slope needs two runs
                runs = [counted(phase, seeds, n, args, Path(tmp) / f"{phase}-{seeds}-{n}") for n in sizes]
                last = runs[-1]
                graph, matmuls = (
                    n / max(last.graph_calls, 1) for n in (last.graph_kernels, last.graph_matmuls)
                )
                form = f"{seeds} stacked" if seeds else "one plain run"
                slope = len(runs) > 1  # on CUDA: per step, the difference of the two runs over 32 steps
                kernels = f"{(last.device_events - runs[0].device_events) / 32:.0f}" if slope else "-"
                busy = f"{(last.device_ms - runs[0].device_ms) / 32:.2f}" if slope else "-"
                skips = str(sum(r.graph_skips for r in runs)) if args.device == "cuda" else "-"
                counts = f"{graph:.0f} | {matmuls:.0f} | {last.eager_ops:.0f} | {kernels}"
                counts += f" | {runs[0].moved_mb:.0f} | {last.host_ms:.2f} | {busy} | {skips}"
                print(f"| {phase} | {form} | {counts} |", flush=True)
                if slope:  # where the GPU's time goes: its longest kernels per step
                    spent = last.device_kernels - runs[0].device_kernels
                    top = spent.most_common(12)
                    tops[f"{phase}, {form}"] = [f"{ms / 32:.3f} ms  {name}" for name, ms in top]
    for case, lines in tops.items():
        print(f"\nthe GPU's longest kernels per step, {case}:", *lines, sep="\n  ")


if __name__ == "__main__":
    main()
