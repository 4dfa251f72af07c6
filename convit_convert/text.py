"""Text from outside (a path, a file's contents, a run folder's name, a class name) made safe for
where it is shown. One classification decides what a reader could not see or that would act on
the reader's screen (:func:`hidden`, by Unicode property: the general categories Cc, Cf, Cs, Co,
Cn, Zl and Zp, every space separator (Zs) but U+0020, every ``Default_Ignorable_Code_Point``, and
the characters the Unicode Character Database names as blank glyphs); every sink shows those
characters as escapes and each backslash of the text doubled (so an escape never reads as text a
name could hold: typed out, its characters show with two backslashes), each sink through one
function: a terminal (:func:`terminal_safe`), a matplotlib label (:func:`label_safe`), a Markdown
model card (:func:`markdown_safe`, :func:`card_number` for a figure read from a file,
:func:`yaml_text` for its front matter), a CSV file (:func:`csv_text`: a spreadsheet runs no cell
as a formula) and a JSON file (:func:`json_text`: JSON's own escapes; `cat` of it moves no
cursor). Class names are checked by the same classification (labels.py).
``tests/test_foreign_text.py`` fails if a module writes CSV, JSON or YAML text any other way."""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import regex

from .errors import one_line

# What a reader cannot see, or what acts on a terminal, by property (the `regex` package's Unicode
# tables, kept current with Unicode): controls (newline and tab included: a foreign string is one
# line wherever it is shown), format characters (zero-width, bidi, tags, the soft hyphen), lone
# surrogates (what undecodable bytes in a file name become), private use, unassigned, the line
# and paragraph separators, and every default-ignorable code point (Hangul fillers, variation
# selectors, the combining grapheme joiner); every space but U+0020 (a no-break, figure or
# ideographic space reads as it); and the blank glyphs (_blank_glyphs).
_PROPERTIES = r"\p{Cc}\p{Cf}\p{Cs}\p{Co}\p{Cn}\p{Zl}\p{Zp}\p{Default_Ignorable_Code_Point}"


@functools.lru_cache(maxsize=1)
def _blank_glyphs() -> str:
    """The characters the Unicode Character Database names as blank glyphs: a letter or mark named
    a FILLER (the Hangul and Khitan fillers) and a symbol named a PATTERN BLANK (U+2800). Unicode has
    no property for "renders as nothing"; its names are the maintained source (planes 0 to 3, where
    letters, marks and symbols are assigned: 50 ms, once, on first use)."""
    found = []
    for code in range(0x40000):
        name = unicodedata.name(chr(code), "")
        if (name.endswith(" FILLER") and unicodedata.category(chr(code))[0] in "LM") or (
            name.endswith(" PATTERN BLANK") and unicodedata.category(chr(code)) == "So"
        ):
            found.append(chr(code))
    return "".join(found)


@functools.lru_cache(maxsize=1)
def _hidden() -> Any:
    return regex.compile(f"[{_PROPERTIES}{regex.escape(_blank_glyphs())}]|(?! )\\p{{Zs}}")


def hidden(ch: str) -> bool:
    """The one classification of a foreign character: True if no reader could see it for what it
    is, or a terminal would act on it (module docstring)."""
    return _hidden().fullmatch(ch) is not None


def escape(ch: str) -> str:
    """``ch`` as text anyone can read: \\xNN, \\uXXXX or \\UXXXXXXXX; an undecodable byte of a
    file name (Python's surrogate escape, U+DC80..U+DCFF) as the byte it was, \\xNN."""
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def escaped(text: str, keep: str = "", as_: Callable[[str], str] = escape) -> str:
    """``text`` with every :func:`hidden` character (but those in ``keep``) replaced by ``as_(ch)``."""
    return _hidden().sub(lambda m: m.group() if m.group() in keep else as_(m.group()), text)


def terminal_safe(text: str) -> str:
    """``text`` on one line with every hidden character (escape sequences, newlines, tabs, bidi
    overrides, zero-width and blank characters, spaces other than U+0020, undecodable bytes) shown
    as an escape and each backslash of its own doubled: a string cannot move the cursor, set the
    title, hide text, pass for another (an escape is never text that reads like one) or start a
    line of its own that looks like cmhsa's (``error: ...``). Every first-level sink (console
    lines, logs, CSV, plot labels, the model card) shows foreign text through it, once."""
    return escaped(text.replace("\\", "\\\\"))


def printed_safe(text: str) -> str:
    """What a console writes, made terminal-safe at the last step: every hidden character but the
    newlines of its own layout shown as an escape (the console's guard behind :func:`terminal_safe`,
    for a value a caller forgot to escape)."""
    return escaped(text, keep="\n")


def lines_safe(text: str) -> str:
    """Several lines cmhsa itself laid out (a warning with its source line), each made terminal-safe."""
    return "".join(terminal_safe(line) + "\n" for line in text.splitlines())


def label_safe(text: str) -> str:
    """``text`` for a matplotlib label: terminal-safe, on one line, and with ``$`` escaped (matplotlib
    would parse the text between two as mathtext, and fail on what it cannot parse)."""
    return terminal_safe(one_line(text)).replace("$", r"\$")


def markdown_safe(value: object, limit: int = 200) -> str:
    """A value from a file in Markdown (a model card the Hub renders as HTML) as a code span: shown
    as it is, never read as Markdown or HTML, whatever the renderer's extensions (no link, image,
    tag, comment, and no autolink of a URL, ``www.`` name or e-mail address, which GitHub-flavoured
    Markdown makes in text but never in code). One line, terminal-safe, at most ``limit``
    characters, fenced by one backtick more than its longest run of them."""
    text = terminal_safe(one_line(str(value)))[:limit] or " "
    fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
    pad = " " if text[0] == "`" or text[-1] == "`" or (text[0] == text[-1] == " " and text.strip()) else ""
    return f"{fence}{pad}{text}{pad}{fence}"


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


def _json_escape(ch: str) -> str:
    """A hidden character as JSON's own escape (UTF-16 units: a character past U+FFFF as its pair)."""
    units = ch.encode("utf-16-be", "surrogatepass")
    return "".join(f"\\u{int.from_bytes(units[i : i + 2], 'big'):04x}" for i in range(0, len(units), 2))


def json_text(doc: Any, indent: int | None = 2, compact: bool = False, sort_keys: bool = False) -> str:
    """``doc`` as JSON text for a file (``indent``; ``compact``: no spaces), readable UTF-8 with
    every :func:`hidden` character written as a ``\\uXXXX`` escape: the same JSON to a parser,
    inert to `cat`, and no name that reads as another (json.dumps escapes the controls inside
    strings itself, so a raw newline left is the layout's own)."""
    text = json.dumps(
        doc,
        indent=None if compact else indent,
        separators=(",", ":") if compact else None,
        ensure_ascii=False,
        sort_keys=sort_keys,
        default=str,
    )
    return escaped(text, keep="\n", as_=_json_escape)


def yaml_text(doc: dict[str, Any]) -> str:
    """``doc`` as a YAML block (a model card's front matter) by a YAML emitter, every string
    written so that reading it back gives that string (``"no"``, ``"0x1f"``, ``"1.5"`` stay text)
    and hidden characters escaped by the emitter; nothing reaches it by string formatting."""
    import yaml

    def clean(v: Any) -> Any:
        if isinstance(v, str):
            return terminal_safe(v)
        if isinstance(v, dict):
            return {clean(k): clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return yaml.safe_dump(
        clean(doc), sort_keys=False, allow_unicode=True, default_flow_style=False, width=10**6
    )
