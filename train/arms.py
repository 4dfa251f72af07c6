"""An experiment's training runs ("arms") as parallel processes, each resumable, within a time budget.

    status = run_arms(arms, parallel=2, time_budget=540)

Each arm is a :class:`TrainConfig` with its own run folder and the arms whose models it starts
from (``after``). An arm whose model file exists is done and skipped; one with a checkpoint is
resumed; the others start once everything they depend on is done. Up to ``parallel`` arms run
at once, each in its own process (``python -m convit_convert.train.arms ARM.json``) with
``threads`` torch CPU threads (default :data:`ARM_THREADS`, 1), the same whatever ``parallel`` is:
torch's CPU results depend on the thread count (docs/training.md, "When two runs are bit-identical"), so an
arm's numbers must not depend on how many arms ran beside it. With a ``time_budget``, no arm
starts in the last ``margin`` seconds (30, or a quarter of a shorter budget) and every running arm
gets SIGTERM then: it finishes its step, saves ``checkpoint-last.pt`` and exits, and the same
command later resumes it. A child's output goes to ``log.txt`` in its run folder.
"""

from __future__ import annotations

import csv
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CmhsaError
from ..io.atomic import atomic_text
from ..io.folder import Folder, make_folder
from ..io.outputs import Target
from ..io.paths import parse_json, read_text
from ..options.training import TrainConfig
from ..options.values import check
from ..text import terminal_safe
from .names import LAST, OUTPUT, seed_folder

CPU_SECONDS = "cpu_seconds.txt"  # an arm's CPU seconds, summed over the processes that trained it

DONE, STOPPED, FAILED, WAITING, BLOCKED = "done", "stopped", "failed", "waiting", "blocked"


@dataclass
class Arm:
    name: str
    config: TrainConfig  # its ``runtime.out`` is the arm's run folder
    after: tuple[str, ...] = ()  # arms that must be done first (this arm's --init reads their model)
    status: str = WAITING
    seconds: float = 0.0  # wall seconds of this invocation's process
    note: str = ""

    @property
    def out(self) -> Path:
        return Path(self.config.runtime.out)

    @property
    def folders(self) -> list[Path]:
        """The arm's run folders: ``out``, or with ``seeds`` (stacked) each seed's in it."""
        seeds = self.config.runtime.seeds
        return [seed_folder(self.out, s) for s in seeds] if seeds else [self.out]

    @property
    def model(self) -> Path:
        """The trained model (the first seed's, for a stacked arm: :attr:`models`)."""
        return self.models[0]

    @property
    def models(self) -> list[Path]:
        return [f / OUTPUT[self.config.phase] for f in self.folders]

    def done(self) -> bool:
        return all(m.is_file() for m in self.models)

    def rows(self) -> list[dict[str, float]]:
        """metrics.csv's rows (:func:`metrics_rows`); the first seed's for a stacked arm."""
        return metrics_rows(self.folders[0])

    def cpu_seconds(self) -> float:
        """CPU seconds of every process that trained this arm (cpu_seconds.txt)."""
        return float((self.out / CPU_SECONDS).read_text())

    def environments(self) -> list[dict]:
        """Where the arm computed (config.json's ``environments``: threads, CPU code path, device,
        torch and timm versions, from which epoch); [] before its first save."""
        try:
            doc = parse_json(read_text(self.out / "config.json", what="run config"), self.out, "config.json")
            return list(doc.get("environments", []))
        except (CmhsaError, AttributeError, TypeError):
            return []

    def progress(self) -> str:
        """Epochs finished / planned."""
        return f"{len(self.rows())}/{self.config.recipe.epochs}"

    def status_line(self, elapsed: float) -> str:
        """One line for a report: seconds since the start, status, name, epochs, why it failed."""
        note = f"  ({self.note})" if self.note else ""
        return f"{elapsed:6.0f} s  {self.status:8s} {self.name}  epochs {self.progress()}{note}"


def metrics_rows(folder: Path) -> list[dict[str, float]]:
    """A run folder's metrics.csv rows as numbers, one per finished epoch, its empty cells left out
    ([] before the first)."""
    try:
        with open(folder / "metrics.csv", newline="") as f:
            return [{k: float(v) for k, v in r.items() if v} for r in csv.DictReader(f)]
    except OSError:
        return []


def unfinished(arms: list[Arm]) -> str | None:
    """What to tell a user when some arms are not done (None when all are)."""
    left = [a for a in arms if a.status != DONE]
    if not left:
        return None
    return (
        f"{len(arms) - len(left)}/{len(arms)} runs done; unfinished: "
        + ", ".join(f"{a.name} ({a.status}, epochs {a.progress()})" for a in left)
        + "\nrun the same command again to continue"
    )


@dataclass
class _Running:
    arm: Arm
    proc: subprocess.Popen
    started: float
    log: object = field(default=None)


ARM_THREADS = 1  # every arm's torch CPU threads, whatever `parallel` is (the module docstring)


