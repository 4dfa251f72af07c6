"""timm's pretrained folder (io/timm_folder.py, `cmhsa export --format timm`): what
`timm.create_model("local-dir:DIR", pretrained=True)` loads is cmhsa's model, both kinds, two sizes;
the folder's data config is `cmhsa eval`'s transform; a folder with a bad config is one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from PIL import Image

import convit_convert.timm  # noqa: F401  (registers cmhsa's architectures)
from conftest import conv_model, invoke, one_error_line
from convit_convert.api import save_checkpoint
from convit_convert.api.convert import convert_file
from convit_convert.errors import CmhsaError
from convit_convert.io.folder import Folder
from convit_convert.io.model_card import CARD
from convit_convert.io.timm_folder import CONFIG, MODELING, WEIGHTS, write_timm_folder

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "conv_digits.safetensors"


def write_folder(path: Path, cfg, state_dict) -> None:
    """A timm folder written as a command writes one: the folder made, then held."""
    path.mkdir()
    with Folder.open(path) as held:
        write_timm_folder(held, cfg, state_dict)


def checkpoints(tmp_path: Path) -> dict[str, Path]:
    """Two sizes of each kind: the shipped digits model (1 channel, 32 px, depth 4) and a random
    12×8 px RGB model with a linear patch embedding, each with its exact conversion."""
    small = conv_model(seed=3, dtype=torch.float32, patch_embed="linear", in_chans=3)
    save_checkpoint(tmp_path / "small.safetensors", small.cfg, small.state_dict())
    files = {"conv digits": FIXTURE, "conv small": tmp_path / "small.safetensors"}
    for name, src in list(files.items()):
        out = tmp_path / f"{name.split()[1]}-attn.safetensors"
        convert_file(src, out)
        files[name.replace("conv", "attn")] = out
    return files


def test_a_folder_loads_in_timm_as_the_same_model_both_kinds_two_sizes(tmp_path: Path) -> None:
    """Each model written by `cmhsa export --format timm`, then loaded by timm from the folder as a
    timm user would: logits equal, bit for bit, to cmhsa's model from the original file on the
    same images (the same weights in the same model), and the folder holds exactly timm's two
    files, the model card and the model for transformers, config.json naming the architecture,
    classes and features."""
    from convit_convert.api import load_checkpoint

    for name, src in checkpoints(tmp_path).items():
        folder = tmp_path / name.replace(" ", "-")
        r = invoke(["export", str(src), "--format", "timm", "-o", str(folder)])
        assert r.exit_code == 0, (name, r.output)
        assert sorted(p.name for p in folder.iterdir()) == sorted([CONFIG, WEIGHTS, CARD, MODELING])
        ckpt = load_checkpoint(src)
        config = json.loads((folder / CONFIG).read_text())
        assert config["architecture"] == f"cmhsa_{ckpt.kind}"
        assert (config["num_classes"], config["num_features"]) == (
            ckpt.config.num_classes,
            ckpt.config.embed_dim,
        )
        model = timm.create_model(f"local-dir:{folder}", pretrained=True).eval()
        x = torch.randn(
            3, ckpt.config.in_chans, *ckpt.config.img_size, generator=torch.Generator().manual_seed(1)
        )
        with torch.inference_mode():
            ref = ckpt.model(torch.float32)(x)
            assert torch.equal(model(x), ref), name
            assert torch.equal(load_checkpoint(folder / WEIGHTS).model(torch.float32)(x), ref), (
                name
            )  # cmhsa reads it


def test_the_folders_data_config_is_cmhsa_evals_transform(tmp_path: Path) -> None:
    """timm's resolve_data_config + create_transform on the loaded model against the transform
    `cmhsa eval` applies (convit_convert.loaders.build_transform, eval), on an RGB image of another size:
    the same tensor."""
    from convit_convert.loaders import build_transform
    from convit_convert.options.training import TrainConfig

    small = conv_model(seed=3, dtype=torch.float32, patch_embed="linear", in_chans=3)
    write_folder(tmp_path / "m", small.cfg, small.state_dict())
    model = timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True)
    theirs = timm.data.create_transform(**timm.data.resolve_data_config(model=model))
    ours = build_transform(small.cfg.img_size, False, TrainConfig.from_flags().recipe, 3)
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 21, 3), dtype=np.uint8))
    assert torch.equal(theirs(img), ours(img))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["model_args"].update(cmhsa_config="x"), "is not a JSON object"),
        (lambda c: c["model_args"]["cmhsa_config"].update(depth=-1), "depth"),
        (lambda c: c.update(architecture="cmhsa_attn"), "missing key"),
    ],
)
def test_a_folder_with_a_bad_config_is_one_line_naming_it(tmp_path: Path, edit, message: str) -> None:
    """A config.json edited by hand: a CmhsaError naming the folder's config.json (a conv model's
    config under the attention architecture is refused as not a valid attention config)."""
    small = conv_model(seed=3, dtype=torch.float32)
    write_folder(tmp_path / "m", small.cfg, small.state_dict())
    config = json.loads((tmp_path / "m" / CONFIG).read_text())
    edit(config)
    (tmp_path / "m" / CONFIG).write_text(json.dumps(config))
    with pytest.raises(CmhsaError, match=message) as info:
        timm.create_model(f"local-dir:{tmp_path / 'm'}", pretrained=True)
    assert str(tmp_path / "m" / CONFIG) in str(info.value) and "\n" not in str(info.value)


def test_export_format_timm_refuses_a_file_as_the_folder(tmp_path: Path) -> None:
    (tmp_path / "taken").write_text("x")
    r = invoke(["export", str(FIXTURE), "--format", "timm", "-o", str(tmp_path / "taken")])
    assert r.exit_code == 2 and "a timm folder is a directory" in r.output
    assert (tmp_path / "taken").read_text() == "x"


def test_features_only_defaults_to_the_blocks_a_shallow_model_has() -> None:
    """timm's ViTs give their last 3 blocks; a depth-2 model gives its 2 (it raised "the last 3
    blocks: the model has 2"), and an out_indices past the model names out_indices."""
    feats = timm.create_model(
        "cmhsa_conv", img_size=16, patch_size=4, depth=2, kernel_size=3, features_only=True
    )
    assert [f.shape for f in feats(torch.randn(1, 3, 16, 16))] == [(1, 48, 4, 4)] * 2
    with pytest.raises(ValueError, match=r"out_indices=\(0, 5\): the model has 2 blocks"):
        timm.create_model(
            "cmhsa_conv",
            img_size=16,
            patch_size=4,
            depth=2,
            kernel_size=3,
            features_only=True,
            out_indices=(0, 5),
        )


