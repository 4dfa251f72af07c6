"""An exclusive lock on a run folder, held while a process writes into it.

An OS file lock (``flock`` on ``FOLDER/.cmhsa.lock``): the kernel releases it when the holder
exits, however it exits (kill -9 included), so a stale lock cannot outlive its process. The file
holds the holder's PID, for the message a second process gets.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from ..errors import CmhsaError

LOCK_NAME = ".cmhsa.lock"


@contextlib.contextmanager
def locked_folder(folder: Path) -> Iterator[None]:
    """Hold ``folder``'s lock for the block; a second holder is refused in one line naming the
    first one's PID."""
    path = folder / LOCK_NAME
    try:  # never through a link (its target would be truncated), never blocking on a FIFO
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY, 0o644)
    except OSError as e:
        why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
        raise CmhsaError(
            f"cannot open the run folder's lock {LOCK_NAME} ({why}); remove it", folder
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CmhsaError(f"the run folder's lock {LOCK_NAME} is not a regular file; remove it", folder)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CmhsaError(
                f"is in use by another cmhsa process (PID {holder}); wait for it to end "
                "or choose another `out`",
                folder,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
