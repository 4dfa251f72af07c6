"""The CLI's side of the bounds (convit_convert/options/values.py holds the table): every command's
numeric options checked before it runs, so a violation is one line naming the flag (exit 2)."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any, Union

from ..options.values import BOUNDS, check


def numeric(hint: Any) -> bool:
    """Whether a parameter annotated ``hint`` holds numbers: int or float, optional, in a tuple."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Annotated:
        return numeric(args[0])
    if origin in (Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return bool(rest) and all(map(numeric, rest))
    if origin is tuple:
        return all(numeric(a) for a in args if a is not Ellipsis)
    return hint in (int, float)


def bounded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a command) with its numeric options checked against BOUNDS before it runs (their
    ranges are added to ``--help`` by options.plain_help, on the built command). A parameter of
    the same name that is text (convert's "HxW") or paths (predict's images) is the command's to
    parse: its numbers are checked there."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params = inspect.signature(fn).parameters
    names = [
        n
        for n, p in params.items()
        if n in BOUNDS and numeric(hints.get(n) if isinstance(p.annotation, str) else p.annotation)
    ]

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
