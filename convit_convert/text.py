"""Text from outside (a path, a file's contents, a run folder's name, a class name) made safe for
where it is shown, each sink through one function: a terminal (:func:`terminal_safe`), a
matplotlib label (:func:`label_safe`), a Markdown model card (:func:`markdown_safe`, and
:func:`card_number` for a figure read from a file), a CSV file (:func:`csv_text`: a spreadsheet
runs no cell as a formula) and a JSON file (:func:`json_text`: `cat` of it moves no cursor).
``tests/test_foreign_text.py`` fails if a module writes CSV or JSON text any other way."""

from __future__ import annotations

import csv
import html
import io
import json
import math
import re
from collections.abc import Iterable, Sequence
from typing import Any

# C0 controls (newline and tab included: a foreign string is one line wherever it is shown),
# DEL, C1, and the bidi overrides and isolates that reorder what follows them
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
# what would start a link, image, code, emphasis or table cell (a value is never at a line's start)
_MARKDOWN = re.compile(r"([\\`*_\[\]()|~])")


def terminal_safe(text: str) -> str:
    """``text`` on one line with every control character (escape sequences, newlines, tabs, bidi
    overrides) shown as \\xNN: a string cannot move the cursor, set the title, hide text or start a
    line of its own that looks like cmhsa's (``error: ...``)."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def printed_safe(text: str) -> str:
    """What a console writes, made terminal-safe at the last step: every control character but the
    newlines of its own layout shown as \\xNN (the console's guard behind :func:`terminal_safe`,
    for a value a caller forgot to escape)."""
    return _CONTROL.sub(lambda m: m.group() if m.group() == "\n" else f"\\x{ord(m.group()):02x}", text)


def lines_safe(text: str) -> str:
    """Several lines cmhsa itself laid out (a warning with its source line), each made terminal-safe."""
    return "".join(terminal_safe(line) + "\n" for line in text.splitlines())


def label_safe(text: str) -> str:
    """``text`` for a matplotlib label: terminal-safe, on one line, and with ``$`` escaped (matplotlib
    would parse the text between two as mathtext, and fail on what it cannot parse)."""
    return terminal_safe(" ".join(text.split())).replace("$", r"\$")


def markdown_safe(value: object, limit: int = 200) -> str:
    """A value from a file as inert text in Markdown (a model card the Hub renders as HTML): one
    line, terminal-safe, at most ``limit`` characters, HTML's special characters as entities (no
    tag, comment or autolink can open) and Markdown's link, image, code and emphasis characters
    backslash-escaped (no ``[x](javascript:...)`` link)."""
    text = terminal_safe(" ".join(str(value).split()))[:limit]
    return _MARKDOWN.sub(r"\\\1", html.escape(text, quote=False))


def card_number(value: object, low: float, high: float, digits: int = 2) -> str | None:
    """A figure read from a file, as text: only a real number (never a bool) that is finite and in
    [low, high], with ``digits`` decimals (0: a whole number, which it must be); else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or not low <= value <= high:
        return None
    if digits == 0:
        return str(value) if isinstance(value, int) else None
    return f"{value:.{digits}f}"


# what a spreadsheet reads as the start of a formula (OWASP's CSV injection guidance: = + - @, tab
# and carriage return; their full-width forms, which some spreadsheets fold to them)
_FORMULA_START = tuple("=+-@\t\r\uff1d\uff0b\uff0d\uff20")


def csv_cell(value: object, number_format: str = "") -> str:
    """One CSV cell: a number cmhsa computed as it is (a float formatted by ``number_format``); text
    terminal-safe (no control character reaches `cat`) and, when it would start a formula,
    prefixed with ``'`` so a spreadsheet shows it as text."""
    if isinstance(value, float):
        return format(value, number_format)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    text = terminal_safe(str(value))
    return "'" + text if text.startswith(_FORMULA_START) else text


def csv_text(rows: Iterable[Sequence[object]], number_format: str = "") -> str:
    """CSV of ``rows`` (the first: the header), every cell through :func:`csv_cell`; ``None`` is an
    empty cell."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    for row in rows:
        writer.writerow(["" if v is None else csv_cell(v, number_format) for v in row])
    return buf.getvalue()


# JSON escapes C0 itself; what it leaves raw with ensure_ascii=False and a terminal would act on:
# DEL, C1, the bidi controls, the line separators, and lone surrogates (which no encoder writes)
_JSON_RAW = re.compile(r"[\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def json_text(doc: Any, indent: int | None = 2, compact: bool = False, sort_keys: bool = False) -> str:
    """``doc`` as JSON text for a file (``indent``; ``compact``: no spaces), readable UTF-8 with
    every character a terminal would act on written as a ``\\uXXXX`` escape: the same JSON to a
    parser, inert to `cat`."""
    text = json.dumps(
        doc,
        indent=None if compact else indent,
        separators=(",", ":") if compact else None,
        ensure_ascii=False,
        sort_keys=sort_keys,
        default=str,
    )
    return _JSON_RAW.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
