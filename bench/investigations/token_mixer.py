"""One phase-1 token mixer's forward and backward at the paper's size, in both conv forms, alone and
as a stack of seeds (convit_convert/conv_mixer.py: what a stacked phase-1 step spends
in its mixers).

    python bench/investigations/token_mixer.py [--batch 8] [--seeds 2] [--rounds 5] [--device cpu]

One ConvMixer (C 3, K 5, P 16, a 14 x 14 grid: 768 features), float32, input (B, 196, 768); a
step is the mixer's output, the mean of its square, and the backward to the weights and the
input. Rows: the pixel form (``F.conv2d``), the token form, the token form's W^O alone
(``token_weight``, built from ``conv.weight`` each step), and the token form of S seeds stacked as
``--seeds`` trains them (``torch.func.vmap`` of ``functional_call`` over stacked weights and
inputs). Each row's median ms over ``--rounds`` rounds of 5 steps, the rows interleaved in every
round so that the machine's drift falls on all of them.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch.func import functional_call, vmap

from convit_convert.conv_mixer import ConvMixer


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


# the mixer's sizes: the paper's (C 3, K 5, P 16 on a 14 x 14 grid: 768 features), or --tiny's
SIZES = {"paper": (3, 5, 16, (14, 14)), "tiny": (3, 3, 4, (4, 4))}
SIZE = ["paper"]


def stacked_step(
    m: ConvMixer, seeds: int, batch: int, g: torch.Generator, device: torch.device
) -> Callable[[], None]:
    """The step of ``seeds`` copies of ``m`` stacked, each on its own input, as ``--seeds`` runs them."""
    params = {k: torch.stack([p.detach()] * seeds).requires_grad_() for k, p in m.named_parameters()}
    buffers = dict(m.named_buffers())
    c, _, p, (gh, gw) = SIZES[SIZE[0]]
    xs = torch.randn(seeds, batch, gh * gw, p * p * c, generator=g).to(device)

    def one(p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return functional_call(m, (p, buffers), (x,))

    return lambda: vmap(one)(params, xs).square().mean().backward()


def cases(batch: int, seeds: int, device: torch.device) -> dict[str, Callable[[], None]]:
    """Each row's step, as a closure over its own mixer and input."""
    g = torch.Generator().manual_seed(0)
    c, k, p, (gh, gw) = SIZES[SIZE[0]]
    x = torch.randn(batch, gh * gw, p * p * c, generator=g).to(device).requires_grad_()
    out: dict[str, Callable[[], None]] = {}
    for form in ("pixels", "tokens"):
        m = ConvMixer(c, k, 1, (gh, gw), p, form=form).to(device)
        out[f"{form} form"] = lambda m=m: m(x).square().mean().backward()
        if form == "tokens":
            out["tokens: W^O alone"] = lambda m=m: m.token_weight().square().sum().backward()
            out[f"tokens, {seeds} seeds stacked"] = stacked_step(m, seeds, batch, g, device)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--tiny", action="store_true", help="a tiny mixer: checks the script runs, measures nothing"
    )
    args = ap.parse_args()
    SIZE[0] = "tiny" if args.tiny else "paper"
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    steps = cases(args.batch, args.seeds, device)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for step in steps.values():  # warm-up
        step(), step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            sync(device)
            began = time.perf_counter()
            for _ in range(5):
                step()
            sync(device)
            times[name].append((time.perf_counter() - began) / 5 * 1e3)
    print(f"torch {torch.__version__}, {device}, batch {args.batch}, {args.threads} threads, float32")
    print("| mixer step | ms (median) | spread |")
    print("|---|---:|---:|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f}-{max(t):.1f} |")


if __name__ == "__main__":
    main()
