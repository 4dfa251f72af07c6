"""The training loop, read top to bottom: an epoch's steps from a batch to the optimizer's update,
then the epoch's evaluation (the loop of nanoGPT's train.py, with DeiT's recipe).

One step (:func:`train_one_step`): the batch to the device, augmented there by the device loader
and mixed (Mixup/CutMix); forward under autocast, the loss; backward; gradient clipping; the
optimizer's step; zero_grad; the EMA and the scheduler. Three things a first reading can skip, in
:mod:`.step`: the loss is summed on the device (``Tally``), so the host never waits for the device
within a stretch of steps; the update is skipped on the device after a non-finite loss
(``update``); ``--compile`` runs the step's middle as one graph (``CompiledStep``), computing what
the eager lines compute. ``backward`` is ``loss.backward()``, with fewer ops where DDP does not
need backward()'s hooks.

Every ``--log-every`` steps and at the epoch's end, one read-out (:func:`read_out`): the loss
totals for the progress line, a non-finite loss (the run stops, naming its step) and a stop
request (all-reduced under torchrun, so every rank stops at the same step). Between read-outs the
host counts steps (a terminal's bar moves with each) and, once PROGRESS_SECONDS of wall time pass
without a line, takes one glance (:func:`glance`: the loss so far, read without resetting it): a
log never goes silent for long, and the device is read at most that often.

Each epoch seeds every global RNG from (seed, epoch, rank), so an epoch's randomness does not
depend on how the process got there (a resumed epoch restores the RNGs saved mid-epoch instead).

The epoch loop drives a :class:`Stepper`: a run's :class:`Loop` is one (a stack of one seed), and
``--seeds``' :class:`.stacked.Stack` (its seeds' steps as one batched computation) and
:class:`.stacked.Interleaved` (each seed's own step in turn) the others, each seed's epoch begun
and ended under its own RNGs. One loop serves all.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from ..analysis import attention_stats
from ..api.common import autocast
from ..api.on_data import evaluate
from ..errors import CheckFailed
from ..loaders import sample_seed
from ..options.training import TrainConfig
from . import progress
from .distributed import Context, all_reduce_sum
from .names import LAST
from .progress import Progress
from .state import RunState, set_rng_state
from .step import CompiledStep, Tally, backward, micro_batch, update


@dataclass(frozen=True)
class Scored:
    """One seed's validation scores at an epoch's end (``val_loss``, ``top1``, ``top5``), and its
    EMA's where it keeps one."""

    model: dict[str, float]
    ema: dict[str, float] | None


@dataclass(kw_only=True)
class Loop:
    """What every step and epoch uses, built once (by keyword) by :func:`.build.build`."""

    cfg: TrainConfig
    ctx: Context
    out: Path
    state: RunState  # the model, optimizer, scheduler, scaler, EMA, metrics and position of the run
    train_loader: Any  # (inputs, labels) batches: images, or the device loader's HeldBatch
    val_loader: Any
    steps_per_epoch: int
    reporter: Progress
    forward: nn.Module  # the model as trained: DDP-wrapped, or compiled (its forward only)
    criterion: nn.Module  # timm's loss (soft targets under Mixup)
    dtype: torch.dtype | None  # autocast's, None for full precision (evaluation's too)
    prepare: Any = None  # the device loader's augmentation (inputs -> images); None: images as given
    mixup: Any = None  # timm's Mixup/CutMix
    compiled: CompiledStep | None = None  # --compile: the step's middle as one graph
    probe: torch.Tensor | None = None  # attn models: fixed val images for the per-epoch attention metrics
    config_json: str = ""  # config.json's text, written with every checkpoint
    classes: tuple[str, ...] | None = None  # the outputs' names, where the data names them (labels.py)
    board: Any = None  # `report_to` tensorboard: the run's event file (train/tensorboard.py)
    tally: Tally = field(init=False)  # the losses since the last read-out, on the device
    params: list[torch.Tensor] = field(init=False)  # what the optimizer updates
    pace: progress.Pace = field(init=False)  # the run's time, for every progress line's estimate
    said_slow: bool = field(init=False, default=False)  # the note that one step outlasts a progress interval

    def __post_init__(self) -> None:
        self.tally = Tally(self.ctx)
        self.params = [p for p in self.state.model.parameters() if p.requires_grad]
        epochs = self.cfg.recipe.epochs
        self.pace = progress.Pace(epochs, self.steps_per_epoch, lambda epoch: eval_due(self, epoch))

    # the run as the epoch loop's Stepper: a stack of one, at no cost ---------------------------

    @property
    def loops(self) -> list[Loop]:
        return [self]

    def stream(self, i: int) -> AbstractContextManager[None]:
        return contextlib.nullcontext()  # the run's own RNGs are the global ones

    def batches(self) -> Iterable[Any]:
        """The device loader's raw batches when the step augments them (``prepare``), else the
        loader's own."""
        return self.train_loader.batches() if self.prepare is not None else self.train_loader

    def step(self, batch: tuple[Any, torch.Tensor]) -> None:
        train_one_step(self, *batch)

    def settle(self) -> None:
        """Nothing to hand back: the run's state is its own."""

    def validation(self, checked: Any = None) -> list[Scored | None]:
        """Nothing measured ahead: the run evaluates itself as its epoch ends (:func:`epoch_metrics`)."""
        return [None]


