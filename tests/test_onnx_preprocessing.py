"""An exported ONNX file carries its preprocessing: README's plain-onnxruntime block, run as a
deployer would (no torch in it), reproduces `cmhsa eval`'s top-1 from the file's metadata alone."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from conftest import ROOT
from convit_convert.api.on_data import evaluate_checkpoint
from convit_convert.data import build_data
from convit_convert.options.operations import EvalOptions

FIXTURE = ROOT / "fixtures" / "conv_digits.safetensors"


def readme_snippet(name: str) -> str:
    text = (ROOT / "docs" / "sharing.md").read_text(encoding="utf-8")
    m = re.search(rf"<!-- snippet: {name} -->\n```python\n(.*?)```", text, re.S)
    assert m is not None, name
    return m.group(1)


def test_readmes_onnxruntime_block_reproduces_cmhsa_evals_top1(shipped: Callable[[str], Path]) -> None:
    """The digits fixture (1 channel, 32 px) exported, then README's block on every validation
    image (8×8 RGB PIL images, as scikit-learn's digits load): the same top-1 as `cmhsa eval`,
    to the image (both resize with PIL's bicubic and crop alike)."""
    onnx_path = shipped("conv.onnx")
    scope: dict = {}
    exec(readme_snippet("onnx-preprocess").replace('"vit.onnx"', repr(str(onnx_path))), scope)
    val = build_data("digits", None, (32, 32)).val
    correct = sum(scope["predict"](img) == label for img, label in (val[i] for i in range(len(val))))
    ours = 100 * correct / len(val)
    theirs = evaluate_checkpoint(FIXTURE, EvalOptions("digits", workers=0)).top1
    assert abs(ours - theirs) < 1e-9, (ours, theirs)
