"""bench/gpu_suite.py's CPU-side logic: the plan without a GPU, the peak table, the goals and the
report rendered from the figures recorded on an H100, and the attention forms it times (against an
independent float64 softmax over the N keys plus the sink)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT

RECORDED = ROOT / "bench" / "results" / "h100-2026-11-23"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_suite  # noqa: E402  (a script beside the benchmarks, not a package)


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_without_a_gpu_it_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    args = [sys.executable, str(ROOT / "bench" / "gpu_suite.py"), str(tmp_path / "out")]
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
