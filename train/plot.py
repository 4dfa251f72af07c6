"""``cmhsa plot``: validation loss and top-1 against epoch for several runs (the paper's Figure 2).

matplotlib is an optional extra: ``pip install 'cmhsa[plot]'``.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import re
from pathlib import Path
from typing import Any

from ..errors import CmhsaError
from ..io.atomic import atomic_names
from ..io.journal import check_settled
from ..io.outputs import Target, held_outputs
from ..io.paths import parse_json, read_text
from ..notices import notice
from ..options.training import starts_from_checkpoint
from ..text import label_safe
from .names import SEED_FOLDER
from .progress import EMA_METRICS, METRICS

_ATTN_COLUMN = re.compile(r"^attn(\d{1,4})_(share|gate|dist_px)$")
LARGEST = 1e12  # no metric cmhsa writes comes near; matplotlib's axes overflow near 1e308


def _column(name: str | None) -> bool:
    """A column the plots read: the run's own metrics and ``attn{block}_{share|gate|dist_px}``."""
    return name is not None and (name in METRICS + EMA_METRICS or _ATTN_COLUMN.match(name) is not None)


def seed_folders(run: Path, look: int = 1000) -> list[str]:
    """The names of up to 3 seed folders of a stacked run (``--seeds``) among the first ``look``
    entries of ``run`` (any folder: bounded, and only names of that exact form are returned)."""
    found: list[str] = []
    with contextlib.suppress(OSError), os.scandir(run) as entries:
        for i, entry in enumerate(entries):
            if i >= look or len(found) == 3:
                break
            if SEED_FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                found.append(entry.name)
    return sorted(found)


MAX_SEED_RUNS = 64  # train/stacked.py's MAX_SEEDS: the seeds one stacked run holds


def seed_runs(run: Path, look: int = 10_000) -> list[Path]:
    """A `seeds` run's seed folders in seed order (``run`` has no metrics.csv of its own), else []:
    folders of names.seed_folder's exact names, never links, among the first ``look`` entries, at
    most MAX_SEED_RUNS."""
    if os.path.lexists(run / "metrics.csv"):
        return []
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError), os.scandir(run) as entries:
        for i, entry in enumerate(entries):
            if i >= look:
                break
            if SEED_FOLDER.fullmatch(entry.name) and entry.is_dir(follow_symlinks=False):
                found.append((int(entry.name[4:]), entry.name))
    if len(found) > MAX_SEED_RUNS:
        raise CmhsaError(f"holds {len(found):,} seed folders, more than a `seeds` run makes", run)
    return [run / name for _, name in sorted(found)]


def mean_rows(runs: list[list[dict[str, float]]]) -> list[dict[str, float]]:
    """The seeds' metrics averaged epoch by epoch: the epochs every seed has, each column every seed
    has there (`eval_every` leaves some empty)."""
    if len(runs) == 1:
        return runs[0]
    by_epoch = [{r["epoch"]: r for r in rows} for rows in runs]
    shared = sorted(set.intersection(*(set(e) for e in by_epoch)))
    out = []
    for epoch in shared:
        rows = [b[epoch] for b in by_epoch]
        keys = set.intersection(*(set(r) for r in rows))
        out.append({k: sum(r[k] for r in rows) / len(rows) for k in sorted(keys)})
    return out


# what one `cmhsa plot` reads of metrics.csv files, all of them together (any number of runs, each
# of up to MAX_SEED_RUNS seeds): 64 seeds of 3,000 epochs fit; a file of a million rows does not
MAX_PLOT_ROWS = 200_000
MAX_PLOT_BYTES = 256 * 2**20


class Budget:
    """What the metrics.csv files of one plot may take together: rows and bytes, counted as read."""

    def __init__(self, rows: int = MAX_PLOT_ROWS, nbytes: int = MAX_PLOT_BYTES) -> None:
        self.rows, self.nbytes = rows, nbytes

    def take(self, rows: int, nbytes: int, path: Path) -> None:
        self.rows, self.nbytes = self.rows - rows, self.nbytes - nbytes
        if self.rows < 0 or self.nbytes < 0:
            raise CmhsaError(
                f"takes the metrics.csv files of this plot past {MAX_PLOT_ROWS:,} rows or "
                f"{MAX_PLOT_BYTES // 2**20} MiB together (no run cmhsa trains writes that many epochs); "
                "plot fewer runs",
                path,
            )


