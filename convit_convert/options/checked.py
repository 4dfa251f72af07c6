"""``Checked``: the base of every option object, a frozen dataclass that checks each field when it
is made, as the command line checks a flag: its annotated type (:func:`fits`), its range in
:data:`.values.BOUNDS`, its ``CHOICES``; a refusal is one CmhsaError naming the option."""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from ..errors import CmhsaError
from .values import DEVICE_NAME, check


def check_device_name(name: object) -> None:
    """``name`` is one a user may give (which GPUs exist is checked where one is used)."""
    if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
        raise CmhsaError(f"`device` must be auto, cpu, cuda or cuda:N, got {name!r}")


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` names, as a typed flag would give it: a bool is no
    number, an int is a float, a tuple has its length."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is tuple and args[-1:] == (Ellipsis,):  # tuple[int, ...]: any length
        return isinstance(value, tuple) and all(fits(v, args[0]) for v in value)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(fits, value, args))
    if origin is not None:
        return isinstance(value, origin)
    return not isinstance(hint, type) or isinstance(value, hint)


TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def type_text(hint: Any) -> str:
    """``hint`` in words, for a refusal: "an integer or none", "2 numbers"."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if hint is type(None):
        return "none"
    if typing.get_origin(hint) is tuple and args[-1:] == (Ellipsis,):
        return "integers" if args[0] is int else "numbers"
    if typing.get_origin(hint) is tuple:
        return f"{len(args)} {'integers' if args[0] is int else 'numbers'}"
    return TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (once per class)."""
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Checked:
    """A frozen set of options, checked when made, as the command line checks its flags: each
    field's value of its annotated type, each number against BOUNDS (by field name), each name
    against ``CHOICES``; ``device`` fields against the device names. ``FLAG_OF`` names a field's
    flag where the two are spelled apart (a refusal names the flag's parameter)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}
    FLAG_OF: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            value, name = getattr(self, f.name), self.FLAG_OF.get(f.name, f.name)
            if not fits(value, hints[f.name]):
                raise CmhsaError(f"`{name}` must be {type_text(hints[f.name])}, got {value!r}")
            check(name, value)
            allowed = self.CHOICES.get(f.name)
            optional = value is None and f.default is None  # a field whose default is "none given"
            if allowed is not None and not optional and value not in allowed:
                raise CmhsaError(f"`{name}` must be one of {', '.join(allowed)}, got {value!r}")
        device = getattr(self, "device", None)
        if device is not None:
            check_device_name(device)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)