def run_arms(
    arms: list[Arm],
    *,
    parallel: int = 1,
    time_budget: float | None = None,
    margin: float | None = None,
    report: Callable[[Arm], None] | None = None,
    poll: float = 0.5,
    threads: int = ARM_THREADS,
) -> list[Arm]:
    """Run what is unfinished of ``arms`` (see the module docstring); each arm's ``status`` says how
    it ended: done, stopped (by the budget: resume with the same call), failed (``note``: the last
    line of its log), blocked (an arm it depends on failed) or waiting (the budget ran out first).
    ``margin`` (default: 30 s, or a quarter of a shorter budget) is left for the arms to save."""
    names = {a.name for a in arms}
    if len(names) != len(arms):
        raise CmhsaError("two arms share a name")
    for a in arms:
        if not set(a.after) <= names:
            raise CmhsaError(f"arm {a.name!r} waits for unknown arms {sorted(set(a.after) - names)}")
    if parallel < 1:
        raise CmhsaError(f"`parallel` must be >= 1, got {parallel}")
    if time_budget is not None and not (math.isfinite(time_budget) and time_budget > 0):
        raise CmhsaError(f"`time_budget` must be a positive number of seconds, got {time_budget}")
    by_name = {a.name: a for a in arms}
    for a in arms:
        a.status = DONE if a.done() else WAITING
    check("threads", threads)  # the range `cmhsa train --threads` takes
    start = time.monotonic()
    deadline = None if time_budget is None else start + time_budget
    if time_budget is not None and margin is None:
        margin = min(30.0, time_budget / 4)
    running: list[_Running] = []
    stopping = False
    while True:
        for r in list(running):  # collect finished children
            code = r.proc.poll()
            if code is None:
                continue
            running.remove(r)
            r.log.close()  # type: ignore[attr-defined]
            r.arm.seconds = time.monotonic() - r.started
            if code == 0 and r.arm.done():
                r.arm.status = DONE
            elif code in (
                128 + signal.SIGTERM,
                -signal.SIGTERM,
            ):  # negative: stopped before its handler was up
                r.arm.status = STOPPED
            else:
                r.arm.status, r.arm.note = FAILED, _last_line(r.arm.out / "log.txt")
            if report:
                report(r.arm)
        for a in arms:  # an arm whose dependency failed can never start
            if a.status == WAITING and any(by_name[d].status in (FAILED, BLOCKED) for d in a.after):
                a.status = BLOCKED
                if report:
                    report(a)
        now = time.monotonic()
        if deadline is not None and now >= deadline - margin and not stopping:  # type: ignore[operator]
            stopping = True
            for r in running:
                r.proc.send_signal(signal.SIGTERM)
        if not stopping:
            for a in arms:
                if len(running) >= parallel:
                    break
                if a.status == WAITING and all(by_name[d].status == DONE for d in a.after):
                    running.append(_launch(a, threads))
        if not running:
            break
        time.sleep(poll)
    return arms


def _launch(arm: Arm, threads: int) -> _Running:
    make_folder(arm.out, "run folder")
    # without a checkpoint it is a fresh start: whatever an earlier attempt left is the arm's own
    started = any((f / LAST).is_file() for f in arm.folders)
    cfg = arm.config.replace(resume=started, overwrite=not started, threads=threads)
    spec = arm.out / "arm.json"
    with Folder.open(arm.out) as folder:  # the arm's folder, held while its files are written
        atomic_text((Target(folder, spec.name), cfg.to_json()))
        log = folder.open_append("log.txt")  # closed when the child is collected
    proc = subprocess.Popen(
        [sys.executable, "-m", "convit_convert.train.arms", str(spec)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": str(threads)},
    )
    arm.status = "running"
    return _Running(arm, proc, time.monotonic(), log)


def _last_line(path: Path) -> str:
    try:
        lines = [ln for ln in path.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1] if lines else ""


def _child(spec: Path) -> int:
    """One arm: run its config, add this process's CPU seconds to cpu_seconds.txt; the exit code
    says how it ended (0 done, 128 + signal when stopped, 1 failed)."""
    from .run import run
    from .stacked import run_seeds

    cfg = TrainConfig.from_dict(parse_json(read_text(spec, what="arm spec"), spec, "arm.json"))
    t = time.process_time()
    try:
        results = run_seeds(cfg) if cfg.runtime.seeds else [run(cfg)]
    except CmhsaError as e:
        print(f"error: {terminal_safe(str(e))}", flush=True)
        return 1
    result = next((r for r in results if r.stopped), results[0])
    with Folder.open(cfg.runtime.out) as folder:  # the arm's folder: its CPU seconds, summed over tries
        before = float(folder.read_bytes(CPU_SECONDS, 64)) if folder.exists(CPU_SECONDS) else 0.0
        atomic_text((Target(folder, CPU_SECONDS), f"{before + time.process_time() - t:.1f}\n"))
    if result.stopped in ("SIGINT", "SIGTERM"):
        return 128 + int(getattr(signal, result.stopped))
    return 0


if __name__ == "__main__":
    sys.exit(_child(Path(sys.argv[1])))
