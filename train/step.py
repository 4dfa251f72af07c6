"""What the training loop's step (:func:`.loop.train_one_step`) leans on, each one a reader of the
loop can skip: the step computes the same without them, only slower or with a host read per step.

- :class:`Tally`: the losses' sum and the first non-finite loss, kept on the device, read every
  ``--log-every`` steps (one transfer) instead of every step.
- :func:`backward`: ``loss.backward()``, as ``torch.autograd.grad`` handed to ``.grad`` where no
  DDP hook needs backward() itself: the same gradients, with fewer ops.
- :func:`update`: the optimizer's step, skipped on the device after a non-finite loss. torch's
  fused Adam, AdamW and SGD kernels (what timm's ``adam``, ``adamw``, ``sgd``, ``momentum`` build;
  recipe.py asks for them) take a ``found_inf`` flag, as GradScaler hands it to them, and then leave
  weights, moments and step counters as they were. Other optimizers have no such flag: for them the
  step reads it on the host, one read per step. The flag is "a non-finite loss since the last read":
  the steps after one, up to the read that stops the run, are skipped too.
- :class:`CompiledStep`: ``--compile``'s form of the step's middle (augmentation, forward, loss,
  gradients, the tally) as one ``torch.compile``'d function with no graph break (dynamo traces the
  backward pass with ``trace_autograd_ops``), with CUDA graphs on CUDA (mode "reduce-overhead").
  It is functional, as CUDA graphs want: tensors in, (tally, flag, gradients) out. Its drop-path
  masks are drawn just before it, from the global RNG in the order the eager forward draws them
  (``VisionTransformer.drop_masks``), and go in as inputs: drawn inside, they would come from
  inductor's own generator, other masks than the eager step's (and a stacked seed's, ``--seeds``).
  The update stays outside: the fused kernel is one launch, and torch declines to trace it; so the
  learning rate never enters a graph and a new epoch's rate cannot recompile one. Mixup's numpy
  draws split it in two (augmentation, then the rest); several processes (DDP's gradient hooks) and
  fp16's GradScaler compile the model's forward only (:func:`whole_step_refusal`), whose graph
  draws its own masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..api.common import autocast
from ..model import VisionTransformer
from .distributed import Context, all_reduce_sum

FUSED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)  # kernels that take found_inf


def fusable(optimizer_class: type) -> bool:
    """Whether torch has a fused kernel (and so a device-side skip) for ``optimizer_class``."""
    return optimizer_class in FUSED


@dataclass
class Totals:
    """What the steps since the last read did, read back in one transfer."""

    loss_sum: float  # sum of the steps' mean losses over ranks: nan or ±inf from a non-finite one on
    bad_step: int | None  # index among those steps of the first non-finite loss; None: all finite


def tallied(tally: torch.Tensor, loss: torch.Tensor, ctx: Context) -> tuple[torch.Tensor, torch.Tensor]:
    """``tally`` (float64: the losses' sum since the last read, the steps before the first
    non-finite one) with ``loss`` added, and the skip flag (float 0/1: a non-finite loss since the
    last read). Pure, so the compiled step traces it; every rank gets the same mean, so every rank
    skips alike. Stacked seeds (``--seeds``) tally as one: ``tally`` (S, 2) and ``loss`` (S,)."""
    mean = loss.detach().to(torch.float64)
    if ctx.distributed:
        mean = all_reduce_sum(mean, ctx) / ctx.world
    total = tally[..., 0] + mean  # non-finite from the first non-finite loss on
    finite = (total - total) == 0  # inf - inf and nan - nan are nan
    return torch.stack([total, tally[..., 1] + finite], dim=-1), (~finite).float()


class Tally:
    """The losses since the last read, on the device: :meth:`add` per step (no host read),
    :meth:`read` every ``--log-every`` steps (one)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.values = torch.zeros(2, dtype=torch.float64, device=ctx.device)
        self.skip = torch.zeros((), device=ctx.device)  # 1.0 after a non-finite loss since the read

    def add(self, loss: torch.Tensor) -> None:
        self.values, self.skip = tallied(self.values, loss, self.ctx)

    def peek(self) -> float:
        """The loss summed since the last read (one device-to-host transfer), left as it is."""
        return float(self.values[0].item())

    def read(self, steps: int) -> Totals:
        """The totals of the ``steps`` steps since the last read (one device-to-host transfer),
        then zeroed."""
        loss_sum, finite = self.values.tolist()
        self.values = torch.zeros_like(self.values)
        return Totals(loss_sum, None if finite == steps else int(finite))