def read_metrics(run: Path, budget: Budget | None = None) -> list[dict[str, float]]:
    """metrics.csv of a run folder: its known columns as numbers (others are ignored), every value
    finite and within ±LARGEST; CmhsaError otherwise. Read row by row, each row's known columns
    only, counted against ``budget`` (a plot's, shared by its runs) as they are read."""
    path = run / "metrics.csv"
    if not os.path.lexists(path):
        seeds = seed_folders(run)
        if seeds:
            raise CmhsaError(
                f"has no metrics.csv: it holds a `seeds` run's folders ({', '.join(seeds)}); plot those", run
            )
        raise CmhsaError("has no metrics.csv (not a training run folder?)", run)
    check_settled(path)
    budget = Budget() if budget is None else budget
    text = read_text(path, what="metrics.csv")
    budget.take(0, len(text), path)
    parsed: list[dict[str, float]] = []
    try:
        reader = csv.reader(io.StringIO(text, newline=""))
        header = next(reader, [])
        known = [(i, k) for i, k in enumerate(header) if _column(k)]
        for row in reader:
            budget.take(1, 0, path)
            parsed.append({k: float(row[i]) for i, k in known if i < len(row) and row[i] != ""})
    except (ValueError, TypeError, csv.Error) as e:
        raise CmhsaError(f"malformed metrics.csv ({type(e).__name__}: {str(e)[:120]})", path) from None
    del text
    bad = next((v for r in parsed for v in r.values() if not abs(v) <= LARGEST), None)
    if bad is not None:
        raise CmhsaError(f"metrics.csv holds {bad!r}, not a metric (finite, within ±{LARGEST:g})", path)
    if not parsed:
        raise CmhsaError("metrics.csv has no epochs yet", path)
    # `eval_every` leaves the validation columns of the epochs between evaluations empty
    missing = [
        c
        for c in COLUMNS
        if any(c not in r for r in parsed) and (c == "epoch" or all(c not in r for r in parsed))
    ]
    if missing:
        raise CmhsaError(
            f"metrics.csv lacks the column(s) {', '.join(missing)} (not written by cmhsa train?)", path
        )
    return parsed


COLUMNS = ("epoch", "val_loss", "top1")  # what the plots draw
FORMATS = ("png", "pdf", "svg")


def check_image_path(output: Path) -> None:
    """An output matplotlib can write: .png, .pdf or .svg (refused before anything is plotted)."""
    if output.suffix.lstrip(".").lower() not in FORMATS:
        raise CmhsaError(f"the plot must be a {', '.join('.' + f for f in FORMATS)} file", output)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend, or a CmhsaError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CmhsaError(
            "plotting needs matplotlib: pip install 'cmhsa[plot]' (in a source "
            "checkout: pip install -e '.[plot]')"
        ) from None
    return plt


def _save(fig: Any, output: Target) -> None:
    suffix = Path(output.name).suffix.lstrip(".").lower()
    with atomic_names(output) as (tmp,):
        fig.savefig(tmp, format=suffix)
    pyplot().close(fig)


def _series(key: str) -> tuple[int, str]:
    """metrics.csv's ``attn{block}_{share|gate|dist_px}`` as (block, what)."""
    block, _, what = key.removeprefix("attn").partition("_")
    return int(block), {"share": "pinned share", "gate": "gate", "dist_px": "distance px"}.get(what, what)


BLOCK_MARKERS = "osD^vP*Xph"  # the attention panel's blocks; a run's colour is the same in every panel
MODEL_FILES = ("conv.safetensors", "conv-ema.safetensors", "vit.safetensors", "vit-ema.safetensors")


