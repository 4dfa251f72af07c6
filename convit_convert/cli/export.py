"""``cmhsa export``: a checkpoint to one self-contained ONNX file, checked in onnxruntime."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from ..errors import CmhsaError
from ..options.operations import ExportOptions
from .common import EXIT_FAIL, console, fmt, path_arg, path_opt, print_import, print_written, safe
from .options import device_option, output_option

app = typer.Typer()
OPTIONS = {f.name: f.default for f in dataclasses.fields(ExportOptions)}  # the flags' defaults, stated there


def print_export(r: Any) -> None:
    """An ExportReport: what was exported, the checker, onnxruntime vs PyTorch per batch, the verdict."""
    ex, check, ckpt = r.exported, r.exported.check, r.checkpoint
    cfg = ckpt.config
    print_import(ckpt)
    console.print(
        f"Exported {safe(str(ckpt.path))} ({ckpt.kind}, depth {cfg.depth}, "
        f"{cfg.img_size[0]}x{cfg.img_size[1]} px) "
        f"{f'in its {ex.form} form ' if ex.form else ''}with the {ex.exporter} "
        f"exporter, opset {ex.opsets.get('ai.onnx')}, in "
        f"{ex.timings['export_s']:.1f} s: "
        f"{len(ex.data) / 1e6:.1f} MB"
    )
    io = ", ".join(f"{v['name']} {v['shape']}" for v in check.inputs + check.outputs)
    console.print(f"checker: full_check passed; {safe(io)}; providers: {', '.join(check.providers)}")
    table = Table(title="onnxruntime vs PyTorch, same images", title_justify="left")
    for col in ("batch", "logits shape", "max |Δ|", "max |ref|", "rel. error", "status"):
        table.add_column(col, justify="right")
    for b in check.batches:
        status = "[green]ok[/]" if b.passed else "[red]FAIL[/]"
        table.add_row(
            str(b.batch), str(tuple(b.output_shape)), fmt(b.max_abs), fmt(b.ref_max), fmt(b.rel), status
        )
    console.print(table)
    for problem in check.problems:
        console.print(f"[red]problem[/]: {safe(problem)}")
    worst, verdict = check.worst, ("[green]PASS[/]", "<=") if check.passed else ("[red]FAIL[/]", ">")
    console.print(
        f"{verdict[0]}: worst relative error {fmt(worst.rel)} (batch "
        f"{worst.batch}) {verdict[1]} tol {check.tol:g}"
    )
    print_written(r.passed, r.output, r.report_path, "check", bool((r.output_facts or {}).get("replaced")))


def run_export(checkpoint: Path, output: Path, options: Any, report: Path | None) -> bool:
    """Export with a spinner and print the report; whether the check passed."""
    from ..api import export_file

    with console.status(f"Exporting {safe(str(checkpoint))} and checking it in onnxruntime..."):
        r = export_file(checkpoint, output, options, report)
    print_export(r)
    return r.passed


def run_timm_folder(checkpoint: Path, folder: Path, license_id: str | None = None) -> bool:
    """Write the folder, load it with timm, print what was written and the check; whether it passed."""
    from ..timm import export_timm_folder

    with console.status(f"Writing {safe(str(folder))} and loading it with timm..."):
        r = export_timm_folder(checkpoint, folder, license_id=license_id)
    print_import(r.checkpoint)
    print_timm_folder(r)
    return r.passed


def print_timm_folder(r: Any) -> None:
    """A TimmFolderReport: the files written and timm's logits against cmhsa's."""
    folder = r.folder
    console.print(f"Wrote timm's folder {safe(str(folder))}: {', '.join(p.name for p in r.written)}")
    verdict = "[green]PASS[/]: equal" if r.passed else "[red]FAIL[/]: not equal"
    console.print(
        f"{verdict} logits from "
        f"timm.create_model('local-dir:{safe(str(folder))}', pretrained=True) and "
        "cmhsa's model "
        f"(max |Δ| {fmt(r.max_abs)}, 4 images)"
    )


@app.command("export")
def export_cmd(
    checkpoint: Annotated[Path, path_arg("Checkpoint to export (attn or conv).")],
    output: Annotated[Path, output_option("ONNX file to write (.onnx); with --format timm, the folder.")],
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="onnx (one file, checked in onnxruntime) or timm (timm's pretrained "
            "folder: model.safetensors, config.json and the model card README.md, for "
            "timm.create_model('local-dir:DIR') and the Hugging Face Hub; checked by "
            "loading it with timm). The other options are ONNX's.",
        ),
    ] = "onnx",
    opset: Annotated[
        int | None, typer.Option(help="ai.onnx opset (>= 17; default: the exporter's).", show_default=False)
    ] = OPTIONS["opset"],
    tol: Annotated[float, typer.Option(help="Largest relative error of onnxruntime vs PyTorch.")] = OPTIONS[
        "tol"
    ],
    exporter: Annotated[
        str,
        typer.Option(help="dynamo (torch.export, the exporter torch recommends) or legacy (TorchScript)."),
    ] = OPTIONS["exporter"],
    form: Annotated[
        str,
        typer.Option(
            help="Attention models: fused (W_V·W_O folded, faster inference, the same "
            "function) or trained (the projections as trained)."
        ),
    ] = OPTIONS["form"],
    device: Annotated[str, device_option()] = OPTIONS["device"],
    seed: Annotated[int, typer.Option(help="Seed of the check images.")] = OPTIONS["seed"],
    report: Annotated[Path | None, path_opt("Report path (default: OUTPUT + .report.json).")] = None,
    license: Annotated[
        str | None,
        typer.Option(
            "--license",
            help="--format timm: the weights' licence id (the Hub's: mit, cc-by-4.0, apache-2.0, other) "
            "in the card's front matter and pretrained_cfg. Default: the training data's (digits "
            "cc-by-4.0, Fashion-MNIST mit; CIFAR, an image folder or unrecorded data: unknown).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Export a checkpoint to one ONNX file checked in onnxruntime, or as timm's pretrained folder.

    Exit 1 when the ONNX check is outside --tol."""
    if format not in ("onnx", "timm"):
        raise CmhsaError(f"`--format` must be onnx or timm, got {format!r}")
    if format == "timm":
        raise typer.Exit(0 if run_timm_folder(checkpoint, output, license) else EXIT_FAIL)
    if license is not None:
        raise CmhsaError("--license is for --format timm (the card, pretrained_cfg); ONNX records none")
    options = ExportOptions(opset=opset, tol=tol, exporter=exporter, form=form, device=device, seed=seed)
    passed = run_export(checkpoint, output, options, report)
    raise typer.Exit(0 if passed else EXIT_FAIL)