def backward(loss: torch.Tensor, params: list[torch.Tensor], ctx: Context, add: bool = False) -> None:
    """``loss.backward()`` for ``params``, with ``.grad`` empty before unless ``add`` (a later
    micro-batch of a gradient accumulation: its gradients added to those there): under DDP exactly
    that (its hooks all-reduce the gradients in backward()); otherwise the same gradients from
    ``torch.autograd.grad``, handed to ``.grad`` as backward() leaves them, without its
    per-parameter accumulation (fewer aten ops a step: BENCHMARKS.md, "Host work per training
    step")."""
    if ctx.distributed:
        loss.backward()
        return
    grads = list(torch.autograd.grad(loss, params, allow_unused=True))
    if add:
        grads = [
            g if p.grad is None else p.grad if g is None else p.grad + g
            for p, g in zip(params, grads, strict=True)
        ]
    assign_gradients(params, grads)


def micro_batch(model: Any, last: bool) -> Any:
    """A gradient accumulation's micro-batch under DDP: its gradients all-reduced only with the
    last's (DDP's ``no_sync`` before); nothing otherwise."""
    if last or not hasattr(model, "no_sync"):
        return contextlib.nullcontext()
    return model.no_sync()


def laid_out(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each gradient in its parameter's layout, as backward() leaves it. autograd.grad may return a
    permuted view (the token form's weight gradient does; vmap's backward does for stacked
    weights), and the fused optimizers need every tensor of a group in the same strides. Called at
    the end of a compiled step, the layout is one more choice of its graph's outputs, not a copy
    per gradient after it (a launch apiece on a GPU, outside the CUDA graph)."""
    return [
        g if g is None or g.stride() == p.stride() else g.contiguous()
        for p, g in zip(params, grads, strict=True)
    ]


def assign_gradients(params: list[torch.Tensor], grads: list[torch.Tensor | None]) -> None:
    """``grads`` into the parameters' ``.grad``, each in its parameter's layout (:func:`laid_out`;
    a compiled step's come laid out already)."""
    for p, g in zip(params, laid_out(params, grads), strict=True):
        p.grad = g


def update(optimizer: Any, scaler: Any, skip: torch.Tensor) -> None:
    """The optimizer's step, skipped where ``skip`` is 1: on the device for the fused kernels
    (GradScaler's ``found_inf`` protocol) and under fp16's GradScaler, by a host read otherwise."""
    if scaler.is_enabled():  # fp16: GradScaler skips non-finite gradients on the device
        scaler.step(optimizer)
        scaler.update()
    elif optimizer.defaults.get("fused"):
        optimizer.found_inf = skip  # read by the fused kernel
        optimizer.step()
    elif not bool(skip):  # no device-side skip for this optimizer: a host read per step
        optimizer.step()


def whole_step_refusal(ctx: Context, scaling: bool, accumulating: bool = False) -> str | None:
    """Why ``--compile`` compiles the model's forward only, or None when it compiles the step."""
    if ctx.distributed:
        return "several processes: DDP's gradient hooks run in backward()"
    if scaling:
        return "fp16's GradScaler"
    if accumulating:
        return "`grad_accum_steps`: a graph of one micro-batch's step, not of the update"
    return None


def with_autograd_traced(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled`` called with dynamo tracing autograd.grad into its graph (the backward pass inside
    the one graph), a setting of this call only: torch's global config is as it was after each
    call, for whatever else the process compiles."""

    def call(*args: Any) -> Any:
        with torch._dynamo.config.patch(trace_autograd_ops=True):
            return compiled(*args)

    return call


Learned = tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]


class CompiledStep:
    """``--compile``'s step from the loader's inputs to the gradients: what the eager lines of
    :func:`.loop.train_one_step` compute (augmentation, Mixup, forward under autocast, loss,
    backward, the tally), as one compiled graph; the gradients land in ``p.grad`` as backward()
    would put them there."""

    def __init__(
        self,
        *,
        model: VisionTransformer,
        criterion: nn.Module,
        dtype: torch.dtype | None,
        ctx: Context,
        prepare: Callable[[Any], torch.Tensor] | None,
        mixup: Any,
    ) -> None:
        self.model, self.criterion, self.dtype, self.ctx = model, criterion, dtype, ctx
        self.prepare, self.mixup = prepare, mixup
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.mask_dtype = dtype or self.params[0].dtype  # the branches' output dtype, as forward's
        self.graphs = ctx.device.type == "cuda"  # CUDA graphs: outputs in memory the next replay reuses
        mode = "reduce-overhead" if self.graphs else None
        self.augment_inside = mixup is None and prepare is not None  # one graph from the raw inputs
        if self.augment_inside:
            self.learn = with_autograd_traced(torch.compile(self.prepared_learn, mode=mode))
        else:  # Mixup's numpy draws between augmentation and the rest: two graphs
            self.learn = with_autograd_traced(torch.compile(self.images_learn, mode=mode))
            if prepare is not None:
                self.prepare = torch.compile(prepare, mode=mode)

    def __call__(self, inputs: Any, labels: torch.Tensor, tally: Tally) -> None:
        device = self.ctx.device
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        if self.augment_inside:  # the augmentation draws from its own generators, not the global RNG
            masks = self.model.drop_masks(len(labels), self.mask_dtype, device)
            values, skip, grads = self.learn(inputs, labels, tally.values, masks)
        else:
            images = (
                self.prepare(inputs) if self.prepare is not None else inputs.to(device, non_blocking=True)
            )
            if self.mixup is not None:
                images, labels = self.mixup(images, labels)
            masks = self.model.drop_masks(len(labels), self.mask_dtype, device)  # after Mixup's, as eager
            values, skip, grads = self.learn(images, labels, tally.values, masks)
        # the sum is the next call's input: not the graph's memory, which that replay overwrites
        tally.values, tally.skip = (values.clone() if self.graphs else values), skip
        assign_gradients(self.params, grads)

    def prepared_learn(
        self, inputs: Any, labels: torch.Tensor, tally: torch.Tensor, masks: list[torch.Tensor]
    ) -> Learned:
        return self.images_learn(self.prepare(inputs), labels, tally, masks)  # type: ignore[misc]

    def images_learn(
        self, images: torch.Tensor, labels: torch.Tensor, tally: torch.Tensor, masks: list[torch.Tensor]
    ) -> Learned:
        """Forward with the drop-path ``masks`` ([]: none), loss and gradients: (the tally with this
        step added, the skip flag, the parameters' gradients)."""
        with autocast(self.ctx.device, self.dtype):
            logits = self.model.forward_head(self.model.forward_features(images, masks or None))
            loss = self.criterion(logits, labels)
        tally, skip = tallied(tally, loss, self.ctx)
        return (
            tally,
            skip,
            laid_out(self.params, list(torch.autograd.grad(loss, self.params, allow_unused=True))),
        )


def probe_seconds(model: nn.Module, image: tuple[int, ...], batch: int, images: int = 2) -> float:
    """The seconds a training step of ``batch`` images of shape ``image`` takes ``model`` on the
    CPU, from the faster of two forward and backward passes of ``images`` random images (the first
    pays one-time set-up), scaled to the batch: an estimate before the first step, for a run that
    would take long. Leaves no trace: the RNGs as they were, no gradient kept, no weight changed."""
    import time

    times = []
    with torch.random.fork_rng(devices=[]):
        for _ in range(2):
            x = torch.randn(images, *image)
            t0 = time.perf_counter()
            model(x).float().logsumexp(1).mean().backward()
            times.append(time.perf_counter() - t0)
            model.zero_grad(set_to_none=True)
    return min(times) / images * batch
