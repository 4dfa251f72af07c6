"""Every script in bench/ and bench/investigations/ runs, at a tiny size, and prints its table: a
benchmark that no longer runs is found here, not by the next person who needs its figure. What it
prints at this size measures nothing (BENCHMARKS.md holds the measurements). Then bench/gpu_suite.py's
CPU-side logic: the plan without a GPU, the peak table, the goals and the report rendered from the
figures recorded on an H100, and the attention forms it times (against an independent float64
softmax over the N keys plus the sink). The one test file that runs or loads bench/'s scripts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import ROOT, write_idx

BENCH = ROOT / "bench"
RECORDED = BENCH / "results" / "h100-2026-11-23"


def load_script(path: Path):
    """A bench/ script as a module, by its path (bench/ is not put on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_suite = load_script(BENCH / "gpu_suite.py")


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


# bench/gpu_suite.py ------------------------------------------------------------------------------


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_without_a_gpu_it_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    args = [sys.executable, str(BENCH / "gpu_suite.py"), str(tmp_path / "out")]
    r = subprocess.run([*args, "--dry-run"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "would run, in order: env, tests, exact, attention, train, profile, infer, step, e2e" in r.stdout
    assert "pytest -m cuda tests/test_cuda.py" in r.stdout
    if not torch.cuda.is_available():
        r = subprocess.run([*args, "--sections", "exact"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0 and r.stdout.startswith("no CUDA device here: nothing measured.")
        assert not (tmp_path / "out").exists()
    r = subprocess.run([*args, "--sections", "tests,bogus"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown section(s) ['bogus']" in r.stderr


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.4),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H200", 989.4),
        ("Tesla T4", None),
    ],
)
def test_dense_bf16_peak(name: str, peak: float | None) -> None:
    assert gpu_suite.dense_bf16_peak(name)[0] == peak


def test_goals_and_report_from_the_recorded_h100_run() -> None:
    results = json.loads((RECORDED / "suite.json").read_text())
    train = results["sections"]["train"]
    goals = gpu_suite.train_goals(train["rows"])["compiled"]
    # the recorded run's figures, worked by hand from its rows (images/s 2,380.4 for phase 2 at
    # qk_dim 64 and 2,973.4 for DeiT-base, 3,195.2 for phase 1; MFU 30.0 %), to 4 digits
    assert goals["phase2_qk64_vs_deit_base (goal >= 0.5)"] == pytest.approx(2380.39 / 2973.36, abs=1e-4)
    assert goals["phase2_qk64_over_phase1_step (goal <= 3)"] == pytest.approx(3195.16 / 2380.39, abs=1e-4)
    assert goals["phase2_qk64_mfu (goal >= 0.40 compiled)"] == pytest.approx(0.3003, abs=1e-4)
    md = gpu_suite.markdown(results)
    assert md == (RECORDED / "suite.md").read_text()  # the committed report is this renderer's output
    for heading in (
        "## tests (ok",
        "## exact (ok",
        "## attention (ok",
        "## train (ok",
        "## infer (ok",
        "## profile (ok",
    ):
        assert heading in md
    assert [c["status"] for c in results["sections"]["tests"]["cases"]] == ["passed"] * 10


def test_attention_forms_equal_an_independent_softmax_with_a_sink() -> None:
    g = torch.Generator().manual_seed(0)
    b, h, n, qk, vd = 2, 3, 7, 4, 5
    q, k = torch.randn(b, h, n, qk, generator=g), torch.randn(b, h, n, qk, generator=g)
    v = torch.randn(b, h, n, vd, generator=g)
    bias, sink = torch.randn(h, n, n, generator=g) * 3, torch.randn(h, generator=g)
    # reference: N + 1 keys in float64, the last with logit sink[h] and a zero value, by loops
    ref = torch.zeros(b, h, n, vd, dtype=torch.float64)
    for bi in range(b):
        for hi in range(h):
            for i in range(n):
                logits = [
                    float(q[bi, hi, i] @ k[bi, hi, j]) / qk**0.5 + float(bias[hi, i, j]) for j in range(n)
                ]
                w = torch.tensor([*logits, float(sink[hi])], dtype=torch.float64).softmax(0)
                ref[bi, hi, i] = (w[:n, None] * v[bi, hi].double()).sum(0)
    for name, form in gpu_suite.attention_forms().items():
        if name == "flex":
            continue  # CUDA only (compiled)
        out = form(q, k, v, bias, sink)
        assert (out.double() - ref).abs().max() / ref.abs().max() < 1e-6, name
