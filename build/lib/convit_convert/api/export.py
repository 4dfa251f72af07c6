"""``cmhsa export``: an attention checkpoint to ONNX, checked in onnxruntime (:class:`ExportReport`)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CmhsaError
from ..io.atomic import atomic_paths
from ..io.checkpoint import Checkpoint
from ..io.report import environment, file_facts, report_text
from ..spec import check_tol
from .common import check_outputs, load_checkpoint


@dataclass
class ExportReport:
    checkpoint: Checkpoint
    exported: Any  # onnx.export.Exported
    output: Path
    report_path: Path
    output_facts: dict[str, Any] | None
    timings: dict[str, float]

    @property
    def passed(self) -> bool:
        return self.exported.check.passed

    def to_dict(self) -> dict[str, Any]:
        import onnx
        import onnxruntime

        ex, ckpt = self.exported, self.checkpoint
        return {
            "command": "export",
            "passed": self.passed,
            "input": {
                **file_facts(ckpt.path),
                "kind": ckpt.kind,
                "dtype": str(ckpt.dtype).removeprefix("torch."),
            },
            "output": self.output_facts,
            "config": ckpt.config.to_dict(),
            "export": {
                "exporter": ex.exporter,
                "form": ex.form,
                "opsets": ex.opsets,
                "ir_version": ex.ir_version,
                "dtype": "float32",
                "onnx": onnx.__version__,
                "onnxruntime": onnxruntime.__version__,
            },
            "check": ex.check.to_dict(),
            "timings": self.timings,
            "environment": environment(),
        }


def export_file(
    checkpoint: Path, output: Path, *, opset: int | None = None, tol: float = 1e-4, exporter: str = "dynamo",
    device: str = "cpu", seed: int = 0, report: Path | None = None, form: str = "fused",
) -> ExportReport:  # fmt: skip
    """``cmhsa export``: load a model file, then :func:`export_checkpoint`."""
    report_path = _check(checkpoint, output, report, tol, exporter, opset, form, device)
    t = time.perf_counter()
    ckpt = load_checkpoint(checkpoint)
    load_s = time.perf_counter() - t
    return _export(ckpt, output, report_path, opset, tol, exporter, device, seed, form, {"load_s": load_s})


def export_checkpoint(
    ckpt: Checkpoint, output: Path, *, opset: int | None = None, tol: float = 1e-4, exporter: str = "dynamo",
    device: str = "cpu", seed: int = 0, report: Path | None = None, form: str = "fused",
) -> ExportReport:  # fmt: skip
    """Export a model held in memory (``cmhsa train --export-onnx``: the model just trained; its
    ``path`` the file it was saved to), check it in onnxruntime, write the ONNX file only if the
    check passes; the JSON report either way."""
    report_path = _check(ckpt.path, output, report, tol, exporter, opset, form, device)
    return _export(ckpt, output, report_path, opset, tol, exporter, device, seed, form, {})


def _check(
    source: Path, output: Path, report: Path | None, tol: float, exporter: str, opset: int | None, form: str,
    device: str,
) -> Path:  # fmt: skip
    """Every option and output path checked before the model is loaded or exported; the report path."""
    from ..onnx.export import check_options

    if device not in ("cpu", "cuda", "auto"):
        raise CmhsaError(f"`device` must be cpu, cuda or auto, got {device!r}")
    report_path = report or output.with_name(output.name + ".report.json")
    check_outputs(source, output, report_path, ".onnx", "ONNX (convert writes safetensors checkpoints)")
    check_tol(tol)
    check_options(exporter, opset, form)
    return report_path


def _export(
    ckpt: Checkpoint, output: Path, report_path: Path, opset: int | None, tol: float, exporter: str, device: str,
    seed: int, form: str, timings: dict[str, float],
) -> ExportReport:  # fmt: skip
    from ..onnx.export import export_and_check
    from ..onnx.load import providers_for

    ex = export_and_check(
        ckpt.model(), exporter=exporter, opset=opset, tol=tol, providers=providers_for(device), seed=seed,
        path=output, form=form,
    )  # fmt: skip
    facts = None
    with atomic_paths(*([output] if ex.check.passed else []), report_path) as tmps:  # both or neither
        if ex.check.passed:
            tmps[0].write_bytes(ex.data)
            facts = {
                "path": str(output),
                "bytes": len(ex.data),
                "sha256": hashlib.sha256(ex.data).hexdigest(),
            }
        out = ExportReport(ckpt, ex, output, report_path, facts, {**timings, **ex.timings})
        tmps[-1].write_text(report_text(out.to_dict()), encoding="utf-8")
    return out
