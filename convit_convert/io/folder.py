"""The one way cmhsa touches files in an output folder: the folder held open, every create, replace,
rename, remove and stat by bare name relative to it, never through a path its contents can redirect.

A folder cmhsa did not make (a downloaded run, a shared export) may hold a symbolic link, a folder,
a hard link or another user's file where cmhsa's output belongs. The anchors are Python's tarfile
``data`` filter (PEP 706) and git's refusal to write through a link in its work tree:

- the folder the user names is opened once (:meth:`Folder.open`: links in the user's own path are
  the user's choice); a subfolder (a run's ``timm/``) is entered ``O_DIRECTORY | O_NOFOLLOW``
  (:meth:`Folder.enter`): a link named ``timm`` is refused, never followed;
- a name cmhsa writes, replaces or removes is absent or a regular file of this user's with one name
  (:meth:`Folder.check_replaceable`); anything else is refused in one line naming it, and
  :meth:`Folder.remove_all` checks every name before it removes the first;
- temp files are created ``O_CREAT | O_EXCL | O_NOFOLLOW`` in the held folder, and a writer opens
  one through the folder's descriptor (:meth:`Folder.writer_path`: ``/proc/self/fd/N/NAME`` where
  the system has it), so nothing renamed in the tree after the check can redirect the write;
- renames and removals pass the folder's descriptor (``dir_fd``).

Also the folders a command creates (:func:`make_folder`) and takes away again if it wrote nothing
(:func:`remove_made`). ``tests/test_architecture.py`` fails on a rename, removal or folder creation
anywhere else in the package.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO

from ..errors import CmhsaError
from .paths import kind_of

_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
# a listing of an output folder is bounded: more entries than this is not a folder cmhsa made
MAX_ENTRIES = 100_000
_TEMP_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # tempfile's alphabet, 8 of them
_PROC_FD = sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd")


def _own(st: os.stat_result) -> bool:
    return not hasattr(os, "geteuid") or st.st_uid == os.geteuid()


def bare(name: str) -> bool:
    """Whether ``name`` is one entry of a folder: no separator, not ``.`` or ``..``, no NUL."""
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\0" not in name
        and (os.altsep is None or os.altsep not in name)
        and len(os.fsencode(name)) <= 255
    )


def _bare(name: str) -> str:
    if not bare(name):
        raise CmhsaError(f"{name!r} is not a file name in the folder")
    return name


def refusal(st: os.stat_result, what: str = "file") -> str | None:
    """Why an entry of stat ``st`` may not be replaced or removed by cmhsa (None: it may): a link, a
    folder, a device, a FIFO, a hard link or another user's file."""
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link; cmhsa never writes or removes through a link"
    if not stat.S_ISREG(st.st_mode):
        return f"is {kind_of(st.st_mode)} where cmhsa's {what} belongs"
    if st.st_nlink > 1:
        return (
            f"is a hard link ({st.st_nlink} names for one file); cmhsa does not replace or remove "
            "a file that has other names"
        )
    if not _own(st):
        return "belongs to another user"
    return None


