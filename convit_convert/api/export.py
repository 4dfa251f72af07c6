"""``cmhsa export``: an attention checkpoint to ONNX, checked in onnxruntime (:class:`ExportReport`)."""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..io.atomic import atomic_names
from ..io.checkpoint import Checkpoint
from ..io.outputs import Target, held_outputs
from ..io.report import environment, file_facts, report_text
from ..options.operations import ExportOptions
from .common import check_suffix, load_checkpoint, read_paths


@dataclass
class ExportReport:
    checkpoint: Checkpoint
    exported: Any  # onnx.export.Exported
    output: Path
    report_path: Path
    output_facts: dict[str, Any] | None
    timings: dict[str, float]
    input_facts: dict[str, Any] | None = None  # the input file's path, bytes, sha256 (None: read them)

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
                **(self.input_facts or file_facts(ckpt.path)),
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
    """``cmhsa export``: load a model file, then export it as :func:`export_checkpoint` does (the
    JSON report: OUTPUT + .report.json unless ``report`` names one)."""
    options = options or ExportOptions()
    check_suffix(output, ".onnx", "ONNX (convert writes safetensors checkpoints)")
    report_path = report or default_report(output)
    with held_outputs(output, report_path, reads=read_paths(checkpoint)) as (out, rep):
        t = time.perf_counter()
        ckpt = load_checkpoint(checkpoint)
        return _export(ckpt, out, rep, options, {"load_s": time.perf_counter() - t})


def default_report(output: Path) -> Path:
    """Where an ONNX file's report goes unless named: ``conv.onnx`` -> ``conv.onnx.report.json``."""
    return output.with_name(output.name + ".report.json")


def export_checkpoint(
    ckpt: Checkpoint,
    output: Target,
    report: Target,
    options: ExportOptions | None = None,
    input_facts: dict[str, Any] | None = None,
) -> ExportReport:
    """Export a model held in memory (``cmhsa train --export-onnx``: the model just trained; its
    ``path`` the file it was saved to, ``input_facts`` that file's path, bytes and sha256 as
    written), check it in onnxruntime, write the ONNX file as ``output`` only if the check passes;
    the JSON report as ``report`` either way (both in held folders)."""
    return _export(ckpt, output, report, options or ExportOptions(), {}, input_facts)


def _export(
    ckpt: Checkpoint,
    output: Target,
    report: Target,
    options: ExportOptions,
    timings: dict[str, float],
    input_facts: dict[str, Any] | None = None,
) -> ExportReport:
    from ..loaders import image_mode
    from ..onnx.export import export_and_check
    from ..onnx.load import providers_for

    o = options
    image_mode(ckpt.config.in_chans, ckpt.path)  # what the recorded preprocessing can describe
    ex = export_and_check(
        ckpt.model(),
        exporter=o.exporter,
        opset=o.opset,
        tol=o.tol,
        providers=providers_for(o.device),
        seed=o.seed,
        path=output.show(),
        form=o.form,
        classes=ckpt.classes,
    )
    facts = None
    replaced = output.exists()  # said in the report and by the CLI: a file is never replaced silently
    with atomic_names(*([output] if ex.check.passed else []), report) as tmps:  # both or neither
        if ex.check.passed:
            tmps[0].write_bytes(ex.data)
            facts = {
                "path": str(output.show()),
                "bytes": len(ex.data),
                "sha256": hashlib.sha256(ex.data).hexdigest(),
                "replaced": replaced,
            }
        out = ExportReport(
            ckpt, ex, output.show(), report.show(), facts, {**timings, **ex.timings}, input_facts
        )
        tmps[-1].write_text(report_text(out.to_dict()), encoding="utf-8")
    return out
