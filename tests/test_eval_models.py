"""`cmhsa eval` measures every model `predict` takes: a checkpoint, a timm folder cmhsa wrote and an
ONNX file cmhsa exported (run in onnxruntime as shipped, with the preprocessing its metadata_props
record). The reference is the checkpoint's own evaluation (torch, timm's evaluation transform).

Tolerance: the timm folder holds the checkpoint's tensors, so its figures are equal. The ONNX
file's logits agree with torch's to export's check (relative 1e-5 of the largest logit), so a
near-tie may flip: top-1 within one image of the 359, the loss within 1e-4 relative."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import invoke, one_error_line
from convit_convert.api.on_data import evaluate_checkpoint
from convit_convert.options.operations import EvalOptions

ONE_IMAGE = 100 / 359  # digits' validation split: one image, in top-1 points
OPTIONS = EvalOptions("digits", device="cpu", workers=0)


@pytest.fixture
def files(shipped: Callable[[str], Path]) -> dict[str, Path]:
    """The digits fixture and its attention conversion, each as the three files a user ships."""
    names = [f"{kind}{form}" for kind in ("conv", "attn") for form in ("", ".onnx", "-timm")]
    return {name: shipped(name) for name in names}


@pytest.mark.parametrize("kind", ["conv", "attn"])
def test_a_timm_folder_and_an_onnx_file_measure_as_their_checkpoint(
    files: dict[str, Path], kind: str
) -> None:
    ref = evaluate_checkpoint(files[kind], OPTIONS)
    folder = evaluate_checkpoint(files[f"{kind}-timm"], OPTIONS)
    assert (folder.top1, folder.top5, folder.val_loss) == (ref.top1, ref.top5, ref.val_loss)
    assert folder.classes == ref.classes and folder.confused == ref.confused
    onnx = evaluate_checkpoint(files[f"{kind}.onnx"], OPTIONS)
    assert onnx.kind == "onnx" and onnx.form == "onnxruntime, CPUExecutionProvider"
    assert onnx.images == ref.images == 359
    assert abs(onnx.top1 - ref.top1) <= ONE_IMAGE + 1e-9 and abs(onnx.top5 - ref.top5) <= ONE_IMAGE + 1e-9
    assert onnx.val_loss == pytest.approx(ref.val_loss, rel=1e-4)
    assert [r.name for r in onnx.classes] == [r.name for r in ref.classes]
    assert [r.images for r in onnx.classes] == [r.images for r in ref.classes]


def test_the_cli_prints_each_model_s_table(files: dict[str, Path]) -> None:
    for name, kind in (("attn.onnx", "onnx, onnxruntime, CPUExecutionProvider"), ("attn-timm", "attn, ")):
        r = invoke("eval", files[name], "--data", "digits", "--device", "cpu", "--workers", "0")
        assert r.exit_code == 0, r.output
        assert f"{files[name]} on digits (val, 359 images)" in r.output.replace("\n", "")
        assert f"│ {kind}" in r.output and "Per class" in r.output


def test_an_onnx_file_s_own_preprocessing_is_not_overridden(files: dict[str, Path]) -> None:
    r = invoke("eval", files["conv.onnx"], "--data", "digits", "--crop-pct", "0.9")
    one_error_line(r, 2, str(files["conv.onnx"]), "carries its own preprocessing", "--crop-pct")


def test_cuda_for_an_onnx_file_needs_onnxruntime_s_cuda_provider(files: dict[str, Path]) -> None:
    import onnxruntime

    if "CUDAExecutionProvider" in onnxruntime.get_available_providers():
        pytest.skip("onnxruntime-gpu is installed here: the provider exists")
    r = invoke("eval", files["conv.onnx"], "--data", "digits", "--device", "cuda")
    one_error_line(r, 2, "no CUDAExecutionProvider", "the gpu extra")


def test_eval_reads_an_onnx_file_once(
    files: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deciding how to run an ONNX file reads it, and that read serves the run: one bounded load
    (and one full check) whether it runs as shipped or is imported as a conv-phase graph."""
    import onnx

    from convit_convert.onnx import load as onnx_load

    bare = onnx.load(str(files["conv.onnx"]))
    del bare.metadata_props[:]  # no cmhsa export's record: read as a conv-phase graph
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    reads: list[str] = []
    load_onnx = onnx_load.load_onnx
    monkeypatch.setattr(onnx_load, "load_onnx", lambda p: reads.append(str(p)) or load_onnx(p))
    for name in (files["conv.onnx"], tmp_path / "bare.onnx"):
        reads.clear()
        report = evaluate_checkpoint(name, OPTIONS)
        assert reads == [str(name)] and report.images == 359, (name, reads)
