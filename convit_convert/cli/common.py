"""What every command shares: the console, errors as one line with flags for parameters, exit
codes, and the renderers of the library's reports (no torch import)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import typer
from rich.console import Console, ConsoleDimensions
from rich.markup import escape
from rich.segment import Segment
from rich.table import Table

from ..errors import CmhsaError
from ..options.values import check
from ..text import printed_safe, terminal_safe

EXIT_FAIL, EXIT_BAD_INPUT = 1, 2
UNWRAPPED = 10_000  # columns when printing to a file or a pipe: a line ends where its text does


class _Console(Console):
    """rich's console, except that output to a file or a pipe is not wrapped (rich wraps it at 80
    columns, breaking lines a reader greps or a script parses); COLUMNS still sets a width."""

    @property
    def size(self) -> ConsoleDimensions:
        size = super().size
        if self._width is None and not self.is_terminal:
            return ConsoleDimensions(UNWRAPPED, size.height)
        return size

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        Console.size.fset(self, new_size)  # type: ignore[attr-defined]

    def _render_buffer(self, buffer: Iterable[Segment]) -> str:
        """Every text segment through ``text.printed_safe`` before rich adds its own styles: a
        control character reaches the terminal only as rich's own (cursor, colour), never from a
        value, whoever printed it and whether or not they escaped it."""
        return super()._render_buffer(
            Segment(printed_safe(seg.text), seg.style, seg.control) if seg.control is None else seg
            for seg in buffer
        )


console = _Console(highlight=False)


# parameters whose flag is not --name-with-dashes: `out` is train's -o/--output (--out is its old spelling)
FLAG_NAMES = {"out": "-o/--output"}


def as_flags(message: str) -> str:
    """Library messages name parameters in backquotes (`img_size`); the CLI's name is --img-size."""
    return re.sub(
        r"`([a-z][a-z0-9_]*)`",
        lambda m: FLAG_NAMES.get(m.group(1)) or "--" + m.group(1).replace("_", "-"),
        message,
    )


def safe(text: object) -> str:
    """Anything from a file or the user, ready for console.print: terminal-safe, markup escaped."""
    return escape(terminal_safe(str(text)))


def path_arg(help: str) -> Any:
    """A file argument: checked by the library (one-line errors), not by click."""
    return typer.Argument(readable=False, help=help, show_default=False)


def path_opt(help: str, *decls: str) -> Any:
    return typer.Option(*decls, readable=False, help=help, show_default=False)


def parse_img_size(value: str | None) -> tuple[int, int] | None:
    """'224' -> (224, 224); '224x160' or '224,160' -> (224, 160)."""
    if value is None:
        return None
    parts = value.lower().replace(",", "x").split("x")
    try:
        hw = [int(p) for p in parts]
    except ValueError:
        hw = []
    if len(hw) == 1:
        hw *= 2
    if len(hw) != 2 or min(hw) < 1:
        raise CmhsaError(f"--img-size must be H or HxW (positive integers), got {value!r}")
    for side in hw:
        check("img_size", side)
    return hw[0], hw[1]


def fmt(x: float) -> str:
    return f"{x:.2e}"


def print_titled(title: str, table: Table) -> None:
    """``table`` under ``title``, a line of its own: a title inside a rich table wraps at the table's
    width, breaking a long path over lines."""
    console.print(title)
    console.print(table)


def print_verification(result: Any, title: str) -> None:
    """A verify_models result: the per-tensor table, then the verdict."""
    table = Table()
    for col in ("tensor", "region", "max |Δ|", "max |ref|", "rel. error", "status"):
        table.add_column(col, justify="right" if col not in ("tensor", "region") else "left")
    for e in result.errors:
        status = ("[green]ok[/]" if e.passed else "[red]FAIL[/]") if e.judged else "[dim]info[/]"
        table.add_row(e.tensor, e.region, fmt(e.max_abs), fmt(e.ref_max), fmt(e.rel), status)
    print_titled(title, table)
    worst = result.worst
    where = f"{worst.tensor} ({worst.region})"
    unjudged = [e for e in result.errors if not e.judged]
    scope = f" (interior only: {len(unjudged)} border/logit rows not judged)" if unjudged else ""
    if result.passed:
        console.print(
            f"[green]PASS[/]{scope}: worst relative error {fmt(worst.rel)} at {where} <= tol {result.tol:g}"
        )
    else:
        console.print(f"[red]FAIL[/]: relative error {fmt(worst.rel)} at {where} > tol {result.tol:g}")
    console.print(f"[dim]criterion: {safe(result.criterion)}[/]")


def print_import(ckpt: Any) -> None:
    """For an ONNX input: how the graph was read, and the onnxruntime agreement that proves it."""
    info = ckpt.import_report
    if info is None:
        return
    read = "; ".join(f"{k} {', '.join(v)}" for k, v in info["read"].items())
    check = info["onnxruntime_check"]
    console.print(
        f"Read {safe(str(ckpt.path))} by its graph ({safe(info['producer'] or 'unknown producer')}, "
        f"opset {info['opsets'].get('ai.onnx', '?')}): {safe(read)}"
    )
    console.print(
        f"onnxruntime vs the rebuilt PyTorch model, batch {check['batch']}: relative error "
        f"{fmt(check['rel'])} <= tol {check['tol']:g} (providers: {', '.join(check['providers'])})"
    )


def print_written(passed: bool, output: Any, report_path: Any, check: str, replaced: bool = False) -> None:
    if passed:
        note = " (it replaced the file there)" if replaced else ""
        console.print(f"Wrote {safe(str(output))}{note} and {safe(str(report_path))}")
    else:
        console.print(f"Not written: {safe(str(output))} ({check} failed); report: {safe(str(report_path))}")
