"""A string that came from a file (a path, checkpoint metadata, a config field, a class name) is
shown through one function per sink: the terminal (`text.terminal_safe`, and `cli.common.safe` for
rich), training's log lines, matplotlib labels (`text.label_safe`), the model card
(`text.markdown_safe`, `text.card_number`). One corpus of hostile strings goes to every sink; a
case's comment says what it would do raw."""

from __future__ import annotations

import ast
import csv
import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from conftest import FIXTURE, ROOT, invoke
from convit_convert.cli.common import safe
from convit_convert.config import ViTConfig
from convit_convert.io.model_card import model_card
from convit_convert.text import card_number, csv_text, json_text, label_safe, markdown_safe, terminal_safe
from convit_convert.train.progress import Progress

HOSTILE = [
    "x\nerror: fake",  # was: a line of its own that looks like cmhsa's error
    "tab\there\rcarriage",
    "\x1b[2J\x1b]0;title\x07cleared",
    "\u202eright-to-left\u2066",
    "line\u2028separator",
    "[bold red]markup[/] [link=file:///etc/passwd]x[/link]",
    "<img src=x onerror=alert(1)>",  # was: passed into the model card
    "[click](javascript:alert(1))",  # was: a link in the card
    "<!-- the rest of the card is hidden",  # was: hid the card's Use section
    "`code` *emphasis* # heading | table |",
    "$\\frac{a}{b}$ $$",
    "\x00nul\x7fdel\x9bcsi",
    "é" * 5000,
]
CONTROL = [chr(c) for c in [*range(32), *range(0x7F, 0xA0)]] + ["\u2028", "\u2029", "\u202e", "\u2066"]


def one_clean_line(text: str) -> None:
    assert not any(c in text for c in CONTROL), repr(text[:200])


def rich_console_printed(value: str) -> str:
    """What cmhsa's own console writes for ``value`` printed without escaping it (markup off)."""
    from convit_convert.cli.common import _Console

    buf = io.StringIO()
    _Console(file=buf, width=10_000, color_system=None, highlight=False).print(
        value, markup=False, soft_wrap=True
    )
    return buf.getvalue()


def rich_printed(markup: str) -> str:
    buf = io.StringIO()
    Console(file=buf, width=10_000, color_system=None, highlight=False).print(markup, soft_wrap=True)
    return buf.getvalue()


CARD_CFG = ViTConfig.build(img_size=8, patch_size=4, in_chans=1, depth=1, kernel_size=3, num_classes=10)


def card_tokens(markdown: str) -> list[tuple[str, str]]:
    """The Markdown as CommonMark parses it (markdown-it, rich's own dependency; a card's front
    matter left out): each token's type and text, a code span's text left out."""
    from markdown_it import MarkdownIt

    out = []
    for token in MarkdownIt("commonmark").parse(markdown.split("---\n", 2)[-1]):
        for t in token.children or [token]:
            out.append((t.type, "" if t.type == "code_inline" else t.content))
    return out


def card(metadata: dict[str, str]) -> str:
    pre = dict(channels="L", input_size="(1, 8, 8)", resize_shorter_to="9", interpolation="bicubic")
    pre |= dict(mean="(0.5,)", std="(0.5,)", num_classes="10")
    return model_card(CARD_CFG, metadata, CARD_CFG.num_params(), pre)


