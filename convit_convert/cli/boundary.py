"""The CLI's one error boundary: every command, and the parsing of its flags, runs inside it.

Exit codes: 0 success; 1 a check that failed (``CheckFailed``, a failed verification or export);
2 bad input (``CmhsaError``, a bad flag, a file that cannot be read or written, an allocation too
large); 3 an internal error (a bug: one line asking for a report); 130 / 143 interrupted by SIGINT
/ SIGTERM, whatever the interruption made fail. A traceback, and the warnings libraries raised, are
shown only with ``cmhsa --debug ...`` or ``CMHSA_DEBUG=1``.
"""

from __future__ import annotations

import contextlib
import errno
import gc
import io
import logging
import os
import re
import signal
import sys
import traceback
import warnings
from collections.abc import Iterator
from typing import Any

from typer.core import TyperGroup

from .. import notices, signals
from ..errors import CheckFailed, CmhsaError, first_line, one_line
from ..resources import SIZED_BY
from ..text import lines_safe
from .common import EXIT_BAD_INPUT, EXIT_FAIL, as_flags, terminal_safe

EXIT_INTERNAL = 3
_DEBUG = {"on": False}


def set_debug(on: bool) -> None:
    _DEBUG["on"] = on
    if on:  # libraries' log records too (library_logs_quiet)
        logging.disable(logging.NOTSET)


def debug_enabled() -> bool:
    return _DEBUG["on"] or os.environ.get("CMHSA_DEBUG", "") not in ("", "0")


def _say(message: str) -> None:
    print(f"error: {terminal_safe(one_line(message))}", file=sys.stderr)


def _allocation_failure(e: BaseException) -> str | None:
    """A failed allocation, said as what was too large; None when `e` is not one."""
    text = str(e)
    if not isinstance(e, MemoryError) and not (
        isinstance(e, RuntimeError)
        and re.search(r"out of memory|can't allocate memory|not enough memory|Allocation on device", text)
    ):
        return None
    size = re.search(
        r"allocate (?:memory: you tried to allocate )?(\d+) bytes|allocate ([\d.]+ [KMGT]iB)", text
    )
    if size and size.group(1):
        what = f"an allocation of {int(size.group(1)) / 2**30:.1f} GiB failed"
    elif size:
        what = f"an allocation of {size.group(2)} failed"
    else:
        what = "an allocation failed"
    sized_by = getattr(e, SIZED_BY, None)
    if isinstance(sized_by, str):  # what the library said the memory was for (resources.sized_by)
        return as_flags(f"out of memory {sized_by}: {what}")
    return f"out of memory: {what}; reduce the sizes given (image size, batch, heads, qk-dim, depth)"


_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum: int, frame: object) -> None:
    """Unwind like Ctrl-C (exit 130 or 143), so every pending write removes its temp file."""
    signals.note(signum)
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


def exit_on_sigterm() -> None:
    """SIGINT and SIGTERM unwind the program (training traps them first, to save and stop); each one
    is also recorded, so the exit code says it came even where its exception was swallowed."""
    for s in _SIGNALS:
        signal.signal(s, _interrupt)

    def quiet(u: Any) -> None:  # an exception in a finaliser after a signal: the exit code tells it
        interrupted = isinstance(u.exc_value, KeyboardInterrupt | SystemExit) or signals.first() is not None
        if not interrupted or debug_enabled():
            sys.__unraisablehook__(u)

    sys.unraisablehook = quiet


def exit_status(code: object) -> int:
    """The process's exit code, once the command is over. From here SIGINT and SIGTERM are only
    recorded, never raised; the finalisers run (loader workers are joined); then a signal that came
    during the command or meanwhile is the exit code, 128 + its number. (The caller then exits at
    once: the interpreter's own teardown would restore the default handlers and could die of a
    signal, with no exit code of ours.)"""
    for s in _SIGNALS:
        signal.signal(s, lambda signum, frame: signals.note(signum))
    gc.collect()
    came = signals.first()
    if came is not None:
        return 128 + came
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


def report(e: BaseException) -> int:
    """Print `e` as one line on stderr; its exit code."""
    if isinstance(e, KeyboardInterrupt):
        return 130
    # whatever a signal caused (a worker it ended, a read cut short) is the interruption
    came = signals.first()
    if came is not None:
        return 128 + came
    if isinstance(e, CmhsaError):
        _say(as_flags(str(e)))
        return EXIT_FAIL if isinstance(e, CheckFailed) else EXIT_BAD_INPUT
    if hasattr(e, "format_message") and isinstance(getattr(e, "exit_code", None), int):  # a click error
        if type(e).__name__ == "NoArgsIsHelpError":
            e.show()  # type: ignore[attr-defined]  (the command's help, as without the boundary)
            return e.exit_code  # type: ignore[attr-defined, no-any-return]
        ctx = getattr(e, "ctx", None)
        hint = f" (see '{ctx.command_path} --help')" if ctx is not None else ""
        _say(e.format_message() + hint)  # type: ignore[attr-defined]
        return e.exit_code  # type: ignore[attr-defined, no-any-return]
    if type(e).__name__ == "Abort":
        _say("aborted")
        return 1
    oom = _allocation_failure(e)
    if oom is not None:
        _say(oom)
        return EXIT_BAD_INPUT
    if isinstance(e, OSError) and e.errno == errno.EPIPE:
        return 1  # the reader went away (cmhsa ... | head): nothing to say
    if isinstance(e, OSError) and e.strerror:
        where = f"{e.filename}: " if e.filename else ""
        _say(f"{where}{e.strerror}")
        return EXIT_BAD_INPUT
    _say(
        f"internal error: {type(e).__name__}: {first_line(e)} "
        "(run with --debug, or CMHSA_DEBUG=1, for the traceback; please report it)"
    )
    return EXIT_INTERNAL


