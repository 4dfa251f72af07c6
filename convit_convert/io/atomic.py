"""Write-then-rename, so a failed or interrupted write never leaves a partial file behind, and
outputs that belong together are replaced together.

Each target gets a temp file beside it (``.NAME.PID.XXXXXXXX.tmp``; a long NAME is replaced by its
hash, so any name the file system allows can be written). A single output is committed by one
``os.replace``. Several outputs (model + report, checkpoint + metrics + config) are committed by a
journal: ``.cmhsa-commit.PID.json`` in the first target's folder, naming every temp and its target,
is renamed into place (the commit point), the temps are renamed onto their targets, and the
journal is removed. SIGINT and SIGTERM are held back from the journal's rename to its removal, so a
signal never splits a pair; a kill -9 there leaves the journal, and the next write to any of the
targets, or :func:`recover` called by a reader, completes the renames it names (rolls forward).
Before the commit point nothing of the previous files has changed.

Temp files are removed when the write fails, when Python unwinds (Ctrl-C, and SIGTERM once
``cli.boundary.exit_on_sigterm`` is installed, as the CLI does), and, after a kill -9 that no
handler sees, by the next write to the same target: a temp whose process no longer exists, and
that no journal names, is stale.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import json
import os
import re
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CmhsaError, first_line
from .paths import check_output_target

JOURNAL_PREFIX = ".cmhsa-commit."
# a temp name adds at most this many bytes to the target's name (".", ".PID", ".XXXXXXXX.tmp")
_TEMP_EXTRA = 1 + 1 + 10 + 1 + 8 + 4


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _name_max(folder: Path) -> int:
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def temp_stem(path: Path) -> str:
    """The part of ``path``'s temp names before the PID: ``.NAME``, or ``.cmhsa-HASH`` where NAME
    is too long for the folder to hold NAME plus the temp suffix."""
    folder = path.parent if str(path.parent) else Path(".")
    if len(os.fsencode(path.name)) + _TEMP_EXTRA <= _name_max(folder):
        return f".{path.name}"
    return ".cmhsa-" + hashlib.sha256(os.fsencode(path.name)).hexdigest()[:20]


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _dead_writer(name: str, prefix: str) -> bool:
    pid = name[len(prefix) :].split(".", 1)[0]
    return pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))


def recover(folder: Path) -> list[Path]:
    """Complete the commits that a killed writer left in ``folder``: every journal whose process no
    longer runs has the renames it names done (those whose temp is still there); the journal is then
    removed. Returns the targets written. Errors are ignored: a reader without write permission
    leaves the journal for a writer."""
    done: list[Path] = []
    for name in glob.glob(glob.escape(str(folder / JOURNAL_PREFIX)) + "*.json"):
        if not _dead_writer(Path(name).name, JOURNAL_PREFIX):
            continue
        try:
            with open(name, encoding="utf-8") as f:
                pairs = json.load(f)
            for tmp, target in pairs:
                if os.path.lexists(tmp):
                    os.replace(tmp, target)
                    done.append(Path(target))
            os.unlink(name)
        except (OSError, ValueError, TypeError):
            continue
    return done


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files of ``path`` left by writers that no longer run (killed with -9), after
    completing any commit such a writer had begun (:func:`recover`)."""
    recover(path.parent)
    removed = []
    prefix = f"{temp_stem(path)}."
    for name in glob.glob(glob.escape(str(path.parent / prefix)) + "*.tmp"):
        if _dead_writer(Path(name).name, prefix):
            with contextlib.suppress(OSError):
                os.unlink(name)
                removed.append(Path(name))
    return removed


def write_error(e: BaseException) -> str | None:
    """Why a write failed, when `e` is a failed write: an OSError, or a library's RuntimeError about
    writing. torch.save raises "PytorchStreamWriter failed writing file ..." when a write call
    fails, and "unexpected pos N vs M" when one wrote short (a full disk or a file-size limit,
    seen under RLIMIT_FSIZE)."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    if isinstance(e, RuntimeError) and re.search(r"(?i)writ|no space|file|unexpected pos", str(e)):
        first = first_line(e, limit=10_000) or "write failed"
        first = re.sub(r"^\[enforce fail at [^\]]*\]\s*\.?\s*", "", first)[:200]  # c10's location prefix
        if first.startswith("unexpected pos"):
            return f"the write stopped short: disk full or a file-size limit? torch: {first}"
        return first
    return None


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM held back while the block runs, then delivered to the handlers they were
    meant for: a commit is never split. (Python-level, not a signal mask: torch's threads would
    take a masked signal, and Python runs every handler in the main thread anyway.)"""
    if threading.current_thread() is not threading.main_thread():
        yield  # handlers run in the main thread only: a signal cannot interrupt this one
        return
    came: list[int] = []
    old = {
        s: signal.signal(s, lambda signum, frame: came.append(signum))
        for s in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        yield
    finally:
        for s, handler in old.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)  # None: set outside Python
        for s in dict.fromkeys(came):  # each once, in the order they came
            signal.raise_signal(s)


def _commit(tmps: list[Path], targets: list[Path]) -> None:
    """Rename every temp onto its target, all or (after a kill -9, until :func:`recover`) none."""
    with signals_held():
        if len(targets) == 1:
            os.replace(tmps[0], targets[0])
            return
        pairs = [[os.path.abspath(t), os.path.abspath(p)] for t, p in zip(tmps, targets, strict=True)]
        folder = targets[0].parent if str(targets[0].parent) else Path(".")
        journal = folder / f"{JOURNAL_PREFIX}{os.getpid()}.json"
        staged = folder / f"{JOURNAL_PREFIX}{os.getpid()}.json.part"
        try:
            staged.write_text(json.dumps(pairs), encoding="utf-8")
            os.replace(staged, journal)  # the commit point
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
        for tmp, target in pairs:
            os.replace(tmp, target)
        os.unlink(journal)


@contextlib.contextmanager
def atomic_paths(*paths: str | Path) -> Iterator[list[Path]]:
    """Yield a temp path in each target's folder; only if the block succeeds, commit them all onto
    their targets (the module docstring: a journal, signals held). A failed write (any error, a
    full disk included) keeps every previous file and leaves no temp file: outputs that belong
    together (model + report, checkpoint + metrics row) are written together or not at all."""
    targets = [Path(p) for p in paths]
    tmps: list[Path] = []
    try:
        for path in targets:
            check_writable(path)
            remove_stale_temps(path)
            try:
                fd, tmp = tempfile.mkstemp(
                    dir=path.parent or Path("."), prefix=f"{temp_stem(path)}.{os.getpid()}.", suffix=".tmp"
                )
            except OSError as e:
                raise CmhsaError(f"cannot create a file in the output folder ({e.strerror})", path) from None
            os.close(fd)
            tmps.append(Path(tmp))
        try:
            yield list(tmps)
            for tmp in tmps:
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would have given
            _commit(tmps, targets)
        except (OSError, RuntimeError) as e:
            why = write_error(e)
            if why is None:
                raise
            others = "".join(f" (nor {p.name})" for p in targets[1:])
            raise CmhsaError(f"cannot write ({why}){others}; any previous file is kept", targets[0]) from None
    finally:
        for tmp in tmps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temp path in ``path``'s folder; rename it onto ``path`` only if the block succeeds."""
    with atomic_paths(path) as tmps:
        yield tmps[0]


def atomic_write(path: str | Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, then move the result onto ``path``."""
    with atomic_path(path) as tmp:
        write(tmp)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
