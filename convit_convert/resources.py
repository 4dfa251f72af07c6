"""What this machine can hold, refusing sizes that will not fit before anything is allocated, and
naming what an allocation that failed anyway was for (no torch import)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from .errors import CmhsaError


def available_memory() -> int:
    """Bytes of memory available now (Linux's MemAvailable; else all physical memory)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 1 << 62  # unknown: refuse nothing


def check_fits(nbytes: int, what: str, path: object = None) -> None:
    """CmhsaError, with the estimate, when ``nbytes`` exceed the memory available now."""
    free = available_memory()
    if nbytes > free:
        raise CmhsaError(
            f"{what} would need about {nbytes / 2**30:,.1f} GiB, more than the "
            f"{free / 2**30:,.1f} GiB of memory "
            "available; reduce the sizes",
            path,
        )


SIZED_BY = "cmhsa_sized_by"  # the attribute a failed allocation carries: what its memory was for


@contextlib.contextmanager
def sized_by(what: str) -> Iterator[None]:
    """Name what the memory allocated in this block is for (an image, an ONNX file, a stack of
    seeds): an exception leaving the block carries the innermost ``what`` (attribute SIZED_BY), so a
    failed allocation is said as running out of memory for it (cli/boundary.py), not as sizes the
    user may not have given."""
    try:
        yield
    except BaseException as e:
        if not hasattr(e, SIZED_BY):
            with contextlib.suppress(AttributeError, TypeError):
                setattr(e, SIZED_BY, what)
        raise
