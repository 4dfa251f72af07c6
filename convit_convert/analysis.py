"""What the attention of a trained model does, per block and head, over real images.

For each head: its pinned offset read back from the bias (None for a free head); ``pinned_share``,
the mean weight on that offset over the queries whose target patch lies inside the image (of the
mixed attention, for a gated head); ``mean_distance_px``, the attention-weighted distance between
query and key patch centres (the ViT paper's "attention distance", over real keys: weight on the
sink counts nowhere); ``entropy``
in nats over the keys plus the sink; the gate (gated heads); and the mean weight at every relative
offset (a (2Gh-1, 2Gw-1) map). The weights are recorded during the ordinary forward pass, so the
analysis costs a forward pass plus O(B·heads·N²) sums.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from .attention import RelPosAttention
from .construct import pinned_offsets
from .model import VisionTransformer


@dataclass
class HeadStats:
    offset: tuple[int, int] | None
    pinned_share: float | None
    mean_distance_px: float
    entropy: float
    gate: float | None
    offset_map: list[list[float]] = field(repr=False)  # mean weight at (dy + Gh - 1, dx + Gw - 1)


@dataclass
class AttentionReport:
    images: int
    grid_size: tuple[int, int]
    patch_size: int
    blocks: list[list[HeadStats]]

    def to_dict(self, checkpoint: str | None = None, with_maps: bool = False) -> dict[str, Any]:
        def head(h: HeadStats) -> dict[str, Any]:
            d = {
                "offset": None if h.offset is None else list(h.offset),
                "pinned_share": h.pinned_share,
                "mean_distance_px": h.mean_distance_px,
                "entropy": h.entropy,
                "gate": h.gate,
            }
            return {**d, "offset_map": h.offset_map} if with_maps else d

        return {
            "checkpoint": checkpoint,
            "images": self.images,
            "blocks": [{"heads": [head(h) for h in b]} for b in self.blocks],
        }

    def block_means(self) -> dict[str, float]:
        """Per block: the mean pinned share (pinned heads), attention distance and gate (gated heads)."""
        out: dict[str, float] = {}
        for i, heads in enumerate(self.blocks):
            shares = [h.pinned_share for h in heads if h.pinned_share is not None]
            gates = [h.gate for h in heads if h.gate is not None]
            if shares:
                out[f"attn{i}_share"] = sum(shares) / len(shares)
            out[f"attn{i}_dist_px"] = sum(h.mean_distance_px for h in heads) / len(heads)
            if gates:
                out[f"attn{i}_gate"] = sum(gates) / len(gates)
        return out


@contextlib.contextmanager
def recording(model: VisionTransformer) -> Iterator[list[list[torch.Tensor]]]:
    """Each attention layer appends its (B, heads, N, N) weights to its own list while active."""
    layers = [b.mixer for b in model.blocks if isinstance(b.mixer, RelPosAttention)]
    records: list[list[torch.Tensor]] = [[] for _ in layers]
    for layer, rec in zip(layers, records, strict=True):
        layer.record = rec
    try:
        yield records
    finally:
        for layer in layers:
            layer.record = None


@torch.no_grad()
def attention_stats(model: VisionTransformer, batches: Iterable[torch.Tensor]) -> AttentionReport:
    """Run ``model`` (an attn model; eval mode for the call) on the image batches and sum up its
    attention (module docstring)."""
    cfg = model.cfg
    if cfg.kind != "attn":
        raise ValueError("attention statistics need an attention model")
    gh, gw = cfg.grid_size
    n, p = gh * gw, cfg.patch_size
    layers = [b.mixer for b in model.blocks]
    device = next(model.parameters()).device
    ys, xs = torch.arange(n, device=device) // gw, torch.arange(n, device=device) % gw
    dist = p * torch.hypot((ys[None] - ys[:, None]).double(), (xs[None] - xs[:, None]).double())  # (N, N)
    index = layers[0].rel_pos_index.to(device).flatten()
    pairs = torch.zeros((2 * gh - 1) * (2 * gw - 1), dtype=torch.float64, device=device)
    pairs.index_add_(0, index, torch.ones(n * n, dtype=torch.float64, device=device))
    offsets = [
        pinned_offsets(a.rel_pos_bias.detach().cpu(), None if a.sink is None else a.sink.detach().cpu())
        for a in layers
    ]
    h = cfg.num_heads
    sums = {
        k: torch.zeros(len(layers), h, dtype=torch.float64, device=device)
        for k in ("share", "share_n", "dist", "mass", "ent")
    }
    maps = torch.zeros(len(layers), h, pairs.numel(), dtype=torch.float64, device=device)
    images, was_training = 0, model.training
    model.eval()
    try:
        for x in batches:
            with recording(model) as records:
                model(x.to(device))
            images += len(x)
            for li, rec in enumerate(records):
                w = rec[0].double()  # (B, h, N, N)
                real = w.sum(-1)  # (B, h, N): mass on real keys; the sink has the rest
                sink = (1 - real).clamp_min(0)
                ent = -(w * w.clamp_min(1e-300).log()).sum(-1) - sink * sink.clamp_min(1e-300).log()
                sums["ent"][li] += ent.mean(-1).sum(0)
                sums["dist"][li] += (
                    (w * dist).sum((-1, -2)).sum(0)
                )  # weighted by real mass: the sink has no place
                sums["mass"][li] += real.sum(-1).sum(0)
                maps[li].index_add_(1, index, w.sum(0).flatten(1))
                for hi, off in enumerate(offsets[li]):
                    if off is None:
                        continue
                    qy, qx = ys + off[0], xs + off[1]
                    inside = (qy >= 0) & (qy < gh) & (qx >= 0) & (qx < gw)
                    target = (qy * gw + qx)[inside]
                    sums["share"][li, hi] += w[:, hi, inside.nonzero().squeeze(1), target].mean(-1).sum()
                    sums["share_n"][li, hi] += len(x) if inside.any() else 0
    finally:
        model.train(was_training)
    if images == 0:
        raise ValueError("no images")
    blocks = []
    for li, a in enumerate(layers):
        gates = None if a.gate is None else a.gates().detach().cpu().tolist()
        heads = []
        for hi in range(h):
            n_share = sums["share_n"][li, hi].item()
            share = (
                sums["share"][li, hi].item() / n_share if offsets[li][hi] is not None and n_share else None
            )
            offset_map = (maps[li, hi] / (pairs * images)).view(2 * gh - 1, 2 * gw - 1).cpu().tolist()
            heads.append(
                HeadStats(
                    offsets[li][hi],
                    share,
                    sums["dist"][li, hi].item() / max(sums["mass"][li, hi].item(), 1e-300),
                    sums["ent"][li, hi].item() / images,
                    None if gates is None else gates[hi],
                    offset_map,
                )
            )
        blocks.append(heads)
    return AttentionReport(images, (gh, gw), p, blocks)
