"""A conversion as two typed objects (no torch import): what the user chose, and what follows.

:class:`ConversionSpec` holds the choices (heads, widths, sink, pinning, margin, W_Q/W_K init,
seed, tolerance, and the approximation's rule and refit), validated when it is made, each default
stated once, here. :class:`ConversionPlan` is a spec applied to a conv config: the offsets Δ, the
offset each head is pinned to, the pinning logits M and S, and the attention config the conversion
writes. The plan is made once per conversion and handed to construction, verification, the report
and training; nothing below the CLI passes these as loose keywords.

The logits (construct.py's module docstring has the derivation): the sink logit S = ln N + margin
beats all N real keys by e^-margin; the offset logit M = S + margin beats the sink and the other
keys alike. Without a sink, M = ln N + margin and border patches are inexact.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from ..config import PINNING, ViTConfig
from ..theory import patch_offsets
from .checked import Checked
from .values import DEFAULT_TOL

DEFAULT_MARGIN = 40.0  # the paper's M = 40 (Appendix A.1), as a margin between competing logits
RULES = ("greedy", "corner")  # how an approximate conversion picks its offsets (approximate.py)

Offset = tuple[int, int]


def pinning_logits(num_patches: int, sink: bool, margin: float = DEFAULT_MARGIN) -> tuple[float, float]:
    """(offset logit M, sink logit S) that make attention one-hot to within e^-margin."""
    sink_logit = math.log(num_patches) + margin
    return (sink_logit + margin if sink else sink_logit), sink_logit


@dataclass(frozen=True)
class ConversionSpec(Checked):
    """What the user chose for a conversion; every field's default is the paper's construction.

    ``heads``, ``qk_dim``, ``v_dim``: None means what Theorem 1 needs (|Δ| heads) and embed_dim.
    ``approximate``: with ``heads`` below |Δ|, keep the offsets ``rule`` picks and (``refit``)
    refit their W^O on calibration images; without it, too few heads are refused.
    """

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"pinning": PINNING, "rule": RULES}

    heads: int | None = None
    qk_dim: int | None = None
    v_dim: int | None = None
    sink: bool = True
    pinning: str = "hard"
    margin: float = DEFAULT_MARGIN
    qk_init_std: float = 0.0
    seed: int = 0
    tol: float = DEFAULT_TOL
    approximate: bool = False
    rule: str = "greedy"
    refit: bool = True

    def replace(self, **changes: Any) -> ConversionSpec:
        """A copy with ``changes``, validated again."""
        return dataclasses.replace(self, **changes)

    def plan(self, conv: ViTConfig) -> ConversionPlan:
        """This spec applied to the conv config ``conv``."""
        offsets = tuple(patch_offsets(conv.kernel_size, conv.patch_size, conv.dilation))
        heads = len(offsets) if self.heads is None else self.heads
        config = conv.without_attention().with_attention(
            heads, self.qk_dim, self.v_dim, self.sink, self.pinning
        )  # type: ignore[arg-type]
        offset_logit, sink_logit = pinning_logits(config.num_patches, self.sink, self.margin)
        return ConversionPlan(
            self,
            conv,
            config,
            offsets,
            pinned_heads(config, offsets),
            offset_logit,
            sink_logit if self.sink else None,
        )


def pinned_heads(cfg: ViTConfig, offsets: tuple[Offset, ...] | list[Offset]) -> tuple[Offset | None, ...]:
    """The offset head r of ``cfg`` (an attn config) is pinned to, ``offsets[r]``, or None where the
    head has nothing to read: an offset beyond the grid (it only ever reads padding, so its output
    weights are zero) or a head beyond the offsets."""
    gh, gw = cfg.grid_size
    pinned = [(dy, dx) if abs(dy) < gh and abs(dx) < gw else None for dy, dx in offsets[: cfg.num_heads]]
    return tuple(pinned + [None] * (cfg.num_heads - len(pinned)))


@dataclass(frozen=True)
class ConversionPlan:
    """A :class:`ConversionSpec` applied to a conv config: everything the construction derives."""

    spec: ConversionSpec
    source: ViTConfig  # the conv config
    config: ViTConfig  # the attention config the conversion writes
    offsets: tuple[Offset, ...]  # Δ, the patch offsets the kernel touches (theory.patch_offsets)
    pinned: tuple[Offset | None, ...]  # per head: its offset, None for a free head
    offset_logit: float  # M
    sink_logit: float | None  # S; None without sinks

    @property
    def needed(self) -> int:
        """|Δ|: the heads Theorem 1 needs for this kernel."""
        return len(self.offsets)

    @property
    def exact(self) -> bool:
        """Enough heads for the exact construction."""
        return self.config.num_heads >= self.needed  # type: ignore[operator]

    @property
    def approximate(self) -> bool:
        """An approximate conversion: fewer heads than |Δ|, asked for."""
        return self.spec.approximate and not self.exact
