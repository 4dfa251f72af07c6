"""The GPU results the docs quote are the raw files' (experiments/results/, bench/results/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_the_60k_table_in_experiments_md_is_the_raw_runs(tmp_path: Path) -> None:
    """experiments/gpu_60k_report.py recomputes the H100 60k comparison from its raw JSON files:
    every table row it prints stands in EXPERIMENTS.md as printed (the bold of the best start
    aside), and it draws the curves."""
    png = tmp_path / "curves.png"
    r = subprocess.run([sys.executable, "experiments/gpu_60k_report.py", "--plot", str(png)], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    doc = (ROOT / "EXPERIMENTS.md").read_text(encoding="utf-8").replace("**", "")
    assert len(rows) == 5 and all(row in doc for row in rows), rows
    assert png.stat().st_size > 10_000
