"""Text from outside (a path, a file's contents, a run folder's name) made safe to print: control
characters shown as escapes, so a string cannot move the cursor, set the title or hide text."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def terminal_safe(text: str) -> str:
    """`text` with control characters (escape sequences, bidi overrides) shown as \\xNN. Newlines
    and tabs stay."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def label_safe(text: str) -> str:
    """`text` for a matplotlib label: terminal-safe, on one line, and with ``$`` escaped (matplotlib
    would parse the text between two as mathtext, and fail on what it cannot parse)."""
    return terminal_safe(" ".join(text.split())).replace("$", r"\$")
