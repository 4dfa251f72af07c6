"""``cmhsa eval``, ``cmhsa attention`` and ``cmhsa plot``: what a trained model does on a dataset's
validation images, what its heads attend to, and a run's curves (thin commands over
:mod:`convit_convert.api.on_data` and :mod:`convit_convert.train.plot`; torch, timm and matplotlib
load when a command runs)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from ..errors import CmhsaError
from ..io.folder import make_folder, remove_made
from ..io.outputs import held_outputs
from ..options.operations import AttentionOptions, EvalOptions
from ..options.values import AMPS
from ..text import json_text
from .common import console, print_titled, safe
from .options import (
    BatchSize,
    SyntheticSeed,
    data_dir_option,
    data_option,
    device_option,
    missing_data,
    output_option,
    threads_option,
    workers_option,
)


def eval_command(
    checkpoint: Annotated[
        Path,
        typer.Argument(
            help="Model: a checkpoint (.safetensors, conv or attn), a timm folder cmhsa wrote, or an ONNX "
            "file (one cmhsa exported runs in onnxruntime as shipped).",
            show_default=False,
        ),
    ],
    data: Annotated[Optional[str], data_option()] = None,  # noqa: UP045
    data_dir: Annotated[Optional[str], data_dir_option()] = EvalOptions.data_dir,  # noqa: UP045
    download: Annotated[bool, typer.Option(help="Let torchvision download CIFAR.")] = EvalOptions.download,
    batch_size: BatchSize = EvalOptions.batch_size,
    device: Annotated[str, device_option()] = EvalOptions.device,
    amp: Annotated[str, typer.Option(help=f"{', '.join(AMPS[:-1])} or {AMPS[-1]}.")] = EvalOptions.amp,
    workers: Annotated[Optional[int], workers_option()] = EvalOptions.workers,  # noqa: UP045
    crop_pct: Annotated[float, typer.Option(help="Eval centre-crop fraction.")] = EvalOptions.crop_pct,
    seed: SyntheticSeed = EvalOptions.seed,
    threads: Annotated[Optional[int], threads_option()] = EvalOptions.threads,  # noqa: UP045
) -> None:
    """Top-1 / top-5 and loss of a checkpoint, timm folder or ONNX file on a dataset's validation split."""
    from rich.table import Table

    from ..api.on_data import evaluate_checkpoint
    from .progress import counted

    if data is None:
        raise CmhsaError(missing_data("eval"))
    options = EvalOptions(data, data_dir, download, batch_size, device, amp, workers, crop_pct, seed, threads)
    with contextlib.ExitStack() as bars:

        def counting(batches: int) -> Callable[[int], None]:
            return bars.enter_context(counted("evaluating", batches, "batches", quick=2))

        r = evaluate_checkpoint(checkpoint, options, counting)
    title, table = f"{safe(str(checkpoint))} on {data} (val, {r.images} images)", Table()
    top5 = len(r.classes) > 5  # top-5 of 5 classes or fewer is 100 % whatever the model does
    for col in ("kind", "top-1 %", *(("top-5 %",) if top5 else ()), "loss"):
        table.add_column(col, justify="right")
    kind = r.kind if r.form == "conv" else f"{r.kind}, {r.form} form"  # attention runs fused where exact
    kind = f"{r.kind}, {r.form}" if r.kind == "onnx" else kind  # the runtime and its provider
    table.add_row(kind, f"{r.top1:.2f}", *((f"{r.top5:.2f}",) if top5 else ()), f"{r.val_loss:.4f}")
    print_titled(title, table)
    print_per_class(r)


ALL_CLASSES_UP_TO = 30  # eval lists every class up to this many; beyond, the worst WORST_CLASSES
WORST_CLASSES = 15


