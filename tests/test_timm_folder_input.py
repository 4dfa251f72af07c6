"""A timm folder loaded from Python (``timm.create_model("local-dir:D", pretrained=True)`` after
``import convit_convert.timm``, or ``hf-hub:``) is read as untrusted input, as cmhsa reads every
file: its config.json is checked field by field before timm parses it or builds anything, and each
hostile value ends in one CmhsaError naming the field, or in a model whose logits equal the file's;
a case's comment says what timm would do with it unchecked."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import timm
import torch

import convit_convert.timm as cmhsa_timm
from conftest import FIXTURE, invoke
from convit_convert.api import load_checkpoint
from convit_convert.errors import CmhsaError
from convit_convert.timm import export_timm_folder

DELETE = object()
DIGITS = sorted((FIXTURE.parent / "digits").glob("*.png"))
CC = ("model_args", "cmhsa_config")

# (path into config.json, new value); each case holds alone
CASES: dict[str, tuple[tuple[str, ...], Any]] = {
    "top num_classes null": (("num_classes",), None),  # was: a random head
    "top num_classes True": (("num_classes",), True),
    "top num_classes missing": (("num_classes",), DELETE),  # harmless: loads the file's model
    "model_args global_pool": (("model_args", "global_pool"), ""),  # was: no pooling, a wrong forward
    "model_args num_classes 0": (("model_args", "num_classes"), 0),  # was: no head
    "model_args device meta": (("model_args", "device"), "meta"),  # was: no weights
    "model_args dtype": (("model_args", "dtype"), "float16"),  # was: raw TypeError
    "model_args a list": (("model_args",), [1]),  # was: raw AttributeError in timm's parser
    "model_args null": (("model_args",), None),  # was: raw AttributeError
    "cmhsa_config a list": (CC, [1]),
    "cmhsa_config depth a string": ((*CC, "depth"), "4"),
    "cmhsa_config norm_eps NaN": ((*CC, "norm_eps"), float("nan")),
    "pretrained_cfg a list": (("pretrained_cfg",), [1]),  # was: raw AttributeError
    "pretrained_cfg null": (("pretrained_cfg",), None),  # was: raw AttributeError
    "input_size null": (("pretrained_cfg", "input_size"), None),
    "input_size of bools": (("pretrained_cfg", "input_size"), [True, 32, 32]),
    "pretrained num_classes null": (("pretrained_cfg", "num_classes"), None),
    "mean of three channels": (("pretrained_cfg", "mean"), [0.1, 0.2, 0.3]),
    "crop_pct 0": (("pretrained_cfg", "crop_pct"), 0),
    "url": (("pretrained_cfg", "url"), "http://127.0.0.1/weights.pth"),
    "custom_load": (("pretrained_cfg", "custom_load"), True),
    "label_offset": (("pretrained_cfg", "label_offset"), 1),
    "architecture a list": (("architecture",), ["cmhsa_conv"]),  # was: raw AttributeError in timm
    "architecture the other kind": (("architecture",), "cmhsa_attn"),
    "num_features a string": (("num_features",), "x"),
    "an unknown top-level key": (("evil",), 1),
    "license 1000 characters": (("pretrained_cfg", "license"), "x" * 1000),
    # the same tensor shapes, another model: refused by the weights' own config
    "norm_eps": ((*CC, "norm_eps"), 1e-5),
    "dilation": ((*CC, "dilation"), 2),
    "img_size": ((*CC, "img_size"), [64, 64]),
    "id2label not the classes": (("id2label",), {"0": "zero"}),
    "architectures another model": (("architectures",), ["ViTForImageClassification"]),
}
HARMLESS = {"top num_classes missing"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("timm") / "digits"
    assert export_timm_folder(FIXTURE, out).passed
    return out


def edited(folder: Path, to: Path, path: tuple[str, ...], value: Any) -> Path:
    shutil.copytree(folder, to)
    doc = json.loads((folder / "config.json").read_text())
    d = doc
    for key in path[:-1]:
        d = d[key]
    if value is DELETE:
        del d[path[-1]]
    else:
        d[path[-1]] = copy.deepcopy(value)
    (to / "config.json").write_text(json.dumps(doc))
    return to


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_config_is_one_error_or_the_file_s_model(tmp_path: Path, folder: Path, case: str) -> None:
    path, value = CASES[case]
    d = edited(folder, tmp_path / "d", path, value)
    ref = load_checkpoint(FIXTURE).model(torch.float32).eval()
    if case in HARMLESS:
        model = timm.create_model(f"local-dir:{d}", pretrained=True).eval()
        x = torch.randn(2, 1, 32, 32)
        with torch.inference_mode():
            assert torch.equal(model(x), ref(x))
        return
    with pytest.raises(CmhsaError) as e:
        timm.create_model(f"local-dir:{d}", pretrained=True)
    assert len(e.value.message) < 400 and "\n" not in e.value.message
    assert e.value.path == str(d / "config.json")
    r = invoke("predict", d, DIGITS[0])  # cmhsa's own route: the same refusal
    assert r.exit_code == 2 and "config.json" in r.output, r.output


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[" * 100_000, "nests deeper"),
        ("{not json", "not valid JSON"),
        ("x" * (2**20 + 1), "more than cmhsa"),
    ],
)
def test_an_unreadable_config_is_one_error(tmp_path: Path, folder: Path, text: str, fragment: str) -> None:
    d = shutil.copytree(folder, tmp_path / "d")
    (d / "config.json").write_text(text)  # was: RecursionError / JSONDecodeError from timm
    with pytest.raises(CmhsaError, match=fragment):
        timm.create_model(f"local-dir:{d}", pretrained=True)


def test_a_hub_folder_is_checked_before_timm_parses_it(
    tmp_path: Path, folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """hf-hub: the same checks, on the config.json timm downloads, and of it against the weights,
    from a huggingface_hub cache laid out as it lays one (offline: nothing is downloaded)."""
    from huggingface_hub import constants

    from conftest import hub_cache

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    for key, value, said in (("device", "meta", "model_args must hold"), ("norm_eps", 1e-5, "says norm_eps")):
        path = ("model_args", key) if key == "device" else (*CC, key)
        d = edited(folder, tmp_path / key, path, value)
        hub_cache(tmp_path / "hub", f"someone/cmhsa-{key}", d)
        with pytest.raises(CmhsaError, match=said):
            timm.create_model(f"hf-hub:someone/cmhsa-{key}", pretrained=True)
    hub_cache(tmp_path / "hub", "someone/cmhsa-digits", folder)
    model = timm.create_model("hf-hub:someone/cmhsa-digits", pretrained=True).eval()
    ref = load_checkpoint(FIXTURE).model(torch.float32).eval()
    x = torch.randn(2, 1, 32, 32)
    with torch.inference_mode():
        assert torch.equal(model(x), ref(x))


def test_another_architecture_s_folder_is_timm_s_to_read(tmp_path: Path) -> None:
    d = tmp_path / "other"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architecture": "resnet18", "num_classes": 3}))
    assert cmhsa_timm.folder_config(d) is None
