"""Lines the library has for the user that are not errors (a journal it found and will not act on),
each said once per process: handed to the sink the CLI installs (stderr), else to ``warnings``."""

from __future__ import annotations

import warnings
from collections.abc import Callable

from .errors import one_line

_SAID: set[str] = set()
_SINK: list[Callable[[str], None]] = []


class CmhsaNotice(UserWarning):
    """A notice raised as a warning when no sink is installed (the library used from Python)."""


def notice(message: str) -> None:
    """Tell the user ``message`` (one line), unless it was said already in this process."""
    message = one_line(message)
    if message in _SAID:
        return
    _SAID.add(message)
    if _SINK:
        _SINK[-1](message)
    else:
        warnings.warn(message, CmhsaNotice, stacklevel=2)


def set_sink(sink: Callable[[str], None] | None) -> None:
    """Where notices go from now (None: back to ``warnings``); forgets what was said (a new command)."""
    _SINK.clear()
    _SAID.clear()
    if sink is not None:
        _SINK.append(sink)
