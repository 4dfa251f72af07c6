"""Class names travel with the model: learnt where a run reads its data, recorded in the checkpoint
(``cmhsa.classes``) and the run's config.json, carried by `convert` (from safetensors and from
ONNX), into ONNX ``metadata_props``, a timm folder's ``label_names`` and its model card, shown by
`inspect` and by `eval`'s per-class table. Names from a folder are foreign text: checked where they
enter (count, length, duplicates, size) and escaped where shown."""

from __future__ import annotations

import json
import re
from pathlib import Path

import onnx
import pytest
import timm
import torch
from PIL import Image
from safetensors import safe_open

import convit_convert.timm  # noqa: F401  (registers cmhsa's architectures)
from conftest import invoke, one_error_line
from convit_convert.api import save_checkpoint
from convit_convert.errors import CmhsaError
from convit_convert.io.model_card import model_card
from convit_convert.io.timm_folder import preprocessing
from convit_convert.labels import DIGITS, FASHION_MNIST, KEY, check_class_names

TINY = "--preset cpu --in-chans 1 --img-size 16 --patch-size 4 --depth 1 --epochs 1 --warmup-epochs 0"
TINY += " --workers 0"


def meta(path: Path) -> dict[str, str]:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("names") / "run"
    r = invoke("train", "phase1", *TINY.split(), "--data", "digits", "-o", out)
    assert r.exit_code == 0, r.output
    return out


def test_the_names_travel_through_every_artefact(tmp_path: Path, digits_run: Path) -> None:
    conv = digits_run / "conv.safetensors"
    assert json.loads(meta(conv)[KEY]) == list(DIGITS)
    assert json.loads((digits_run / "config.json").read_text())["classes"] == list(DIGITS)
    vit = tmp_path / "vit.safetensors"
    assert invoke("convert", conv, "-o", vit).exit_code == 0
    assert json.loads(meta(vit)[KEY]) == list(DIGITS)
    assert invoke("export", vit, "-o", tmp_path / "vit.onnx").exit_code == 0
    props = {p.key: p.value for p in onnx.load(tmp_path / "vit.onnx").metadata_props}
    assert json.loads(props["classes"]) == list(DIGITS)
    # an ONNX file cmhsa exported gives its names back when it is converted
    assert invoke("export", conv, "-o", tmp_path / "conv.onnx").exit_code == 0
    assert invoke("convert", tmp_path / "conv.onnx", "-o", tmp_path / "from_onnx.safetensors").exit_code == 0
    assert json.loads(meta(tmp_path / "from_onnx.safetensors")[KEY]) == list(DIGITS)
    # timm's folder: label_names as timm and the Hub read them, and the card
    assert invoke("export", vit, "--format", "timm", "-o", tmp_path / "timm").exit_code == 0
    cfg = json.loads((tmp_path / "timm" / "config.json").read_text())
    assert cfg["label_names"] == list(DIGITS)  # where timm writes them, and transformers reads them
    model = timm.create_model(f"local-dir:{tmp_path / 'timm'}", pretrained=True)
    assert model.pretrained_cfg["label_names"] == list(DIGITS)
    assert (
        "## Classes\n\nOutput 0 first: `0`, `1`, `2`, `3`, `4`, `5`, `6`, `7`, `8`, `9`."
        in (tmp_path / "timm" / "README.md").read_text()
    )
    assert "0, 1, 2, 3, 4, 5, 6, 7, 8, 9" in invoke("inspect", vit).output


def test_eval_names_each_class_and_the_most_confused_pairs(digits_run: Path) -> None:
    r = invoke("eval", digits_run / "conv.safetensors", "--data", "digits")
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    per_class = lines[lines.index("Per class") : lines.index("Most confused (true -> predicted)")]
    rows = [line.split("│")[1:4] for line in per_class if line.startswith("│")]
    names, images, top1 = zip(
        *[(a.strip(), int(b.replace(",", "")), float(c)) for a, b, c in rows], strict=True
    )
    assert names == DIGITS and sum(images) == 359  # digits' validation split
    overall = float(next(line for line in lines if line.startswith("│ conv")).split("│")[2])
    weighted = sum(n * t for n, t in zip(images, top1, strict=True)) / sum(images)
    assert abs(weighted - overall) < 0.01  # the per-class figures add up to the top-1 (2-decimal rounding)
    assert "Most confused (true -> predicted)" in r.output


def image_folder(root: Path, names: list[str]) -> Path:
    for split in ("train", "val"):
        for i, name in enumerate(names):
            (root / split / name).mkdir(parents=True)
            for j in range(2):
                Image.new("L", (16, 16), 60 * i + j).save(root / split / name / f"{j}.png")
    return root


