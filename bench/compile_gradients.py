"""One training step's gradients, eager against compiled, on digits and on synthetic images.

    python bench/compile_gradients.py

The phase-1 model of tests/test_step.py (``--preset cpu`` at 16 px, 1 channel, device loader,
batch 4), one batch: the eager step's gradients against ``--compile``'s (train/step.py's one
graph), against a plain ``torch.compile`` of the model with eager gradients, and against the
eager step at 2 threads (torch's own reordering of the sums, for scale). Prints, per
dataset, the largest difference of each from the eager gradients, relative to the largest eager
gradient (float32 rounding: about 1e-7).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from convit_convert.options.training import TrainConfig
from convit_convert.train import run as engine
from convit_convert.train.progress import Progress


def built_step(data: str, out: Path):
    """The Loop of a 1-step run on ``data`` with --compile (its CompiledStep), and one batch (its
    inputs, labels)."""
    captured = {}
    real = engine.train_one_epoch

    def one_step(loop, stop, stop_after_steps=None):
        captured["loop"] = loop
        return real(loop, stop, 1)

    engine.train_one_epoch = one_step
    try:
        cfg = TrainConfig.from_flags(
            preset="cpu",
            data=data,
            img_size=16,
            in_chans=1,
            hidden_chans=1,
            loader="device",
            device="cpu",
            threads=1,
            batch_size=4,
            train_samples=32,
            val_samples=8,
            epochs=1,
            drop_path=0.0,
            compile=True,
            out=str(out),
        )
        engine.run(cfg, progress=Progress(None))
    finally:
        engine.train_one_epoch = real
    loop = captured["loop"]
    loop.train_loader.sampler.set_epoch(0)
    return loop, next(loop.train_loader.batches())


def worst(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest difference over all gradients, relative to the largest eager gradient."""
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True)) / max(
        x.abs().max().item() for x in a
    )


DATA = ("digits", "synthetic")


def main() -> None:
    torch.set_num_threads(1)
    print("| data | compiled step vs eager | torch.compile(model) vs eager | eager at 2 threads vs 1 |")
    print("|---|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for data in DATA:
            loop, (inputs, y) = built_step(data, Path(tmp) / data)
            step, model, tally = loop.compiled, loop.state.model, loop.tally.values
            x = loop.train_loader.prepare(inputs)
            eager = step.images_learn(x, y, tally, [])[2]
            compiled = step.learn(inputs, y, tally, [])[2]
            plain = torch.autograd.grad(step.criterion(torch.compile(model)(x), y), step.params)
            torch.set_num_threads(2)
            threads = step.images_learn(x, y, tally, [])[2]
            torch.set_num_threads(1)
            cols = (worst(eager, compiled), worst(eager, list(plain)), worst(eager, threads))
            print(f"| {data} | " + " | ".join(f"{c:.1e}" for c in cols) + " |")


if __name__ == "__main__":
    main()
