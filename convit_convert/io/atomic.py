"""Write-then-rename, so a failed or interrupted write never leaves a partial file behind, and
outputs that belong together are replaced together.

Each target gets a temp file beside it (``.NAME.PID.XXXXXXXX.tmp``; a long NAME is replaced by its
hash, so any name the file system allows can be written). A single output is committed by one
``os.replace``. Several outputs (model + report, checkpoint + metrics + config) are committed by a
journal (``io/journal.py``: ``.cmhsa-commit.PID.json``, naming each temp and its target by bare
name) in each folder the outputs lie in: the journals are renamed into place (the commit point),
the temps renamed onto their targets, and the journals removed. SIGINT and SIGTERM are held back
from the first journal's rename to the last removal, so a signal never splits a commit; a kill -9
there leaves the journals, and the next cmhsa command that *writes* into that folder completes the
renames (:func:`recover`, rolling forward). A reader never renames: it refuses a file a pending
commit names (``journal.check_settled``). A journal that cmhsa did not begin in that folder
(``journal.scan``'s rules: this user's, bare names, the writer's own temp names, its process gone)
is never acted on. Before the commit point nothing of the previous files has changed; outputs in
two folders are committed folder by folder, so a kill -9 between the two commit points (one
rename apart) leaves the first folder's outputs new and the second's as they were.

Temp files are removed when the write fails, when Python unwinds (Ctrl-C, and SIGTERM once
``cli.boundary.exit_on_sigterm`` is installed, as the CLI does), and, after a kill -9 that no
handler sees, by the next write to the same target: a temp of this user's whose process no longer
exists, and that no journal names, is stale.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from ..errors import CmhsaError, first_line
from ..notices import notice
from ..text import json_text
from .folder import Folder
from .journal import JOURNAL_PREFIX, Scan, alive, name_max, scan, temp_pid, temp_stem
from .outputs import Target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def recover(folder: Folder, found: Scan | None = None) -> list[str]:
    """Complete the commits that a killed writer left pending in ``folder`` (``journal.scan``: only
    those cmhsa began there; ``found``: that scan, when the caller has it): each temp still there
    is renamed onto its target, then the journal is removed, and one note names the files replaced
    (a journal that passes every check may still be one cmhsa did not write). Returns the targets
    written. Only a command that writes into ``folder`` calls this; an error (no write permission)
    leaves the journal for the next writer."""
    done: list[str] = []
    for journal in (found or scan(folder)).pending:
        replaced = []
        try:
            for tmp, target in journal.pairs:
                if folder.exists(tmp):
                    folder.rename_onto(tmp, target)
                    replaced.append(target)
            folder.discard(journal.name)
        except (OSError, CmhsaError):
            continue
        finally:
            if replaced:
                notice(
                    f"{folder.path}: finished the commit process {journal.pid} began and did not end "
                    f"({journal.name}): replaced {', '.join(replaced)}"
                )
        done += replaced
    return done


def remove_stale_temps(folder: Folder, target: str) -> list[str]:
    """Delete temp files of ``target`` left by this user's writers that no longer run (killed with
    -9), after completing any commit such a writer had begun (:func:`recover`). A temp any journal
    names is kept: a foreign journal's commit is not ours to finish, nor to undo."""
    found = scan(folder)  # one look at the journals serves both (a finished commit's temps are gone)
    recover(folder, found)
    longest = name_max(folder)
    prefix = f"{temp_stem(target, longest)}."
    removed = []
    try:
        with os.scandir(folder.fd) as entries:
            names = [e.name for e in entries if e.name.startswith(prefix) and e.name.endswith(".tmp")]
    except OSError:
        return removed
    for name in names:
        pid = temp_pid(name, target, longest)
        if pid is None or name in found.named_temps or pid == os.getpid() or alive(pid):
            continue
        with contextlib.suppress(OSError, CmhsaError):
            folder.check_replaceable(name)  # this user's, one name, not a link
            folder.discard(name)
            removed.append(name)
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


def _commit(tmps: list[str], targets: Sequence[Target]) -> None:
    """Rename every temp onto its target, all or (after a kill -9, until :func:`recover`) none, per
    folder (the module docstring)."""
    with signals_held():
        if len(targets) == 1:
            folder, name = targets[0]
            folder.rename_onto(tmps[0], name)
            return
        by_folder: dict[tuple[int, int], tuple[Folder, list[list[str]]]] = {}
        for tmp, (folder, name) in zip(tmps, targets, strict=True):
            by_folder.setdefault(folder.identity, (folder, []))[1].append([tmp, name])
        journals: list[tuple[Folder, str, str]] = []
        try:
            for folder, pairs in by_folder.values():
                journal = f"{JOURNAL_PREFIX}{os.getpid()}.json"
                staged = journal + ".part"
                folder.discard(staged)  # a staged journal of a killed process of this PID
                folder.write_new(staged, json_text({"pairs": pairs}, indent=None).encode())
                journals.append((folder, staged, journal))
            for folder, staged, journal in journals:
                folder.rename_onto(staged, journal)  # the commit point (of this folder's outputs)
        finally:
            for folder, staged, _ in journals:
                folder.discard(staged)
        for folder, pairs in by_folder.values():
            for tmp, name in pairs:
                folder.rename_onto(tmp, name)
        for folder, _, journal in journals:
            folder.discard(journal)


@contextlib.contextmanager
def atomic_names(*targets: Target) -> Iterator[list[Path]]:
    """Yield, for each (held folder, bare name), a temp file's path in that folder (a writer opens it
    through the folder's descriptor: ``Folder.writer_path``); only if the block succeeds, commit them
    all onto their targets (the module docstring: a journal, signals held). Each target is checked
    first (``Folder.check_replaceable``: never a link, folder, hard link or another user's file). A
    failed write (any error, a full disk included) keeps every previous file and leaves no temp
    file: outputs that belong together are written together or not at all."""
    for folder, name in targets:  # every target checked before any temp is made
        folder.check_replaceable(name)
    made: list[tuple[Folder, str]] = []
    try:
        for folder, name in targets:
            remove_stale_temps(folder, name)
            stem = f"{temp_stem(name, name_max(folder))}.{os.getpid()}"
            made.append((folder, folder.make_temp(stem)))
        try:
            yield [folder.writer_path(tmp) for folder, tmp in made]
            for folder, tmp in made:
                folder.set_mode(tmp, 0o666 & ~_umask())  # made 0600; give what open() would have given
            _commit([tmp for _, tmp in made], targets)
        except (OSError, RuntimeError) as e:
            why = write_error(e)
            if why is None:
                raise
            first, *rest = (folder.show(name) for folder, name in targets)
            others = "".join(f" (nor {p.name})" for p in rest)
            raise CmhsaError(f"cannot write ({why}){others}; any previous file is kept", first) from None
    finally:
        for folder, tmp in made:
            with contextlib.suppress(OSError):
                folder.discard(tmp)


def atomic_text(*outputs: tuple[Target, str]) -> None:
    """Write each (target, text) as UTF-8, all together or none (:func:`atomic_names`)."""
    with atomic_names(*(target for target, _ in outputs)) as tmps:
        for i, (_, text) in enumerate(outputs):
            tmps[i].write_text(text, encoding="utf-8")
