"""``cmhsa verify``: does an attention checkpoint compute what a conv checkpoint computes?
(:class:`VerifyReport`)"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CmhsaError, article
from ..io.checkpoint import Checkpoint
from ..io.outputs import held_outputs
from ..io.report import environment, file_facts, write_report
from ..options.operations import Verification, VerifyOptions
from ..resources import check_fits
from ..verify import VerifyResult, verify_models
from .common import load_checkpoint, read_paths, resolve_device, resolve_dtype


@dataclass
class VerifyReport:
    conv: Checkpoint
    attn: Checkpoint
    result: VerifyResult
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.result.passed

    def to_dict(self) -> dict[str, Any]:
        return {
            "command": "verify",
            "passed": self.passed,
            "conv": file_facts(self.conv.path),
            "attn": file_facts(self.attn.path),
            "config": self.attn.config.to_dict(),
            "verification": self.result.to_dict(),
            "timings": self.timings,
            "environment": environment(),
        }


def verify_files(
    conv: Path,
    attn: Path,
    *,
    options: VerifyOptions | None = None,
    verification: Verification | None = None,
    report: Path | None = None,
) -> VerifyReport:
    """``cmhsa verify``: does the attn checkpoint compute what the conv checkpoint computes, within
    ``options.tol`` on random images drawn from ``options.seed``, checked as ``verification`` says?"""
    o, v = options or VerifyOptions(), verification or Verification()
    if report is None:
        return _verify(conv, attn, o, v)
    # the report's folder checked and held from the start: a bad report never costs the check
    with held_outputs(report, reads=[*read_paths(conv), *read_paths(attn)]) as (target,):
        out = _verify(conv, attn, o, v)
        write_report(target, out.to_dict())
        return out


def _verify(conv: Path, attn: Path, o: VerifyOptions, v: Verification) -> VerifyReport:
    tol, seed = o.tol, o.seed
    verify_dtype, verify_device = resolve_dtype(v.dtype), resolve_device(v.device)
    batch = v.batch
    t = time.perf_counter()
    a, b = load_checkpoint(conv, onnx_tol=tol), load_checkpoint(attn)
    load_s = time.perf_counter() - t
    for ck, kind, which in ((a, "conv", "first"), (b, "attn", "second")):
        if ck.kind != kind:
            msg = f"is {article(ck.kind)} checkpoint; the {which} argument must be {article(kind)} checkpoint"
            raise CmhsaError(msg, ck.path)
    shared_a, shared_b = a.config.to_dict(), b.config.without_attention().to_dict()
    differ = [k for k in shared_a if shared_a[k] != shared_b[k]]
    if differ:
        detail = ", ".join(f"{k} {shared_a[k]} vs {shared_b[k]}" for k in differ[:3])
        raise CmhsaError(f"config does not match the conv checkpoint's: {detail}", attn)
    need = (b.config.activation_bytes(batch) + a.config.activation_bytes(batch)) * verify_dtype.itemsize // 4
    check_fits(need, f"verifying at batch {batch}", attn)
    t = time.perf_counter()
    result = verify_models(
        a.model(), b.model(), batch=batch, seed=seed, dtype=verify_dtype, device=verify_device, tol=tol
    )
    return VerifyReport(a, b, result, {"load_s": load_s, "verify_s": time.perf_counter() - t})
