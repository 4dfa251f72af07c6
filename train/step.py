"""One training step that never waits for the host: augmentation (device loader), Mixup/CutMix,
forward, loss, gradients and the optimizer's update, with the loss and its finiteness kept on the
device.

    step = TrainStep(...);  step(inputs, labels)  # per step: no read of a device value
    totals = step.read(steps)                      # every --log-every steps: one read

A non-finite loss never reaches the weights: the update is skipped on the device. torch's fused
Adam, AdamW and SGD kernels (what timm's ``adam``, ``adamw``, ``sgd``, ``momentum`` build;
recipe.py asks for them) take a ``found_inf`` flag, as GradScaler hands it to them, and then leave
weights, moments and step counters as they were. Other optimizers have no such flag: for them the
step reads it on the host, one read per step. The loop reads the totals every ``--log-every``
steps and stops there, naming the first non-finite loss's step; the steps after it up to the
read are skipped too (the flag is "a non-finite loss since the last read").

``compile``: everything before the update (augmentation, forward, loss, gradients, the tally) is
one ``torch.compile``'d function with no graph break (dynamo traces the backward pass with
``trace_autograd_ops``), with CUDA graphs on CUDA (mode "reduce-overhead"). It is functional, as
CUDA graphs want: tensors in, (tally, flag, gradients) out. The update stays outside: the fused
kernel is one launch, and torch declines to trace it (``torch.compiler.disable``, "don't trace
into fused optimizer"); so the learning rate never enters a graph and a new epoch's rate cannot
recompile one. Mixup's numpy draws split the function in two (augmentation, then the rest); a
multi-process run (DDP's gradient hooks) and fp16's GradScaler compile the model's forward only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..api.common import autocast
from .distributed import Context, all_reduce_sum

FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # kernels that take found_inf

Learned = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None] | None]


def fusable(optimizer_class: type) -> bool:
    """Whether torch has a fused kernel (and so a device-side skip) for ``optimizer_class``."""
    return optimizer_class in FUSED


@dataclass
class Totals:
    """What the steps since the last read did, read back in one transfer."""

    loss_sum: float  # sum of the steps' mean losses over ranks: nan or ±inf from a non-finite one on
    bad_step: int | None  # index among those steps of the first non-finite loss; None: all finite


def with_autograd_traced(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` called with dynamo tracing autograd.grad into its graph (the backward pass inside
    the one graph), a setting of this call only: torch's global config is as it was after each
    call, for whatever else the process compiles."""

    def call(*args: Any) -> Any:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args)

    return call


