"""`cmhsa predict`: a model's most probable classes for image files, from a checkpoint, a timm
folder or an ONNX file, prepared as `cmhsa eval` prepares its own. The reference is eval's own
figure (api.on_data.evaluate_checkpoint over the digits validation split, images held in memory),
against predict over the same images saved as PNG files."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import FIXTURE, invoke, one_error_line
from convit_convert.api import save_checkpoint
from convit_convert.api.on_data import evaluate_checkpoint
from convit_convert.api.predict import predict_files
from convit_convert.data import build_data
from convit_convert.labels import KEY
from convit_convert.options.operations import EvalOptions, PredictOptions


@pytest.fixture(scope="module")
def digit_files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """digits' 359 validation images as grey PNG files, named INDEX_LABEL.png."""
    folder = tmp_path_factory.mktemp("digits_png")
    spec = build_data("digits", None, (32, 32))
    for i in range(len(spec.val)):
        img, label = spec.val[i]
        img.convert("L").save(folder / f"{i:03d}_{label}.png")
    return folder


def top1(report) -> float:
    hits = [p.top[0][1] == int(Path(p.image).stem.split("_")[1]) for p in report.predictions]
    return 100 * sum(hits) / len(hits)


def test_predict_s_top1_is_eval_s_for_a_checkpoint_an_onnx_file_and_a_timm_folder(
    digit_files: Path, shipped: Callable[[str], Path]
) -> None:
    expected = evaluate_checkpoint(FIXTURE, EvalOptions("digits", device="cpu", workers=0)).top1
    options = PredictOptions(top_k=1, device="cpu")
    ckpt = predict_files(FIXTURE, [digit_files], options)
    assert len(ckpt.predictions) == 359 and top1(ckpt) == pytest.approx(expected, abs=1e-9)
    onnx = predict_files(shipped("conv.onnx"), [digit_files], options)
    assert [p.top[0][1] for p in onnx.predictions] == [p.top[0][1] for p in ckpt.predictions]
    folder = predict_files(shipped("conv-timm"), [digit_files], options)
    assert [p.top[0] for p in folder.predictions] == [p.top[0] for p in ckpt.predictions]


def test_classes_are_named_and_written_as_csv_and_json(tmp_path: Path) -> None:
    from safetensors import safe_open

    with safe_open(str(FIXTURE), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    from convit_convert.api import load_checkpoint

    names = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
    named = tmp_path / "named.safetensors"
    save_checkpoint(named, load_checkpoint(FIXTURE).config, tensors, {KEY: json.dumps(names)})
    digits = FIXTURE.parent / "digits"
    r = invoke("predict", named, digits, "--top-k", "3", "-o", tmp_path / "p.csv")
    assert r.exit_code == 0, r.output
    assert "│ " + str(digits / "7.png") in r.output and "seven" in r.output
    rows = list(csv.DictReader((tmp_path / "p.csv").open()))
    assert len(rows) == 30 and [k for k in rows[0]] == ["image", "rank", "class", "index", "probability"]
    firsts = {Path(row["image"]).stem: row["class"] for row in rows if row["rank"] == "1"}
    assert firsts["7"] == "seven" and sum(v == names[int(k)] for k, v in firsts.items()) >= 9
    assert invoke("predict", named, digits / "3.png", "-o", tmp_path / "p.json").exit_code == 0
    doc = json.loads((tmp_path / "p.json").read_text())
    assert doc["names_from"] == "model" and len(doc["predictions"][0]["top"]) == 5
    probs = [t["probability"] for t in doc["predictions"][0]["top"]]
    assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-6


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["missing.png"], "no such file or folder"),
        (["not_an_image.png"], "not an image of a format cmhsa reads"),
        (["empty_folder"], "no image files"),
        (["img.png", "-o", "out.txt"], "must end in .csv or .json"),
        (["img.png", "--top-k", "0"], "--top-k"),
        (["img.png", "-o", "link.csv"], "symbolic link"),
    ],
)
def test_bad_input_is_one_line(tmp_path: Path, monkeypatch, args: list[str], fragment: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "not_an_image.png").write_bytes(b"not a png")
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "img.png").write_bytes((FIXTURE.parent / "digits" / "1.png").read_bytes())
    (tmp_path / "victim.csv").write_text("kept\n")
    (tmp_path / "link.csv").symlink_to("victim.csv")
    if "-o" in args:  # a bad output is refused before any image is read
        monkeypatch.setattr("convit_convert.api.predict.predict_images", None)
    one_error_line(invoke("predict", FIXTURE, *args), 2, fragment)
    assert not (tmp_path / "out.txt").exists() and (tmp_path / "victim.csv").read_text() == "kept\n"


def test_an_image_s_name_is_shown_as_text(tmp_path: Path) -> None:
    hostile = tmp_path / "x\nerror: fake [bold]y.png"
    hostile.write_bytes((FIXTURE.parent / "digits" / "1.png").read_bytes())
    r = invoke("predict", FIXTURE, hostile)
    assert r.exit_code == 0, r.output
    assert not [line for line in r.output.splitlines() if line.startswith("error")]
    assert "x\\x0aerror: fake [bold]y.png" in r.output