def print_per_class(r: Any) -> None:
    """Per-class top-1 (every class, or the worst ones of many) and the most frequent mistakes,
    classes by name where the model or the data names them (names are foreign text: escaped)."""
    if not r.classes:
        return
    rows = r.classes
    if len(rows) > ALL_CLASSES_UP_TO:
        rows = sorted(rows, key=lambda row: row.top1)[:WORST_CLASSES]
        title = f"The {WORST_CLASSES} classes with the lowest top-1 (of {len(r.classes):,})"
    else:
        title = "Per class"
    if r.names_from == "numbers":
        title += " (classes by number: neither the model nor the data names them)"
    from rich.table import Table

    table = Table()
    for col in ("class", "images", "top-1 %"):
        table.add_column(col, justify="left" if col == "class" else "right")
    for row in rows:
        table.add_row(safe(row.name), f"{row.images:,}", f"{row.top1:.2f}")
    print_titled(title, table)
    if r.confused:  # a table: a class's name (foreign text) never begins a line of its own
        confused = Table()
        for col in ("true", "predicted", "images"):
            confused.add_column(col, justify="right" if col == "images" else "left")
        for c in r.confused:
            confused.add_row(safe(c.true), safe(c.predicted), f"{c.images:,}")
        print_titled("Most confused (true -> predicted)", confused)
    if r.data_names_differ:
        console.print(
            "note: the data names its classes differently from the model; rows name the model's outputs"
        )


def attention_command(
    checkpoint: Annotated[
        Path, typer.Argument(help="Attention checkpoint (.safetensors).", show_default=False)
    ],
    output: Annotated[Path, output_option("Folder for attention.json and attention.png (created).")],
    data: Annotated[Optional[str], data_option()] = None,  # noqa: UP045
    data_dir: Annotated[Optional[str], data_dir_option()] = AttentionOptions.data_dir,  # noqa: UP045
    images: Annotated[int, typer.Option(help="Validation images to average over.")] = AttentionOptions.images,
    batch_size: BatchSize = AttentionOptions.batch_size,
    device: Annotated[str, device_option()] = AttentionOptions.device,
    seed: SyntheticSeed = AttentionOptions.seed,
) -> None:
    """What each head attends to on real images: pinned share, attention distance, entropy, gate."""
    from rich.table import Table

    from ..api.on_data import attention_on_data
    from ..train.plot import pyplot, write_attention

    if data is None:
        raise CmhsaError(missing_data("attention"))
    if output.exists() and not output.is_dir():
        raise CmhsaError("is a file; give a folder for attention.json and attention.png", output)
    pyplot()  # fail before the slow part, and before anything is written, if matplotlib is missing
    created = make_folder(output)
    written = (output / "attention.json", output / "attention.png")
    try:  # the outputs checked and held before the slow part
        reads = [checkpoint, *([data_dir] if data_dir else [])]
        with held_outputs(*written, reads=reads) as (json_out, png_out):
            r = attention_on_data(
                checkpoint,
                AttentionOptions(data, data_dir, images, batch_size, device, seed=seed),
            )
            doc = json_text(r.to_dict(str(checkpoint))) + "\n"
            title = f"{checkpoint.name} on {data}: mean attention by relative offset, {r.images} images"
            write_attention(r, json_out, png_out, doc, title)
    except BaseException:
        remove_made(created)  # nothing was written: leave no folder it made either
        raise
    title, table = f"{safe(str(checkpoint))} on {data} (val, {r.images} images)", Table()
    for col in ("block", "head", "offset", "pinned share", "distance px", "entropy", "gate"):
        table.add_column(col, justify="right")
    for i, block in enumerate(r.blocks):
        for j, h in enumerate(block):
            fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
            off = "free" if h.offset is None else f"{h.offset[0]:+d},{h.offset[1]:+d}"
            table.add_row(
                str(i),
                str(j),
                off,
                fmt(h.pinned_share, ".3f"),
                f"{h.mean_distance_px:.2f}",
                f"{h.entropy:.3f}",
                fmt(h.gate, ".3f"),
            )
    print_titled(title, table)
    console.print(f"wrote {safe(str(written[0]))} and {safe(str(written[1]))}")


def plot_command(
    runs: Annotated[
        list[Path], typer.Argument(help="Run folders (each with metrics.csv).", show_default=False)
    ],
    output: Annotated[
        Optional[Path],  # noqa: UP045
        typer.Option(
            "--output",
            "-o",
            help="Image to write (.png, .pdf, .svg) \\[default: FIRST_RUN/curves.png].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Loss, top-1 and learning rate against epoch for one or more runs (the paper's Figure 2 view)."""
    from ..train.plot import plot_runs

    output = output or runs[0] / "curves.png"  # beside the runs, never in whatever folder the shell is in
    plot_runs(runs, output)  # its notes reach stderr through the boundary's notice sink
    console.print(f"wrote {safe(str(output))}")


app = typer.Typer()
app.command("eval")(eval_command)
app.command("plot")(plot_command)
app.command("attention")(attention_command)
