"""What gathering the relative-position bias with ``index_select`` (deterministic on CPU) costs
against advanced indexing (``table[:, index]``, whose backward accumulates with atomics), per
phase-2 training step.

    python bench/position_gather.py                  # CPU, 2 threads
    python bench/position_gather.py --device cuda

Two models: the EXPERIMENTS.md one (28 px, P 4, d 48, depth 2, 9 heads, gated, batch 128) and the
paper's (224 px, P 16, d 768, depth 6, 9 heads, gated, batch 8 on CPU). The two forms are timed in
alternation (A B A B ...), so a machine that is busy with something else slows both alike; the
median step of each is reported, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from convit_convert.config import ViTConfig
from convit_convert.model import RelPosAttention, VisionTransformer

DETERMINISTIC = RelPosAttention.position_bias


def advanced_indexing(self: RelPosAttention, table: torch.Tensor | None = None) -> torch.Tensor:
    return (self.rel_pos_bias if table is None else table).flatten(1)[:, self.rel_pos_index]


def step_seconds(
    model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t = time.perf_counter()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sync()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--only", choices=["small", "paper"], default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    small = ViTConfig.build(
        img_size=28, patch_size=4, in_chans=1, hidden_chans=3, depth=2, num_classes=10, kernel_size=5
    )
    paper = ViTConfig.build()
    cases = [
        ("Fashion-MNIST model, batch 128", small, 128),
        ("paper's model, batch 8", paper, 8 if dev.type == "cpu" else 128),
    ]
    cases = [
        c
        for c in cases
        if args.only is None or c[0].startswith({"small": "Fashion", "paper": "paper"}[args.only])
    ]
    print(f"{'model':34s} {'index_select ms':>16s} {'table[:, idx] ms':>17s} {'ratio':>6s}")
    for name, cfg, batch in cases:
        cfg = cfg.with_attention(9, pinning="gated")
        torch.manual_seed(0)
        model = VisionTransformer(cfg).to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(batch, cfg.in_chans, *cfg.img_size, device=dev)
        y = torch.randint(0, cfg.num_classes, (batch,), device=dev)
        times: dict[str, list[float]] = {"select": [], "index": []}
        forms = [("select", DETERMINISTIC), ("index", advanced_indexing)]
        for r in range(args.rounds + 2):
            for form, fn in forms if r % 2 else forms[::-1]:  # alternate which goes first
                RelPosAttention.position_bias = fn  # type: ignore[method-assign]
                s = step_seconds(model, opt, x, y)
                if r >= 2:  # the first two rounds warm up
                    times[form].append(s)
        RelPosAttention.position_bias = DETERMINISTIC  # type: ignore[method-assign]
        a, b = statistics.median(times["select"]), statistics.median(times["index"])
        print(f"{name:34s} {a * 1e3:16.1f} {b * 1e3:17.1f} {b / a:6.2f}", flush=True)


if __name__ == "__main__":
    main()