class Stepper(Protocol):
    """What :func:`train_one_epoch` drives: one step of every seed at a time. A run's :class:`Loop`
    (one seed) or :class:`.stacked.Stack` (several, in lockstep)."""

    @property
    def loops(self) -> list[Loop]:
        """Each seed's loop (its state, loaders, reporter), the lead seed's first."""
        ...

    def stream(self, i: int) -> AbstractContextManager[None]:
        """Seed ``i``'s global RNGs in place (begin and end of epoch, saves), kept after."""
        ...

    def batches(self) -> Iterable[Any]:
        """The epoch's batches from the step the run is at: what :meth:`step` takes."""
        ...

    def step(self, batch: Any) -> None:
        """One optimizer step of every seed."""
        ...

    def settle(self) -> None:
        """Each seed's state made its own again (after an epoch or a stop, before a save)."""
        ...

    def validation(self, checked: Any) -> list[Scored | None]:
        """At an evaluated epoch's end, each seed's validation scores where the stepper measured
        them itself (a stack: every seed in one batched forward); None: the seed's own evaluation.
        ``checked``: what its count of batches goes through (:func:`stoppable`)."""
        ...


def train_one_step(loop: Loop, inputs: Any, labels: torch.Tensor) -> None:
    """One optimizer step on a batch, with no read of a device value (for a fused optimizer)."""
    st, device, tally = loop.state, loop.ctx.device, loop.tally
    optimizer, scaler = st.optimizer, st.scaler
    labels = labels.to(device, non_blocking=True)
    if loop.compiled is not None:  # the same as the lines below, as one graph: gradients in p.grad
        loop.compiled(inputs, labels, tally)
    else:
        images = loop.prepare(inputs) if loop.prepare is not None else inputs.to(device, non_blocking=True)
        if loop.mixup is not None:  # over the update's whole batch, as one batch of its size mixes
            images, labels = loop.mixup(images, labels)
        # `grad_accum_steps` micro-batches, each's gradient of its share of the batch's mean loss
        # added to the last's: one update of the batch's images, a micro-batch's memory
        n = loop.cfg.recipe.grad_accum_steps
        if n == 1:
            with autocast(device, loop.dtype):
                loss = loop.criterion(loop.forward(images), labels)
            backward(scaler.scale(loss), loop.params, loop.ctx)  # fp16 scales the loss; else it is as is
        else:
            loss = accumulated(loop, images.chunk(n), labels.chunk(n))
        tally.add(loss)  # on the device: the sum, and whether every loss since the last read-out was finite
    clip = loop.cfg.recipe.clip_grad
    if clip is not None:
        scaler.unscale_(optimizer)  # a no-op unless fp16's scaler is on
        nn.utils.clip_grad_norm_(loop.params, clip, foreach=True)
    update(optimizer, scaler, tally.skip)  # skipped on the device after a non-finite loss
    optimizer.zero_grad(set_to_none=True)
    st.global_step += 1
    if st.ema is not None:
        st.ema.update(st.model, step=st.global_step)
    st.scheduler.step_update(num_updates=st.global_step)


