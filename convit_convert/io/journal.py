"""The commit journal read as untrusted input: which unfinished commits a folder holds, and which
of its files are cmhsa's temp files. Nothing here renames or removes a file (``atomic.py`` writes
journals and rolls them forward; readers only ask).

A journal ``.cmhsa-commit.PID.json`` lists, by bare name in its own folder, each temp file that
process PID wrote and the target it becomes: ``{"pairs": [[".vit.safetensors.PID.XXXXXXXX.tmp",
"vit.safetensors"], ...]}``. Its rename into place is a commit's point of no return; a journal
whose writer no longer runs is a commit a kill -9 (or a power cut) left *pending*.

A downloaded or shared folder may hold a file of that name that cmhsa never wrote, so a journal is
pending only if every one of these holds (else it is *foreign*: never acted on, said once):

- its name is ``.cmhsa-commit.PID.json`` with PID a process number this platform can have (0 <
  PID < pid_max), and that process is not running;
- it is a regular file of this user's with one name (not a link, FIFO, device or hard link: read
  through the held folder with O_NOFOLLOW and O_NONBLOCK), of at most MAX_JOURNAL_BYTES, JSON
  nested at most MAX_JOURNAL_DEPTH deep;
- it holds 1 to MAX_PAIRS pairs of bare names (no separator, no ``..``, no NUL);
- each temp is the name cmhsa's writer gives its target's temp file in process PID
  (:func:`temp_stem`, the PID, 8 random characters, ``.tmp``); each temp and target is absent or a
  regular file of this user's with one name (``folder.refusal``), and no target is itself a temp
  or journal name.

The folder is read through ``io/folder.py``'s held :class:`Folder`, by bare name.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import CmhsaError
from ..notices import notice
from .folder import Folder, bare, refusal
from .paths import parse_json

JOURNAL_PREFIX = ".cmhsa-commit."
JOURNAL_RE = re.compile(r"\.cmhsa-commit\.(\d{1,20})\.json")
# cmhsa's writers commit at most 5 files together (a checkpoint with its metrics, config and the
# list of a replaced run's files); a journal of 16 pairs of 255-byte names is under 9 KB
MAX_PAIRS = 16
MAX_JOURNAL_BYTES = 16 * 2**10
MAX_JOURNAL_DEPTH = 3
MAX_JOURNALS = 64  # journals looked at in one folder; more is not a folder a cmhsa writer made
# a temp name adds at most this many bytes to the target's name (".", ".PID", ".XXXXXXXX.tmp")
TEMP_EXTRA = 1 + 1 + 10 + 1 + 8 + 4
_MKSTEMP_CHARS = "[a-z0-9_]{8}"  # tempfile's _RandomNameSequence: 8 of a-z, 0-9, _


@functools.lru_cache(maxsize=1)
def pid_limit() -> int:
    """The largest process number this platform gives (Linux: /proc/sys/kernel/pid_max)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/sys/kernel/pid_max", "rb") as f:
        return int(f.read(32))
    return 2**22 if sys.platform.startswith("linux") else 2**31 - 1


