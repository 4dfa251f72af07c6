"""The library's one error hierarchy (no torch import): bad input, or a check that failed.

Messages are one line and name the file (when there is one). They name parameters as they are
spelled in Python, in backquotes (`img_size`); the CLI shows them as its flags (--img-size).
"""

from __future__ import annotations

import re
from pathlib import Path

_ASCII_SPACE = re.compile(r"[ \t\n\r\f\v]+")


def one_line(text: str) -> str:
    """``text`` on one line: each run of ASCII whitespace (a library's newlines and indents) one
    space. Nothing else is touched: a no-break or ideographic space is a character a sink shows as
    an escape (text.py), never folded into the space it looks like."""
    return _ASCII_SPACE.sub(" ", text).strip(" ")


class CmhsaError(Exception):
    """Bad input: names the file, when there is one, and the problem, in one line. (Exit codes are
    the CLI's: cli/boundary.py.)"""

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        self.message = one_line(str(message))  # whatever the source said
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


class CheckFailed(CmhsaError):
    """Valid input whose check failed: a conversion outside its tolerance, a training run that
    cannot go on."""


def first_line(e: BaseException, limit: int = 300) -> str:
    """The first line of a library's exception message, shortened: for one-line errors."""
    return (str(e).strip().splitlines() or [""])[0][:limit]


def article(kind: str) -> str:
    """'a conv', 'an attn': for messages that name a model kind."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"
