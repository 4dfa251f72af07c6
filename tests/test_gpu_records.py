"""The measured results the docs quote are the raw files' (experiments/results/, bench/results/):
the GPU runs, and the CPU scales read beside them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def test_the_60k_table_in_experiments_md_is_the_raw_runs(tmp_path: Path) -> None:
    """experiments/gpu_60k_report.py recomputes the H100 60k comparison from its raw JSON files:
    every table row it prints stands in EXPERIMENTS.md as printed (the bold of the best start
    aside), and it draws the curves."""
    png = tmp_path / "curves.png"
    r = subprocess.run(
        [sys.executable, "experiments/gpu_60k_report.py", "--plot", str(png)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    doc = (ROOT / "EXPERIMENTS.md").read_text(encoding="utf-8").replace("**", "")
    assert len(rows) == 5 and all(row in doc for row in rows), rows
    assert png.stat().st_size > 10_000


PLATEAU = ROOT / "experiments" / "results" / "plateau_e200_n60000_h100"


# the CPU scales between 1k and 60k (experiments/plateau_stacked.py): README column -> (raw runs, flags)
CPU_SCALES = {
    "4k": ("plateau_e200_n4000_cpu", ("--epochs", "200", "--train-samples", "4000", "--seeds", "0", "1")),
    "16k": ("plateau_e200_n16000_cpu", ("--epochs", "200", "--train-samples", "16000", "--seeds", "0", "1")),
}


def plateau_report(
    tmp_path: Path, raw_runs: Path = PLATEAU, flags: tuple[str, ...] = ("--figure2",)
) -> dict[str, tuple[str, str]]:
    """experiments/plateau_stacked.py --report on a copy of a plateau run's raw files (it writes
    results.json beside them; the H100 run's by default): setting -> (top-1 per seed, mean ±
    half-range), for the settings that ran."""
    import shutil

    raw = shutil.copytree(raw_runs, tmp_path / raw_runs.name)
    r = subprocess.run(
        [sys.executable, "experiments/plateau_stacked.py", "--report", "--out", str(raw), *flags],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [ln.split("|")[1:5] for ln in r.stdout.splitlines() if ln.startswith("| ") and "---" not in ln]
    return {name.strip(): (seeds.strip(), mean.strip()) for name, _, seeds, mean in rows[1:] if mean.strip()}


def test_the_plateau_table_in_experiments_md_is_the_raw_runs(tmp_path: Path) -> None:
    """Every setting of the H100 plateau run: its per-seed top-1 and its mean ± half-range, as the
    report recomputes them from the raw metrics.csv files, stand in EXPERIMENTS.md's table."""
    rows = plateau_report(tmp_path)
    assert set(rows) == {
        "phase 1 only",
        "phase-1 half alone (E/2)",
        "two-phase, gated pinning",
        "two-phase, hard pinning",
        "two-phase, gated, no warm-up in phase 2",
    }
    doc = (ROOT / "EXPERIMENTS.md").read_text(encoding="utf-8").replace("**", "")
    section = doc.split("### At a plateau: 200 epochs", 1)[1].split("\n### ", 1)[0]
    for name, (seeds, mean) in rows.items():
        assert f"| {seeds} | {mean} |" in section, (name, seeds, mean)


def _raw_rows(md: str) -> dict[str, str]:
    """A results .md table's setting -> its "top-1 %" cell."""
    rows = [ln.split("|")[1:3] for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln]
    return {name.strip(): top1.strip() for name, top1 in rows[1:]}