class ValidationCut(Exception):
    """A stop request arrived during a validation: the epoch's steps are done and saved, its
    validation is redone when the run resumes."""


def accumulated(
    loop: Loop, images: tuple[torch.Tensor, ...], labels: tuple[torch.Tensor, ...]
) -> torch.Tensor:
    """`grad_accum_steps` micro-batches of one update: each's gradient of its share of the batch's
    mean loss added to the last's (one update of the batch's images in a micro-batch's memory;
    under DDP all-reduced once, with the last); the batch's mean loss."""
    n, total = len(images), None
    for i, (x, y) in enumerate(zip(images, labels, strict=True)):
        with autocast(loop.ctx.device, loop.dtype):
            part = loop.criterion(loop.forward(x), y) / n
        with micro_batch(loop.forward, last=i == n - 1):
            backward(loop.state.scaler.scale(part), loop.params, loop.ctx, add=i > 0)
        total = part.detach() if total is None else total + part.detach()
    return total  # type: ignore[return-value]


def train_one_epoch(stepper: Stepper, stop: Any, stop_after_steps: int | None = None) -> bool:
    """Train the epoch the run is in, from its step on, every seed of ``stepper`` in lockstep;
    evaluate each and append its epoch's row to its ``state.metrics``. False if a stop request (or
    ``stop_after_steps``) ended it early, with ``state.step`` the steps done; a stop during the
    validation ends it there (its steps all done, the validation redone on resume). Nothing is read
    from the device between read-outs (every ``log_every`` steps and the epoch's last) but a glance
    each PROGRESS_SECONDS: a stop request is acted on at the next one (at the next step with one
    process); a non-finite loss in any seed stops them all there."""
    loops = stepper.loops
    lead = loops[0]
    cfg, ctx, st, pace = lead.cfg, lead.ctx, lead.state, lead.pace
    lrs = []
    for i, loop in enumerate(loops):  # each seed's epoch begins under its own RNGs
        with stepper.stream(i):
            lrs.append(begin_epoch(loop))
    first = st.step
    pace.start_epoch(st.epoch, first)
    lead.reporter.start_epoch(st.epoch, lead.steps_per_epoch, first, pace.estimate(first))
    every = max(1, cfg.runtime.log_every)
    since = first
    t_last = last_line = t_step = progress.clock()  # the last read-out, line, and step's end

    def read_outs(now: float) -> bool:  # every seed's totals; True if a stop was requested (on any rank)
        return any([read_out(loop, stop, since, t_last, now) for loop in loops])

    for step, batch in enumerate(until_stopped(stepper.batches(), stop), start=first):
        stepper.step(batch)
        for loop in loops:
            loop.state.step = step + 1
        now = progress.clock()
        if now - t_step > progress.PROGRESS_SECONDS and not lead.said_slow:
            lead.said_slow = True
            lead.reporter.log(
                f"note: a step takes {progress.duration(now - t_step)} here, longer than the "
                f"{progress.PROGRESS_SECONDS:.0f} s between progress lines: a line after every step"
            )
        t_step = now
        limit = stop_after_steps is not None and st.global_step >= stop_after_steps
        signalled = ctx.world == 1 and stop.signal is not None  # one process: no rank to agree with
        if st.step % every == 0 or st.step == lead.steps_per_epoch or limit or signalled:
            stopping = read_outs(now)
            since, t_last, last_line = st.step, now, now
            if stopping or limit:
                return False
        elif now - last_line >= progress.PROGRESS_SECONDS:
            glance(lead, since, t_last, now)  # the lead seed's alone: one line, one read
            last_line = now
        lead.reporter.moved(st.step, pace.estimate(st.step))
    if stop.signal is not None and st.step < lead.steps_per_epoch:  # the loader ended with the stop
        if st.step > since:  # the steps since the last read-out, into the totals the checkpoint saves
            read_outs(progress.clock())
        return False
    pace.end_steps(st.step)
    began = progress.clock()
    checked = stoppable(stop, ctx)
    try:
        measured = stepper.validation(checked) if eval_due(lead) else [None] * len(loops)
        rows = []
        for i, loop in enumerate(loops):  # each seed's evaluation, under its own RNGs
            with stepper.stream(i):
                rows.append(epoch_metrics(loop, lrs[i], measured[i], checked))
    except ValidationCut:
        return False
    if eval_due(lead):
        pace.validated(progress.clock() - began)
    for i, loop in enumerate(loops):  # every seed's epoch ends only once every seed's is measured
        with stepper.stream(i):
            end_epoch(loop, rows[i])
    return True


