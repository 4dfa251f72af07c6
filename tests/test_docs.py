"""The documents a user reads: a README that reads in one sitting, docs/ pages whose links resolve
(on GitHub: files and heading anchors), a command-line reference that is the commands' own
``--help``, no change history in user documents, and the demos' commands as the data needs them."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from conftest import ROOT

README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
USER_PAGES = [p for p in PAGES if p.name != "ARCHITECTURE.md"]  # ARCHITECTURE.md: for maintainers
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)  # not code's '#'
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", text, re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_the_readme_reads_in_one_sitting() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 200, lines


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_link_resolves(page: Path) -> None:
    """Every relative link of a page names a file or folder of the repository, and a heading
    anchor (``#...``) names a heading of the page it points to."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    broken = []
    for m in LINK.finditer(text):
        target = m.group(1) or m.group(2)
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in anchors(resolved)):
            broken.append(target)
    assert not broken, broken


def test_the_cli_reference_is_the_commands_help() -> None:
    """docs/cli.md is what docs/cli_reference.py prints (in a fresh process: how wide typer draws
    help depends on the environment it first loaded rich in)."""
    import subprocess

    argv = [sys.executable, str(ROOT / "docs" / "cli_reference.py"), "--check"]
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert all(f"## `cmhsa {c}`" in text for c in ("convert", "verify", "export", "train phase2", "plot"))


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_no_change_history_in_user_documents(page: Path) -> None:
    """Issue numbers and "before issue N" belong in BENCHMARKS.md and EXPERIMENTS.md's dated
    records, not in the pages that say how cmhsa works."""
    text = page.read_text(encoding="utf-8")
    assert not re.findall(r"\bissues? \d+", text, re.I), page.name


def bash_lines() -> list[tuple[str, str]]:
    """(page, line) of every line of every bash block of the user pages."""
    found = []
    for page in USER_PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(encoding="utf-8"), re.S):
            found += [(page.name, line) for line in block.splitlines()]
    return found


def test_grey_data_is_trained_with_one_channel_in_every_documented_command() -> None:
    """A documented command (or the flags variable it uses) that trains on digits or Fashion-MNIST
    says --in-chans 1: those images are grey, and with 3 channels every run of it printed the
    tool's 'images are grey' note."""
    grey = [
        (page, line)
        for page, line in bash_lines()
        if re.search(r"--data (digits|fashion-mnist)\b", line) and not line.lstrip().startswith("cmhsa eval")
    ]
    assert len(grey) >= 4
    assert all("--in-chans 1" in line for _, line in grey), [g for g in grey if "--in-chans 1" not in g[1]]


def test_the_training_page_shows_the_quick_starts_commands() -> None:
    """docs/training.md's demo is the README's quick start, which docs/examples.py runs."""

    def trains(page: Path) -> list[str]:
        text = page.read_text(encoding="utf-8")
        block = re.search(r'```bash\n(D="--preset cpu --data digits.*?)```', text, re.S)
        assert block is not None, page.name
        lines = block.group(1).splitlines()
        return [line.split("#")[0].rstrip() for line in lines if "train" in line or "D=" in line]

    assert trains(ROOT / "docs" / "training.md") == trains(README)


def test_the_python_pages_api_block_runs(tmp_path: Path) -> None:
    import subprocess

    text = (ROOT / "docs" / "python.md").read_text(encoding="utf-8")
    code = re.search(r"<!-- snippet: api -->\n```python\n(.*?)```", text, re.S).group(1)  # type: ignore[union-attr]
    (tmp_path / "fixtures").symlink_to(ROOT / "fixtures")
    (tmp_path / "runs").mkdir()
    argv = [sys.executable, "-c", code]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[:2] == ["True", "16"] and (tmp_path / "runs" / "vit_qk16.safetensors").exists()
    assert not (tmp_path / "runs" / "vit.safetensors").exists()  # the quick start's model is not replaced


def test_every_code_fence_is_closed() -> None:
    """A fence opens and closes at the start of a line (docs/python.md once ran prose into a block)."""
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text(encoding="utf-8")
        starts = [ln for ln in text.splitlines() if ln.startswith("```")]
        assert text.count("```") == len(starts) and len(starts) % 2 == 0, page.name


def test_the_readmes_test_command_is_what_ci_runs() -> None:
    """.ci/run sets up from nothing and runs the README's test command: the lines are one, in
    README and in docs/development.md, which says it is CI's."""
    ci = [ln for ln in (ROOT / ".ci" / "run").read_text().splitlines() if ln.startswith("python3 -m venv")]
    assert len(ci) == 1
    for page in (README, ROOT / "docs" / "development.md"):
        lines = page.read_text(encoding="utf-8").splitlines()
        said = [ln for ln in lines if ln.startswith("python3 -m venv") and "pytest" in ln]
        assert said == ci, page.name