class TrainStep:
    """Callable per step on (inputs, labels); ``prepare`` turns the loader's inputs into images
    (the device loader's augmentation), None when the loader already gave images."""

    def __init__(
        self,
        model: nn.Module,
        fwd: nn.Module,
        criterion: nn.Module,
        optimizer: Any,
        scaler: Any,
        clip_grad: float | None,
        dtype: torch.dtype | None,
        ctx: Context,
        prepare: Callable[[Any], torch.Tensor] | None,
        mixup: Any,
        compile: bool,
    ) -> None:
        self.fwd, self.criterion, self.optimizer = fwd, criterion, optimizer
        self.scaler, self.clip_grad, self.dtype, self.ctx = scaler, clip_grad, dtype, ctx
        self.prepare, self.mixup = prepare, mixup
        self.scaling = scaler.is_enabled()  # fp16's GradScaler (read once: dynamo does not trace it)
        self.fused = bool(optimizer.defaults.get("fused")) and not self.scaling
        self.params = [p for p in model.parameters() if p.requires_grad]
        # the losses' sum since the last read, and the number of those steps before the first non-finite one
        self.tally = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        self.learn: Callable[..., Learned] = self._learn
        self.augment_inside = False  # learn takes the loader's inputs and augments them itself
        self.graphs = False  # CUDA graphs: outputs live in memory the next replay overwrites
        self.why_not_whole = whole_step_refusal(ctx, self.scaling) if compile else None
        if compile and self.why_not_whole is None:
            self.graphs = ctx.device.type == "cuda"
            mode = "reduce-overhead" if self.graphs else None
            if mixup is None and prepare is not None:
                self.learn = with_autograd_traced(torch.compile(self._prepared_learn, mode=mode))
                self.augment_inside = True
            else:
                self.learn = with_autograd_traced(torch.compile(self._learn, mode=mode))
                if prepare is not None:
                    self.prepare = torch.compile(prepare, mode=mode)
        elif compile:
            self.fwd = torch.compile(fwd)

    def __call__(self, inputs: Any, y: torch.Tensor) -> None:
        device = self.ctx.device
        y = y.to(device, non_blocking=True)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.augment_inside:
            tally, skip, grads = self.learn(inputs, y, self.tally)
        else:
            x = self.prepare(inputs) if self.prepare is not None else inputs.to(device, non_blocking=True)
            if self.mixup is not None:
                x, y = self.mixup(x, y)
            tally, skip, grads = self.learn(x, y, self.tally)
        self.tally = tally.clone() if self.graphs else tally  # not the graph's memory: the next call's input
        if grads is not None:  # handed over as they are (backward() would add each into .grad)
            for p, g in zip(self.params, grads, strict=True):
                # in the parameter's layout, as backward() makes it: autograd.grad may return a
                # permuted view (the token form's weight gradient does on CUDA), and the fused
                # optimizers need every tensor of a group in the same strides
                p.grad = g if g is None or g.stride() == p.stride() else g.contiguous()
        self.update(skip)

    def _prepared_learn(self, inputs: Any, y: torch.Tensor, tally: torch.Tensor) -> Learned:
        return self._learn(self.prepare(inputs), y, tally)

    def _learn(self, x: torch.Tensor, y: torch.Tensor, tally: torch.Tensor) -> Learned:
        """Forward, loss and gradients: (the tally with this step added, the skip flag as float
        0/1, the parameters' gradients; None when DDP's backward() put them in .grad)."""
        with autocast(self.ctx.device, self.dtype):
            loss = self.criterion(self.fwd(x), y)
        mean = loss.detach().to(torch.float64)
        if self.ctx.distributed:  # every rank gets the same mean, so every rank skips alike
            mean = all_reduce_sum(mean, self.ctx) / self.ctx.world
        total = tally[0] + mean  # non-finite from the first non-finite loss on
        finite = (total - total) == 0  # inf - inf and nan - nan are nan
        tally = torch.stack([total, tally[1] + finite])
        scaled = self.scaler.scale(loss) if self.scaling else loss
        if self.ctx.distributed:  # DDP's gradient all-reduce hooks run in backward()
            self.optimizer.zero_grad(set_to_none=True)
            scaled.backward()
            return tally, (~finite).float(), None
        return tally, (~finite).float(), list(torch.autograd.grad(scaled, self.params, allow_unused=True))

    def update(self, skip: torch.Tensor) -> None:
        """The optimizer's step, skipped where ``skip`` is 1 (on the device when it can be)."""
        opt, scaler = self.optimizer, self.scaler
        if self.clip_grad is not None:
            if self.scaling:
                scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(self.params, self.clip_grad, foreach=True)
        if self.fused:
            opt.found_inf = skip  # read by the fused kernel (GradScaler's protocol)
            opt.step()
        elif self.scaling:  # fp16: GradScaler skips non-finite gradients on the device
            scaler.step(opt)
            scaler.update()
        elif not bool(skip):  # no device-side skip for this optimizer: a host read per step
            opt.step()

    def read(self, steps: int) -> Totals:
        """The totals of the ``steps`` steps since the last read (one device-to-host transfer),
        then zeroed."""
        loss_sum, finite = self.tally.tolist()
        self.tally = torch.zeros_like(self.tally)
        return Totals(loss_sum, None if finite == steps else int(finite))


def whole_step_refusal(ctx: Context, scaling: bool) -> str | None:
    """Why ``compile`` compiles the model's forward only, or None when it compiles the step."""
    if ctx.distributed:
        return "several processes: DDP's gradient hooks run in backward()"
    if scaling:
        return "fp16's GradScaler"
    return None
