"""Text from outside (a path, a file's contents, a run folder's name, a class name) made safe for
where it is shown, each sink through one function: a terminal (:func:`terminal_safe`), a
matplotlib label (:func:`label_safe`), a Markdown model card (:func:`markdown_safe`, and
:func:`card_number` for a figure read from a file)."""

from __future__ import annotations

import html
import math
import re

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
