"""The one door from a path the user gave for an output to the folder that holds it: each path
checked (a file cmhsa may replace; not a file the command reads, nor inside a folder it reads), its
folder opened once and held, and a :class:`Target` (held folder, bare name) handed to the writers.

Only a command's entry point calls :func:`held_outputs` (a CLI command, or the public Python
function the user called with a path); everything below it writes through the targets
(``io.atomic.atomic_names``), so nothing renamed in the tree while the command runs can redirect a
write. ``tests/test_outputs.py`` fails on a call of it, of ``Folder.open`` or ``make_folder``
anywhere else, and on a write to a path that ``atomic_names`` did not give.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import NamedTuple

from ..errors import CmhsaError
from .folder import Folder
from .paths import check_output_target


class Target(NamedTuple):
    """An output: the bare ``name`` in the held ``folder``."""

    folder: Folder
    name: str

    def show(self) -> Path:
        """The path to show a user."""
        return self.folder.show(self.name)

    def exists(self) -> bool:
        return self.folder.exists(self.name)


def check_writable(path: Path) -> None:
    """Fail early, before any expensive work, if ``path`` cannot be written: it names a file that is
    absent or regular (never a folder, link, device or FIFO), in a writable folder (a name too long
    for it is refused by :func:`check_output_target`'s look-up)."""
    check_output_target(path)
    folder = path.parent if str(path.parent) else Path(".")
    try:
        is_dir = folder.is_dir()
    except OSError as e:
        raise CmhsaError(f"cannot check the output folder ({e.strerror})", path) from None
    if not is_dir:
        raise CmhsaError("output folder does not exist", path)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CmhsaError("output folder is not writable", path)


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _folders_up(folder: Folder) -> set[tuple[int, int]]:
    """(device, inode) of the held folder and of every folder above it, up to the root."""
    seen = {folder.identity}
    path = os.path.realpath(folder.path)
    while True:
        with contextlib.suppress(OSError):
            seen.add(_identity(os.stat(path)))
        parent = os.path.dirname(path)
        if parent == path:
            return seen
        path = parent


def check_apart(target: Target, reads: Sequence[str | Path]) -> None:
    """CmhsaError unless ``target`` is none of the files the command reads (same device and inode:
    a link or a second name of an input counts) and lies inside none of the folders it reads
    (``reads``: as the user gave them, links followed). A read that cannot be looked at is the
    reader's to refuse."""
    st = target.folder.lstat(target.name)
    above: set[tuple[int, int]] | None = None
    for item in reads:
        try:
            read = os.stat(item)
        except (OSError, ValueError):
            continue
        if stat.S_ISDIR(read.st_mode):
            above = _folders_up(target.folder) if above is None else above
            if _identity(read) in above:
                raise CmhsaError(
                    f"lies inside {item}, a folder this command reads; write it somewhere else", target.show()
                )
        elif st is not None and _identity(read) == _identity(st):
            same = os.path.abspath(item) == os.path.abspath(target.show())
            what = (
                "is an input of this command"
                if same
                else f"is the same file as {item}, an input of this command"
            )
            raise CmhsaError(
                f"{what}; cmhsa never replaces a file the command reads: choose another name", target.show()
            )


@contextlib.contextmanager
def held_outputs(*paths: str | Path, reads: Sequence[str | Path] = ()) -> Iterator[list[Target]]:
    """The outputs ``paths`` as targets, each folder opened once and held until the block ends: each
    path a file cmhsa may write (:func:`check_writable`), no two the same, none a file the command
    ``reads`` nor inside a folder it reads (:func:`check_apart`). Checked before anything is read or
    computed, so a bad output never costs the work."""
    targets_paths = [Path(p) for p in paths]
    for path in targets_paths:
        check_writable(path)
    with contextlib.ExitStack() as stack:
        held: dict[str, Folder] = {}
        targets: list[Target] = []
        for path in targets_paths:
            parent = os.path.dirname(os.path.abspath(path))
            if parent not in held:
                held[parent] = stack.enter_context(Folder.open(path.parent if str(path.parent) else "."))
            target = Target(held[parent], path.name)
            if any(t.name == target.name and t.folder.identity == target.folder.identity for t in targets):
                raise CmhsaError("is named twice as an output; choose another name for one", path)
            check_apart(target, reads)
            targets.append(target)
        yield targets
