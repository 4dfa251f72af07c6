"""A string that came from a file (a path, checkpoint metadata, a config field, a class name) is
shown through one function per sink: the terminal (`text.terminal_safe`, and `cli.common.safe` for
rich), training's log lines, matplotlib labels (`text.label_safe`), the model card
(`text.markdown_safe`, `text.card_number`). One corpus of hostile strings goes to every sink. Each
case marked "was" failed on main 8bdbcb2."""

from __future__ import annotations

import io
import json
import math
import re
from pathlib import Path

import pytest
from rich.console import Console

from conftest import FIXTURE, invoke
from convit_convert.cli.common import safe
from convit_convert.config import ViTConfig
from convit_convert.io.model_card import model_card
from convit_convert.text import card_number, label_safe, markdown_safe, terminal_safe
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


def rich_printed(markup: str) -> str:
    buf = io.StringIO()
    Console(file=buf, width=10_000, color_system=None, highlight=False).print(markup, soft_wrap=True)
    return buf.getvalue()


CARD_CFG = ViTConfig.build(img_size=8, patch_size=4, in_chans=1, depth=1, kernel_size=3, num_classes=10)


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
    # the model card: the value is text, never markup
    md = markdown_safe(s)
    one_clean_line(md)
    for opened in ("<", "](", "<!--"):
        assert opened not in md
    assert not re.search(r"(?<!\\)[`\[\]*_]", md)  # each Markdown character escaped (CommonMark: \`)
    meta = {
        "cmhsa.trained": s,
        "cmhsa.init": json.dumps({"init": s, "init_sha256": s}),
        "cmhsa.result": json.dumps({"data": s, "top1": 90.0, "epoch": 3}),
        "cmhsa.source_sha256": s,
    }
    text, plain = card(meta), card({k: v.replace(s, "plain") for k, v in meta.items()})
    assert text.count("\n") == plain.count("\n")  # nothing starts a line, a heading or a block
    body = text.split("---", 2)[2]
    for opened in ("<img", "<!--", "](javascript", "<javascript"):
        assert opened not in body
    assert text.rstrip().endswith(plain.rstrip().splitlines()[-1]) and "## Use" in text


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
    assert "/home/someone" not in text and f"conv.safetensors (sha256 {'ab' * 32})" in text.replace(
        "\\_", "_"
    )


def test_an_output_folder_named_like_an_error_line_prints_no_error_line(tmp_path: Path) -> None:
    # was: `mkdir $'x\nerror: fake'` printed a line "error: fake/vit.safetensors ..." from "Wrote ..."
    folder = tmp_path / "x\nerror: fake"
    folder.mkdir()
    r = invoke("convert", FIXTURE, "-o", folder / "vit.safetensors")
    assert r.exit_code == 0, r.output
    assert not [line for line in r.output.splitlines() if line.startswith("error")]
    assert any(line.startswith("Wrote ") and "x\\x0aerror: fake" in line for line in r.output.splitlines())