def stoppable(stop: Any, ctx: Context) -> Callable[[Callable[[int], None]], Callable[[int], None]]:
    """What makes a validation's count end it at a stop request (:class:`ValidationCut`), after the
    batch that saw it: a validation is answered within a batch, not at its end. One process only:
    under torchrun every rank's validation sums are reduced at its end, so each finishes it."""

    def checked(count: Callable[[int], None]) -> Callable[[int], None]:
        def counted(n: int) -> None:
            count(n)
            if stop.signal is not None and ctx.world == 1:
                raise ValidationCut

        return counted

    return checked


def begin_epoch(loop: Loop) -> float:
    """The epoch's global RNGs (seeded from (seed, epoch, rank); a resumed epoch's as saved) and
    its sampler's order from the step the run is at; returns the epoch's learning rate."""
    cfg, st = loop.cfg, loop.state
    if st.step > 0 and st.rng is not None:
        set_rng_state(st.rng)
    else:
        seed_everything(sample_seed(cfg.seed, st.epoch, 10_000 + loop.ctx.rank))
        st.partial = {"loss_sum": 0.0, "seconds": 0.0, "images": 0}
    loop.train_loader.sampler.set_epoch(st.epoch, st.step)
    return st.optimizer.param_groups[0]["lr"]


def end_epoch(loop: Loop, row: dict[str, Any]) -> None:
    """The epoch's metrics row (:func:`epoch_metrics`) kept, the scheduler's epoch step, the counters
    at the next epoch."""
    st = loop.state
    st.scheduler.step(st.epoch + 1)
    st.metrics.append(row)
    st.epoch, st.step, st.rng = st.epoch + 1, 0, None


def step_line(loop: Loop, since: int, t_last: float, now: float, loss_sum: float) -> progress.StepLine:
    """The progress line's numbers after the steps ``since``..``state.step`` (whose losses sum to
    ``loss_sum``, timed from ``t_last`` to ``now``): what a read-out and a glance both show."""
    st = loop.state
    steps = max(st.step - since, 1)
    images = steps * loop.cfg.update_batch * loop.ctx.world
    lr = float(st.optimizer.param_groups[0]["lr"])
    return progress.StepLine(
        st.epoch,
        loop.cfg.recipe.epochs,
        st.step,
        loop.steps_per_epoch,
        loss_sum / steps,
        lr,
        images / max(now - t_last, 1e-9),
        loop.pace.estimate(st.step),
    )


def read_out(loop: Loop, stop: Any, since: int, t_last: float, now: float) -> bool:
    """The device's totals for the steps ``since``..``state.step`` into ``state.partial`` and the
    progress line (the one host read of a stretch of steps); a non-finite loss among them stops the
    run. True if a stop was requested (on any rank)."""
    st, ctx = loop.state, loop.ctx
    steps = st.step - since
    totals = loop.tally.read(steps)
    if totals.bad_step is not None:
        raise CheckFailed(non_finite_message(totals.loss_sum, st.epoch, since + totals.bad_step, loop.out))
    line = step_line(loop, since, t_last, now, totals.loss_sum)
    if loop.board is not None:
        figures = {"step/loss": line.loss, "step/lr": line.lr, "step/images_per_s": line.images_per_s}
        loop.board.scalars(st.global_step, figures)
    st.partial["loss_sum"] += totals.loss_sum
    st.partial["seconds"] += now - t_last
    st.partial["images"] += steps * loop.cfg.update_batch * ctx.world
    loop.reporter.step(line)
    if not ctx.distributed:
        return stop.signal is not None
    stopping = torch.tensor(float(stop.signal is not None), device=ctx.device)
    return all_reduce_sum(stopping, ctx).item() > 0


