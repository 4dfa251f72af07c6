"""The CLI's side of the bounds (convit_convert/bounds.py holds the table): every command's
numeric options checked before it runs, so a violation is one line naming the flag (exit 2)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

from ..options.values import BOUNDS, check


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a command) with its numeric options checked against BOUNDS before it runs (their
    ranges are added to ``--help`` by options.plain_help, on the built command)."""
    names = [n for n in inspect.signature(fn).parameters if n in BOUNDS]

    @functools.wraps(fn)
    def command(*args: Any, **kwargs: Any) -> Any:
        for n in names:
            check(n, kwargs.get(n))
        return fn(*args, **kwargs)

    return command


BOUNDED: set[Callable[..., Any]] = set()  # the commands bound_all made (kept here, not on them)


def bound_all(app: Any) -> None:
    """Every command of a typer app (and of its groups) through `bounded`, once."""
    for info in app.registered_commands:
        if info.callback is not None and info.callback not in BOUNDED:
            info.callback = bounded(info.callback)
            BOUNDED.add(info.callback)
    for group in app.registered_groups:
        bound_all(group.typer_instance)