class Folder:
    """A folder held open (``fd``), shown as ``path``; every operation by bare name relative to it.
    Use as a context manager, or :meth:`close` it."""

    def __init__(self, fd: int, path: Path) -> None:
        self.fd, self.path = fd, path

    # opening -------------------------------------------------------------------------------------
    @classmethod
    def open(cls, path: str | Path) -> Folder:
        """The folder the user named (following links in that path: it is the user's)."""
        path = Path(path) if str(path) else Path(".")
        try:
            return cls(os.open(path, _DIR_FLAGS), path)
        except FileNotFoundError:
            raise CmhsaError("no such folder", path) from None
        except NotADirectoryError:
            raise CmhsaError("is not a folder", path) from None
        except OSError as e:
            raise CmhsaError(f"cannot open the folder ({e.strerror})", path) from None

    def enter(self, name: str, create: bool = False) -> Folder:
        """The subfolder ``name``, opened without following a link (a link is refused); made first
        when ``create`` and absent."""
        _bare(name)
        st = self.lstat(name)
        if st is None and create:
            try:
                os.mkdir(name, 0o777, dir_fd=self.fd)
            except FileExistsError:
                pass
            except OSError as e:
                raise CmhsaError(f"cannot create the folder ({e.strerror})", self.path / name) from None
            st = self.lstat(name)
        if st is None:
            raise CmhsaError("no such folder", self.path / name)
        if stat.S_ISLNK(st.st_mode):
            raise CmhsaError(
                "is a symbolic link where cmhsa's folder belongs; cmhsa never writes or removes through "
                "a link: remove it",
                self.path / name,
            )
        if not stat.S_ISDIR(st.st_mode):
            raise CmhsaError(f"is {kind_of(st.st_mode)} where cmhsa's folder belongs", self.path / name)
        if not _own(st):
            raise CmhsaError("is another user's folder", self.path / name)
        try:
            fd = os.open(name, _DIR_FLAGS | _NOFOLLOW, dir_fd=self.fd)
        except OSError as e:
            raise CmhsaError(f"cannot open the folder ({e.strerror})", self.path / name) from None
        return Folder(fd, self.path / name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> Folder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def identity(self) -> tuple[int, int]:
        """(device, inode): two Folders of one folder have the same."""
        st = os.fstat(self.fd)
        return st.st_dev, st.st_ino

    def show(self, name: str) -> Path:
        """The path to show a user for entry ``name``."""
        return self.path / name

    # looking -------------------------------------------------------------------------------------
    def lstat(self, name: str) -> os.stat_result | None:
        """The entry's own stat (a link's, not its target's), or None if absent."""
        try:
            return os.stat(_bare(name), dir_fd=self.fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise CmhsaError(f"cannot check ({e.strerror})", self.show(name)) from None

    def exists(self, name: str) -> bool:
        return self.lstat(name) is not None

    def names(self) -> list[str]:
        """The folder's entries (at most MAX_ENTRIES), sorted."""
        out: list[str] = []
        try:
            with os.scandir(self.fd) as it:
                for entry in it:
                    out.append(entry.name)
                    if len(out) > MAX_ENTRIES:
                        raise CmhsaError(f"holds more than {MAX_ENTRIES:,} entries", self.path)
        except OSError as e:
            raise CmhsaError(f"cannot list the folder ({e.strerror})", self.path) from None
        return sorted(out)

    def check_replaceable(self, name: str, what: str = "file") -> None:
        """CmhsaError naming the entry unless it is absent or a regular file of this user's with one
        name: what cmhsa may replace or remove."""
        st = self.lstat(name)
        why = None if st is None else refusal(st, what)
        if why is not None:
            raise CmhsaError(f"{why}: remove or rename it first", self.show(name))

    def read_bytes(self, name: str, max_bytes: int, what: str = "file") -> bytes:
        """A regular file's bytes, opened without following a link or blocking on a FIFO; at most
        ``max_bytes`` (more is a CmhsaError). OSError for a link (ELOOP) or an absent file."""
        fd = os.open(_bare(name), os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=self.fd)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CmhsaError(f"is {kind_of(st.st_mode)}, not a regular file", self.show(name))
            if st.st_size > max_bytes:
                raise CmhsaError(
                    f"is {st.st_size:,} bytes, more than a {what} holds ({max_bytes:,})", self.show(name)
                )
            data = os.read(fd, max_bytes + 1)
        finally:
            os.close(fd)
        if len(data) > max_bytes:
            raise CmhsaError(f"holds more than a {what} does ({max_bytes:,} bytes)", self.show(name))
        return data

    def open_read(self, name: str) -> BinaryIO:
        """A regular file opened for reading, never through a link, never blocking on a FIFO."""
        try:
            fd = os.open(_bare(name), os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=self.fd)
        except OSError as e:
            why = (
                "is a symbolic link; cmhsa never reads a run's files through a link"
                if e.errno == errno.ELOOP
                else f"cannot read ({e.strerror})"
            )
            raise CmhsaError(why, self.show(name)) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            raise CmhsaError(f"is {kind_of(st.st_mode)}, not a regular file", self.show(name))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")

    # writing -------------------------------------------------------------------------------------
    def open_lock(self, name: str) -> int:
        """``name`` opened read-write, created if absent, never through a link and never a file with
        other names (writing the holder's PID would change them) or of another user; its descriptor."""
        try:
            fd = os.open(_bare(name), os.O_RDWR | os.O_CREAT | _NOFOLLOW | _NONBLOCK, 0o644, dir_fd=self.fd)
        except OSError as e:
            why = "it is a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise CmhsaError(
                f"cannot open the run folder's lock {name} ({why}); remove it", self.path
            ) from None
        why = refusal(os.fstat(fd), "lock")
        if why is not None:
            os.close(fd)
            raise CmhsaError(f"the run folder's lock {name} {why}; remove it", self.path)
        return fd

    def open_append(self, name: str) -> BinaryIO:
        """``name`` opened for appending (a log), created if absent; never through a link, and never
        a file cmhsa may not replace (:func:`refusal`)."""
        try:
            fd = os.open(
                _bare(name),
                os.O_WRONLY | os.O_APPEND | os.O_CREAT | _NOFOLLOW | _NONBLOCK,
                0o644,
                dir_fd=self.fd,
            )
        except OSError as e:
            why = (
                "is a symbolic link; cmhsa never writes through a link"
                if e.errno == errno.ELOOP
                else e.strerror
            )
            raise CmhsaError(f"cannot open for appending ({why})", self.show(name)) from None
        why = refusal(os.fstat(fd))
        if why is not None:
            os.close(fd)
            raise CmhsaError(why, self.show(name))
        os.set_blocking(fd, True)
        return os.fdopen(fd, "ab")

    def make_temp(self, stem: str) -> str:
        """A new empty file ``STEM.XXXXXXXX.tmp`` (mode 0600) made in the folder, O_EXCL, never
        through a link; its name."""
        for _ in range(100):
            name = f"{stem}.{''.join(secrets.choice(_TEMP_CHARS) for _ in range(8))}.tmp"
            try:
                fd = os.open(
                    _bare(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd
                )
            except FileExistsError:
                continue
            except OSError as e:
                raise CmhsaError(
                    f"cannot create a file in the output folder ({e.strerror})", self.path
                ) from None
            os.close(fd)
            return name
        raise CmhsaError("cannot create a temp file in the output folder (every name taken)", self.path)

    def write_new(self, name: str, data: bytes) -> None:
        """Create ``name`` (which must not exist) holding ``data``."""
        fd = os.open(_bare(name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o600, dir_fd=self.fd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)

    def set_mode(self, name: str, mode: int) -> None:
        """chmod of a regular file, never through a link."""
        fd = os.open(_bare(name), os.O_RDONLY | _NOFOLLOW | _NONBLOCK, dir_fd=self.fd)
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def writer_path(self, name: str) -> Path:
        """The path a library's writer (torch.save, safetensors, matplotlib) opens for ``name``: through
        the held folder's descriptor where the system has /proc/self/fd, so a link planted in the tree
        after the folder was opened cannot redirect it; else the folder's path."""
        _bare(name)
        if _PROC_FD:
            return Path(f"/proc/self/fd/{self.fd}") / name
        return self.path / name

    def rename_onto(self, src: str, dst: str) -> None:
        """Rename ``src`` onto ``dst`` within the folder."""
        os.replace(_bare(src), _bare(dst), src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def discard(self, name: str) -> bool:
        """Remove the entry ``name`` (a file, or a link itself); whether it was there."""
        try:
            os.unlink(_bare(name), dir_fd=self.fd)
        except FileNotFoundError:
            return False
        return True

    def check_all(self, names: Iterable[str]) -> None:
        """Check each of cmhsa's names (bare, or ``SUB/NAME`` for a file in a subfolder) as
        :meth:`remove_all` does before it removes anything: what cmhsa may replace or remove, its
        subfolder a real one entered without following a link (an absent one holds nothing)."""
        subs: dict[str, Folder | None] = {}
        try:
            self._check(list(names), subs)
        finally:
            _close(subs)

    def lstat_below(self, name: str) -> os.stat_result | None:
        """The entry's own stat, ``SUB/NAME`` entering SUB without following a link; None if absent."""
        subs: dict[str, Folder | None] = {}
        try:
            folder, leaf = self._locate(name, subs)
            return None if folder is None else folder.lstat(leaf)
        finally:
            _close(subs)

    def remove_all(self, names: Iterable[str]) -> list[str]:
        """Remove cmhsa's files ``names`` (bare, or ``SUB/NAME`` for a file in a subfolder), each
        checked (:meth:`check_all`) before the first is removed; an emptied subfolder goes too. The
        names removed."""
        names = list(dict.fromkeys(names))
        subs: dict[str, Folder | None] = {}
        try:
            self._check(names, subs)
            removed = []
            for name in names:
                folder, leaf = self._locate(name, subs)
                if folder is None:
                    continue
                try:
                    if folder.discard(leaf):
                        removed.append(name)
                except OSError as e:
                    raise CmhsaError(f"cannot remove ({e.strerror})", folder.show(leaf)) from None
            for sub, folder in subs.items():
                if folder is not None:
                    with contextlib.suppress(OSError):  # not empty: kept
                        os.rmdir(sub, dir_fd=self.fd)
            return removed
        finally:
            _close(subs)

    def _check(self, names: list[str], subs: dict[str, Folder | None]) -> None:
        for name in names:
            folder, leaf = self._locate(name, subs)
            if folder is not None:
                folder.check_replaceable(leaf)

    def _locate(self, name: str, subs: dict[str, Folder | None]) -> tuple[Folder | None, str]:
        """The held folder and bare name ``name`` (``SUB/NAME``: one level down) lies in; None for
        the folder when SUB is absent."""
        parts = name.split("/")
        if len(parts) == 1:
            return self, _bare(name)
        if len(parts) != 2:
            raise CmhsaError(f"{name!r} is not a file name in the folder", self.path)
        sub, leaf = _bare(parts[0]), _bare(parts[1])
        if sub not in subs:
            subs[sub] = self.enter(sub) if self.exists(sub) else None
        return subs[sub], leaf


def _close(subs: dict[str, Folder | None]) -> None:
    for folder in subs.values():
        if folder is not None:
            folder.close()


def missing_folders(path: Path) -> list[Path]:
    """``path`` and those of its parents that do not exist, deepest first."""
    missing = []
    p = Path(os.path.abspath(path))
    while not os.path.lexists(p) and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing


def make_folder(path: Path, what: str = "folder") -> list[Path]:
    """Create the folder ``path`` and any missing parents (the path the user gave); the folders
    created, deepest first, for :func:`remove_made` to take away again if the command that asked
    writes nothing."""
    missing = missing_folders(path)
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        remove_made(missing)
        raise CmhsaError(f"cannot create the {what} ({e.strerror})", path) from None
    return missing


def remove_made(created: list[Path], keep: tuple[str, ...] = ()) -> None:
    """Remove the folders :func:`make_folder` created, deepest first, as long as each holds nothing
    but files named in ``keep`` (removed with it, by name in the held folder): a refused command
    leaves no folder behind."""
    with contextlib.suppress(OSError, CmhsaError):
        for path in created:
            with Folder.open(path) as folder:
                for name in keep:
                    st = folder.lstat(name)
                    if st is not None and refusal(st) is None:
                        folder.discard(name)
            os.rmdir(path)  # OSError (not empty): stop here, keeping it and its parents