def _run_config(run: Path) -> dict[str, Any] | None:
    """A run's config.json, or None where there is none cmhsa can read (the curves are then drawn
    without what it would add: a start after another run, the dataset, the resumes)."""
    path = run / "config.json"
    try:
        check_settled(path)
        cfg = parse_json(read_text(path, what="config.json"), path) if os.path.lexists(path) else None
    except CmhsaError:
        return None
    return cfg if isinstance(cfg, dict) else None


def _started_from(run: Path) -> str | None:
    """The checkpoint a phase-2 run started from, as its config.json names it (None: another
    start, or no config.json cmhsa can read: the curves are then drawn from epoch 1)."""
    cfg = _run_config(run)
    info = cfg.get("init_info") if cfg is not None else None
    init = info.get("init") if isinstance(info, dict) else None
    ok = isinstance(init, str) and starts_from_checkpoint(str(cfg.get("phase")), init)  # type: ignore[union-attr]
    return init if ok else None


MAX_MARKS = 100  # resume marks drawn per run (config.json may be anyone's)


def resumed_at(run: Path) -> list[float]:
    """The epochs (fractional within an epoch) where a run was resumed, from config.json's
    ``environments`` records flagged ``resumed``: whole numbers from 0 to LARGEST only, at most
    MAX_MARKS of them (anything else in the file is ignored)."""
    cfg = _run_config(run)
    envs = cfg.get("environments") if cfg is not None else None
    marks: set[float] = set()
    for e in envs if isinstance(envs, list) else []:
        if not isinstance(e, dict) or e.get("resumed") is not True:
            continue
        epoch, step = e.get("epoch"), e.get("step")
        if all(type(v) is int and 0 <= v <= LARGEST for v in (epoch, step)):
            marks.add(epoch + (0.5 if step > 0 else 0.0))  # within an epoch: its middle
        if len(marks) >= MAX_MARKS:
            break
    return sorted(marks)


def dataset_of(run: Path) -> str | None:
    """The dataset a run trained on (config.json's ``data``, with its folder), None if unknown."""
    cfg = _run_config(run)
    data = cfg.get("data") if cfg is not None else None
    if not isinstance(data, str):
        return None
    folder = cfg.get("data_dir")  # type: ignore[union-attr]
    said = f"{data} ({folder})" if isinstance(folder, str) and data == "imagefolder" else data
    return label_safe(said[:200])  # anyone's file: a name, not a page of text


def epoch_offsets(runs: list[Path], last_epoch: dict[Path, float]) -> dict[Path, tuple[float, Path | None]]:
    """Per run, the epochs drawn before its own and the run it continues: a phase-2 run that
    started from a model another of ``runs`` wrote (phase 1's conv.safetensors, say) is drawn
    after that run's last epoch, as two-phase training happened; any other run from epoch 1."""
    # each run's model files by identity (device, inode): one stat each, then one per start
    written: dict[tuple[int, int], Path] = {}
    for run in runs:
        for name in MODEL_FILES:
            with contextlib.suppress(OSError):
                st = os.stat(run / name)
                written.setdefault((st.st_dev, st.st_ino), run)
    parent: dict[Path, Path] = {}
    for run in runs:
        init = _started_from(run)
        with contextlib.suppress(OSError):
            st = os.stat(init) if init else None
            other = written.get((st.st_dev, st.st_ino)) if st is not None else None
            if other is not None and other is not run:
                parent[run] = other

    # each chain followed once, iteratively (no recursion, however long): a run's offset is its
    # parent's plus the parent's last epoch; where a chain closes on itself (no real runs make a
    # cycle), the run it closes on is drawn from epoch 1
    offsets: dict[Path, float] = {}
    for run in runs:
        chain: list[Path] = []
        on_chain: set[Path] = set()
        node: Path | None = run
        while node is not None and node not in offsets:
            if node in on_chain:
                offsets[node] = 0.0
                break
            chain.append(node)
            on_chain.add(node)
            node = parent.get(node)
        for member in reversed(chain):
            before = parent.get(member)
            if member not in offsets:
                offsets[member] = offsets[before] + last_epoch[before] if before in offsets else 0.0
    return {run: (offsets[run], parent.get(run)) for run in runs}


