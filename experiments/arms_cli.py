"""What the experiment scripts share for running their arms: the flags and the call that runs them.

add_arm_flags(ap)          # --loader, --parallel, --threads, --time-budget, --settings
run_or_exit(arms, args)    # prints a line per arm; exits 3 while some are unfinished
chosen_settings(SETTINGS, args), needed(arms, settings)   # --settings: run only some of a table
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from convit_convert.errors import CmhsaError
from convit_convert.train.arms import ARM_THREADS, Arm, run_arms, unfinished


def add_arm_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--loader", default="auto", help="auto, device, workers (README: Loader)")
    ap.add_argument("--parallel", type=int, default=1, help="runs at once, each in its own process")
    ap.add_argument(
        "--threads",
        type=int,
        default=ARM_THREADS,
        help="torch CPU threads of every run, whatever --parallel is (the results depend on it)",
    )
    ap.add_argument(
        "--settings",
        nargs="+",
        default=None,
        metavar="WORDS",
        help="only the table's settings whose name holds one of these (and the runs they are made of)",
    )
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds: stop cleanly before this (unfinished runs resume on the next call)",
    )


def run_or_exit(
    arms: list[Arm], args: argparse.Namespace, on_end: Callable[[Arm], None] | None = None
) -> None:
    """Run what is unfinished of ``arms`` (convit_convert.train.arms), a status line as each ends
    (then ``on_end(arm)``); bad flags exit 1 with one line, unfinished arms exit 3 with what to do."""
    t0 = time.time()

    def report(arm: Arm) -> None:
        print(arm.status_line(time.time() - t0), flush=True)
        if on_end is not None:
            on_end(arm)

    try:
        run_arms(
            arms, parallel=args.parallel, time_budget=args.time_budget, report=report, threads=args.threads
        )
    except CmhsaError as e:
        raise SystemExit(f"error: {e}") from None
    if (left := unfinished(arms)) is not None:
        print("\n" + left)
        raise SystemExit(3)


def chosen_settings(settings: list[tuple], args: argparse.Namespace) -> list[tuple]:
    """The table's settings ``--settings`` names (each a tuple whose first item is its name, its last
    the run names it is made of); all without it."""
    wanted = getattr(args, "settings", None)
    if not wanted:
        return settings
    # a setting's whole name picks it alone; other words, every setting whose name holds them
    names = {row[0] for row in settings}
    picked = [
        row
        for row in settings
        if any(words == row[0] or (words in row[0] and words not in names) for words in wanted)
    ]
    if not picked:
        raise SystemExit(f"error: --settings names none of: {'; '.join(row[0] for row in settings)}")
    return picked


def needed(arms: list[Arm], settings: list[tuple]) -> list[Arm]:
    """The arms the ``settings`` are made of (``NAME`` or ``seedN/NAME`` for a NAME of theirs), in order."""
    names = {name for row in settings for name in row[-1]}
    return [arm for arm in arms if arm.name.rsplit("/", 1)[-1] in names]
