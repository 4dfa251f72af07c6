"""What this machine can hold, and refusing sizes that will not fit before anything is allocated
(no torch import)."""

from __future__ import annotations

import os
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
