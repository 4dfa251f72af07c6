"""What a user's path is, checked once before anything is opened or written: regular file, folder,
symbolic link, device, FIFO or socket; and bounded reads of what is found there (no torch import).

A FIFO would block a reader forever and a device would be read without end or replaced by a
regular file; a symbolic link as an output would be replaced by the file instead of writing through
it. So every reader asks :func:`check_input_file` (or opens with :func:`open_regular`) and every
writer asks :func:`check_output_target` first. JSON from a file goes through :func:`parse_json`,
whose failures (nesting, huge integers, bad text) are bad input like any other.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from ..errors import CmhsaError, article, one_line

# the largest text files cmhsa reads whole: a run's metrics.csv and config.json, a model's JSON
# metadata (1,000,000 epochs of metrics are about 100 MB; a config is a few KB)
MAX_TEXT_BYTES = 128 * 2**20
MAX_JSON_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 64
# integers: cmhsa writes at most 20 digits (a seed, a size, a count); this bound holds whatever
# Python's own (sys.set_int_max_str_digits, which a library may lift) is set to
MAX_INT_DIGITS = 1000


def kind_of(mode: int) -> str:
    """'a FIFO', 'a device', ... for a stat mode that is not a regular file or a folder."""
    if stat.S_ISFIFO(mode):
        return "a FIFO (named pipe)"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "not a regular file"


def require_regular(st: os.stat_result, path: object, what: str = "file", fix: str | None = None) -> None:
    """CmhsaError unless ``st`` (a stat result of ``path``) is a regular file; ``fix`` says what to
    do instead (default: give one)."""
    if stat.S_ISDIR(st.st_mode):
        raise CmhsaError(f"is a directory, expected {article(what)}", path)
    if not stat.S_ISREG(st.st_mode):
        raise CmhsaError(
            f"is {kind_of(st.st_mode)}, not a regular file; {fix or 'give ' + article(what)}", path
        )


def stat_input(path: Path, missing: str = "no such file") -> os.stat_result:
    """The stat of an input path (a link followed), or CmhsaError: ``missing`` when it is absent."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        raise CmhsaError(missing, path) from None
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None


def check_input_file(path: Path, what: str = "file") -> os.stat_result:
    """An existing, non-empty regular file (a link to one is fine), or CmhsaError; its stat."""
    if not str(path):
        raise CmhsaError(f"the {what} path is empty")
    st = stat_input(path)
    require_regular(st, path, what)
    if st.st_size == 0:
        raise CmhsaError("file is empty", path)
    return st


def check_output_target(path: Path) -> None:
    """A path cmhsa may replace with a new regular file: it has a name, and it is absent or a
    regular file. A folder, device, FIFO, socket or symbolic link is refused, never replaced."""
    if not path.name or path.name in (".", ".."):
        raise CmhsaError("output path names no file", path if str(path) else None)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CmhsaError(f"cannot check the output path ({e.strerror})", path) from None
    if stat.S_ISDIR(st.st_mode):
        raise CmhsaError("output path is a directory", path)
    if stat.S_ISLNK(st.st_mode):
        raise CmhsaError(
            "output path is a symbolic link; cmhsa replaces files, it does not write through links: "
            "give the link's target or another name",
            path,
        )
    if not stat.S_ISREG(st.st_mode):
        raise CmhsaError(
            f"output path is {kind_of(st.st_mode)}, not a regular file; choose a file name", path
        )


@contextlib.contextmanager
def open_regular(path: Path, max_bytes: int | None = None, what: str = "file") -> Iterator[IO[bytes]]:
    """``path`` opened for binary reading, only if it is a regular file (checked on the open file,
    so a FIFO cannot block the open) of at most ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise CmhsaError("no such file", path) from None
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    try:
        st = os.fstat(fd)
        require_regular(st, path, what)
        if max_bytes is not None and st.st_size > max_bytes:
            raise CmhsaError(
                f"is {st.st_size:,} bytes, more than cmhsa reads for a {what} ({max_bytes:,})", path
            )
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_text(path: Path, max_bytes: int = MAX_TEXT_BYTES, what: str = "text file") -> str:
    """A regular file of at most ``max_bytes`` as UTF-8 text, or CmhsaError."""
    try:
        with open_regular(path, max_bytes, what) as f:
            data = f.read(max_bytes + 1)
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror or e})", path) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CmhsaError(f"is not UTF-8 text (byte {e.start})", path) from None


def _depth(text: str) -> int:
    """The deepest nesting of [ and { outside strings, without recursion."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def parse_json(
    text: str | bytes, path: object = None, what: str = "JSON", max_depth: int = MAX_JSON_DEPTH
) -> Any:
    """``text`` parsed as JSON, refusing what no cmhsa file holds (more than MAX_JSON_BYTES, nesting
    deeper than ``max_depth``, integers of more than MAX_INT_DIGITS digits) in one line, as bad
    input. The one parser of JSON from a file: ``tests/test_foreign_text.py`` fails on
    ``json.loads`` anywhere else."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError:
            raise CmhsaError(f"{what} is not UTF-8 text", path) from None
    if len(text) > MAX_JSON_BYTES:
        raise CmhsaError(
            f"{what} is {len(text):,} characters, more than cmhsa reads ({MAX_JSON_BYTES:,})", path
        )
    if _depth(text) > max_depth:
        raise CmhsaError(f"{what} nests deeper than {max_depth} levels", path)
    try:
        return json.loads(text, parse_int=_bounded_int)
    except (ValueError, RecursionError, TypeError) as e:  # JSONDecodeError, too many digits
        raise CmhsaError(f"{what} is not valid JSON ({str(e).split(';')[0]})", path) from None


def parse_yaml(text: str, path: object = None, what: str = "YAML") -> Any:
    """``text`` parsed as YAML by PyYAML's safe loader (plain data: no tag makes an object, no code
    runs), refusing in one line what no config file needs and a hostile one uses: more than
    MAX_JSON_BYTES, anchors and aliases (a few lines that expand to gigabytes), nesting deeper than
    MAX_JSON_DEPTH. The one parser of YAML from a file."""
    import yaml

    if len(text) > MAX_JSON_BYTES:
        raise CmhsaError(
            f"{what} is {len(text):,} characters, more than cmhsa reads ({MAX_JSON_BYTES:,})", path
        )
    try:
        depth = 0
        for event in yaml.parse(text, Loader=yaml.SafeLoader):
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
                raise CmhsaError(f"{what} uses an anchor or alias (&, *), which cmhsa does not read", path)
            depth += isinstance(event, yaml.CollectionStartEvent) - isinstance(event, yaml.CollectionEndEvent)
            if depth > MAX_JSON_DEPTH:
                raise CmhsaError(f"{what} nests deeper than {MAX_JSON_DEPTH} levels", path)
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise CmhsaError(f"{what} is not valid YAML ({one_line(str(e))[:200]})", path) from None


def _bounded_int(digits: str) -> int:
    """An integer of JSON text, refused (ValueError) past MAX_INT_DIGITS digits before it is made."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits.lstrip('-')):,} digits, more than any cmhsa file holds")
    return int(digits)
