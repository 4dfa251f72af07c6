"""The console examples of README.md and the docs/ pages are what their commands print today
(docs/examples.py rewrites them; this fails when one went stale). The training examples are
marked slow and checked by ``python docs/examples.py --slow --check``, not here."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("readme_examples", ROOT / "docs" / "examples.py")
examples = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["readme_examples"] = examples  # its dataclass looks its module up there
_spec.loader.exec_module(examples)  # type: ignore[union-attr]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TEXTS = examples.documents()
ALL = "\n".join(TEXTS.values())


def test_every_console_block_is_a_checked_example() -> None:
    """Every console block in README.md and docs/ is an example docs/examples.py runs (a page
    with one outside DOCS would go unchecked)."""
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    unlisted = [p.name for p in pages if "```console" in p.read_text(encoding="utf-8") and p not in TEXTS]
    assert not unlisted, unlisted
    blocks = ALL.count("```console")
    found = [e for e in examples.all_examples(TEXTS) if not e.run_only]
    assert blocks == len(found) >= 8
    assert {e.name for e in found if e.slow} == {"quick-eval", "demo-eval-p1", "demo-eval"}


loose = examples.loose


@pytest.mark.slow
def test_fast_examples_print_what_the_readme_shows() -> None:
    got = examples.outputs(TEXTS, slow=False)
    stale = [
        e.name for e in examples.all_examples(TEXTS) if e.name in got and loose(got[e.name]) != loose(e.shown)
    ]
    assert not stale, f"examples differ from their commands (run python docs/examples.py): {stale}"


def test_loose_masks_rounding_only() -> None:
    line = "PASS: worst relative error 3.98e-07 at blocks.1.mixer (border) <= tol 1e-05"
    assert loose(line) == "PASS: worst relative error ~ at ~ <= tol 1e-05"
    assert loose("5.15e+00 0.2546 96.38% 1.2e-3") == "5.15e+00 0.2546 96.38% 1.2e-3"


def test_cuts_and_timings_are_marked() -> None:
    out = "a\nb 1.5 s\nc\nd\ne\n"
    assert examples.normalise(out, None) == "a\nb <t> s\nc\nd\ne\n"
    assert examples.normalise(out, examples._slices("0:2,-1:")) == "a\nb <t> s\n...\ne\n"
    assert examples.normalise(out, examples._slices("1:2")) == "...\nb <t> s\n...\n"


def test_prose_claims_about_flags(tmp_path: Path) -> None:
    """The sentences the docs say about flags name flags that exist where they say they do."""
    assert "`--margin` shape the" in ALL or "and `--margin` shape the" in ALL
    from conftest import invoke

    for cmd in (["convert"], ["train", "phase2"]):
        assert "--margin" in invoke([*cmd, "--help"], env={"COLUMNS": "300"}).output
    # "fewer are refused, citing the lower bound where one is proven ... and naming --approximate"
    r = invoke(
        [
            "convert",
            "fixtures/conv_digits.safetensors",
            "-o",
            str(tmp_path / "x.safetensors"),
            "--heads",
            "4",
        ],
    )
    assert r.exit_code == 2 and "--approximate" in r.stderr and "no lower bound is proven" in r.stderr
    assert re.search(r"fewer are refused, citing the\s+lower bound where one is proven", ALL)


def test_check_passes_another_cpus_rounding_and_fails_anything_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``docs/examples.py --check`` on a README whose blocks differ from the commands' output only in
    float32 rounding digits: exit 0, README untouched; in a verdict: exit 1."""
    readme = tmp_path / "README.md"
    readme.write_text(
        "<!-- example: one -->\n```console\n$ cmhsa verify a b\nPASS: worst relative error 3.98e-07 at "
        "blocks.1.mixer (border) <= tol 1e-05\n```\n"
    )
    monkeypatch.setattr(examples, "DOCS", [readme])
    monkeypatch.setattr(sys, "argv", ["examples.py", "--check"])
    other_cpu = "PASS: worst relative error 4.21e-07 at blocks.0.mixer (interior) <= tol 1e-05\n"
    monkeypatch.setattr(examples, "outputs", lambda text, slow: {"one": other_cpu})
    before = readme.read_text()
    assert examples.main() == 0 and readme.read_text() == before
    monkeypatch.setattr(examples, "outputs", lambda text, slow: {"one": other_cpu.replace("PASS", "FAIL")})
    assert examples.main() == 1 and readme.read_text() == before