@pytest.mark.parametrize("s", HOSTILE)
def test_every_sink_shows_a_hostile_string_as_inert_text(s: str) -> None:
    # the terminal: one line, no control character; rich markup shown, not applied
    one_clean_line(terminal_safe(s))
    printed = rich_printed(f"Wrote {safe(s)}")
    assert printed.count("\n") == 1 and printed.startswith("Wrote ")
    one_clean_line(printed.rstrip("\n"))
    if "[bold red]" in s:
        assert "[bold red]markup[/]" in printed
    # training's log lines
    said: list[str] = []
    Progress(said.append).log(f"wrote {s}")
    assert len(said) == 1
    one_clean_line(said[0])
    # a matplotlib label: one line, no mathtext
    label = label_safe(s)
    one_clean_line(label)
    assert "$" not in label.replace("\\$", "")
    # the model card: the value is one code span, shown as it is, never markup
    md = markdown_safe(s)
    one_clean_line(md)
    assert card_tokens(md) == [("paragraph_open", ""), ("code_inline", ""), ("paragraph_close", "")]
    meta = {
        "cmhsa.trained": s,
        "cmhsa.init": json.dumps({"init": s, "init_sha256": s}),
        "cmhsa.result": json.dumps({"data": s, "top1": 90.0, "epoch": 3}),
        "cmhsa.source_sha256": s,
    }
    # CSV and JSON files: no control character in the file; no cell a spreadsheet runs as a formula
    csv_file = csv_text([["image", "class"], [s, "=" + s], [1, 0.5]])
    one_clean_line(csv_file.replace("\n", ""))
    cells = [c for row in csv.reader(io.StringIO(csv_file)) for c in row]
    assert not [c for c in cells if c.startswith(("=", "+", "-", "@", "\t", "\r"))]
    doc = json_text({"class": s})
    one_clean_line(doc.replace("\n", ""))
    assert json.loads(doc) == {"class": s}
    # the console itself: a value nobody escaped still reaches the terminal inert
    # (its newlines are its layout's: keeping a value on one line is terminal_safe's, above)
    one_clean_line(rich_console_printed(s).replace("\n", ""))
    text, plain = card(meta), card({k: v.replace(s, "plain") for k, v in meta.items()})
    assert card_tokens(text) == card_tokens(plain)  # the value only ever inside code spans


@pytest.mark.parametrize(
    "top1, epoch, shown",
    [
        (1e308, 3, None),  # was: 300 digits
        (math.nan, 3, None),  # was: "nan%"
        (math.inf, 3, None),
        (-1.0, 3, None),
        (100.5, 3, None),
        ("90", 3, None),
        (True, 3, None),
        (90.0, True, "90.00% after"),  # was: "after epoch True"
        (90.0, 3, "90.00% after epoch 3,"),
        (90.0, 10**12, "90.00%, on"),
    ],
)
def test_the_card_shows_a_figure_only_when_it_is_a_real_one(
    top1: object, epoch: object, shown: str | None
) -> None:
    meta = {"cmhsa.result": json.dumps({"data": "digits", "top1": top1, "epoch": epoch}, allow_nan=True)}
    text = card(meta)
    if shown is None:
        assert "top-1" not in text and "metrics:" not in text
    elif shown.endswith("after"):
        assert "90.00%, on" in text and "after epoch" not in text
    else:
        assert shown in text


def test_card_numbers() -> None:
    assert card_number(True, 0, 100) is None and card_number(3, 0, 100, digits=0) == "3"
    assert card_number(3.0, 0, 100, digits=0) is None and card_number(50, 0, 100) == "50.00"


def test_the_card_names_a_start_by_its_file_name_never_a_local_path() -> None:
    meta = {
        "cmhsa.init": json.dumps(
            {"init": "/home/someone/runs/f1b/conv.safetensors", "init_sha256": "ab" * 32}
        )
    }
    text = card(meta)
    assert "/home/someone" not in text and f"`conv.safetensors` (sha256 `{'ab' * 32}`)" in text


def test_the_card_shows_addresses_as_code_never_as_links() -> None:
    """A URL, a `www.` name and an e-mail address in class names or metadata: each inside a code
    span, where GitHub-flavoured Markdown (the Hub's renderer) makes no autolink, and in no text."""
    from convit_convert.labels import KEY

    links = ["https://evil.example/x", "www.evil.example", "someone@evil.example", "mailto:x@evil.example"]
    names = [*links, *(str(i) for i in range(6))]
    meta = {"cmhsa.trained": " ".join(links), KEY: json.dumps(names)}
    body = card(meta)
    tokens = card_tokens(body)
    text = " ".join(content for kind, content in tokens if kind != "code_inline")
    assert not [link for link in links if link.split("/")[0] in text]
    plain = {"cmhsa.trained": "plain", KEY: json.dumps([f"n{i}" for i in range(10)])}
    assert tokens == card_tokens(card(plain))  # the card's own links only: none from the values
    assert all(f"`{link}`" in body for link in links)