def test_an_image_folder_s_names_are_its_folders_shown_as_text(tmp_path: Path) -> None:
    hostile = ["cat", "[red]dog[bold]", "=HYPERLINK(x)", "error: fake"]  # a folder name holds no "/"
    image_folder(tmp_path, hostile)
    args = [*TINY.split(), "--data", "imagefolder", "--data-dir", tmp_path, "--batch-size", "2"]
    r = invoke("train", "phase1", *args, "-o", tmp_path / "run")
    assert r.exit_code == 0, r.output
    recorded = json.loads(meta(tmp_path / "run" / "conv.safetensors")[KEY])
    assert recorded == sorted(hostile)  # torchvision's order: output i is the i-th folder by name
    r = invoke("eval", tmp_path / "run" / "conv.safetensors", "--data", "imagefolder", "--data-dir", tmp_path)
    assert r.exit_code == 0, r.output
    # a class named like an error line starts no line, the per-class table's and the confusions' alike
    assert not [line for line in r.output.splitlines() if line.lstrip().startswith("error")]
    assert "[red]dog[bold]" in r.output and "error: fake" in r.output


# what no class name may hold, each as it would enter: a lone surrogate (from a folder name that is not
# UTF-8, or a JSON escape), invisible and bidi characters, controls, other spaces, a decomposed accent
UNREADABLE_NAMES = {
    "a lone surrogate": ("bad\udcff", "U+DCFF, a lone surrogate"),
    "a zero-width space": ("one\u200b", "U+200B, a format character"),
    "a right-to-left mark": ("\u200fdog", "U+200F, a format character"),
    "a right-to-left override": ("cat\u202e", "U+202E, a format character"),
    "a C1 control": ("x\x9b", "U+009B, a control character"),
    "a newline": ("x\nerror: fake", "U+000A, a control character"),
    "a no-break space": ("one\u00a0two", "a space other than U+0020"),
    "a figure space": ("one\u2007two", "a space other than U+0020"),
    "an ideographic space": ("one\u3000two", "a space other than U+0020"),
    "a combining mark first": ("\u0301one", "U+0301, a combining mark"),
    "a Hangul filler": ("\u3164", "an invisible character"),
    # each reads as "one": accepted beside it, a second class would look like the first
    "a blank Braille pattern": ("one\u2800", "U+2800, an invisible character"),
    "a Khitan filler": ("one\U00016fe4", "U+16FE4, an invisible character"),
    "a tag character": ("one\U000e0041", "U+E0041, a format character"),
    "a soft hyphen": ("on\u00ade", "U+00AD, a format character"),
    "an Arabic letter mark": ("one\u061c", "U+061C, a format character"),
    "a variation selector": ("one\ufe0f", "U+FE0F, an invisible character"),
    "a trailing space": ("one ", "begins or ends with a space"),
    "a decomposed accent": ("cafe\u0301", "not in Unicode's NFC form"),
}


