"""``cmhsa predict``: a model's most probable classes for image files, as a table, a CSV or JSON."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from ..options.operations import PredictOptions
from .common import console, path_opt, safe
from .options import device_option, threads_option
from .progress import counted

app = typer.Typer()
SHOWN = 50  # images the console table shows; --output holds all of them


@app.command("predict")
def predict_command(
    model: Annotated[
        Path,
        typer.Argument(
            help="A checkpoint (.safetensors), a timm folder (cmhsa export --format timm) or an ONNX "
            "file (cmhsa export; run by onnxruntime with the preprocessing it records).",
            show_default=False,
        ),
    ],
    images: Annotated[
        list[Path],
        typer.Argument(help="Image files, or folders of them (walked, by name).", show_default=False),
    ],
    top_k: Annotated[int, typer.Option(help="Classes shown per image, most probable first.")] = (
        PredictOptions.top_k
    ),
    output: Annotated[
        Optional[Path],  # noqa: UP045 (typer needs the Optional form at runtime)
        path_opt(
            "Also write every prediction to this file: .csv (a row per image and rank) or .json.",
            "-o",
            "--output",
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Images per forward pass.")] = PredictOptions.batch_size,
    device: Annotated[str, device_option()] = PredictOptions.device,
    threads: Annotated[Optional[int], threads_option()] = PredictOptions.threads,  # noqa: UP045
) -> None:
    """The most probable classes of each image, by the names the model records.

    Images are prepared as cmhsa eval prepares its own (the same top-1)."""
    from ..api.common import read_paths
    from ..api.predict import check_predictions_path, image_files, predict_images, write_predictions
    from ..io.outputs import held_outputs

    options = PredictOptions(top_k, batch_size, device, threads)
    with contextlib.ExitStack() as held:
        target = None
        if output is not None:  # before the images are read: a bad output never costs the predictions
            check_predictions_path(output)
            reads = [*read_paths(model), *images]
            (target,) = held.enter_context(held_outputs(output, reads=reads))
        files = image_files(images)  # listed once: the bar's total, then the predictions
        with counted("predicting", len(files), "images", quick=2 * batch_size) as count:
            r = predict_images(model, files, options, count)
        print_predictions(r)
        if target is not None:
            write_predictions(r, target)
            console.print(f"Wrote {safe(str(output))} ({len(r.predictions):,} images)")


def print_predictions(r: Any) -> None:
    """The first SHOWN images' classes and probabilities (names are foreign text: escaped)."""
    names = "" if r.names_from == "model" else " (classes by number: the model records no names)"
    table = Table()
    table.add_column("image")
    for rank in range(1, r.top_k + 1):
        table.add_column(f"#{rank}")
    for p in r.predictions[:SHOWN]:
        table.add_row(safe(p.image), *(f"{safe(n)} {100 * q:.1f}%" for n, _, q in p.top))
    title = f"{safe(r.model)} ({r.source}): {len(r.predictions):,} images{names}"
    console.print(title)
    console.print(table)
    if len(r.predictions) > SHOWN:
        console.print(f"... {len(r.predictions) - SHOWN:,} more (-o FILE.csv writes all of them)")
