"""The interrupting signals this process has received (SIGINT, SIGTERM), noted by whichever handler
took them (the CLI's, or a training run's stop request), so that an error one of them caused, such
as a loader worker it ended, is reported as the interruption it is. Process-wide, as signals are."""

from __future__ import annotations

RECEIVED: list[int] = []


def note(signum: int) -> None:
    RECEIVED.append(signum)


def first() -> int | None:
    """The first interrupting signal received, or None."""
    return RECEIVED[0] if RECEIVED else None


def clear() -> None:
    """Forget them: a new command starts (the CLI's tests run many in one process)."""
    RECEIVED.clear()