def test_an_output_folder_named_like_an_error_line_prints_no_error_line(tmp_path: Path) -> None:
    # was: `mkdir $'x\nerror: fake'` printed a line "error: fake/vit.safetensors ..." from "Wrote ..."
    folder = tmp_path / "x\nerror: fake"
    folder.mkdir()
    r = invoke("convert", FIXTURE, "-o", folder / "vit.safetensors")
    assert r.exit_code == 0, r.output
    assert not [line for line in r.output.splitlines() if line.startswith("error")]
    assert any(line.startswith("Wrote ") and "x\\x0aerror: fake" in line for line in r.output.splitlines())


def test_predict_s_csv_and_json_are_sinks_too(tmp_path: Path) -> None:
    """Class names that start like a formula and image file names that hold escape sequences, bidi
    overrides and C1 controls: the CSV shows them as text (a leading ``'``), the raw files hold no
    control character, and both read back as the names."""
    from PIL import Image

    from convit_convert.api import load_checkpoint, save_checkpoint
    from convit_convert.labels import KEY

    names = ["=1+1", "+cmd", "-2", "@SUM(A1)", "\tx", *map(str, range(5, 10))]
    names[4] = "tab"  # a tab is a control character: no class name holds one (test_class_names.py)
    ckpt = load_checkpoint(FIXTURE)
    model = tmp_path / "named.safetensors"
    save_checkpoint(model, ckpt.config, ckpt.tensors, {KEY: json.dumps(names)})
    images = tmp_path / "images"
    images.mkdir()
    hostile = [
        "=HYPERLINK(x)",
        "\x1b]0;title\x07",
        "\x1b]8;;x\x1b\\link",
        "\u202ecod.exe",
        "\x9bc",
        "-1",
    ]
    for i, stem in enumerate(hostile):
        Image.new("L", (8, 8), 30 * i).save(images / f"{stem}.png")
    for out in (tmp_path / "p.csv", tmp_path / "p.json"):
        r = invoke("predict", model, images, "-o", out, "--top-k", "10")
        assert r.exit_code == 0, r.output
        raw = out.read_text(encoding="utf-8")
        one_clean_line(raw.replace("\n", ""))
    rows = list(csv.reader(io.StringIO((tmp_path / "p.csv").read_text())))
    text_cells = [c for row in rows[1:] for c in (row[0], row[2])]
    assert not [c for c in text_cells if c.startswith(("=", "+", "-", "@"))]
    assert {row[2] for row in rows[1:]} >= {"'=1+1", "'+cmd", "'-2", "'@SUM(A1)"}
    doc = json.loads((tmp_path / "p.json").read_text())
    assert {Path(p["image"]).stem for p in doc["predictions"]} == set(hostile)
    assert {t["class"] for p in doc["predictions"] for t in p["top"]} == set(names)


# the mechanism: each sink and each foreign kind has one function, and nothing walks around it ------


def calls(source: str, owner: str, names: set[str]) -> list[str]:
    """Calls ``owner.NAME(...)`` (``owner`` a module or class name; "": a bare ``NAME(...)``) in
    ``source``, with their lines."""
    found = []
    for n in ast.walk(ast.parse(source)):
        if not isinstance(n, ast.Call):
            continue
        if owner and isinstance(n.func, ast.Attribute) and getattr(n.func.value, "id", None) == owner:
            name = n.func.attr
        elif not owner and isinstance(n.func, ast.Name):
            name = n.func.id
        else:
            continue
        if name in names:
            found.append(f"{owner}.{name} (line {n.lineno})")
    return found


def package() -> dict[str, str]:
    files = [*(ROOT / "convit_convert").rglob("*.py"), *(ROOT / "train").rglob("*.py")]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in sorted(files)}


