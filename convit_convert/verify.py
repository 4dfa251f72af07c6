"""Numerical proof that a converted attention model computes what its conv model computes.

Both models see the same seeded random images. For every block, both token mixers are fed the same
input (the conv model's ``norm1`` output) and compared; then the two models' logits. Per tensor:

    max_abs = max |attn - conv|,   rel = max_abs / max |conv|

over all patches, and apart over *border* patches (whose receptive field reaches the zero padding)
and *interior* ones. A model with sinks passes iff every rel ≤ tol. A model without sinks (the
paper's construction) is exact only in the interior by design: it passes iff every interior mixer
rel ≤ tol, and its border and logit errors are reported, not judged.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch

from .config import ViTConfig
from .model import VisionTransformer
from .options.operations import Verification
from .options.values import DEFAULT_TOL
from .theory import patch_offsets


@dataclass
class ErrorStat:
    tensor: str  # "blocks.{i}.mixer" or "logits"
    region: str  # "all", "border" or "interior"
    max_abs: float
    ref_max: float
    rel: float
    judged: bool  # False: reported only (border and logits of a sink-less model)
    passed: bool | None  # None where not judged


@dataclass
class VerifyResult:
    passed: bool
    tol: float
    dtype: str
    device: str
    seed: int
    batch: int
    criterion: str
    errors: list[ErrorStat] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def worst(self) -> ErrorStat:
        judged = [e for e in self.errors if e.judged] or self.errors
        return max(judged, key=lambda e: e.rel)

    def to_dict(self) -> dict:
        return asdict(self)


def border_mask(cfg: ViTConfig) -> torch.Tensor:
    """(N,) True for patches whose receptive field leaves the image (reads zero padding)."""
    gh, gw = cfg.grid_size
    offsets = patch_offsets(cfg.kernel_size, cfg.patch_size, cfg.dilation)
    dys = [dy for dy, _ in offsets]
    dxs = [dx for _, dx in offsets]
    y = torch.arange(gh).view(-1, 1)
    x = torch.arange(gw).view(1, -1)
    out = (y + min(dys) < 0) | (y + max(dys) >= gh) | (x + min(dxs) < 0) | (x + max(dxs) >= gw)
    return out.flatten()


@contextlib.contextmanager
def exact_matmul() -> Iterator[None]:
    """TF32 off on CUDA while checking (TF32 alone gives ~1e-3 relative error)."""
    old = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def relative_error(max_abs: float, ref_max: float) -> float:
    """max |Δ| / max |ref|, the measure every cmhsa check judges: 0 when both are 0, infinite when
    only the reference is."""
    return max_abs / ref_max if ref_max > 0 else (0.0 if max_abs == 0 else float("inf"))


def _stat(
    tensor: str, region: str, ref: torch.Tensor, out: torch.Tensor, tol: float, judged: bool
) -> ErrorStat:
    ref_max = ref.abs().max().item()
    max_abs = (out - ref).abs().max().item()
    rel = relative_error(max_abs, ref_max)
    return ErrorStat(tensor, region, max_abs, ref_max, rel, judged, (rel <= tol) if judged else None)


def verify_models(
    conv: VisionTransformer,
    attn: VisionTransformer,
    *,
    batch: int = Verification.batch,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    tol: float = DEFAULT_TOL,
) -> VerifyResult:
    """Compare every block's mixer and the logits of ``conv`` and ``attn`` (same config but the
    mixer). Models are moved to ``device`` and ``dtype``."""
    cfg = conv.cfg
    sink = bool(attn.cfg.sink)
    conv = conv.to(device=device, dtype=dtype).eval()
    attn = attn.to(device=device, dtype=dtype).eval()
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, cfg.in_chans, *cfg.img_size, generator=gen, dtype=torch.float64)
    images = images.to(device=device, dtype=dtype)
    border = border_mask(cfg).to(device)
    criterion = (
        "every relative error <= tol"
        if sink
        else "interior mixer errors <= tol (no sink: border patches and logits are inexact by construction)"
    )
    result = VerifyResult(True, tol, str(dtype).removeprefix("torch."), str(device), seed, batch, criterion)
    t0 = time.perf_counter()
    with torch.no_grad(), exact_matmul():
        x = conv.patch_embed(images)
        for i, (cb, ab) in enumerate(zip(conv.blocks, attn.blocks, strict=True)):
            u = cb.norm1(x)
            ref, out = cb.mixer(u), ab.mixer(u)
            name = f"blocks.{i}.mixer"
            result.errors.append(_stat(name, "all", ref, out, tol, sink))
            for region, mask, judged in (("border", border, sink), ("interior", ~border, True)):
                if mask.any():  # a tiny grid may have no interior
                    result.errors.append(_stat(name, region, ref[:, mask], out[:, mask], tol, judged))
            x = cb(x)
        t1 = time.perf_counter()
        ref_logits, out_logits = conv(images), attn(images)
    t2 = time.perf_counter()
    result.errors.append(_stat("logits", "all", ref_logits, out_logits, tol, sink))
    result.passed = all(e.passed for e in result.errors if e.judged)
    result.timings = {"mixers_s": t1 - t0, "logits_s": t2 - t1}
    return result