def test_readmes_start_table_is_the_experiments_raw_results(tmp_path: Path) -> None:
    """README's "Which start should I use?" tables, cell for cell, are the raw results of every
    scale: the 1k depth-2 and depth-6 runs' result files, the CPU scales' and the 60k plateau's
    reports (plateau_stacked.py --report), the 60k 40-epoch report's output ("–": not run). Rows are
    matched by the setting each experiment names."""
    results = ROOT / "experiments" / "results"
    d2 = _raw_rows((results / "init_comparison_cpu_e200_n1000.md").read_text(encoding="utf-8"))
    d6_md = (results / "tuned_comparison_d6.md").read_text(encoding="utf-8")
    d6 = _raw_rows("| setting |" + d6_md.split("| setting |", 1)[1])  # its second table: the full runs
    r = subprocess.run(
        [sys.executable, "experiments/gpu_60k_report.py", "--plot", str(tmp_path / "c.png")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    gpu = {k: v for k, v in (ln.split("|")[1:4:2] for ln in r.stdout.splitlines() if ln.startswith("| "))}
    gpu = {k.strip(): v.strip().replace("**", "") for k, v in gpu.items()}
    plateau = {k: mean for k, (_, mean) in plateau_report(tmp_path).items()}
    cpu = [  # 4k, 16k: their own runs' report
        {k: mean for k, (_, mean) in plateau_report(tmp_path, results / src, flags).items()}
        for src, flags in CPU_SCALES.values()
    ]
    settings = {  # README's row -> its name in each column (1k d2, 1k d6, 4k, 16k, 60k, 60k at 200)
        "phase 1 only": ("phase 1 only",) * 6,
        "--init impulse": (
            "phase 2 only, impulse init (conversion's offsets)",
            "phase 2 only, impulse init",
            "phase 2 only, impulse init",
            None,  # not run at 16k
            "phase 2 only, impulse init",
            None,
        ),
        "--init mimetic": ("phase 2 only, mimetic init", None, None, None, None, None),
        "gated": ("two-phase, gated pinning",) * 6,
        "hard pinning": (
            "two-phase, hard pinning",
            "two-phase, hard pinning (the paper's)",
            "two-phase, hard pinning",
            "two-phase, hard pinning",
            "two-phase, hard pinning",
            "two-phase, hard pinning",
        ),
        "--init random": ("phase 2 only, random init",) * 2 + (None, None, "phase 2 only, random init", None),
    }
    columns = (d2, d6, *cpu, gpu, plateau)
    table, restart = _readme_tables()
    assert len(table) == len(settings)
    for line in table:
        start, *cells = (c.strip() for c in line.strip("|").split("|"))
        names = next(v for k, v in settings.items() if k in start)
        want = [raw[n] if n else "–" for raw, n in zip(columns, names, strict=True)]
        assert cells == want, (start, cells, want)
    # the restart control's table: one session per column, its own raw files (4k, 16k: the table's)
    d2 = _raw_rows((results / "init_comparison_cpu_e200_n1000_restart.md").read_text(encoding="utf-8"))
    d6_md = (results / "tuned_comparison_d6_restart.md").read_text(encoding="utf-8")
    d6 = _raw_rows("| setting |" + d6_md.split("| setting |", 1)[1])
    restarted = "phase 1, restarted (phase 2's rate and warm-up, no conversion)"
    settings = {
        "phase 1 only": ("phase 1 only",) * 4,
        "restarted": (restarted,) * 4,
        "hard pinning": (
            "two-phase, hard pinning",
            "two-phase, hard pinning (the paper's)",
            "two-phase, hard pinning",
            "two-phase, hard pinning",
        ),
        "gated": ("two-phase, gated pinning",) * 4,
    }
    assert len(restart) == len(settings)
    for line in restart:
        start, *cells = (c.strip() for c in line.strip("|").split("|"))
        names = next(v for k, v in settings.items() if k in start)
        want = [raw[n] for raw, n in zip((d2, d6, *cpu), names, strict=True)]
        assert cells == want, (start, cells, want)


def _readme_tables() -> list[list[str]]:
    """The table rows (header dropped, bold removed) of each table in README's "Which start?"."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Which start?", 1)[1].split("\n## ", 1)[0]
    tables = [[]]
    for ln in section.splitlines():
        if ln.startswith("|"):
            tables[-1].append(ln.replace("**", ""))
        elif tables[-1]:
            tables.append([])
    return [[ln for ln in t if "---" not in ln][1:] for t in tables if t]


def test_the_restart_sections_per_seed_numbers_and_shares_are_the_raw_runs() -> None:
    """EXPERIMENTS.md's restart control: each scale's per-seed line (the final top-1 on the 10k of
    every arm) and the row of "What the restart explains" (differences of the seeds' means, each
    rounded to 0.01) are recomputed from the raw results' JSON."""
    import json
    import statistics

    doc = (ROOT / "EXPERIMENTS.md").read_text(encoding="utf-8")
    section = doc.split("## What two-phase gains, separated", 1)[1].split("\n## ", 1)[0]
    results = ROOT / "experiments" / "results"
    scales = {  # raw file -> the scale's row in the summary table
        "init_comparison_cpu_e200_n1000_restart.json": "| 1k images, depth 2 |",
        "tuned_comparison_d6_restart.json": "| 1k images, depth 6, tuned |",
    }
    for name, row in scales.items():
        runs = json.loads((results / name).read_text(encoding="utf-8"))["runs"]
        top1 = {
            arm: [runs[f"seed{s}/{arm}"]["final"]["top1"] for s in (0, 1)]
            for arm in ("half-p1", "p1-restart", "hard", "gated", "p1")
        }
        prose = " ".join(section.split())  # lines wrap anywhere
        for arm, values in top1.items():
            assert " / ".join(f"{v:.2f}" for v in values) in prose, (name, arm, values)
        mean = {arm: statistics.mean(v) for arm, v in top1.items()}
        steps = [
            mean["p1-restart"] - mean["half-p1"],
            mean["hard"] - mean["p1-restart"],
            mean["gated"] - mean["hard"],
            round(mean["p1"], 2) - round(mean["gated"], 2),  # the tables' rounded means
        ]
        want = row + " " + " | ".join(f"{d:+.2f}".replace("-", "\u2212") for d in steps) + " |"
        assert want in section, (want, [ln for ln in section.splitlines() if ln.startswith(row)])


def test_the_crossover_tables_and_figure_are_the_raw_runs(tmp_path: Path) -> None:
    """experiments/crossover.py recomputes, from every scale's raw runs (experiments/results/), the
    table of starts, the table of two-phase's gain taken apart and the plateau check: each row it
    prints stands in EXPERIMENTS.md's section "Where does two-phase start to pay?", the gain's
    rows in the opening answer too, and the figure's points are the committed
    experiments/results/crossover.json."""
    import json

    points = tmp_path / "points.json"
    r = subprocess.run(
        [sys.executable, "experiments/crossover.py", "--json", str(points)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ")]
    doc = (ROOT / "EXPERIMENTS.md").read_text(encoding="utf-8").replace("**", "")
    section = doc.split("## Where does two-phase start to pay?", 1)[1].split("\n## ", 1)[0]
    assert len(rows) >= 15 and all(row in section for row in rows), [r for r in rows if r not in section]
    opening = doc.split("### The answer, by the size of the training set", 1)[1].split("\n### ", 1)[0]
    steps = [
        row for row in rows if row.startswith(("| restart (", "| reparameterisation (", "| attention ("))
    ]
    assert len(steps) == 3 and all(row in opening for row in steps), [r for r in steps if r not in opening]
    committed = ROOT / "experiments" / "results" / "crossover.json"
    assert json.loads(points.read_text()) == json.loads(committed.read_text())
    assert "results/crossover.png" in section and (committed.parent / "crossover.png").stat().st_size > 10_000