@pytest.mark.parametrize("case", UNREADABLE_NAMES)
def test_a_name_no_file_holds_or_no_reader_tells_apart_is_refused_where_read(
    tmp_path: Path, digits_run: Path, case: str
) -> None:
    """Refused in one line naming the file and the class's index, by every command that reads it,
    and nothing written: no file nothing can read (a lone surrogate), no UnicodeEncodeError in
    `export`, no `one` and `one\\u200b` as two classes."""
    name, words = UNREADABLE_NAMES[case]
    names = [name, *DIGITS[1:]]
    with pytest.raises(CmhsaError, match=f"class name 0 .*{re.escape(words.split(',')[0])}"):
        check_class_names(names, 10)
    from convit_convert.api import load_checkpoint

    ckpt = load_checkpoint(digits_run / "conv.safetensors")
    path = tmp_path / "named.safetensors"
    save_checkpoint(path, ckpt.config, ckpt.tensors, {KEY: json.dumps(names)})  # \u escapes: any JSON
    for args in (
        ("inspect", path),
        ("convert", path, "-o", tmp_path / "vit.safetensors"),
        ("export", path, "-o", tmp_path / "m.onnx"),
        ("export", path, "--format", "timm", "-o", tmp_path / "timm"),
    ):
        one_error_line(invoke(*args), 2, str(path), "class name 0", words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["named.safetensors"]


def test_an_image_folder_with_a_name_that_reads_as_another_is_refused_naming_it(tmp_path: Path) -> None:
    image_folder(tmp_path, ["one", "one\u200b", "two"])
    args = [*TINY.split(), "--data", "imagefolder", "--data-dir", tmp_path, "--batch-size", "2"]
    r = invoke("train", "phase1", *args, "-o", tmp_path / "run")
    one_error_line(r, 2, str(tmp_path / "train"), "class name 1 holds U+200B")
    assert not (tmp_path / "run").exists()


# pairs Unicode's confusables (UTS #39) give one skeleton: different text, the same reading
READ_ALIKE = {
    "Latin and Cyrillic a": ("a", "\u0430"),
    "a and mathematical sans-serif a": ("a", "\U0001d5ba"),
    "Coat with a Cyrillic o": ("Coat", "C\u043eat"),
    "m and rn": ("arm", "arrn"),
    "a full-width letter": ("Bag", "B\uff41g"),
}


@pytest.mark.parametrize("case", READ_ALIKE)
def test_names_that_read_alike_are_refused_naming_both(tmp_path: Path, case: str) -> None:
    """Refused as a file's names and as an image folder's (train writes nothing), naming both
    classes and the characters that differ; names that merely share letters are not."""
    first, second = READ_ALIKE[case]
    with pytest.raises(CmhsaError, match=r"class names 1 and 2 read alike .*UTS #39"):
        check_class_names(["dog", first, second], 3)
    image_folder(tmp_path, [first, second, "dog"])
    args = [*TINY.split(), "--data", "imagefolder", "--data-dir", tmp_path, "--batch-size", "2"]
    one_error_line(invoke("train", "phase1", *args, "-o", tmp_path / "run"), 2, "read alike", "U+")
    assert not (tmp_path / "run").exists()
    assert check_class_names([first, "dog", "cat"], 3) == (first, "dog", "cat")


@pytest.mark.parametrize(
    "names, fragment",
    [
        (["a"] * 10, "given twice"),
        ([str(i) for i in range(10**5)], "100,000 class names for a model of 10 classes"),
        (["x" * 300, *DIGITS[1:]], "1 to 256 characters"),
        ([1, *DIGITS[1:]], "not a string"),
        ("0123456789", "not a list"),
        ({"0": 0}, "not a list"),
    ],
)
def test_hostile_names_in_a_file_are_one_line(
    tmp_path: Path, digits_run: Path, names: object, fragment: str
) -> None:
    src = digits_run / "conv.safetensors"
    with safe_open(str(src), "pt") as f:
        tensors, metadata = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()  # noqa: SIM118
    from convit_convert.api import load_checkpoint

    cfg = load_checkpoint(src).config
    path = tmp_path / "hostile.safetensors"
    save_checkpoint(
        path,
        cfg,
        tensors,
        {**{k: v for k, v in metadata.items() if k.startswith("cmhsa.t")}, KEY: json.dumps(names)},
    )
    one_error_line(invoke("inspect", path), 2, fragment)


def test_the_names_are_checked_where_they_enter() -> None:
    assert check_class_names(list(FASHION_MNIST), 10) == FASHION_MNIST
    with pytest.raises(CmhsaError, match="more than 65,536 bytes"):
        check_class_names([f"{i:0250d}" for i in range(300)], 300)


def test_the_card_lists_names_as_inert_text_and_at_most_twenty() -> None:
    from convit_convert.config import ViTConfig

    cfg = ViTConfig.build(img_size=8, patch_size=4, in_chans=1, depth=1, kernel_size=3, num_classes=25)
    names = ["<img src=x onerror=alert(1)>", "[a](javascript:b)"] + [f"c{i}" for i in range(23)]
    card = model_card(cfg, {KEY: json.dumps(names)}, cfg.num_params(), preprocessing(cfg))
    listed = card.split("## Classes", 1)[1].split("##", 1)[0]
    # each name a code span: shown as it is, nothing a renderer reads as a tag or a link
    assert "`<img src=x onerror=alert(1)>`, `[a](javascript:b)`, `c0`" in listed
    assert "`c17`, and 5 more (config.json's `label_names`)." in listed


def test_a_timm_folder_s_label_names_are_checked(tmp_path: Path, digits_run: Path) -> None:
    assert (
        invoke("export", digits_run / "conv.safetensors", "--format", "timm", "-o", tmp_path / "t").exit_code
        == 0
    )
    cfg = json.loads((tmp_path / "t" / "config.json").read_text())
    cfg["label_names"] = ["a"] * 10
    (tmp_path / "t" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CmhsaError, match="given twice"):
        timm.create_model(f"local-dir:{tmp_path / 't'}", pretrained=True)
    torch.manual_seed(0)