@pytest.mark.slow  # a whole command in a subprocess, or a signal or a budget: the full tier
def test_a_trained_models_folder_has_a_model_card_the_hub_reads(tmp_path: Path) -> None:
    """`cmhsa train --export-timm` writes README.md beside timm's files: huggingface_hub's
    ModelCard reads it offline, its metadata says timm, its tags and metric, and its body how the
    model was made (phase, start, data, epochs, the run's last top-1 from metrics.csv), its input,
    and the import line; that code, run as the card shows it, builds the model from the folder."""
    import csv
    import subprocess
    import sys

    from huggingface_hub import ModelCard

    run = tmp_path / "run"
    flags = "--data digits --img-size 16 --patch-size 4 --depth 1 --kernel-size 3 --in-chans 1"
    r = invoke(
        "train", "phase2", *flags.split(), "--epochs", "1", "--warmup-epochs", "0", "--workers", "0",
        "--device", "cpu", "--export-timm", "-o", run,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    card = ModelCard.load(run / "timm" / CARD)
    meta = card.data.to_dict()
    # the Hub's convention for a model whose code travels with it: transformers runs it alone
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == "image-classification"
    assert {"timm", "custom_code", "cmhsa", "cmhsa_attn"} <= set(meta["tags"])
    assert meta["metrics"] == ["accuracy"]
    assert "datasets" not in meta  # digits: no Hub dataset id, so none is claimed
    top1 = float(list(csv.DictReader((run / "metrics.csv").open()))[-1]["top1"])
    text = card.text
    assert "Trained by `cmhsa train`: `phase2 digits, 1 epochs`." in text  # from metadata: code
    assert "Start: `impulse`." in text
    held_out = "on `cmhsa's fixed 20% of the digits, held out of training` (the run's metrics.csv)"
    assert f"Validation top-1 {top1:.2f}% after epoch 1, {held_out}" in text
    assert "Grey (PIL mode L) images, [1, 16, 16]" in text
    # every code block runs as written: transformers' (no cmhsa), then timm's
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) == 2 and "trust_remote_code=True" in blocks[0] and "timm.create_model" in blocks[1]
    from PIL import Image

    Image.new("L", (16, 16), 128).save(tmp_path / "image.png")
    checks = [
        "assert model.config.num_classes == 10\n",
        "assert model.num_classes == 10 and config['input_size'] == (1, 16, 16)\n",
    ]
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    try:  # the hub extra's transformers; the dependency floors' environment cannot import it
        from transformers import AutoModelForImageClassification, pipeline  # noqa: F401
    except ImportError:
        blocks, checks = blocks[1:], checks[1:]
    for code, check in zip(blocks, checks, strict=True):
        code = code.replace("PATH/TO/THIS/FOLDER", str(run / "timm")) + check
        p = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
        )
        assert p.returncode == 0, p.stderr[-2000:]


