"""``cmhsa plot``: validation loss and top-1 against epoch for several runs (the paper's Figure 2).

matplotlib is an optional extra: ``pip install 'cmhsa[plot]'``.
"""

from __future__ import annotations

import csv
from pathlib import Path

from ..errors import CmhsaError
from ..io.atomic import atomic_path


def read_metrics(run: Path) -> list[dict[str, float]]:
    path = run / "metrics.csv"
    if not path.is_file():
        raise CmhsaError("has no metrics.csv (not a training run folder?)", run)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    try:
        return [{k: float(v) for k, v in r.items() if v not in (None, "")} for r in rows]
    except ValueError as e:
        raise CmhsaError(f"malformed metrics.csv ({e})", path) from None


def plot_runs(runs: list[Path], output: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CmhsaError(
            "plotting needs matplotlib: pip install 'cmhsa[plot]' (in a source checkout: pip install -e '.[plot]')"
        ) from None
    data = {run: read_metrics(run) for run in runs}
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(11, 4))
    for run, rows in data.items():
        epochs = [r["epoch"] for r in rows]
        ax_loss.plot(epochs, [r["val_loss"] for r in rows], label=run.name)
        ax_acc.plot(epochs, [r["top1"] for r in rows], label=run.name)
    ax_loss.set(xlabel="epoch", ylabel="validation loss")
    ax_acc.set(xlabel="epoch", ylabel="top-1 (%)")
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    suffix = output.suffix.lstrip(".") or "png"
    with atomic_path(output) as tmp:
        fig.savefig(tmp, format=suffix)
    plt.close(fig)
