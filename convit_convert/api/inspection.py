"""``cmhsa inspect``: what a model file holds (:class:`Inspection`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..construct import pinned_offsets
from ..io.checkpoint import Checkpoint
from ..io.report import file_facts
from ..options.operations import Geometry
from ..theory import HeadCount, head_count
from .common import load_checkpoint


@dataclass
class Inspection:
    checkpoint: Checkpoint
    facts: dict[str, Any]  # path, bytes, sha256
    heads: HeadCount
    pinned: list[list[tuple[int, int] | None]] | None  # attn: per block, per head, read from the bias
    gates: list[list[float]] | None = None  # gated attn: per block, per head, clamped to [0, 1]

    def to_dict(self) -> dict[str, Any]:
        c, hc = self.checkpoint, self.heads
        return {
            "command": "inspect",
            "file": self.facts,
            "kind": c.kind,
            "read_as": c.source,
            "config": c.config.to_dict(),
            "parameters": c.num_params,
            "dtype": str(c.dtype).removeprefix("torch."),
            "heads_needed": {
                "patch": hc.patch_heads,
                "patch_lower_bound": hc.patch_lower_bound,
                "reason": hc.patch_reason,
            },
            "written_by_train": {
                k: c.metadata[f"cmhsa.{k}"] for k in ("trained", "init") if f"cmhsa.{k}" in c.metadata
            },
            "pinned": None
            if self.pinned is None
            else [[None if o is None else list(o) for o in b] for b in self.pinned],
            "gates": self.gates,
        }


def inspect_file(path: Path, geometry: Geometry | None = None) -> Inspection:
    """Kind, config, size and hash of a model file or a timm folder's weights (a bare state dict
    read as ``geometry`` says); for attention, each head's pinned offset."""
    ckpt = load_checkpoint(path, geometry)
    cfg = ckpt.config
    pinned = None
    if ckpt.kind == "attn":
        pinned = [
            pinned_offsets(
                ckpt.tensors[f"blocks.{i}.attn.rel_pos_bias"], ckpt.tensors.get(f"blocks.{i}.attn.sink")
            )
            for i in range(cfg.depth)
        ]
    hc = head_count(cfg.kernel_size, cfg.patch_size, cfg.dilation, channels=cfg.hidden_chans)
    gates = None
    if cfg.pinning == "gated":
        gates = [ckpt.tensors[f"blocks.{i}.attn.gate"].clamp(0, 1).tolist() for i in range(cfg.depth)]
    return Inspection(ckpt, file_facts(ckpt.path), hc, pinned, gates)
