"""An exclusive lock on a run folder, held while a process writes into it.

An OS file lock (``flock`` on ``FOLDER/.cmhsa.lock``): the kernel releases it when the holder
exits, however it exits (kill -9 included), so a stale lock cannot outlive its process. The file
holds the holder's PID, for the message a second process gets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from ..errors import CmhsaError
from .folder import Folder

LOCK_NAME = ".cmhsa.lock"


@contextlib.contextmanager
def locked_folder(folder: Folder) -> Iterator[None]:
    """Hold ``folder``'s lock for the block; a second holder is refused in one line naming the
    first one's PID. The lock file is opened by name in the held folder: never through a link, and
    never a hard link or another user's file (writing the PID into it would change the other name)."""
    fd = folder.open_lock(LOCK_NAME)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise CmhsaError(
                f"is in use by another cmhsa process (PID {holder[:20]}); wait for it to end "
                "or choose another `out`",
                folder.path,
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
