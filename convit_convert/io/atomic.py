"""Write-then-rename, so a failed or interrupted write never leaves a partial file behind.

The temp file sits beside the target as ``.NAME.PID.XXXXXXXX.tmp``. It is removed when the write
fails, when Python unwinds (Ctrl-C, and SIGTERM once ``cli.boundary.exit_on_sigterm`` is installed, as the
CLI does), and, after a kill -9 that no handler sees, by the next write to the same target: a temp
of that target whose process no longer exists is stale.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import CmhsaError, first_line
from .paths import check_output_target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def check_writable(path: Path) -> None:
    """Fail early, before any expensive work, if ``path`` cannot be written: it names a file that is
    absent or regular (never a folder, link, device or FIFO), in a writable folder."""
    check_output_target(path)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
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


def remove_stale_temps(path: Path) -> list[Path]:
    """Delete temp files of ``path`` left by writers that no longer run (killed with -9)."""
    removed = []
    prefix = f".{path.name}."
    for name in glob.glob(glob.escape(str(path.parent / prefix)) + "*.tmp"):
        pid = Path(name).name[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
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
def atomic_paths(*paths: str | Path) -> Iterator[list[Path]]:
    """Yield a temp path in each target's folder; only if the block succeeds, rename them all onto
    their targets. A failed write (any error, a full disk included) keeps every previous file and
    leaves no temp file: outputs that belong together (model + report, checkpoint + metrics row)
    are written together or not at all."""
    targets = [Path(p) for p in paths]
    tmps: list[Path] = []
    try:
        for path in targets:
            check_writable(path)
            remove_stale_temps(path)
            try:
                fd, tmp = tempfile.mkstemp(
                    dir=path.parent, prefix=f".{path.name}.{os.getpid()}.", suffix=".tmp"
                )
            except OSError as e:
                raise CmhsaError(f"cannot create a file in the output folder ({e.strerror})", path) from None
            os.close(fd)
            tmps.append(Path(tmp))
        try:
            yield list(tmps)
            for tmp in tmps:
                os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give what open() would have given
            for tmp, path in zip(tmps, targets, strict=True):
                os.replace(tmp, path)
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
