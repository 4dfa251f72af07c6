"""Run every console example README.md and the docs/ pages show and rewrite its output block from
what the command printed, so the examples cannot go stale (tests/test_readme_examples.py runs the
fast ones in CI).

An example is a fenced ``console`` block whose first line is ``$ COMMAND``, right after a marker:

    <!-- example: NAME [slow] [keep=A:B,C:D] -->

``slow``: run only with ``--slow`` (the training demo); ``keep``: Python slices of the output lines
that the block shows, a ``...`` line marking each cut. A ``bash`` block after an
``<!-- example: NAME slow run -->`` marker is run (as a script, unchecked) before the examples
after it: the runs they read. Commands run in the order of DOCS (README.md first, each page top to
bottom) in one scratch folder holding ``fixtures/``; timings print as ``<t> s``.

    python docs/examples.py            # rewrite the fast blocks
    python docs/examples.py --slow     # and the training ones (about 2 minutes on 2 cores)
    python docs/examples.py --check    # exit 1, with a diff, when a block differs

--check ignores float32 rounding: errors of 1e-6 and below, and the layer where the worst of them
fell, differ from one CPU to another (the order a matmul kernel sums in); everything else must match.
Commands print at COLUMNS=200, so rich's tables are not wrapped; a narrower terminal wraps them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# the pages whose examples run, in this order (a page's examples may read what an earlier one wrote)
DOCS = [README] + [
    ROOT / "docs" / f"{name}.md" for name in ("conversion", "training", "sharing", "reliability", "python")
]
MARKER = re.compile(
    r"<!-- example: (?P<name>[\w-]+)(?P<opts>[^>]*)-->\n```(?P<lang>console|bash)\n(?P<body>.*?)```", re.S
)
TIMING = re.compile(r"\b\d+(?:\.\d+)? s\b")
ROUNDING = re.compile(r"\b\d\.\d\de-(0[6-9]|1\d)\b")  # float32 rounding: 1e-6 and below
WHERE = re.compile(r"at blocks\.\d+\.mixer \(\w+\)|at logits \(\w+\)|\(batch \d+\)")
ENV = {"COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb", "PYTHONHASHSEED": "0"}


@dataclass
class Example:
    name: str
    slow: bool
    run_only: bool  # a bash block run for its effects
    keep: list[slice] | None
    command: str
    shown: str  # the output block as README has it
    span: tuple[int, int]  # of the body in README's text


def _slices(spec: str) -> list[slice]:
    return [slice(*(int(x) if x else None for x in part.split(":"))) for part in spec.split(",")]


def examples(text: str) -> list[Example]:
    found = []
    for m in MARKER.finditer(text):
        opts = m.group("opts").split()
        keep = next((_slices(o[5:]) for o in opts if o.startswith("keep=")), None)
        body = m.group("body")
        run_only = m.group("lang") == "bash"
        first, _, rest = body.partition("\n")
        if not run_only and not first.startswith("$ "):
            raise SystemExit(f"example {m.group('name')} does not start with '$ COMMAND'")
        command = body if run_only else first[2:]
        found.append(Example(m.group("name"), "slow" in opts, run_only, keep, command, rest, m.span("body")))
    return found


def normalise(output: str, keep: list[slice] | None) -> str:
    lines = [TIMING.sub("<t> s", line.rstrip()) for line in output.rstrip("\n").splitlines()]
    if keep is None:
        return "\n".join(lines) + "\n"
    shown: list[str] = []
    last = 0
    for s in keep:
        start, stop, _ = s.indices(len(lines))
        if start > last:  # a cut
            shown.append("...")
        shown += lines[start:stop]
        last = stop
    if last < len(lines):
        shown.append("...")
    return "\n".join(shown) + "\n"


def loose(block: str) -> str:
    """A block with its float32-rounding-level errors, and where the worst of them fell, masked: their
    digits follow the CPU's matmul kernels (another instruction set sums in another order), while
    everything else (shapes, verdicts, accuracies, approximation errors) must match exactly."""
    return WHERE.sub("at ~", ROUNDING.sub("~", block))


def run(example: Example, cwd: Path) -> str:
    """What the example prints, normalised (stdout and stderr together, as a terminal shows them)."""
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    if example.run_only:
        args = ["bash", "-e", "-c", example.command]
    else:
        words = shlex.split(example.command)
        args = [sys.executable, "-m", "convit_convert", *words[1:]] if words[0] == "cmhsa" else words
    r = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
    if example.run_only and r.returncode:
        raise SystemExit(f"example {example.name} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return normalise(r.stdout + r.stderr, example.keep)


def scratch() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="cmhsa-examples-")
    (Path(tmp.name) / "fixtures").symlink_to(ROOT / "fixtures")
    (Path(tmp.name) / "runs").mkdir()
    return tmp


def documents() -> dict[Path, str]:
    """DOCS' texts, by path."""
    return {path: path.read_text(encoding="utf-8") for path in DOCS}


def all_examples(texts: dict[Path, str]) -> list[Example]:
    """Every page's examples, in DOCS order; a name is one example's, across all pages."""
    found = [ex for text in texts.values() for ex in examples(text)]
    names = [ex.name for ex in found]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SystemExit(f"example names used twice: {', '.join(dup)}")
    return found


def outputs(texts: dict[Path, str] | str, slow: bool) -> dict[str, str]:
    """Each example's output, by name, run in DOCS order (slow ones only when ``slow``); ``texts``:
    the pages (a single text: one page)."""
    texts = {README: texts} if isinstance(texts, str) else texts
    got = {}
    with scratch() as tmp:
        for ex in all_examples(texts):
            if ex.slow and not slow:
                continue
            out = run(ex, Path(tmp))
            if not ex.run_only:
                got[ex.name] = out
    return got


def rewritten(text: str, got: dict[str, str]) -> str:
    for ex in reversed(examples(text)):
        if ex.name in got:
            a, b = ex.span
            text = text[:a] + f"$ {ex.command}\n{got[ex.name]}" + text[b:]
    return text


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slow", action="store_true", help="also the training examples")
    ap.add_argument("--check", action="store_true", help="compare, do not write; exit 1 on a difference")
    args = ap.parse_args()
    texts = documents()
    got = outputs(texts, args.slow)
    if args.check:  # float32 rounding digits may differ from the pages' CPU's (loose)
        diff = []
        for path, text in texts.items():
            differ = {
                e.name: got[e.name]
                for e in examples(text)
                if e.name in got and loose(got[e.name]) != loose(e.shown)
            }
            name = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
            new = rewritten(text, differ)
            diff += difflib.unified_diff(text.splitlines(), new.splitlines(), name, "commands", lineterm="")
        print("\n".join(diff) or "every example block is what its command prints")
        return 1 if diff else 0
    for path, text in texts.items():
        path.write_text(rewritten(text, got), encoding="utf-8")
    print(f"{len(all_examples(texts))} example blocks in {len(texts)} pages rewritten from their commands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