@contextlib.contextmanager
def library_logs_quiet() -> Iterator[None]:
    """While a command runs, libraries' log records (torch's "No CUDA runtime is found" while
    torch.compile builds, timm's loader notes) are not printed unless ``--debug`` or CMHSA_DEBUG
    (:func:`set_debug` lifts it when the flag is parsed). cmhsa itself prints, never logs."""
    logging.disable(logging.NOTSET if debug_enabled() else logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


class ReaderGone:
    """stdout or stderr as cmhsa writes to it. When the reader has gone (a pipe whose reader exited,
    as in ``cmhsa ... | head -c1``: EPIPE), what is printed is dropped and the command finishes its
    work quietly. Any other failure (a stream closed with ``>&-``, a full disk, an I/O error) is
    kept in ``lost``: the command finishes, then :func:`output_lost` turns it into an error, as
    coreutils do, so ``cmhsa inspect X > report.txt`` on a full disk never ends in success."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._gone = stream is None
        self.lost: str | None = None  # why what was written did not arrive (None: it did, or EPIPE)

    def _call(self, name: str, *args: Any) -> Any:
        if self._gone:
            if self._stream is None and name == "write" and args[0] and self.lost is None:
                self.lost = "it is closed"
        else:
            try:
                return getattr(self._stream, name)(*args)
            except (OSError, ValueError) as e:  # EPIPE, EBADF, ENOSPC, EIO; ValueError: a closed file
                self._gone = True
                if not (isinstance(e, OSError) and e.errno == errno.EPIPE):
                    self.lost = (e.strerror if isinstance(e, OSError) else None) or "it is closed"
        return len(args[0]) if name == "write" else None

    def write(self, text: str) -> int:
        return self._call("write", text)  # type: ignore[no-any-return]

    def flush(self) -> None:
        self._call("flush")

    def isatty(self) -> bool:
        return not self._gone and bool(self._call("isatty"))

    def __getattr__(self, name: str) -> Any:  # encoding, errors, fileno, ...: the real stream's
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def output_lost(code: int) -> int:
    """The exit code once the command is over: ``code``, or, when a successful command's output to
    stdout could not be written (closed, disk full; not a reader that went away), one line on stderr
    and exit 2."""
    out = sys.stdout
    if isinstance(out, ReaderGone):
        out.flush()  # a full disk says so only when the buffer is written
        if out.lost is not None and code == 0:
            _say(f"cannot write the output to standard output ({out.lost})")
            return EXIT_BAD_INPUT
    return code


def tolerate_gone_readers() -> None:
    """Install :class:`ReaderGone` on sys.stdout and sys.stderr (the ``cmhsa`` program does, before
    the command runs; a closed stream arrives as None)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, io.TextIOWrapper):  # an ASCII locale: Δ and ≥ as escapes, never a crash
            stream.reconfigure(errors="backslashreplace")
        if not isinstance(stream, ReaderGone):
            setattr(sys, name, ReaderGone(stream))


def empty_argument(args: list[str]) -> None:
    """An empty argument is never meant (``-o ""`` would be the current folder): refuse it, naming
    the option it was given to."""
    for i, a in enumerate(args):
        if a == "" or (a.startswith("--") and a.endswith("=")):
            name = a[:-1] if a else (args[i - 1] if i > 0 and args[i - 1].startswith("-") else "an argument")
            raise CmhsaError(f"{name} is empty: give a value")


class BoundaryGroup(TyperGroup):
    """The root command group: runs click in non-standalone mode and renders whatever escapes."""

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        set_debug(False)  # one invocation's --debug does not carry to the next (CliRunner tests)
        from .options import plain_help

        plain_help(self)  # --help: each default once, no type metavars (once per command tree)
        signals.clear()  # this invocation's signals only (CliRunner runs many in one process)
        notices.set_sink(lambda line: print(f"note: {terminal_safe(line)}", file=sys.stderr))
        args = list(sys.argv[1:] if args is None else args)
        for stream in (sys.stdout, sys.stderr):  # an ASCII locale: Δ and ≥ as escapes, never a crash
            if isinstance(stream, io.TextIOWrapper):
                stream.reconfigure(errors="backslashreplace")
        try:
            with warnings.catch_warnings(record=True) as caught, library_logs_quiet():
                warnings.simplefilter("default")  # each once, so the record stays small
                empty_argument(args)
                rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            if debug_enabled():  # a library's warnings are for whoever asked for the details
                for w in caught:
                    print(
                        lines_safe(warnings.formatwarning(w.message, w.category, w.filename, w.lineno)),
                        end="",
                        file=sys.stderr,
                    )
        except SystemExit:
            raise
        except BaseException as e:
            if debug_enabled() and not hasattr(e, "format_message"):
                traceback.print_exc()
            code = report(e)
            if not standalone_mode:
                raise
            sys.exit(code)
        code = rv if isinstance(rv, int) else 0  # typer.Exit(n) comes back as n
        if standalone_mode:
            sys.exit(code)
        return rv