# (module that may call it, owner, names): the one function of each kind
ONE_WAY = {
    "JSON, CSV and YAML text for a file": (
        "convit_convert/text.py",
        [
            ("json", {"dump", "dumps"}),
            ("csv", {"writer", "DictWriter"}),
            ("yaml", {"dump", "safe_dump", "dump_all", "safe_dump_all", "emit"}),
        ],
    ),
    # the one classification of foreign characters: text.hidden, over the `regex` package's Unicode
    # properties; no other module asks unicodedata what a character is but labels.py, which only
    # words the refusal text.hidden decided
    "a foreign character's kind": ("convit_convert/text.py", [("regex", {"compile", "sub", "match"})]),
    "JSON from a file": ("convit_convert/io/paths.py", [("json", {"load", "loads"})]),
    "an image file": ("convit_convert/io/images.py", [("Image", {"open"})]),
    # the tensor files: held to memory by what they hold before a tensor is read
    "a safetensors file": ("convit_convert/io/checkpoint.py", [("", {"safe_open", "load_file"})]),
    "a PyTorch file (a model, a run's state)": ("convit_convert/io/checkpoint.py", [("torch", {"load"})]),
    "an ONNX file": ("convit_convert/onnx/load.py", [("onnx", {"load", "load_model"})]),
}


@pytest.mark.parametrize("kind", ONE_WAY)
def test_each_foreign_kind_and_each_file_sink_has_one_function(kind: str) -> None:
    allowed, forbidden = ONE_WAY[kind]
    offenders = {
        rel: found
        for rel, source in package().items()
        if rel != allowed
        and (found := [c for owner, names in forbidden for c in calls(source, owner, names)])
    }
    assert offenders == {}
    assert any(calls(package()[allowed], owner, names) for owner, names in forbidden)  # the one is there


def escaped(value: ast.expr) -> bool:
    """Whether a printed value is a call of one of text.py's ``*_safe`` functions."""
    return isinstance(value, ast.Call) and getattr(value.func, "id", "").endswith("_safe")


def test_nothing_prints_a_value_around_terminal_safe() -> None:
    """The terminal: a `print` (stderr's error and note lines) passes each value through text.py;
    everything else goes through cmhsa's console, which passes every segment through
    text.printed_safe (the corpus test above)."""
    offenders = []
    for rel, source in package().items():
        for node in ast.walk(ast.parse(source)):
            if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print"):
                continue
            for arg in node.args:
                values = [v.value for v in ast.walk(arg) if isinstance(v, ast.FormattedValue)]
                if isinstance(arg, ast.JoinedStr | ast.Constant):
                    bare = [
                        v
                        for v in values
                        if not (isinstance(v, ast.Call) and getattr(v.func, "id", "").endswith("_safe"))
                    ]
                else:
                    bare = (
                        [arg]
                        if not (isinstance(arg, ast.Call) and getattr(arg.func, "id", "").endswith("_safe"))
                        else []
                    )
                offenders += [f"{rel}:{node.lineno}: {ast.unparse(v)}" for v in bare]
    assert offenders == []


def test_the_mechanism_tests_find_what_they_forbid() -> None:
    src = "import json\njson.dumps(x)\nImage.open(p)\nwriter = csv.writer(f)\n"
    assert calls(src, "json", {"dumps"}) == ["json.dumps (line 2)"]
    assert calls(src, "Image", {"open"}) == ["Image.open (line 3)"] and calls(src, "csv", {"writer"})