@pytest.mark.parametrize(
    ("trained", "license_id", "named"),
    [
        ("phase1 digits, 30 epochs", "cc-by-4.0", "licensed CC BY 4.0"),
        ("phase1 fashion-mnist, 200 epochs", "mit", "Fashion-MNIST (Zalando Research), licensed MIT"),
        ("phase1 cifar100, 400 epochs", "unknown", "published with no licence stated"),
        ("phase1 imagefolder, 10 epochs", "unknown", "whose licence cmhsa cannot know"),
        (None, "unknown", "not recorded in the weights' metadata"),
    ],
)
def test_the_cards_licence_is_the_training_datas(
    tmp_path: Path, trained: str | None, license_id: str, named: str
) -> None:
    """The licence the card's front matter and pretrained_cfg declare is the training data's, by the
    data the weights record; the card names the data."""
    import json

    from huggingface_hub import ModelCard

    from convit_convert.api import load_checkpoint

    ckpt = load_checkpoint(FIXTURE)
    meta = {} if trained is None else {"cmhsa.trained": trained}
    model = tmp_path / "m.safetensors"
    save_checkpoint(model, ckpt.config, ckpt.tensors, meta)
    assert invoke("export", model, "--format", "timm", "-o", tmp_path / "f").exit_code == 0
    card = ModelCard.load(tmp_path / "f" / CARD)
    assert card.data.to_dict()["license"] == license_id and named in card.text
    doc = json.loads((tmp_path / "f" / "config.json").read_text())
    assert doc["pretrained_cfg"]["license"] == license_id


def test_export_license_sets_both_places_and_is_checked(tmp_path: Path) -> None:
    import json

    from huggingface_hub import ModelCard

    r = invoke("export", FIXTURE, "--format", "timm", "--license", "apache-2.0", "-o", tmp_path / "f")
    assert r.exit_code == 0, r.output
    assert ModelCard.load(tmp_path / "f" / CARD).data.to_dict()["license"] == "apache-2.0"
    pcfg = json.loads((tmp_path / "f" / "config.json").read_text())["pretrained_cfg"]
    assert pcfg["license"] == "apache-2.0"
    assert "by the data it would be `cc-by-4.0`" in (tmp_path / "f" / CARD).read_text()
    # each would read back from unquoted YAML as None, False, True, 31, 123 or 1.5, not the string
    bads = ("MIT", "mit\nlicense: other", "", "x" * 65, "null", "no", "off", "yes", "true", "0x1f", "123")
    for bad in (*bads, "1.5", "mit OR apache-2.0", "licenseref-mine"):
        r = invoke("export", FIXTURE, "--format", "timm", "--license", bad, "-o", tmp_path / "g")
        one_error_line(r, 2, "--license", "is empty" if bad == "" else "is not a known licence id")
        assert not (tmp_path / "g").exists()
    r = invoke("export", FIXTURE, "--license", "mit", "-o", tmp_path / "m.onnx")
    one_error_line(r, 2, "--license is for --format timm")


