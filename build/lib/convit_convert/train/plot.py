"""``cmhsa plot``: validation loss and top-1 against epoch for several runs (the paper's Figure 2).

matplotlib is an optional extra: ``pip install 'cmhsa[plot]'``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from ..errors import CmhsaError
from ..io.atomic import atomic_path


def read_metrics(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.csv"
    if not path.is_file():
        raise CmhsaError("has no metrics.csv (not a training run folder?)", run)
    try:
        with open(path, newline="", encoding="utf-8") as f:
            rows = list(csv.DictReader(f))
        parsed = [{k: float(v) for k, v in r.items() if v not in (None, "") and k is not None} for r in rows]
    except (ValueError, TypeError, csv.Error) as e:  # UnicodeDecodeError is a ValueError
        raise CmhsaError(f"malformed metrics.csv ({type(e).__name__}: {str(e)[:120]})", path) from None
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    if not parsed:
        raise CmhsaError("metrics.csv has no epochs yet", path)
    missing = [c for c in COLUMNS if any(c not in r for r in parsed)]
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
            "plotting needs matplotlib: pip install 'cmhsa[plot]' (in a source checkout: pip install -e '.[plot]')"
        ) from None
    return plt


def _save(fig: Any, output: Path) -> None:
    fig.tight_layout()
    check_image_path(output)
    suffix = output.suffix.lstrip(".").lower()
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format=suffix)
    pyplot().close(fig)


def plot_runs(runs: list[Path], output: Path) -> None:
    """Validation loss and top-1; with phase-2 runs, also each block's pinned share and gate."""
    check_image_path(output)
    plt = pyplot()
    data = {run: read_metrics(run) for run in runs}
    attn = sorted({k for rows in data.values() for k in (rows[0] if rows else {}) if k.startswith("attn")})
    fig, axes = plt.subplots(1, 3 if attn else 2, figsize=(16 if attn else 11, 4))
    ax_loss, ax_acc = axes[0], axes[1]
    for run, rows in data.items():
        epochs = [r["epoch"] for r in rows]
        ax_loss.plot(epochs, [r["val_loss"] for r in rows], label=run.name)
        ax_acc.plot(epochs, [r["top1"] for r in rows], label=run.name)
        for key in attn:
            if not key.endswith("_dist_px") and all(key in r for r in rows):
                style = "--" if key.endswith("_gate") else "-"
                axes[2].plot(epochs, [r[key] for r in rows], style, label=f"{run.name} {key}")
    ax_loss.set(xlabel="epoch", ylabel="validation loss")
    ax_acc.set(xlabel="epoch", ylabel="top-1 (%)")
    if attn:
        axes[2].set(xlabel="epoch", ylabel="pinned share (solid), gate (dashed)")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _save(fig, output)


def plot_attention(report: Any, output: Path, title: str = "") -> None:
    """One heat map per block and head: the mean attention weight at each relative offset."""
    plt = pyplot()
    blocks = report.blocks
    heads = max(len(b) for b in blocks)
    fig, axes = plt.subplots(len(blocks), heads, figsize=(1.9 * heads, 2.0 * len(blocks)), squeeze=False)
    gh, gw = report.grid_size
    for i, block in enumerate(blocks):
        for j, h in enumerate(block):
            ax = axes[i][j]
            ax.imshow(h.offset_map, cmap="viridis", vmin=0, extent=(-gw + 0.5, gw - 0.5, gh - 0.5, -gh + 0.5))
            off = "free" if h.offset is None else f"{h.offset[0]:+d},{h.offset[1]:+d}"
            share = "" if h.pinned_share is None else f" {h.pinned_share:.2f}"
            gate = "" if h.gate is None else f" g{h.gate:.2f}"
            ax.set_title(f"b{i} h{j} {off}{share}{gate}\n{h.mean_distance_px:.1f}px", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
        for j in range(len(block), heads):
            axes[i][j].axis("off")
    fig.suptitle(
        title or f"mean attention by relative offset (dy down, dx right), {report.images} images", fontsize=9
    )
    _save(fig, output)
