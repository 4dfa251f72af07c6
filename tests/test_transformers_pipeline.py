"""A cmhsa timm folder runs in transformers' image-classification pipeline (TimmWrapper), after
``import convit_convert.timm``, with the class names the folder records, and says what cmhsa
predict says about the same images. The pipeline builds the model without its non-persistent
buffers and calls ``init_non_persistent_buffers`` (timm's convention); it makes every image RGB,
which a grey model takes as its luma (PIL's "L")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from PIL import Image

import convit_convert.timm  # noqa: F401  (registers cmhsa's architectures)
from conftest import FIXTURE, conv_model, invoke
from convit_convert.api import save_checkpoint
from convit_convert.api.predict import predict_files
from convit_convert.attention import RelPosAttention
from convit_convert.conv_mixer import ConvMixer
from convit_convert.labels import KEY
from convit_convert.options.operations import PredictOptions

transformers = pytest.importorskip("transformers")  # the dev extra installs it
DIGITS = sorted((FIXTURE.parent / "digits").glob("*.png"))


def pipeline_says(folder: Path, images: list[Path], k: int) -> list[list[tuple[str, float]]]:
    classify = transformers.pipeline("image-classification", model=str(folder), device="cpu")
    return [[(o["label"], o["score"]) for o in classify(Image.open(p), top_k=k)] for p in images]


def predict_says(model: Path, images: list[Path], k: int) -> list[list[tuple[str, float]]]:
    r = predict_files(model, images, PredictOptions(top_k=k, device="cpu"))
    return [[(name, prob) for name, _, prob in p.top] for p in r.predictions]


def test_a_colour_attention_model_runs_with_its_class_names(tmp_path: Path) -> None:
    m = conv_model(seed=3, dtype=torch.float32, in_chans=3)
    names = [f"class {c}" for c in "ABCDEFGHIJ"[: m.cfg.num_classes]]
    save_checkpoint(tmp_path / "conv.safetensors", m.cfg, m.state_dict(), {KEY: json.dumps(names)})
    assert invoke("convert", tmp_path / "conv.safetensors", "-o", tmp_path / "vit.safetensors").exit_code == 0
    args = ("export", tmp_path / "vit.safetensors", "--format", "timm", "-o", tmp_path / "timm")
    assert invoke(*args).exit_code == 0
    images = []
    for i, p in enumerate(DIGITS[:4]):  # colour images of the model's size and larger
        img = Image.open(p).convert("RGB").resize((12 + 4 * i, 8 + 8 * i))
        img.putpixel((1, 1), (200, 10, 90))
        images.append(tmp_path / f"{i}.png")
        img.save(images[-1])
    said, expected = (
        pipeline_says(tmp_path / "timm", images, 3),
        predict_says(tmp_path / "vit.safetensors", images, 3),
    )
    for got, want in zip(said, expected, strict=True):
        assert [n for n, _ in got] == [n for n, _ in want]
        assert [s for _, s in got] == pytest.approx([s for _, s in want], abs=1e-5)  # float32 rounding


def test_a_grey_model_runs_as_cmhsa_predicts(tmp_path: Path) -> None:
    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "timm").exit_code == 0
    said = pipeline_says(tmp_path / "timm", DIGITS, 2)
    expected = predict_says(FIXTURE, DIGITS, 2)
    assert [[n.removeprefix("LABEL_") for n, _ in g] for g in said] == [[n for n, _ in w] for w in expected]
    assert [s for g in said for _, s in g] == pytest.approx([s for w in expected for _, s in w], abs=1e-5)


def test_non_persistent_buffers_are_rebuilt_by_their_module() -> None:
    """As TimmWrapper does: built on the meta device, moved with empty storage, then init."""
    for make in (
        lambda: RelPosAttention(12, (3, 4), 2, 4, 4),
        lambda: ConvMixer(2, 5, 1, (3, 4), 2, form="tokens"),
    ):
        fresh = make()
        with torch.device("meta"):
            built = make()
        built = built.to_empty(device="cpu")
        built.init_non_persistent_buffers()
        for name, buf in fresh.named_buffers():
            assert torch.equal(dict(built.named_buffers())[name], buf), name
