"""Run every console example README.md shows and rewrite its output block from what the command
printed, so the examples cannot go stale (tests/test_readme_examples.py runs the fast ones in CI).

An example is a fenced ``console`` block whose first line is ``$ COMMAND``, right after a marker:

    <!-- example: NAME [slow] [keep=A:B,C:D] -->

``slow``: run only with ``--slow`` (the training demo); ``keep``: Python slices of the output lines
that the block shows, a ``...`` line marking each cut. A ``bash`` block after an
``<!-- example: NAME slow run -->`` marker is run (as a script, unchecked) before the examples
after it: the runs they read. Commands run in README order in one scratch folder holding
``fixtures/``; timings print as ``<t> s``.

    python docs/examples.py            # rewrite the fast blocks in README.md
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
            raise SystemExit(f"README.md: example {m.group('name')} does not start with '$ COMMAND'")
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
        raise SystemExit(f"README.md: example {example.name} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return normalise(r.stdout + r.stderr, example.keep)


def scratch() -> tempfile.TemporaryDirectory:
    tmp = tempfile.TemporaryDirectory(prefix="cmhsa-examples-")
    (Path(tmp.name) / "fixtures").symlink_to(ROOT / "fixtures")
    (Path(tmp.name) / "runs").mkdir()
    return tmp


def outputs(text: str, slow: bool) -> dict[str, str]:
    """Each example's output, by name, run in README order (slow ones only when ``slow``)."""
    got = {}
    with scratch() as tmp:
        for ex in examples(text):
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
    text = README.read_text(encoding="utf-8")
    got = outputs(text, args.slow)
    if args.check:  # float32 rounding digits may differ from this README's CPU's (loose)
        differ = {
            e.name: got[e.name]
            for e in examples(text)
            if e.name in got and loose(got[e.name]) != loose(e.shown)
        }
        new = rewritten(text, differ)
        diff = list(
            difflib.unified_diff(text.splitlines(), new.splitlines(), "README.md", "commands", lineterm="")
        )
        print("\n".join(diff) or "README.md: every example block is what its command prints")
        return 1 if diff else 0
    README.write_text(rewritten(text, got), encoding="utf-8")
    print(f"README.md: {len(examples(text))} example blocks rewritten from their commands")
    return 0


if __name__ == "__main__":
    sys.exit(main())
