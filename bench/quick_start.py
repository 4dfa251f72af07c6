"""The README's quick start as a newcomer runs it: every command of its "Quick start" section, in
order, in a fresh clone, timed one by one (wall seconds), with an empty home folder so that no
cache a previous run left (matplotlib's font cache, torch's compile cache) helps.

    python bench/quick_start.py CLONE [--json OUT.json] [--only N]

CLONE: a fresh clone whose ``.venv`` is installed as the README's "Install" says, its ``runs/``
empty or absent (the install line makes it; one holding anything, or a link, is refused, never
emptied: the commands write into it). The commands are the section's ``$ cmhsa ...`` console lines
and its bash blocks' lines, taken from README.md itself, so this times what the README tells a
reader to run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path


def quick_start_commands(readme: str) -> list[str]:
    """The shell lines of README's "## Quick start" section: ``$ `` lines of its console blocks,
    every line of its bash blocks (comments kept: bash ignores them)."""
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands, block = [], None
    for line in section.splitlines():
        if line.startswith("```"):
            block = None if block is not None else line[3:].strip()
            continue
        if block == "console" and line.startswith("$ "):
            commands.append(line[2:])
        elif block == "bash" and line.strip():
            commands.append(line)
    return commands


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("clone", type=Path)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", type=int, default=None, help="the first N commands (a test that it runs)")
    args = ap.parse_args()
    clone = args.clone.resolve()
    commands = quick_start_commands((clone / "README.md").read_text(encoding="utf-8"))[: args.only]
    runs = clone / "runs"
    if runs.is_symlink() or (runs.exists() and (not runs.is_dir() or any(runs.iterdir()))):
        raise SystemExit(
            f"error: {runs} is not an empty folder: give a fresh clone (the quick start writes there)"
        )
    runs.mkdir(exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="quick-start-home-"))
    env = {**os.environ, "HOME": str(home), "PATH": f"{clone / '.venv' / 'bin'}:{os.environ['PATH']}"}
    env.pop("XDG_CACHE_HOME", None)
    env.pop("MPLCONFIGDIR", None)
    rows, shell_vars = [], ""
    for command in commands:
        if "=" in command.split()[0] and not command.startswith("cmhsa"):  # D="..." : kept for later lines
            shell_vars += command + "\n"
            continue
        t = time.perf_counter()
        r = subprocess.run(["bash", "-c", shell_vars + command], cwd=clone, env=env, capture_output=True)
        seconds = time.perf_counter() - t
        rows.append({"command": command, "seconds": round(seconds, 1), "exit": r.returncode})
        print(f"{seconds:7.1f} s  exit {r.returncode}  {command}", flush=True)
        if r.returncode != 0:
            print(r.stderr.decode(errors="replace")[-2000:])
    total = sum(row["seconds"] for row in rows)
    print(f"{total:7.1f} s  in all ({len(rows)} commands; home {home}, emptied caches)")
    if args.json is not None:
        doc = {"commands": rows, "total_seconds": round(total, 1)}
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
