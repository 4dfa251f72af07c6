"""What counts a training step's work, for the tests and bench/: the aten ops dispatched while a
counter is active (:class:`OpCounter`; a host read of a device value is ``aten._local_scalar_dense``),
and a profiler record around each step of a run or a stack (:func:`steps_recorded`) with the rule
for the ops a step dispatched itself, outside its compiled graph (:func:`eager_step`)."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

import torch

try:  # torch's one way to see every op; private, so a torch that moves it loses the op counts alone
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # pragma: no cover
    TorchDispatchMode = object  # type: ignore[assignment,misc]

HOST_READ = "aten._local_scalar_dense"  # what ``.item()`` and friends dispatch: the host waits for the device
STEP = "cmhsa::step"  # the profiler's record around one step of a run or a stack
GRAPH_CALL = "## Call CompiledFxGraph"  # the profiler's record around one call of a compiled graph
COMPILED = ("Torch-Compiled Region", GRAPH_CALL)  # records whose ops ran inside the compiled step
NOT_KERNELS = ("aten::empty", "aten::as_strided", "aten::view", "aten::resize", "aten::set_", "aten::alias")


class OpCounter(TorchDispatchMode):
    """Every aten op dispatched while active, by name (``ops``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def steps_recorded() -> Iterator[None]:
    """Every step of a run (:class:`.loop.Loop`) or a stack (:class:`.stacked.Stack`) under a
    profiler record named :data:`STEP`."""
    from .loop import Loop
    from .stacked import Stack

    originals = {cls: cls.step for cls in (Loop, Stack)}

    def recorded(step: Any) -> Any:
        def wrapped(self: Any, batch: Any) -> None:
            with torch.profiler.record_function(STEP):
                return step(self, batch)

        return wrapped

    for cls, step in originals.items():
        cls.step = recorded(step)  # type: ignore[method-assign]
    try:
        yield
    finally:
        for cls, step in originals.items():
            cls.step = step  # type: ignore[method-assign]


def eager_step(e: Any) -> int | None:
    """The id of the step record under which the profiler event ``e`` is an aten op the step
    dispatched itself, outside the compiled graph; None for any other event."""
    if not e.name.startswith("aten::") or e.name.startswith(NOT_KERNELS):
        return None
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("aten::") or p.name.startswith(COMPILED):
            return None
        if p.name == STEP:
            return p.id
        p = p.cpu_parent
    return None
