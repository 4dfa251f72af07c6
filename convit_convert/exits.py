"""Exit codes and the one-line error every command gives for bad input (no torch import)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from .errors import CmhsaError

F = TypeVar("F", bound=Callable[..., Any])
EXIT_FAIL, EXIT_BAD_INPUT = 1, 2


def fail(message: str) -> None:
    """One line on stderr, no traceback."""
    print(f"error: {' '.join(message.split())}", file=sys.stderr)


def handles_errors(fn: F) -> F:
    """Bad input becomes a one-line error and exit 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CmhsaError as e:
            fail(str(e))
            raise typer.Exit(EXIT_BAD_INPUT) from None
        except MemoryError:
            fail("out of memory")
            raise typer.Exit(EXIT_BAD_INPUT) from None

    return wrapper  # type: ignore[return-value]
