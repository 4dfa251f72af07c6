"""The library's one error hierarchy (no torch import): bad input, or a check that failed.

Messages are one line and name the file (when there is one). They name parameters as they are
spelled in Python, in backquotes (`img_size`); the CLI shows them as its flags (--img-size).
"""

from __future__ import annotations

from pathlib import Path


class CmhsaError(Exception):
    """Bad input: names the file, when there is one, and the problem, in one line. (Exit codes are
    the CLI's: cli/boundary.py.)"""

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        self.message = " ".join(str(message).split())  # one line, whatever the source said
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