def run_labels(runs: list[Path]) -> list[str]:
    """Each run's name in the legend: its folder's name, or the path as given where two share a name."""
    names = [run.name for run in runs]
    return [label_safe(str(run) if names.count(run.name) > 1 else run.name) for run in runs]


def curves_figure(runs: list[Path]) -> tuple[Any, list[str]]:
    """Loss (validation solid, training dashed), top-1 and the learning rate against epoch, one
    colour per run in every panel, each epoch a marker (a one-epoch run is a dot); with phase-2
    runs, each block's pinned share (solid) and gate (dashed), a marker per block. A phase-2 run
    that continues another of ``runs`` is drawn after it (:func:`epoch_offsets`), a dotted line
    where it was converted; a dash-dotted line where a run was resumed; epochs are whole numbers on
    the axes. Also the notes a reader needs (runs on different datasets)."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    seen: dict[str, Path] = {}
    for run in runs:
        first = seen.setdefault(os.path.realpath(run), run)
        if first is not run:
            raise CmhsaError(f"is given twice (also as {first}); give each run once", run)
    # a `seeds` run's folder is drawn as its seeds (thin) and their mean (one line, the run's colour)
    members = {run: seed_runs(run) or [run] for run in runs}
    budget = Budget()  # every run's metrics.csv together
    per_member = {m: read_metrics(m, budget) for ms in members.values() for m in ms}
    data = {
        run: per_member[ms[0]] if len(ms) == 1 else mean_rows([per_member[m] for m in ms])
        for run, ms in members.items()
    }
    empty = next((run for run, rows in data.items() if not rows), None)
    if empty is not None:
        raise CmhsaError("its seeds share no evaluated epoch to average", empty)
    attn = sorted(
        {k for rows in data.values() for k in rows[0] if k.startswith("attn") and not k.endswith("_dist_px")}
    )
    fig, axes = plt.subplots(
        1, 4 if attn else 3, figsize=(21 if attn else 16, 4.4), layout="constrained", sharex=True
    )
    ax_loss, ax_acc, ax_lr = axes[0], axes[1], axes[2]
    labels = run_labels(runs)
    label_of = {m: label for run, label in zip(runs, labels, strict=True) for m in members[run]}
    flat = list(per_member)  # a seed continues its own seed's run of another `seeds` folder
    member_offsets = epoch_offsets(flat, {m: max(r["epoch"] for r in rows) for m, rows in per_member.items()})
    offsets = {run: member_offsets[ms[0]] for run, ms in members.items()}
    marks = {run: resumed_at(members[run][0]) for run in runs}
    dot = dict(marker="o", markersize=3)
    # each axis's named lines, kept here: matplotlib leaves a label that starts with "_" out of a
    # legend, which a run folder named "_x" would be
    named: dict[Any, list[Any]] = {ax: [] for ax in axes}

    def plot(ax: Any, *args: Any, label: str, **kw: Any) -> None:
        named[ax] += ax.plot(*args, label=label, **kw)

    for n, (run, rows, name) in enumerate(zip(runs, data.values(), labels, strict=True)):
        shift, before = offsets[run]
        colour, epochs = f"C{n % 10}", [shift + r["epoch"] for r in rows]
        seeds = members[run] if len(members[run]) > 1 else []
        for m in seeds:  # each seed thin, unlabelled; the mean below carries the run's name
            ev = [r for r in per_member[m] if "top1" in r]
            xs = [shift + r["epoch"] for r in ev]
            ax_loss.plot(xs, [r["val_loss"] for r in ev], color=colour, alpha=0.3, linewidth=0.8)
            ax_acc.plot(xs, [r["top1"] for r in ev], color=colour, alpha=0.3, linewidth=0.8)
        if seeds:
            name = f"{name}: mean of {len(seeds)} seeds (thin: each)"
        if before is not None:
            name = f"{name} (after {label_of[before]})"
            for ax in axes:
                ax.axvline(shift, color=colour, linestyle=":", linewidth=1)
        for at in marks[run]:
            for ax in axes:
                ax.axvline(shift + at, color=colour, linestyle="-.", linewidth=1, alpha=0.7)
        evaluated = [(e, r) for e, r in zip(epochs, rows, strict=True) if "top1" in r]  # `eval_every`
        xs = [e for e, _ in evaluated]
        plot(ax_loss, xs, [r["val_loss"] for _, r in evaluated], color=colour, label=name, **dot)
        if all("train_loss" in r for r in rows):
            train = [r["train_loss"] for r in rows]
            plot(ax_loss, epochs, train, "--", color=colour, label=f"{name} (train)", **dot)
        plot(ax_acc, xs, [r["top1"] for _, r in evaluated], color=colour, label=name, **dot)
        if all("lr" in r and r["lr"] > 0 for r in rows):
            plot(ax_lr, epochs, [r["lr"] for r in rows], color=colour, label=name, **dot)
        for key in attn:
            if all(key in r for r in rows):
                block, what = _series(key)
                run_name = f"{name}: " if len(data) > 1 else ""
                plot(
                    axes[3],
                    epochs,
                    [r[key] for r in rows],
                    "--" if what == "gate" else "-",
                    color=colour,
                    marker=BLOCK_MARKERS[block % len(BLOCK_MARKERS)],
                    markevery=max(1, len(rows) // 8),
                    markersize=4,
                    label=f"{run_name}block {block} {what}",
                )
    ax_loss.set(xlabel="epoch", ylabel="loss", title="Loss: validation (solid), training (dashed)")
    ax_acc.set(xlabel="epoch", ylabel="top-1 (%)", title="Validation top-1")
    ax_lr.set(xlabel="epoch", ylabel="learning rate", title="Learning rate (at each epoch's start)")
    if named[ax_lr]:
        ax_lr.set_yscale("log")
    else:
        ax_lr.text(0.5, 0.5, "no learning rate in metrics.csv", ha="center", transform=ax_lr.transAxes)
    if attn:
        axes[3].set(
            xlabel="epoch", ylabel="0 to 1, a marker per block", title="Pinned share (solid), gate (dashed)"
        )
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if named[ax]:
            ax.legend(named[ax], [line.get_label() for line in named[ax]], fontsize=7)
    notes = []
    datasets = {run: dataset_of(run) for run in runs}
    if len({d for d in datasets.values() if d is not None}) > 1:
        said = ", ".join(f"{label_of[r]}: {d or 'unknown'}" for r, d in datasets.items())
        notes.append(f"the runs trained on different datasets ({said}): their curves are not comparable")
    title = f"Training curves: {', '.join(labels)}"
    if any(marks.values()):
        title += " (dash-dotted: resumed)"
    fig.suptitle(title + ("\n" + notes[0] if notes else ""))
    return fig, notes


def plot_runs(runs: list[Path], output: Path) -> None:
    """:func:`curves_figure`, written to ``output`` (.png, .pdf, .svg); its notes (also in its
    title) said as notices (the CLI prints them as ``note:`` lines)."""
    check_image_path(output)
    # held from the start; the runs' metrics are what it reads (its default place is in a run)
    with held_outputs(output, reads=[Path(r) / "metrics.csv" for r in runs]) as (target,):
        fig, notes = curves_figure(runs)
        _save(fig, target)
    for line in notes:
        notice(line)


DECADES = 3  # the attention maps' log scale spans this many powers of ten below a block's largest weight
ATTENTION_LEGEND = (
    "Colour: mean attention weight a query patch gives the key patch at offset (dy, dx), over the images; "
    "log scale, one per block (its colour bar), from its largest weight down "
    f"{DECADES} decades (less: the darkest). "
    "Red square: the head's pinned offset.\n"
    "Panel title: head, pinned offset (free: not pinned); share = weight on the pinned offset; "
    "gate = weight of content attention in a gated head (0: pinned only); "
    "dist = mean attention distance in pixels."
)


def offset_ticks(g: int) -> list[int]:
    """Ticks for the offsets -(g-1)..g-1 of a g-patch side: 0 and its multiples, at most 5 in all."""
    step = max(1, -(-(g - 1) // 2))  # ceil((g-1)/2): 0, ±step within the range
    return [k * step for k in range(-((g - 1) // step), (g - 1) // step + 1)]


def attention_figure(report: Any, title: str = "") -> Any:
    """One heat map per block (row) and head (column): the mean attention weight at each relative
    offset, one log colour scale per block (a pinned head's weight off its offset is orders of
    magnitude below the pinned weight: a linear scale shows it as black), the pinned offset marked."""
    import numpy as np
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    plt = pyplot()
    blocks = report.blocks
    heads = max(len(b) for b in blocks)
    fig, axes = plt.subplots(
        len(blocks),
        heads,
        figsize=(1.9 * heads + 1.2, 2.1 * len(blocks) + 1.3),
        squeeze=False,
        layout="constrained",
    )
    gh, gw = report.grid_size
    extent = (-gw + 0.5, gw - 0.5, gh - 0.5, -gh + 0.5)  # offset (0, 0) at the centre; dy grows downwards
    xticks, yticks = offset_ticks(gw), offset_ticks(gh)  # the same for every panel
    for i, block in enumerate(blocks):
        vmax = max(max(max(row) for row in h.offset_map) for h in block) or 1.0
        norm = LogNorm(vmin=vmax * 10.0**-DECADES, vmax=vmax)
        for j, h in enumerate(block):
            ax = axes[i][j]
            shown = np.maximum(
                np.asarray(h.offset_map, dtype=float), norm.vmin
            )  # 0 (never attended): darkest
            im = ax.imshow(shown, cmap="viridis", norm=norm, extent=extent)
            if h.offset is not None:
                dy, dx = h.offset
                ax.add_patch(
                    Rectangle((dx - 0.5, dy - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=1.2)
                )
            off = "free" if h.offset is None else f"({h.offset[0]:+d}, {h.offset[1]:+d})"
            stats = [f"share {h.pinned_share:.2f}"] if h.pinned_share is not None else []
            stats += [f"gate {h.gate:.2f}"] if h.gate is not None else []
            stats.append(f"dist {h.mean_distance_px:.1f}px")
            ax.set_title(f"head {j} {off}\n{', '.join(stats)}", fontsize=7)
            ax.set_xticks(xticks)
            ax.set_yticks(yticks)
            ax.tick_params(labelsize=6)
            if i == len(blocks) - 1:
                ax.set_xlabel("dx", fontsize=7)
            if j == 0:
                ax.set_ylabel(f"block {i}\ndy", fontsize=8)
        for j in range(len(block), heads):
            axes[i][j].axis("off")
        bar = fig.colorbar(im, ax=list(axes[i]), shrink=0.9, pad=0.01)
        bar.set_label("mean weight (log)", fontsize=7)
        bar.ax.tick_params(labelsize=6)
    fig.suptitle(
        label_safe(title) or f"Mean attention by relative offset, {report.images} images", fontsize=10
    )
    fig.supxlabel(ATTENTION_LEGEND, fontsize=7, ha="left", x=0.01, wrap=True)
    return fig


def plot_attention(report: Any, output: Path, title: str = "") -> None:
    """:func:`attention_figure`, written to ``output``."""
    check_image_path(output)
    with held_outputs(output) as (target,):
        _save(attention_figure(report, title), target)


def write_attention(report: Any, json_out: Target, png_out: Target, doc: str, title: str = "") -> None:
    """``doc`` as ``json_out`` and the figure as ``png_out`` (``attention.json`` and
    ``attention.png``), both or neither: the figure is drawn first, then the two files are written
    together."""
    fig = attention_figure(report, title)
    with atomic_names(json_out, png_out) as (json_tmp, png_tmp):
        json_tmp.write_text(doc, encoding="utf-8")
        fig.savefig(png_tmp, format="png")
    pyplot().close(fig)
