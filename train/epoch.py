"""One epoch: the training steps of DeiT's recipe, then evaluation on the validation split.

Each epoch seeds every global RNG from (seed, epoch, rank), so an epoch's randomness does not
depend on how the process got there (a resumed epoch restores the RNGs saved mid-epoch instead).
Per step: :class:`.step.TrainStep` (augmentation, Mixup/CutMix, forward, loss, backward, update,
with no read of a device value), EMA, scheduler. Every ``log_every`` steps and at the epoch's end,
one read-out: the loss totals, a non-finite loss (its update was skipped on the device; the run
stops with the step named) and a stop request (all-reduced, so every rank stops at the same step).
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis import attention_stats
from ..api.on_data import evaluate
from ..data import sample_seed
from ..errors import CheckFailed
from .config import TrainConfig
from .distributed import Context, all_reduce_sum
from .progress import Progress
from .state import LAST, RunState, set_rng_state
from .step import TrainStep


@dataclass
class Loop:
    """What every epoch uses, built once by :func:`convit_convert.train.run.build`."""

    cfg: TrainConfig
    ctx: Context
    out: Path
    dtype: torch.dtype | None  # autocast dtype, None for full precision (evaluation's)
    train_loader: Any
    val_loader: Any
    steps_per_epoch: int
    state: RunState
    reporter: Progress
    step: TrainStep  # augmentation to update: the model as trained (DDP-wrapped, compiled), loss, Mixup
    probe: torch.Tensor | None = None  # attn models: fixed val images for the per-epoch attention metrics
    config_json: str = ""  # config.json's text, written with every checkpoint
    classes: tuple[str, ...] | None = None  # the outputs' names, where the data names them (labels.py)


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


def until_stopped(loader: Any, stop: Any) -> Iterator[Any]:
    """The loader's batches; ends early, instead of raising, when the loader fails after a stop was
    requested: a SIGTERM to the process group ends the loader's workers too, and their end is part
    of that stop (the run saves its last finished step)."""
    it = iter(loader)
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


def read_out(loop: Loop, stop: Any, step: int, since: int, t_last: float) -> bool:
    """The device's totals for steps ``since``..``step`` into ``state.partial`` and the progress
    line (the one host read of a stretch of steps); a non-finite loss among them stops the run.
    True if a stop was requested (on any rank)."""
    st, ctx = loop.state, loop.ctx
    steps = step + 1 - since
    totals = loop.step.read(steps)
    if totals.bad_step is not None:
        raise CheckFailed(non_finite_message(totals.loss_sum, st.epoch, since + totals.bad_step, loop.out))
    now = time.perf_counter()
    images = steps * loop.cfg.recipe.batch_size * ctx.world
    st.partial["loss_sum"] += totals.loss_sum
    st.partial["seconds"] += now - t_last
    st.partial["images"] += images
    lr = float(st.optimizer.param_groups[0]["lr"])
    loop.reporter.step(st.epoch, step, totals.loss_sum / steps, lr, images / max(now - t_last, 1e-9))
    if not ctx.distributed:
        return stop.signal is not None
    stopping = torch.tensor(float(stop.signal is not None), device=ctx.device)
    return all_reduce_sum(stopping, ctx).item() > 0


def train_one_epoch(loop: Loop, stop: Any, stop_after_steps: int | None = None) -> bool:
    """Train the epoch ``loop.state`` is in, from its step on; evaluate and append the epoch's row
    to ``state.metrics``. False if a stop request (or ``stop_after_steps``) ended it early, with
    ``state.step`` the steps done. Nothing is read from the device between read-outs (every
    ``log_every`` steps and the epoch's last): a stop request is acted on at the next one (at the
    next step with one process)."""
    cfg, ctx, st = loop.cfg, loop.ctx, loop.state
    device, epoch, first = ctx.device, st.epoch, st.step
    if first > 0 and st.rng is not None:
        set_rng_state(st.rng)
    else:
        seed_everything(sample_seed(cfg.seed, epoch, 10_000 + ctx.rank))
        st.partial = {"loss_sum": 0.0, "seconds": 0.0, "images": 0}
    loop.train_loader.sampler.set_epoch(epoch, first)
    loop.reporter.start_epoch(epoch, loop.steps_per_epoch, first)
    lr = st.optimizer.param_groups[0]["lr"]
    every = max(1, cfg.runtime.log_every)
    t_last, since = time.perf_counter(), first
    loader = loop.train_loader
    batches = until_stopped(loader.batches() if hasattr(loader, "batches") else loader, stop)
    for step, (inputs, y) in enumerate(batches, start=first):
        loop.step(inputs, y)
        st.global_step += 1
        if st.ema is not None:
            st.ema.update(st.model, step=st.global_step)
        st.scheduler.step_update(num_updates=st.global_step)
        st.step = step + 1
        limit = stop_after_steps is not None and st.global_step >= stop_after_steps
        signalled = ctx.world == 1 and stop.signal is not None  # one process: no rank to agree with
        if (step + 1) % every == 0 or step + 1 == loop.steps_per_epoch or limit or signalled:
            stopping = read_out(loop, stop, step, since, t_last)
            t_last, since = time.perf_counter(), step + 1
            if stopping or limit:
                return False
    if stop.signal is not None and st.step < loop.steps_per_epoch:  # the loader ended with the stop
        if st.step > since:  # the steps since the last read-out, into the totals the checkpoint saves
            read_out(loop, stop, st.step - 1, since, t_last)
        return False
    st.scheduler.step(epoch + 1)

    def reduce(sums: torch.Tensor) -> None:  # every rank's validation share summed
        all_reduce_sum(sums, ctx)

    row: dict[str, Any] = {
        "epoch": epoch + 1,
        "train_loss": st.partial["loss_sum"] / max(loop.steps_per_epoch, 1),
        **evaluate(st.model, loop.val_loader, device, loop.dtype, reduce),
        "lr": lr,
        "epoch_seconds": st.partial["seconds"],
        "images_per_s": st.partial["images"] / max(st.partial["seconds"], 1e-9),
    }
    if st.ema is not None:
        em = evaluate(st.ema.module, loop.val_loader, device, loop.dtype, reduce)
        row.update(ema_val_loss=em["val_loss"], ema_top1=em["top1"], ema_top5=em["top5"])
    if loop.probe is not None:  # what the attention does: pinned share, distance, gate per block
        row.update(attention_stats(st.model, [loop.probe]).block_means())
    st.metrics.append(row)
    st.epoch, st.step, st.rng = epoch + 1, 0, None
    return True
