"""The host's work per training step: aten ops dispatched, host reads of device values, and CPU steps/s.

    python bench/ops_per_step.py [--batch 8] [--data-dir DIR]

The EXPERIMENTS.md model and recipe (``--preset cpu``: 28 px, P 4, d 48, depth 2, K 5), both
phases (phase 2 from impulse init, gated pinning, 9 heads), the device loader, on the CPU, at a
small batch, where the fixed cost of a step dominates. Ops: every aten op dispatched (a
TorchDispatchMode counts them) during a 1-epoch run of 16 steps and one of 48; the per-step count
is the slope, so set-up and the epoch's evaluation (the same in both) cancel. A count is the same
on every machine with the same torch. The model's share: the ops of its forward pass and
``torch.autograd.grad`` of a loss (its sum) at the same batch, outside any run: the floor that
a step's other work (augmentation, loss, update, bookkeeping) adds to. Steps/s: the 48-step run
again without the counter, its epoch's training seconds (metrics.csv) over its steps, median of 3.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import torch
from sizes import TINY

from convit_convert.options.training import TrainConfig
from convit_convert.train.profiling import HOST_READ, OpCounter
from convit_convert.train.progress import Progress
from convit_convert.train.run import run

# bench/sizes.py's tiny model as training flags (its class count is the data's)
TINY_RUN = {k: v for k, v in TINY.items() if k != "num_classes"}


def config(
    phase: str,
    steps: int,
    batch: int,
    out: Path,
    data_dir: str | None,
    report_to: str = "none",
    tiny: bool = False,
) -> TrainConfig:
    """The run measured: ``--preset cpu`` on Fashion-MNIST, phase 2 from impulse init, gated; with
    ``tiny``, bench/sizes.py's tiny model (one block of a 16-pixel input) for tests/test_bench.py."""
    extra = dict(init="impulse", pinning="gated") if phase == "phase2" else {}
    if tiny:
        extra.update(TINY_RUN)
    return TrainConfig.from_flags(
        phase=phase,
        preset="cpu",
        data="fashion-mnist",
        data_dir=data_dir,
        in_chans=1,
        loader="device",
        device="cpu",
        threads=1,
        batch_size=batch,
        train_samples=steps * batch,
        val_samples=64,
        epochs=1,
        log_every=50,  # the default: 16 and 48 steps read out once, at the epoch's end
        report_to=report_to,
        out=str(out),
        **extra,
    )


# where a step's ops go: functions whose calls are counted apart, (owner, name) as looked up at call
# time; each part counts the ops inside its calls, so the parts nest in the whole
PARTS = {
    "augmentation's parameters": [
        ("convit_convert.train.augment", "sample_params"),
        ("convit_convert.train.held", "sample_params"),
    ],
    "augmentation's pixels": [
        ("convit_convert.train.augment", "augment"),
        ("convit_convert.train.held", "augment"),
    ],
    "model forward": [("convit_convert.model", "VisionTransformer.forward")],
    "gradients": [("torch", "autograd.grad"), ("torch", "Tensor.backward")],
    "optimizer": [("torch.optim", "AdamW.step")],
}


@contextlib.contextmanager
def parts_counted() -> Iterator[Counter[str]]:
    """Ops inside each of :data:`PARTS`' functions while active (their totals by part)."""
    totals: Counter[str] = Counter()
    undo = []
    for part, places in PARTS.items():
        for module, name in places:
            owner = importlib.import_module(module)
            *path, attr = name.split(".")
            for p in path:
                owner = getattr(owner, p)
            if not hasattr(owner, attr):
                continue
            real = getattr(owner, attr)

            def counted(*a, _real=real, _part=part, **k):
                counter = OpCounter()
                with counter:
                    out = _real(*a, **k)
                totals[_part] += sum(counter.ops.values())
                return out

            setattr(owner, attr, counted)
            undo.append((owner, attr, real))
    try:
        yield totals
    finally:
        for owner, attr, real in reversed(undo):
            setattr(owner, attr, real)


def one_run(cfg: TrainConfig, count: str | None) -> tuple[Counter[str], float]:
    """(ops by name, or by part with ``count`` "parts"; training seconds of the epoch) of one run
    of ``cfg``. The parts are counted in runs of their own (their wrappers shift the total by a
    few ops)."""
    if count == "ops":
        with OpCounter() as counter:
            result = run(cfg, progress=Progress(None))
        return counter.ops, float(result.rows[-1]["epoch_seconds"])
    if count == "parts":
        with parts_counted() as parts:
            result = run(cfg, progress=Progress(None))
        return parts, float(result.rows[-1]["epoch_seconds"])
    result = run(cfg, progress=Progress(None))
    return Counter(), float(result.rows[-1]["epoch_seconds"])


def model_ops(cfg: TrainConfig, batch: int) -> int:
    """Aten ops of the phase's model: forward and gradients of every parameter, one batch."""
    from convit_convert.train.phases import build_phase_model

    model = build_phase_model(cfg, 10, lambda _: None).model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    x = torch.randn(batch, cfg.model.in_chans, cfg.model.img_size, cfg.model.img_size)
    counter = OpCounter()
    with counter:
        torch.autograd.grad(model(x).sum(), params, allow_unused=True)
    return sum(counter.ops.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--data-dir", default=None, help="Fashion-MNIST's four IDX .gz files (default: Debian's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--report-to", default="none", help="none or tensorboard, as cmhsa train's flag")
    args = ap.parse_args()
    torch.set_num_threads(1)
    said = f"torch {torch.__version__}, CPU, 1 thread, batch {args.batch}, device loader"
    print(f"{said}, --report-to {args.report_to}\n")
    print(
        "| phase | aten ops per step | of which the model's forward + gradients | host reads per step "
        f"| CPU steps/s (median of {args.repeats}) |"
    )
    print("|---|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("phase1", "phase2"):
            counts, parts = {}, {}
            for steps in (16, 48):
                cfg = config(
                    phase, steps, args.batch, Path(tmp) / f"{phase}-{steps}", args.data_dir, args.report_to
                )
                counts[steps], _ = one_run(cfg, count="ops")
                cfg = config(phase, steps, args.batch, Path(tmp) / f"{phase}-{steps}-parts", args.data_dir)
                parts[steps], _ = one_run(cfg, count="parts")
            per_step = (sum(counts[48].values()) - sum(counts[16].values())) / 32
            rates = []
            for i in range(args.repeats):
                cfg = config(phase, 48, args.batch, Path(tmp) / f"{phase}-t{i}", args.data_dir)
                rates.append(48 / one_run(cfg, count=None)[1])
            floor = model_ops(cfg, args.batch)
            # .item(), float() and bool() of a tensor: the host waiting for the device
            reads = (counts[48][HOST_READ] - counts[16][HOST_READ]) / 32
            print(f"| {phase} | {per_step:.0f} | {floor} | {reads:.2f} | {statistics.median(rates):.1f} |")
            top = Counter({k: (counts[48][k] - counts[16][k]) / 32 for k in counts[48]}).most_common(8)
            print("|  | most frequent: " + ", ".join(f"{k} {v:.0f}" for k, v in top) + " | | | |")
            split = {k: (parts[48][k] - parts[16][k]) / 32 for k in PARTS}
            split["the rest (loss, bookkeeping)"] = per_step - sum(split.values())
            print("|  | per step: " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()) + " | | | |")


if __name__ == "__main__":
    main()
