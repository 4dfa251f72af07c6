"""The figures a person reads: attention.png and curves.png carry their titles, colour bars, axis
labels and readable series names (checked on matplotlib's objects, not on pixels)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from matplotlib.colors import LogNorm
from matplotlib.patches import Rectangle

from conftest import invoke
from convit_convert.analysis import AttentionReport, HeadStats
from convit_convert.train.plot import attention_figure, curves_figure, plot_attention, plot_runs


def report() -> AttentionReport:
    """2 blocks x 3 heads on a 3x3 grid (offset maps 5x5): block 1's weights are half block 0's, so
    one scale per block shows both at full colour and a shared scale would not."""
    blocks = []
    for b, scale in enumerate((1.0, 0.5)):
        heads = []
        for h, offset in enumerate([(-1, 0), (0, 1), None]):
            m = [[0.0] * 5 for _ in range(5)]
            dy, dx = offset or (0, 0)
            m[dy + 2][dx + 2] = scale * (0.9 if offset else 0.3)
            gate = 0.1 * b if offset else None
            heads.append(HeadStats(offset, None if offset is None else scale, 4.0 + h, 0.5, gate, m))
        blocks.append(heads)
    return AttentionReport(images=7, grid_size=(3, 3), patch_size=4, blocks=blocks)


def test_attention_figure_can_be_read_without_the_source() -> None:
    fig = attention_figure(report(), "model.safetensors on digits")
    assert fig._suptitle.get_text() == "model.safetensors on digits"
    legend = fig._supxlabel.get_text()
    for word in ("share", "gate", "dist", "colour bar", "pinned offset"):
        assert word in legend, word
    panels = [ax for ax in fig.axes if ax.images]
    bars = [ax for ax in fig.axes if ax.get_ylabel() == "mean weight (log)"]
    assert len(panels) == 6 and len(bars) == 2  # one colour bar per block
    for row, block_max in ((panels[:3], 0.9), (panels[3:], 0.45)):  # one scale per block: its own max
        for ax in row:
            assert ax.images[0].get_clim() == pytest.approx((block_max * 1e-3, block_max))
        assert all(isinstance(ax.images[0].norm, LogNorm) for ax in row)
    # a weight 100x below the block's largest (the share a pinned head leaves elsewhere) is not the
    # colour of zero: linear, it would be 1% up the colour bar, next to black
    low, zero = panels[0].images[0].norm([0.009, 0.0009])
    assert low == pytest.approx(1 / 3) and zero == pytest.approx(0.0)
    assert [ax.get_ylabel() for ax in panels[::3]] == ["block 0\ndy", "block 1\ndy"]
    assert all(ax.get_xlabel() == "dx" for ax in panels[3:])
    assert all(len(ax.get_xticks()) > 1 and len(ax.get_yticks()) > 1 for ax in panels)
    assert panels[0].get_title().startswith("head 0 (-1, +0)\nshare 1.00, gate 0.00, dist 4.0px")
    assert panels[2].get_title().startswith("head 2 free")
    # the pinned offset marked where the map has it: (dx, dy) = (0, -1) for head 0
    (mark,) = [p for p in panels[0].patches if isinstance(p, Rectangle)]
    assert mark.get_xy() == (-0.5, -1.5) and not panels[2].patches
    # no title overlaps another panel (titles above the row below, as laid out)
    fig.canvas.draw()
    boxes = [ax.get_window_extent() for ax in panels]
    for ax in panels:
        title = ax.title.get_window_extent()
        assert not any(
            title.overlaps(box) for other, box in zip(panels, boxes, strict=True) if other is not ax
        )


def metrics(run: Path, rows: int) -> Path:
    run.mkdir()
    head = "epoch,val_loss,top1,attn0_share,attn0_dist_px,attn0_gate,attn1_share,attn1_dist_px,attn1_gate"
    lines = [f"{e},{1.0 / e},{50 + e},0.9,4.0,0.1,0.8,5.0,0.2" for e in range(1, rows + 1)]
    (run / "metrics.csv").write_text("\n".join([head, *lines]) + "\n")
    return run


def test_curves_figure_names_its_runs_and_series(tmp_path: Path) -> None:
    runs = [metrics(tmp_path / "gated", 3), metrics(tmp_path / "impulse", 4)]
    fig, notes = curves_figure(runs)
    assert fig._suptitle.get_text() == "Training curves: gated, impulse" and notes == []
    loss, acc, _lr, attn = fig.axes[:4]
    assert (loss.get_title(), acc.get_title()) == (
        "Loss: validation (solid), training (dashed)",
        "Validation top-1",
    )
    labels = [line.get_label() for line in attn.lines]
    assert "gated: block 0 pinned share" in labels and "impulse: block 1 gate" in labels
    assert not any("attn" in label or "dist" in label for label in labels)
    # one colour per run, the same in every panel; blocks apart by marker, share and gate by line style
    colour = {line.get_label(): line.get_color() for line in attn.lines}
    marker = {line.get_label(): line.get_marker() for line in attn.lines}
    assert [line.get_color() for line in loss.lines] == [line.get_color() for line in acc.lines]
    assert loss.lines[0].get_color() != loss.lines[1].get_color()
    assert {colour[k] for k in colour if k.startswith("gated")} == {loss.lines[0].get_color()}
    assert {colour[k] for k in colour if k.startswith("impulse")} == {loss.lines[1].get_color()}
    assert (
        marker["gated: block 0 gate"]
        == marker["impulse: block 0 pinned share"]
        != marker["gated: block 1 gate"]
    )
    plot_runs(runs, tmp_path / "curves.png")
    plot_attention(report(), tmp_path / "attention.png")
    assert (tmp_path / "curves.png").stat().st_size > 0 and (tmp_path / "attention.png").stat().st_size > 0


def test_two_runs_of_one_name_are_told_apart(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    runs = [metrics(tmp_path / "a" / "phase2", 2), metrics(tmp_path / "b" / "phase2", 2)]
    fig, _ = curves_figure(runs)
    labels = [line.get_label() for line in fig.axes[0].lines]
    assert labels == [str(runs[0]), str(runs[1])]


def test_a_run_whose_name_starts_with_an_underscore_is_in_every_legend(tmp_path: Path) -> None:
    """matplotlib leaves out of a legend a label that starts with "_" (its "no legend" mark): a run
    folder named so is named in each panel's legend all the same, and its learning rate drawn."""
    runs = [tmp_path / "_scratch", tmp_path / "__"]
    for run in runs:
        run.mkdir()
        rows = [f"{e},{1.0 / e},{1.1 / e},{50 + e},{1e-3 / e}" for e in (1, 2, 3)]
        (run / "metrics.csv").write_text("\n".join(["epoch,train_loss,val_loss,top1,lr", *rows]) + "\n")
    fig, _ = curves_figure(runs)
    for ax in fig.axes[:3]:
        shown = [t.get_text() for t in ax.get_legend().get_texts()]
        assert shown[0].startswith("_scratch") and "__" in shown, shown
    assert not [t for t in fig.axes[2].texts if "no learning rate" in t.get_text()]