def test_the_card_installs_cmhsa_from_its_source_never_by_a_bare_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cmhsa is on no package index: the card never says `pip install cmhsa` (someone else could
    register the name). Its first route needs no cmhsa (transformers, trust_remote_code). The cmhsa
    route installs from the source URL in the installed metadata ([project.urls] Source) where there
    is one; without one it says so, with no command (`pip install -e .` failed where the card is
    read). Before that code block it says to install cmhsa and import convit_convert.timm, and it
    names the ONNX route."""
    from convit_convert.io import model_card

    for url in (None, "https://example.org/cmhsa"):
        monkeypatch.setattr(model_card, "source_url", lambda url=url: url)
        from convit_convert.io import timm_folder

        monkeypatch.setattr(timm_folder, "source_url", lambda url=url: url)
        folder = tmp_path / f"f{url is None}"
        assert invoke("export", FIXTURE, "--format", "timm", "-o", folder).exit_code == 0
        text = (folder / CARD).read_text()
        assert "pip install cmhsa" not in text
        use = text.split("## Use", 1)[1]
        first, transformers_route = use.split("```python", 1)[0], use.split("```", 2)[1]
        assert "trust_remote_code=True" in transformers_route and "no cmhsa" in first
        warning, cmhsa_route = use.split("```", 2)[2].split("With timm", 1)
        assert "pip install timm" in warning and "Pass `trust_remote_code=True`" in warning
        before_code = cmhsa_route.split("```python", 1)[0]
        assert "import convit_convert.timm" in before_code and "Unknown model" in before_code
        assert "No module named 'convit_convert'" in before_code
        if url is None:
            assert "records no address for its source" in before_code and "pip install" not in before_code
        else:
            assert f'pip install "cmhsa @ git+{url}"' in before_code and url in text.split("## How", 1)[0]
        assert "For onnxruntime alone" in text and "arxiv.org/abs/2111.01353" in text
        assert "a reference implementation of the paper" in text


def test_a_source_url_the_card_shows_is_an_https_address_and_nothing_else(monkeypatch) -> None:
    """The installed metadata's Project-URL reaches the card only as a plain https address: no
    backtick, quote, bracket or space that could end the card's code span or link."""
    from importlib import metadata

    from convit_convert.io import model_card

    class Meta:
        def __init__(self, urls: list[str]) -> None:
            self.urls = urls

        def get_all(self, key: str) -> list[str]:
            return self.urls

    for url, shown in [
        ("https://github.com/someone/cmhsa", "https://github.com/someone/cmhsa"),
        ("https://x.org/a`b", None),
        ("https://x.org/a) [evil](https://e.org", None),
        ("http://x.org/cmhsa", None),
        ("https://x.org/cmhsa extra", None),
    ]:
        monkeypatch.setattr(metadata, "metadata", lambda name, u=url: Meta([f"Source, {u}"]))
        assert model_card.source_url() == shown, url


def test_a_fine_tuned_models_card_says_what_it_started_from(tmp_path: Path, monkeypatch) -> None:
    """The shipped digits model (CC BY 4.0 data) fine-tuned on a 3-class image folder (licence
    unknown), started from a Hub download in huggingface_hub's cache: the card names the start
    (file, sha256, the Hub id as front matter's base_model) and its data with that data's licence,
    declares `unknown` (what the image folder's licence leaves), and calls the validation images
    the folder's own val/, never "held out". The same folder copied elsewhere under a Hub-like path
    is a local start: no base_model, whatever its path's name says."""
    import hashlib

    from huggingface_hub import ModelCard, constants
    from PIL import Image

    from conftest import hub_cache

    assert invoke("export", FIXTURE, "--format", "timm", "-o", tmp_path / "exported").exit_code == 0
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    snapshot = hub_cache(tmp_path / "hub", "alice/cmhsa-digits", tmp_path / "exported")
    copy = hub_cache(tmp_path / "elsewhere", "openai/clip-vit-large-patch14", tmp_path / "exported")
    for split in ("train", "val"):
        for i, name in enumerate(("a", "b", "c")):
            (tmp_path / "three" / split / name).mkdir(parents=True)
            for j in range(4):
                Image.new("L", (32, 32), 60 * i + j).save(tmp_path / "three" / split / name / f"{j}.png")
    flags = ["--data", "imagefolder", "--data-dir", tmp_path / "three", "--epochs", "1", "--batch-size", "4"]
    for start, run in ((snapshot, "r"), (copy, "c")):
        r = invoke("train", "phase1", *flags, "--device", "cpu", "--init", start, "-o", tmp_path / run)
        assert r.exit_code == 0, r.output
        r = invoke(
            "export", tmp_path / run / "conv.safetensors", "--format", "timm", "-o", tmp_path / f"t{run}"
        )
        assert r.exit_code == 0, r.output
    card = ModelCard.load(tmp_path / "tr" / CARD)
    meta = card.data.to_dict()
    assert meta["license"] == "unknown" and meta["base_model"] == "alice/cmhsa-digits"
    made = card.text.split("## How it was made", 1)[1].split("##", 1)[0]
    sha = hashlib.sha256((snapshot / WEIGHTS).read_bytes()).hexdigest()
    assert f"sha256 `{sha}`" in made and "`alice/cmhsa-digits`" in made
    assert "a model trained on scikit-learn's digits" in made and "CC BY 4.0" in made
    assert "the image folder's own val/" in made and "held out" not in made
    licence = card.text.split("## Training data and licence", 1)[1].split("##", 1)[0]
    assert "an image folder, whose licence cmhsa cannot know" in licence and "CC BY 4.0" in licence
    copied = ModelCard.load(tmp_path / "tc" / CARD)
    assert "base_model" not in copied.data.to_dict() and "openai" not in copied.text


