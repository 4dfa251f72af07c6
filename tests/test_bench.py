"""Every script in bench/ and bench/investigations/ runs, at a tiny size, and prints its table: a
benchmark that no longer runs is found here, not by the next person who needs its figure. What it
prints at this size measures nothing (BENCHMARKS.md holds the measurements)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import ROOT, write_idx

BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def fmnist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Fashion-MNIST: 512 training and 64 validation images in the four IDX files."""
    root = tmp_path_factory.mktemp("fmnist")
    rng = np.random.default_rng(0)
    for split, n in (("train", 512), ("t10k", 64)):
        write_idx(root / f"{split}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(root / f"{split}-labels-idx1-ubyte.gz", np.arange(n) % 10)
    return root


def run(script: str, *args: object, cwd: Path = ROOT, timeout: int = 300) -> str:
    """``python bench/SCRIPT ARGS`` from ``cwd``: exit 0, its output."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    r = subprocess.run(
        [sys.executable, str(BENCH / script), *map(str, args)],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert r.returncode == 0, (script, r.stdout[-2000:], r.stderr[-3000:])
    return r.stdout


# script -> (arguments, with {data} and {tmp} filled in; what its output must hold)
CASES = {
    "convert.py": (["--tiny", "--repeats", "1", "--out", "{tmp}"], "| sink | dtype |"),
    "approximate.py": (["--rounds", "1", "--images", "16", "--heldout", "16"], "heads --checkpoint sweep"),
    "train_small.py": (
        ["--data-dir", "{data}", "--train-samples", "256", "--epochs", "1", "--recipe", "experiments"],
        "| device",
    ),
    "train_step.py": (["--tiny", "--steps", "1", "--warmup", "0"], "s/step"),
    "inference.py": (["--tiny", "--iters", "1"], "| timm deit_base_patch16_224 |"),
    "onnx_speed.py": (
        ["--tiny", "--iters", "1", "--batches", "1", "--exporters", "legacy", "--models", "conv", "attn64"],
        "| AttnViT qk_dim 64 | fused | legacy |",
    ),
    "stacked_cpu.py": (["--seeds", "2", "--epochs", "1", "--phases", "phase1"], "one after another"),
    "stacked_seeds.py": (
        [
            *("--device", "cpu", "--data-dir", "{data}", "--train-samples", "512", "--epochs", "2"),
            *("--stacks", "1", "--separate", "1", "--phases", "phase1", "--val-samples", "64"),
            *("--out", "{tmp}/s.json"),
        ],
        "1 processes, one seed each",
    ),
    "gpu_suite.py": (["{tmp}/gpu", "--dry-run"], "train"),
    "ops_per_step.py": (["--batch", "2", "--repeats", "1", "--data-dir", "{data}"], "host reads per step"),
    "attention_cost.py": (["--tiny", "--batches", "1"], "attention_stats"),
    "threads.py": (
        ["--tiny", "--busy", "1", "--threads", "default", "--sizes", "cpu", "--out", "{tmp}"],
        "| cpu | 2 | 1 |",
    ),
    "investigations/stacked_kernels.py": (
        ["--tiny", "--phases", "phase1", "--stacks", "1", "--batch", "2", "--data-dir", "{data}"],
        "| phase",
    ),
    "investigations/stacked_eval.py": (
        [*("--seeds", "2", "--phases", "phase1", "--val", "64", "--batch", "32", "--data-dir", "{data}")],
        "batched / own",
    ),
    "investigations/token_mixer.py": (["--tiny", "--rounds", "1"], "| tokens form |"),
    "investigations/train_forms.py": (["--model", "digits", "--steps", "1", "--warmup", "0"], "ms/step"),
}


def test_every_script_in_bench_has_a_case() -> None:
    scripts = {p.relative_to(BENCH).as_posix() for p in BENCH.rglob("*.py")} - {"sizes.py"}
    assert scripts == set(CASES) | {"quick_start.py"}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(CASES))
def test_a_benchmark_runs_at_a_tiny_size(script: str, fmnist: Path, tmp_path: Path) -> None:
    args, shown = CASES[script]
    out = run(script, *(a.format(data=fmnist, tmp=tmp_path) for a in args))
    assert shown in out, out[-3000:]


@pytest.mark.slow
def test_the_quick_start_bench_runs_the_readmes_commands(tmp_path: Path) -> None:
    """In a clone-like folder (README.md, the fixtures, this checkout's .venv), its first two
    commands: convert and verify, each timed and exit 0."""
    clone = tmp_path / "clone"
    clone.mkdir()
    (clone / "README.md").write_text((ROOT / "README.md").read_text(encoding="utf-8"), encoding="utf-8")
    (clone / "fixtures").symlink_to(ROOT / "fixtures")
    (clone / ".venv").symlink_to(Path(sys.executable).parent.parent)
    out = run("quick_start.py", clone, "--only", "2")
    lines = [line for line in out.splitlines() if " s  exit " in line]
    assert len(lines) == 2 and all("exit 0  cmhsa " in line for line in lines), out
    assert "in all (2 commands" in out


def test_the_gpu_call_names_scripts_that_are_there() -> None:
    """bench/investigations/stacked_gpu_call.sh cannot run without a GPU; what it runs exists and
    the shell reads it."""
    import re

    call = BENCH / "investigations" / "stacked_gpu_call.sh"
    assert subprocess.run(["bash", "-n", str(call)], capture_output=True).returncode == 0
    text = call.read_text()
    named = set(re.findall(r"python (?:bench/)?(?:investigations/)?([a-z_]+\.py)", text))
    assert named == {"token_mixer.py", "stacked_kernels.py", "stacked_eval.py", "stacked_seeds.py"}
    assert "bench/stacked_seeds.py" in text and all(list(BENCH.rglob(n)) for n in named)


def test_every_script_is_named_in_benchmarks_md_and_no_other_is() -> None:
    """BENCHMARKS.md names every script bench/ holds (its headline table, a section or its
    Investigations); a bench/ path it names that is not there is a removed probe, which it may
    name only with the commit it ran at ("git show COMMIT:bench/NAME.py")."""
    import re

    text = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    scripts = {
        p.relative_to(ROOT).as_posix()
        for p in BENCH.rglob("*")
        if p.suffix in (".py", ".sh") and "results" not in p.relative_to(BENCH).parts  # a call's raw files
    }
    assert all(s in text for s in scripts), sorted(s for s in scripts if s not in text)
    named = set(re.findall(r"bench/[a-z_/]+\.(?:py|sh)", text)) - {"bench/NAME.py"}
    gone = named - scripts
    assert "git show COMMIT:bench/NAME.py" in text and all(f"`{g}" in text for g in gone), gone