@pytest.mark.parametrize("grid", [(3, 3), (14, 14), (7, 4), (16, 2)])
def test_attention_ticks_mark_offset_zero(grid: tuple[int, int]) -> None:
    r = report()
    gh, gw = grid
    r = AttentionReport(images=r.images, grid_size=grid, patch_size=r.patch_size, blocks=r.blocks)
    ax = next(ax for ax in attention_figure(r).axes if ax.images)
    for ticks, g in ((ax.get_xticks(), gw), (ax.get_yticks(), gh)):
        assert 0 in ticks and min(ticks) >= -(g - 1) and max(ticks) <= g - 1 and len(ticks) <= 5


def test_phase_2_is_drawn_after_the_phase_1_it_continues(tmp_path: Path) -> None:
    """Two-phase training drawn as it happened: the phase-2 run whose config.json names a given
    run's conv.safetensors as its start continues that run's epochs (a dotted line at the
    conversion); a phase-2 run from impulse init, and a run with no config.json, start at epoch 1.
    Epoch ticks are whole numbers, and every panel's title lies inside the figure."""
    p1, p2, impulse = (
        metrics(tmp_path / "p1", 3),
        metrics(tmp_path / "p2", 2),
        metrics(tmp_path / "impulse", 2),
    )
    (p1 / "conv.safetensors").write_bytes(b"model")
    (p2 / "config.json").write_text(
        json.dumps({"phase": "phase2", "init_info": {"init": str(p1 / "conv.safetensors")}})
    )
    (impulse / "config.json").write_text(json.dumps({"phase": "phase2", "init_info": {"init": "impulse"}}))
    fig, _ = curves_figure([p1, p2, impulse])
    loss = fig.axes[0]
    drawn = {
        line.get_label(): list(line.get_xdata())
        for line in loss.lines
        if not line.get_label().startswith("_")
    }
    assert drawn == {"p1": [1, 2, 3], "p2 (after p1)": [4, 5], "impulse": [1, 2]}
    assert [list(line.get_xdata()) for line in loss.lines if line.get_linestyle() == ":"] == [[3, 3]]
    fig.canvas.draw()
    for ax in fig.axes[:4]:
        assert all(float(t).is_integer() for t in ax.get_xticks()), ax.get_xticks()
        box, page = ax.title.get_window_extent(), fig.bbox
        assert page.x0 <= box.x0 and box.x1 <= page.x1, ax.get_title()
    titles = [ax.title.get_window_extent() for ax in fig.axes[:4]]
    assert not any(titles[i].overlaps(titles[i + 1]) for i in range(len(titles) - 1))