@pytest.mark.parametrize("license_id", ["mit", "cc-by-4.0", "other", "unknown", "gpl-3.0"])
def test_the_front_matter_reads_back_as_config_json_says(tmp_path: Path, license_id: str) -> None:
    """The card's front matter is written by a YAML emitter: read back by a YAML parser (and by
    huggingface_hub) it gives config.json's licence, the string."""
    import json

    import yaml

    r = invoke("export", FIXTURE, "--format", "timm", "--license", license_id, "-o", tmp_path / "f")
    assert r.exit_code == 0, r.output
    front = yaml.safe_load((tmp_path / "f" / CARD).read_text().split("---\n")[1])
    doc = json.loads((tmp_path / "f" / CONFIG).read_text())
    assert front["license"] == doc["pretrained_cfg"]["license"] == license_id
    assert front["library_name"] == "transformers"  # the route that runs without cmhsa
    assert front["tags"][:2] == ["image-classification", "custom_code"]


@pytest.mark.parametrize(
    "metadata",
    [
        {"cmhsa.result": '{"data": ["digits"], "top1": 1}'},  # was: TypeError unhashable, exit 3
        {"cmhsa.result": '{"data": {"a": 1}}'},
        {"cmhsa.result": '{"data": "syn\\ud800", "top1": 50.0}'},  # was: UnicodeEncodeError, exit 3
        {"cmhsa.init": '{"init": "ran\\ud800dom", "init_data": ["x"], "init_hub_id": 3}'},
        {"cmhsa.init": '{"init": "a", "init_license": "no\\nlicense: mit", "init_data": "digits"}'},
    ],
)
def test_metadata_of_the_wrong_type_or_text_reaches_no_sink_raw(tmp_path: Path, metadata: dict) -> None:
    """Metadata values are type-checked where they are read, and text goes through text.py: the
    export succeeds, the card is valid UTF-8, its front matter is YAML whose licence is a known id."""
    import yaml

    from convit_convert.api import load_checkpoint, save_checkpoint

    ckpt = load_checkpoint(FIXTURE)
    save_checkpoint(tmp_path / "m.safetensors", ckpt.config, ckpt.tensors, metadata)
    r = invoke("export", tmp_path / "m.safetensors", "--format", "timm", "-o", tmp_path / "f")
    assert r.exit_code == 0, r.output
    text = (tmp_path / "f" / CARD).read_bytes().decode("utf-8")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["license"] in ("unknown", "other", "cc-by-4.0", "mit")
    assert "\ud800" not in text and "\n" not in front["license"]


@pytest.mark.parametrize(("field_name", "value"), [("num_classes", 5), ("depth", 1000), ("kernel_size", 3)])
def test_a_config_json_that_disagrees_with_its_weights_is_refused_naming_both(
    tmp_path: Path, field_name: str, value: int
) -> None:
    """A self-consistent config.json saying num_classes 5 (or depth 1000) beside weights of 10
    classes and depth 4 is refused by predict, eval and train phase1 --init, as timm refuses it:
    one source of truth, one line naming both files."""
    import json

    folder = tmp_path / "t"
    assert invoke("export", FIXTURE, "--format", "timm", "-o", folder).exit_code == 0
    doc = json.loads((folder / CONFIG).read_text())
    doc["model_args"]["cmhsa_config"][field_name] = value
    if field_name == "num_classes":  # every field that follows from it, too: self-consistent
        doc["num_classes"] = doc["pretrained_cfg"]["num_classes"] = value
    (folder / CONFIG).write_text(json.dumps(doc))
    digit = FIXTURE.parent / "digits" / "3.png"
    for args in (
        ("predict", folder, digit),
        ("eval", folder, "--data", "digits"),
        ("train", "phase1", "--data", "digits", "--epochs", "1", "--init", folder, "-o", tmp_path / "r"),
    ):
        r = invoke(*args)
        line = one_error_line(r, 2, str(folder / CONFIG), field_name, WEIGHTS)
        assert "config.json" in line and str(value) in line, line
    assert not (tmp_path / "r").exists()
