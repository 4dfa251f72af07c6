"""``cmhsa export``: an attention checkpoint to ONNX, checked in onnxruntime (:class:`ExportReport`)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.atomic import atomic_paths
from ..io.checkpoint import Checkpoint
from ..io.report import environment, file_facts, report_text
from ..options.operations import ExportOptions
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
    checkpoint: Path, output: Path, options: ExportOptions | None = None, report: Path | None = None
) -> ExportReport:
    """``cmhsa export``: load a model file, then export it as :func:`export_checkpoint` does."""
    options = options or ExportOptions()
    report_path = _report_path(checkpoint, output, report)
    t = time.perf_counter()
    ckpt = load_checkpoint(checkpoint)
    return _export(ckpt, output, report_path, options, {"load_s": time.perf_counter() - t})


def export_checkpoint(
    ckpt: Checkpoint, output: Path, options: ExportOptions | None = None, report: Path | None = None
) -> ExportReport:
    """Export a model held in memory (``cmhsa train --export-onnx``: the model just trained; its
    ``path`` the file it was saved to), check it in onnxruntime, write the ONNX file only if the
    check passes; the JSON report (default: OUTPUT + .report.json) either way."""
    return _export(ckpt, output, _report_path(ckpt.path, output, report), options or ExportOptions(), {})


def _report_path(source: Path, output: Path, report: Path | None) -> Path:
    """The output paths checked before the model is loaded or exported; the report path."""
    report_path = report or output.with_name(output.name + ".report.json")
    check_outputs(source, output, report_path, ".onnx", "ONNX (convert writes safetensors checkpoints)")
    return report_path


def _export(
    ckpt: Checkpoint, output: Path, report_path: Path, options: ExportOptions, timings: dict[str, float]
) -> ExportReport:
    from ..onnx.export import export_and_check
    from ..onnx.load import providers_for

    o = options
    ex = export_and_check(
        ckpt.model(),
        exporter=o.exporter,
        opset=o.opset,
        tol=o.tol,
        providers=providers_for(o.device),
        seed=o.seed,
        path=output,
        form=o.form,
        classes=ckpt.classes,
    )
    facts = None
    replaced = output.exists()  # said in the report and by the CLI: a file is never replaced silently
    with atomic_paths(*([output] if ex.check.passed else []), report_path) as tmps:  # both or neither
        if ex.check.passed:
            tmps[0].write_bytes(ex.data)
            facts = {
                "path": str(output),
                "bytes": len(ex.data),
                "sha256": hashlib.sha256(ex.data).hexdigest(),
                "replaced": replaced,
            }
        out = ExportReport(ckpt, ex, output, report_path, facts, {**timings, **ex.timings})
        tmps[-1].write_text(report_text(out.to_dict()), encoding="utf-8")
    return out