def possible_pid(pid: int) -> bool:
    """Whether a process can have number ``pid``: 0 < pid < pid_max (pid_max itself is never given)."""
    return 0 < pid < pid_limit()


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (someone else's counts). A number no process can have is dead."""
    if not possible_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except (OverflowError, ValueError, OSError):
        return False
    return True


def name_max(folder: Folder) -> int:
    """The longest file name ``folder`` holds."""
    try:
        return os.fpathconf(folder.fd, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def temp_stem(target: str, longest: int = 255) -> str:
    """The part of ``target``'s temp names before the PID: ``.NAME``, or ``.cmhsa-HASH`` where NAME
    is too long for a folder holding names of ``longest`` bytes to hold NAME plus the temp suffix."""
    if len(os.fsencode(target)) + TEMP_EXTRA <= longest:
        return f".{target}"
    return ".cmhsa-" + hashlib.sha256(os.fsencode(target)).hexdigest()[:20]


def temp_pid(name: str, target: str, longest: int = 255) -> int | None:
    """The writer's PID in ``name`` if it is one of ``target``'s temp files, else None."""
    stem = re.escape(temp_stem(target, longest))
    m = re.fullmatch(stem + rf"\.(\d{{1,20}})\.{_MKSTEMP_CHARS}\.tmp", name)
    return None if m is None else int(m.group(1))


@dataclass(frozen=True)
class Journal:
    """A pending commit: ``path`` (the journal), its writer's ``pid``, and its (temp, target) names."""

    path: Path
    pid: int
    pairs: tuple[tuple[str, str], ...]
    name: str = ""  # the journal's bare name in its folder

    @property
    def folder(self) -> Path:
        return self.path.parent

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(target for _, target in self.pairs)


@dataclass(frozen=True)
class Scan:
    """What a folder's journals are: ``pending`` commits (their writers gone) and the names of
    ``foreign`` files with a journal's name (never acted on), with why."""

    pending: tuple[Journal, ...]
    foreign: tuple[tuple[str, str], ...]
    named_temps: frozenset[str]  # temp names any journal there lists (never removed as stale)


def _read(folder: Folder, name: str) -> str:
    """The journal's text, if it is a regular file of this user's with one name and at most
    MAX_JOURNAL_BYTES (opened without following a link and without blocking on a FIFO); else
    ValueError(why)."""
    try:
        st = folder.lstat(name)
        why = "absent" if st is None else refusal(st, "journal")
        if why is not None:
            raise ValueError(why)
        data = folder.read_bytes(name, MAX_JOURNAL_BYTES, "journal")
    except CmhsaError as e:
        raise ValueError(e.message) from None
    except OSError as e:
        raise ValueError(
            "a symbolic link" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
        ) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None


def _pairs(doc: object) -> tuple[tuple[str, str], ...]:
    pairs = doc.get("pairs") if isinstance(doc, dict) else None
    if not isinstance(pairs, list) or not 1 <= len(pairs) <= MAX_PAIRS:
        raise ValueError(f"not a list of 1 to {MAX_PAIRS} pairs")
    out = []
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2 and all(bare(n) for n in pair)):
            raise ValueError("names a path that is not a bare file name in its folder")
        out.append((pair[0], pair[1]))
    return tuple(out)


def _check_pair(folder: Folder, pid: int, tmp: str, target: str) -> None:
    if target.startswith(JOURNAL_PREFIX) or target.endswith(".tmp"):
        raise ValueError("names a temp or journal file as a target")
    if temp_pid(tmp, target, name_max(folder)) != pid:
        raise ValueError("names a file that is not the writer's temp file of its target")
    for name, what in ((tmp, "temp file"), (target, "target")):
        try:
            st = folder.lstat(name)
        except CmhsaError as e:
            raise ValueError(f"its {what} cannot be checked ({e.message})") from None
        why = None if st is None else refusal(st, what)
        if why is not None:
            raise ValueError(f"its {what} {name} {why}")


def _read_pairs(folder: Folder, name: str) -> tuple[tuple[str, str], ...]:
    """The (temp, target) names a journal file lists, read bounded; ValueError(why) if it is not one."""
    try:
        doc = parse_json(_read(folder, name), folder.show(name), "journal", max_depth=MAX_JOURNAL_DEPTH)
    except CmhsaError as e:
        raise ValueError(e.message) from None
    return _pairs(doc)


def _journal(folder: Folder, name: str, pid: int) -> Journal:
    """``name`` read and checked as a pending journal of process ``pid``; ValueError(why) if not."""
    pairs = _read_pairs(folder, name)
    for tmp, target in pairs:
        _check_pair(folder, pid, tmp, target)
    return Journal(folder.show(name), pid, pairs, name)


def _named_temps(folder: Folder, name: str) -> list[str]:
    """The temp names a journal that is not pending lists: a live writer's temps, or a foreign
    journal's, are never taken for stale ones."""
    try:
        return [tmp for tmp, _ in _read_pairs(folder, name)]
    except ValueError:
        return []


def scan(where: Folder | Path) -> Scan:
    """The journals in a folder (held, or a path a reader opens): pending ones (checked as the module
    docstring says) and foreign ones, each foreign one said once (:func:`notices.notice`). Reads at
    most MAX_JOURNALS files, each at most MAX_JOURNAL_BYTES; never blocks, renames or removes."""
    if not isinstance(where, Folder):
        try:
            folder = Folder.open(where)
        except CmhsaError:
            return Scan((), (), frozenset())
        with folder:
            return scan(folder)
    folder = where
    pending: list[Journal] = []
    foreign: list[tuple[str, str]] = []
    named: set[str] = set()
    try:
        with os.scandir(folder.fd) as it:
            names = []
            for entry in it:
                if entry.name.startswith(JOURNAL_PREFIX) and entry.name.endswith(".json"):
                    names.append(entry.name)
                    if len(names) > MAX_JOURNALS:
                        break
    except OSError:
        return Scan((), (), frozenset())
    for i, name in enumerate(sorted(names)):
        m = JOURNAL_RE.fullmatch(name)
        if i >= MAX_JOURNALS:
            foreign.append((name, f"more than {MAX_JOURNALS} journals in one folder"))
            continue
        if m is None or not possible_pid(int(m.group(1))):
            foreign.append((name, "not a process number this system gives"))
            continue
        pid = int(m.group(1))
        if pid == os.getpid() or alive(pid):  # a commit in progress: its writer finishes it
            named.update(_named_temps(folder, name))
            continue
        try:
            journal = _journal(folder, name, pid)
        except ValueError as e:
            foreign.append((name, str(e)))
            named.update(_named_temps(folder, name))
            continue
        pending.append(journal)
        named.update(tmp for tmp, _ in journal.pairs)
    for name, why in foreign:
        notice(
            f"{folder.path}: ignoring {name}, which is not a commit cmhsa began here ({why}); "
            "nothing was renamed"
        )
    return Scan(tuple(pending), tuple(foreign), frozenset(named))


def finish_hint(journal: Journal) -> str:
    """Which command finishes ``journal``'s commit (any command writing into its folder does)."""
    folder = journal.folder
    if "checkpoint-last.pt" in journal.targets:
        return f"`cmhsa train phase1|phase2 --resume -o {folder}` finishes it"
    return f"running again the cmhsa command that wrote it into {folder} finishes it"


def check_settled(path: Path) -> None:
    """CmhsaError if ``path`` is the target of a commit a killed cmhsa left pending: a reader never
    renames, and reads no half-committed set of files; the error says which command finishes it."""
    path = Path(path)
    for journal in scan(path.parent).pending:
        if path.name in journal.targets:
            raise CmhsaError(
                f"a cmhsa write of this file was cut short (process {journal.pid} was killed after its "
                f"commit point; {journal.path.name} holds the rest); {finish_hint(journal)}",
                path,
            )