def glance(loop: Loop, since: int, t_last: float, now: float) -> None:
    """The progress line between read-outs: the mean loss of the steps ``since``..``state.step``
    (the tally read, not reset: the read-outs' totals stay as they would be) and their speed."""
    loop.reporter.step(step_line(loop, since, t_last, now, loop.tally.peek()), glance=True)


def eval_due(loop: Loop, epoch: int | None = None) -> bool:
    """Whether the epoch ``epoch`` (0-based; default: the one the run is in) ends with an
    evaluation: every `eval_every` and the last."""
    epoch = (loop.state.epoch if epoch is None else epoch) + 1
    return epoch % loop.cfg.runtime.eval_every == 0 or epoch == loop.cfg.recipe.epochs


def epoch_metrics(
    loop: Loop,
    lr: float,
    measured: Scored | None = None,
    checked: Callable[[Callable[[int], None]], Callable[[int], None]] = lambda count: count,
) -> dict[str, Any]:
    """The finished epoch's metrics.csv row: its training loss and speed; at an evaluated epoch
    (:func:`eval_due`) the validation split's loss and top-1/top-5 (and the EMA's), or the
    ``measured`` ones, and for attention models what the heads attend to. ``checked``: what each
    validation's count goes through (:func:`stoppable`)."""
    st, ctx = loop.state, loop.ctx

    def reduce(sums: torch.Tensor) -> None:  # every rank's validation share summed
        all_reduce_sum(sums, ctx)

    row: dict[str, Any] = {
        "epoch": st.epoch + 1,
        "train_loss": st.partial["loss_sum"] / max(loop.steps_per_epoch, 1),
        "lr": lr,
        "epoch_seconds": st.partial["seconds"],
        "images_per_s": st.partial["images"] / max(st.partial["seconds"], 1e-9),
    }
    if not eval_due(loop):  # `eval_every`: not this epoch
        return row
    if measured is None:
        batches = len(loop.val_loader)

        def scores(model: nn.Module, what: str) -> dict[str, float]:
            count = checked(loop.reporter.counting(what, batches))
            return evaluate(model, loop.val_loader, ctx.device, loop.dtype, reduce, progress=count)

        ema = None if st.ema is None else scores(st.ema.module, "validating the EMA")
        measured = Scored(scores(st.model, "validating"), ema)
    row.update(measured.model)
    if measured.ema is not None:
        em = measured.ema
        row.update(ema_val_loss=em["val_loss"], ema_top1=em["top1"], ema_top5=em["top5"])
    if loop.probe is not None:  # what the attention does: pinned share, distance, gate per block
        row.update(attention_stats(st.model, [loop.probe]).block_means())
    return row


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


def non_finite_message(loss: float, epoch: int, step: int, out: Path) -> str:
    """What a user can do after a non-finite loss: the advice depends on whether a checkpoint exists."""
    head = (
        f"non-finite loss ({loss}) at epoch {epoch + 1}, step {step + 1}: "
        "stopped before it reached the weights; "
    )
    last = out / LAST
    if last.exists():
        return head + (
            f"the last good checkpoint is {last}: continue from it with `resume` and "
            "a lower `lr` (the schedule "
            "is rebuilt, so the run is no longer one uninterrupted run), or start a "
            "new `out` with a lower `lr`, "
            "`amp` none or `clip_grad`"
        )
    return head + "no checkpoint was saved yet: start again with a lower `lr`, `amp` none or `clip_grad`"


def until_stopped(batches: Any, stop: Any) -> Iterator[Any]:
    """``batches``; ends early, instead of raising, when the loader fails after a stop was
    requested: a SIGTERM to the process group ends the loader's workers too, and their end is part
    of that stop (the run saves its last finished step)."""
    it = iter(batches)
    while True:
        try:
            batch = next(it)
        except StopIteration:
            return
        except Exception:  # "worker killed", or a batch half-received from it (ConnectionResetError)
            if stop.signal is None:
                raise
            return
        yield batch