def full_metrics(run: Path, rows: int, data: str = "digits", resumed: list[tuple[int, int]] = ()) -> Path:
    """A run folder as cmhsa train writes it: metrics.csv with every column, config.json with the
    dataset and an environment record per (re)start."""
    run.mkdir()
    head = "epoch,train_loss,val_loss,top1,top5,lr,epoch_seconds,images_per_s"
    lines = [f"{e},{2.0 / e},{1.0 / e},{50 + e},{90},{1e-3 / e},1.0,100.0" for e in range(1, rows + 1)]
    (run / "metrics.csv").write_text("\n".join([head, *lines]) + "\n")
    envs = [{"epoch": 0, "step": 0, "threads": 2}] + [
        {"epoch": e, "step": s, "resumed": True, "threads": 2} for e, s in resumed
    ]
    (run / "config.json").write_text(json.dumps({"phase": "phase1", "data": data, "environments": envs}))
    return run


def test_a_one_epoch_run_is_drawn_and_every_curve_a_run_has_is_there(tmp_path: Path) -> None:
    """A run of one epoch is a visible dot (a line of one point draws nothing without a marker);
    the loss panel has the training loss (dashed) beside the validation loss, a panel draws the
    learning rate, and each resume is a dash-dotted line at its epoch (mid-epoch: its middle)."""
    one = full_metrics(tmp_path / "one", 1)
    three = full_metrics(tmp_path / "three", 3, resumed=[(1, 0), (2, 5)])
    fig, notes = curves_figure([one, three])
    loss, acc, lr = fig.axes[:3]
    assert notes == []
    for ax in (loss, acc, lr):
        drawn = [line for line in ax.lines if not line.get_label().startswith("_")]
        assert all(line.get_marker() == "o" for line in drawn), ax.get_title()
    assert [line.get_label() for line in loss.lines if line.get_linestyle() == "--"] == [
        "one (train)",
        "three (train)",
    ]
    curves = [list(line.get_ydata()) for line in lr.lines if not line.get_label().startswith("_")]
    assert lr.get_yscale() == "log" and curves[1][0] == 1e-3
    resumes = sorted({line.get_xdata()[0] for line in acc.lines if line.get_linestyle() == "-."})
    assert resumes == [1.0, 2.5] and "resumed" in fig._suptitle.get_text()


def test_runs_on_different_datasets_are_said(tmp_path: Path) -> None:
    a = full_metrics(tmp_path / "a", 2, data="digits")
    b = full_metrics(tmp_path / "b", 2, data="fashion-mnist")
    _, notes = curves_figure([a, b])
    assert notes == [
        "the runs trained on different datasets (a: digits, b: fashion-mnist): "
        "their curves are not comparable"
    ]
    r = invoke("plot", a, b, "-o", tmp_path / "c.png")
    assert r.exit_code == 0 and "note: the runs trained on different datasets" in r.stderr, r.output
    assert invoke("plot", a, full_metrics(tmp_path / "c", 2), "-o", tmp_path / "d.png").stderr == ""


