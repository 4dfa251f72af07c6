"""A run's folder: made, held open and locked while the run is in it (a failed start leaves it as
it was), the names a run writes there (train/names.py) checked before anything is touched, and a
previous run's files refused, kept or replaced (`resume`, `overwrite`, `init`)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..errors import CmhsaError
from ..io.folder import Folder, make_folder, remove_made
from ..io.lock import LOCK_NAME, locked_folder
from ..io.paths import parse_json
from ..io.timm_folder import FILES, WEIGHTS
from ..options.training import TrainConfig
from .distributed import Context, barrier
from .names import BEST, LAST, NUMBERED, OUTPUT, PENDING_REMOVAL, TIMM_FOLDER
from .tensorboard import EVENTS
from .tensorboard import NAME as EVENT_FILE


@contextlib.contextmanager
def run_folder(
    cfg: TrainConfig, ctx: Context, wrote: list[Path], parent: Folder | None = None
) -> Iterator[Folder]:
    """The run folder, made if missing, held open and locked (one process at a time writes a run
    folder: a second one is refused) while the run is in it. If the run fails before it saved
    anything (``wrote`` empty), the folder is left as it was: no folder it made, no lock.
    ``parent``: the held folder the run folder's name is cmhsa's choice in (a `seeds` run's seed
    folder), entered by that name, never through a link and only if it is this user's folder;
    without it, the path the user gave (links in it followed: it is the user's)."""
    out = Path(cfg.runtime.out).expanduser()
    created: list[Path] = []
    folder, had_lock = None, True
    try:
        if parent is not None:
            made = parent.lstat(out.name) is None
            folder = parent.enter(out.name, create=True)
            created = [out] if made else []
            if not os.access(out, os.W_OK | os.X_OK):
                raise CmhsaError("the run folder is not writable", out)
        else:
            if ctx.is_main:
                created = make_folder(out, "run folder")
                if not os.access(out, os.W_OK | os.X_OK):
                    raise CmhsaError("the run folder is not writable", out)
            barrier(ctx)
            folder = Folder.open(out)  # held for the whole run: every file below it is touched by name
        had_lock = folder.exists(LOCK_NAME)
        with locked_folder(folder) if ctx.is_main else contextlib.nullcontext():
            yield folder
    except BaseException:
        if ctx.is_main and not wrote:
            # it wrote nothing: leave the folder as it was, and no folder it made
            if created:
                remove_made(created, keep=(LOCK_NAME,))
            elif folder is not None and not had_lock:
                with contextlib.suppress(OSError, CmhsaError):
                    folder.remove_all([LOCK_NAME])
        raise
    finally:
        if folder is not None:
            folder.close()


def run_files(phases: tuple[str, ...] = tuple(OUTPUT)) -> list[str]:
    """The names a run of ``phases`` writes in its folder (relative; numbered checkpoints apart)."""
    models = [OUTPUT[p] for p in phases]
    names = [LAST, "metrics.csv", "config.json", PENDING_REMOVAL, BEST, *models]
    names += [n.replace(".safetensors", s) for n in models for s in ("-ema.safetensors", ".onnx")]
    names += [n.replace(".safetensors", ".onnx.report.json") for n in models]
    return names + [f"{TIMM_FOLDER}/{n}" for n in FILES]


def run_outputs(folder: Folder) -> list[str]:
    """What a run writes into its folder (any phase), as far as it is there: exact names, and the
    numbered checkpoints and TensorBoard files by the forms only cmhsa writes."""
    found = [n for n in run_files() if folder.lstat_below(n) is not None]
    found += [n for n in folder.names() if NUMBERED.fullmatch(n)]
    if folder.lstat(EVENTS) is not None:  # entered by name, never through a link (refused in one line)
        with folder.enter(EVENTS) as events:
            found += [f"{EVENTS}/{n}" for n in events.names() if EVENT_FILE.fullmatch(n)]
    return found


def check_run_names(folder: Folder) -> None:
    """Every name a run writes, replaces or removes in its folder (its outputs, the numbered copies,
    the timm folder) is absent or what cmhsa writes there: a regular file of this user's with one
    name, ``timm`` a real folder. Anything else (a link, a folder where a file belongs, a hard link,
    another user's file) is refused here (``Folder.check_all``), naming it, before anything is read,
    written or removed."""
    folder.check_all([*run_files(), *(n for n in folder.names() if NUMBERED.fullmatch(n))])


def check_init_kept(folder: Folder, phase: str, init: str | None) -> None:
    """The file `init` names is never replaced by the run that starts from it: refused when it is
    one this run writes (its model, checkpoints, exports)."""
    if not init:
        return
    written = run_files((phase,)) + [n for n in folder.names() if NUMBERED.fullmatch(n)]
    if any(is_init(folder, n, init) for n in written):
        raise CmhsaError(
            f"`init` {init} is a file this run writes (its model or a checkpoint) and would be "
            "replaced by the trained model; copy it out of `out` first, or choose another `out`",
            folder.path,
        )


def is_init(folder: Folder, name: str, init: str | None) -> bool:
    """Whether the run folder's ``name`` is the file `init` names (the same device and inode)."""
    if not init:
        return False
    path = Path(init).expanduser()
    try:
        source = os.stat(path / WEIGHTS if path.is_dir() else path)  # a timm folder: its weights
    except OSError:
        return False
    st = folder.lstat_below(name)
    return st is not None and (st.st_dev, st.st_ino) == (source.st_dev, source.st_ino)


def previous_run(folder: Folder, overwrite: bool, init: str | None = None) -> list[str]:
    """A new run in ``folder``: refused while another run's outputs are there (its metrics and model
    would be silently replaced, or mixed with this run's), unless ``overwrite``. Returns what the
    new run replaces (names), removed only once it has written its first checkpoint
    (:func:`train`), and never the file ``init`` names, which the new run starts from."""
    previous = run_outputs(folder)
    if not previous:
        return []
    if not overwrite:
        what = "a previous run (checkpoint-last.pt)" if previous[0] == LAST else "another run's outputs"
        names = ", ".join(previous[:4]) + (" ..." if len(previous) > 4 else "")
        raise CmhsaError(
            f"holds {what}: {names}; pass `resume` to continue it, `overwrite` to replace it, "
            "or choose another `out`",
            folder.path,
        )
    return [n for n in previous if not is_init(folder, n, init)]


def remove_replaced(folder: Folder, names: list[str]) -> None:
    """`overwrite`: remove the previous run's files ``names``, then the list of them
    (:data:`PENDING_REMOVAL`) and a timm folder left empty; every name checked before the first is
    removed (``Folder.remove_all``)."""
    try:
        folder.remove_all([*names, PENDING_REMOVAL])
    except CmhsaError as e:
        raise CmhsaError(f"`overwrite`: {e}") from None


def removable(name: object) -> bool:
    """Whether ``name`` (from a run folder's :data:`PENDING_REMOVAL`, which anyone may have written)
    is a previous run's file that `overwrite` removes: a run output other than the three every save
    writes, or a numbered checkpoint; never a path out of the folder."""
    kept = (LAST, "metrics.csv", "config.json", PENDING_REMOVAL)
    return isinstance(name, str) and (
        (name in run_files() and name not in kept) or NUMBERED.fullmatch(name) is not None
    )


def finish_removal(folder: Folder) -> None:
    """`resume` of a run whose `overwrite` was cut short after its first checkpoint: remove what
    :data:`PENDING_REMOVAL` still lists (names checked by :func:`removable`; the file is bounded)."""
    if not folder.exists(PENDING_REMOVAL):
        return
    path = folder.show(PENDING_REMOVAL)
    data = folder.read_bytes(PENDING_REMOVAL, 64 * 2**10, PENDING_REMOVAL)
    names = parse_json(data, path, PENDING_REMOVAL, max_depth=2)
    if not isinstance(names, list) or not all(removable(n) for n in names):
        raise CmhsaError(
            f"is not a list of a previous run's files that `overwrite` removes; delete {PENDING_REMOVAL} "
            "to resume without it",
            path,
        )
    remove_replaced(folder, names)