def test_a_class_named_like_an_error_line_begins_no_line_of_eval_s_report(monkeypatch) -> None:
    """eval's "most confused" list never prints a line that reads `  error: fake -> x: 3`."""
    from convit_convert.api.on_data import ClassRow, Confusion, EvalReport
    from convit_convert.cli import common
    from convit_convert.cli import evaluate as cli_eval

    report = EvalReport("conv", 6, 50.0, 100.0, 0.7, "conv", names_from="model")
    report.classes = [ClassRow("error: fake", 3, 0.0), ClassRow("x", 3, 100.0)]
    report.confused = [Confusion("error: fake", "x", 3)]
    buf = io.StringIO()
    console = common._Console(file=buf, width=200, color_system=None, highlight=False)
    monkeypatch.setattr(common, "console", console)  # print_titled's
    monkeypatch.setattr(cli_eval, "console", console)
    cli_eval.print_per_class(report)
    lines = buf.getvalue().splitlines()
    assert "error: fake" in buf.getvalue()
    assert not [line for line in lines if line.lstrip().startswith("error")]


# one classification, by Unicode property --------------------------------------------------------

# a sample of each kind text.hidden classifies, by property: none may reach the CSV, JSON or
# console raw, nor pass the class-name check
HIDDEN_KINDS = {
    "zero-width space (Cf)": "\u200b",
    "left-to-right mark (Cf)": "\u200e",
    "right-to-left mark (Cf)": "\u200f",
    "Arabic letter mark (Cf)": "\u061c",
    "byte order mark (Cf)": "\ufeff",
    "tag latin capital A (Cf)": "\U000e0041",
    "soft hyphen (Cf)": "\u00ad",
    "private use (Co)": "\ue000",
    "unassigned (Cn)": "\u0378",
    "line separator (Zl)": "\u2028",
    "Hangul filler (default-ignorable)": "\u3164",
    "variation selector (default-ignorable)": "\ufe0f",
    "blank Braille pattern (blank glyph)": "\u2800",
    "Khitan filler (blank glyph)": "\U00016fe4",
    "undecodable byte (surrogate escape)": "\udcff",
    "no-break space (Zs)": "\u00a0",
    "figure space (Zs)": "\u2007",
    "narrow no-break space (Zs)": "\u202f",
    "em space (Zs)": "\u2003",
    "ideographic space (Zs)": "\u3000",
}


@pytest.mark.parametrize("kind", HIDDEN_KINDS)
def test_every_sink_escapes_each_kind_the_classification_finds(kind: str) -> None:
    from convit_convert.text import hidden, yaml_text

    ch = HIDDEN_KINDS[kind]
    assert hidden(ch)
    value = f"a{ch}b"
    for sink in (terminal_safe, label_safe, markdown_safe, lambda v: csv_text([[v]]), json_text, yaml_text):
        out = sink({"k": value}) if sink is yaml_text else sink(value)
        assert ch not in out, (kind, sink)
        out.encode("utf-8")  # writable: no lone surrogate left
    assert json.loads(json_text(value)) == value  # the same string to a parser


def test_the_classification_keeps_what_readers_see() -> None:
    from convit_convert.text import hidden

    for ch in "aZ09 -_.é中ㄱ가Ωя€→😀\u0301":  # letters, digits, space, CJK, Hangul, emoji, a combining accent
        assert not hidden(ch), repr(ch)


def test_image_names_that_are_not_utf8_or_hold_invisible_characters(tmp_path: Path) -> None:
    """predict's CSV, JSON and console show each name with its invisible characters and undecodable
    bytes escaped, so `a\\u200bb.png` never reads as `ab.png`; a name that is not UTF-8 is
    shown, never an internal error."""
    import os

    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    stems = ["a\u200bb", "c\u200ed", "e\u200ff", "g\u061ch", "i\ufeffj", "k\U000e0041l", "m\u00adn"]
    for i, stem in enumerate(stems):
        Image.new("L", (8, 8), 20 * i).save(images / f"{stem}.png")
    Image.new("L", (8, 8), 200).save(os.fsdecode(os.path.join(os.fsencode(images), b"\xff\xfebad.png")))
    for out in (tmp_path / "p.csv", tmp_path / "p.json"):
        r = invoke("predict", FIXTURE, images, "-o", out)
        assert r.exit_code == 0, r.output
        raw = out.read_text(encoding="utf-8")
        assert not any(ch in raw for stem in stems for ch in stem if ch not in "abcdefghijklmn")
        assert "ab.png" not in raw and "\\xff\\xfebad.png" in raw if out.suffix == ".csv" else True
    assert "a\\u200bb.png" in r.output and "\\xff\\xfebad.png" in r.output
    doc = json.loads((tmp_path / "p.json").read_text())
    assert {Path(p["image"]).name for p in doc["predictions"]} >= {"a\u200bb.png", "\udcff\udcfebad.png"}


