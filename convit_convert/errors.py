"""The one exception the CLI turns into a one-line error (exit 2)."""

from __future__ import annotations

from pathlib import Path


class CmhsaError(Exception):
    """Bad input: names the file (when there is one) and the problem, in one line."""

    def __init__(self, message: str, path: str | Path | None = None) -> None:
        self.path = None if path is None else str(path)
        self.message = " ".join(str(message).split())  # one line, whatever the source said
        super().__init__(f"{self.path}: {self.message}" if self.path else self.message)


def article(kind: str) -> str:
    """'a conv', 'an attn': for messages that name a model kind."""
    return f"{'an' if kind[:1] in 'aeiou' else 'a'} {kind}"