def test_resume_marks_from_a_config_anyone_wrote_are_bounded(tmp_path: Path) -> None:
    """config.json is read as untrusted: records that are not objects, flags that are not true,
    epochs that are not whole numbers in range (a bool, a float, 10**400, negative) are ignored,
    and at most MAX_MARKS marks are drawn."""
    from convit_convert.train.plot import MAX_MARKS, resumed_at

    run = full_metrics(tmp_path / "run", 2)
    envs = [
        "text",
        7,
        {"resumed": "yes", "epoch": 1, "step": 0},
        {"resumed": True, "epoch": True, "step": 0},
        {"resumed": True, "epoch": 1.5, "step": 0},
        {"resumed": True, "epoch": 10**400, "step": 0},
        {"resumed": True, "epoch": -1, "step": 0},
        {"resumed": True, "epoch": 1, "step": 3},
    ] + [{"resumed": True, "epoch": e, "step": 0} for e in range(2, 10_000)]
    (run / "config.json").write_text(json.dumps({"phase": "phase1", "environments": envs}))
    marks = resumed_at(run)
    assert marks[0] == 1.5 and len(marks) == MAX_MARKS
    fig, _ = curves_figure([run])
    assert fig is not None


def test_a_chain_of_a_thousand_runs_is_followed_in_linear_time(tmp_path: Path) -> None:
    """`cmhsa plot r0 ... r999`, each run's config.json naming the previous run's model as its start:
    one stat per model file and start, each chain followed iteratively (no recursion), run i drawn
    after the i runs before it."""
    import time

    from convit_convert.train.plot import epoch_offsets

    runs = []
    for i in range(1000):
        run = tmp_path / f"r{i}"
        run.mkdir()
        (run / "vit.safetensors").write_bytes(b"model")
        if i:
            start = {"phase": "phase2", "init_info": {"init": str(runs[-1] / "vit.safetensors")}}
            (run / "config.json").write_text(json.dumps(start))
        runs.append(run)
    t0 = time.perf_counter()
    offsets = epoch_offsets(runs, {run: 2.0 for run in runs})
    assert time.perf_counter() - t0 < 20  # 1000 runs; the quadratic search it replaced took ~90 s
    assert [offsets[run][0] for run in runs] == [2.0 * i for i in range(1000)]
    assert offsets[runs[5]][1] == runs[4] and offsets[runs[0]][1] is None
    # a cycle no real runs make: drawn, from epoch 1 where it closes
    (runs[0] / "config.json").write_text(
        json.dumps({"phase": "phase2", "init_info": {"init": str(runs[2] / "vit.safetensors")}})
    )
    cyc = epoch_offsets(runs[:3], {run: 2.0 for run in runs[:3]})
    assert sorted(v for v, _ in cyc.values()) == [0.0, 2.0, 4.0]


def test_metrics_files_are_read_within_one_budget_for_the_whole_plot(tmp_path: Path) -> None:
    """A 128 MiB metrics.csv (within the per-file limit), and two of them: rows are read one at a
    time, their known columns only, against one budget for every run of the plot: past it, one line
    naming the file."""
    from conftest import one_error_line
    from convit_convert.train import plot

    big = tmp_path / "big"
    big.mkdir()
    head = "epoch,train_loss,val_loss,top1,top5,lr,epoch_seconds,images_per_s,unknown_column"
    rows = (f"{e},1,1,50,90,0.001,1,100,x" for e in range(1, plot.MAX_PLOT_ROWS + 2))
    (big / "metrics.csv").write_text(head + "\n" + "\n".join(rows) + "\n")
    r = invoke("plot", big, "-o", tmp_path / "c.png")
    one_error_line(r, 2, str(big / "metrics.csv"), f"past {plot.MAX_PLOT_ROWS:,} rows")
    half = plot.MAX_PLOT_ROWS // 2 + 1
    runs = [metrics(tmp_path / f"s{i}", half) for i in range(2)]  # each within it, both not
    one_error_line(invoke("plot", *runs, "-o", tmp_path / "d.png"), 2, f"past {plot.MAX_PLOT_ROWS:,} rows")
    assert not (tmp_path / "c.png").exists() and not (tmp_path / "d.png").exists()