def test_names_that_print_alike_are_printed_apart(tmp_path: Path) -> None:
    """Four images whose names read alike raw: with a space and with a no-break space, and with a
    zero-width space and with the six characters of its escape typed out (and the same for an
    undecodable byte): predict's console and CSV show six different names, each backslash of a
    name's own text doubled, and its JSON gives each name back."""
    import os

    from PIL import Image

    images = tmp_path / "images"
    images.mkdir()
    names = ["a b.png", "a\u00a0b.png", "c\u200bd.png", "c\\u200bd.png", "e\\xffg.png"]
    for i, name in enumerate(names):
        Image.new("L", (8, 8), 20 * i).save(images / name)
    Image.new("L", (8, 8), 200).save(os.fsdecode(os.path.join(os.fsencode(images), b"e\xffg.png")))
    shown = ["a b.png", "a\\xa0b.png", "c\\u200bd.png", "c\\\\u200bd.png", "e\\\\xffg.png", "e\\xffg.png"]
    r = invoke("predict", FIXTURE, images, "-o", tmp_path / "p.csv")
    assert r.exit_code == 0, r.output
    cells = [row[0] for row in csv.reader(io.StringIO((tmp_path / "p.csv").read_text("utf-8")))][1:]
    assert sorted({Path(c).name for c in cells}) == sorted(shown), cells
    for name in shown:
        assert f"{images}/{name}" in r.output.replace("\n", ""), name
    assert invoke("predict", FIXTURE, images, "-o", tmp_path / "p.json").exit_code == 0
    doc = json.loads((tmp_path / "p.json").read_text("utf-8"))
    assert len({Path(p["image"]).name for p in doc["predictions"]}) == 6


@pytest.mark.parametrize("fmt", ["png", "svg", "pdf"])
def test_plot_of_a_run_folder_whose_name_is_not_utf8(tmp_path: Path, tiny_run: Path, fmt: str) -> None:
    """Drawn in each format, the name's undecodable bytes escaped (matplotlib's text takes no
    surrogate)."""
    import os
    import shutil

    pytest.importorskip("matplotlib")
    run = os.fsdecode(os.path.join(os.fsencode(tmp_path), b"run\xff\xfe"))
    shutil.copytree(tiny_run, run, ignore=shutil.ignore_patterns(".cmhsa.lock"))
    r = invoke("plot", run, "-o", tmp_path / f"c.{fmt}")
    assert r.exit_code == 0, r.output
    assert (tmp_path / f"c.{fmt}").stat().st_size > 1000


def test_no_yaml_is_written_by_string_formatting() -> None:
    """A model card's front matter comes from text.yaml_text (a YAML emitter): no module but text.py
    (the one writer) and io/paths.py (the one reader, parse_yaml) imports yaml, and model_card.py
    builds no line of the form `key: value` itself."""
    for rel, source in package().items():
        tree = ast.parse(source)
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        if rel not in ("convit_convert/text.py", "convit_convert/io/paths.py"):
            assert "yaml" not in imported, rel
    card = package()["convit_convert/io/model_card.py"]
    assert "yaml_text(" in card
    assert not re.search(r'"(license|library_name|base_model|datasets|tags): ', card)


def test_no_module_keeps_its_own_list_of_characters() -> None:
    """No character class of controls, zero-width or bidi characters outside text.py: a second
    list is the next value not on it."""
    pattern = re.compile(r"\\(x00|u200b|u202a|u2066)-|^INVISIBLE", re.M)  # a range of them, or a set
    offenders = [
        rel for rel, source in package().items() if rel != "convit_convert/text.py" and pattern.search(source)
    ]
    assert offenders == []
