"""``cmhsa heads --checkpoint``: every head count from 1 to the bound, measured (:class:`HeadsSweep`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..approximate import Calibration, HeldOut, heldout_errors, problems
from ..errors import CmhsaError, article
from ..io.checkpoint import Checkpoint
from ..options.conversion import ConversionSpec, Offset
from ..options.operations import CalibrationSource, HeadsQuery
from ..theory import HeadCount, head_count
from .convert import approximation, as_float32_model, converted_model, make_calibration


@dataclass
class SweepRow:
    """One head count of :func:`heads_sweep`: worst block on the calibration set (plain dropping,
    refit), and the converted model on the held-out images."""

    heads: int
    calib_drop_error: float
    calib_refit_error: float
    heldout: HeldOut
    kept: list[list[Offset]] | None  # per block; None: every offset (the exact conversion)
    refit_kept: list[bool] | None  # per block, whether the guarded refit was kept

    def to_dict(self) -> dict[str, Any]:
        h = self.heldout
        return {
            "heads": self.heads,
            "calib_drop_error": self.calib_drop_error,
            "calib_refit_error": self.calib_refit_error,
            "heldout_mixer_error": max(h.mixer_errors),
            "heldout_logits_error": h.logits_error,
            "conv_top1": h.conv_top1,
            "attn_top1": h.attn_top1,
            "kept": "all" if self.kept is None else [[list(o) for o in k] for k in self.kept],
            "refit_kept": self.refit_kept,
        }


@dataclass
class HeadsSweep:
    """``cmhsa heads --checkpoint``: every head count from 1 to the bound, measured."""

    checkpoint: Checkpoint
    rule: str
    calibration: str
    heldout_images: int
    rows: list[SweepRow]

    def to_dict(self) -> dict[str, Any]:
        return {
            "checkpoint": str(self.checkpoint.path),
            "rule": self.rule,
            "calibration": self.calibration,
            "heldout_images": self.heldout_images,
            "rows": [r.to_dict() for r in self.rows],
        }


def checkpoint_head_count(ckpt: Checkpoint, query: HeadsQuery | None = None) -> HeadCount:
    """``cmhsa heads --checkpoint``: the heads ``ckpt``'s kernel needs (theory.head_count, with the
    checkpoint's channels unless ``query.channels`` is given); a kernel or patch size the query
    gives must be the checkpoint's."""
    cfg, q = ckpt.config, query or HeadsQuery()
    asked = (q.kernel_size, q.patch_size)
    if asked != (None, None) and asked != (cfg.kernel_size, cfg.patch_size):
        raise CmhsaError(
            f"has K = {cfg.kernel_size}, P = {cfg.patch_size}; drop `kernel_size`/`patch_size` or match them",
            ckpt.path,
        )
    channels = cfg.hidden_chans if q.channels is None else q.channels
    return head_count(cfg.kernel_size, cfg.patch_size, cfg.dilation, channels)


def heads_sweep(
    ckpt: Checkpoint,
    calibration: CalibrationSource | Calibration | None = None,
    rule: str = "greedy",
    seed: int = 0,
) -> HeadsSweep:
    """For every N from 1 to the bound, the approximate conversion's errors (as ``convert
    --approximate``), from one pass of the calibration images through the conv model and one drop
    sequence per block: N's choice is its prefix. ``calibration``: images already made, or where to
    make them (default: noise images seeded by ``seed``)."""
    if ckpt.kind != "conv":
        raise CmhsaError(f"is {article(ckpt.kind)} checkpoint; the sweep needs a conv-phase one", ckpt.path)
    cfg = ckpt.config
    spec = ConversionSpec(approximate=True, rule=rule, seed=seed)
    calibration = make_calibration(cfg, calibration or CalibrationSource(seed=seed))
    conv = ckpt.model()
    probs = problems(as_float32_model(ckpt, conv), calibration.images.float(), rule)
    rows = []
    for n in range(1, spec.plan(cfg).needed + 1):
        plan = spec.replace(heads=n).plan(cfg)
        a = None
        if plan.approximate:
            a = approximation(ckpt, plan, conv, [p.choice(n) for p in probs], calibration)
        attn = converted_model(ckpt, plan, None if a is None else a.blocks)
        h = heldout_errors(conv, attn, calibration.heldout, calibration.labels)
        rows.append(
            SweepRow(
                n,
                0.0 if a is None else max(b.drop_error for b in a.blocks),
                0.0 if a is None else max(b.refit_error for b in a.blocks),
                h,
                None if a is None else [b.kept for b in a.blocks],
                None if a is None else [b.refit_kept for b in a.blocks],
            )
        )
    return HeadsSweep(ckpt, rule, calibration.source, len(calibration.heldout), rows)
