"""Several seeds of one run trained together in one process (``--seeds``): as one stacked model, or
each seed's own step in turn.

    run_seeds(TrainConfig.from_flags(..., seeds=(0, 1, 2), out="runs/p1"))  # runs/p1/seed0, seed1, seed2

Small models leave a GPU idle: S processes time-slice it, while one process whose every kernel
carries S seeds could fill it. Each seed is built exactly as its own ``cmhsa train --seed N --out
OUT/seedN`` run builds it (:func:`.build.build`: data subset and order, initialisation, optimizer,
schedule, EMA, loader, run folder, checkpoints, exports). Then every parameter becomes one
``nn.Parameter`` with the seeds on a leading axis, each seed's parameters its slices
(:func:`stacked_weights`), and the step is shared: the S forwards, losses and backwards run as one
batched computation (``torch.func.vmap`` of the model's ``functional_call``; one graph under
``--compile``), each seed's gradients are clipped to its own norm (:func:`clipped_per_seed`), and one
optimizer steps the stacked weights (its step is elementwise: each seed's own step). What each
seed gets is its own run's:

- its batches and their augmentation: its loader's, drawn from generators seeded by its seed;
- its drop-path masks and Mixup/CutMix draws: from its own global-RNG state, swapped in around
  its draws (:meth:`Stack.step_stream`); the masks are drawn before the batched forward, in the
  order a forward draws them (``VisionTransformer.drop_masks``);
- its learning rate (its own scheduler's), EMA, counters, metrics, checkpoints (its slice of the
  weights and of the optimizer's moments, :meth:`Stack.share_moments`) and saved RNG states.

What is guaranteed: every seed computes what its own run computes, eager or under ``--compile``
(whose separate runs also draw their drop-path masks outside the graph, :class:`.step.CompiledStep`),
up to the rounding of the batched kernels (float64: agreement to 1e-10, tests/test_stacked.py;
float32: the last bits), and a stacked resume is bit for bit. One difference, by design: a
non-finite loss in any seed skips that step for all of them, then stops the run at the next
read-out, every seed at its last good checkpoint (a separate run's neighbours would have gone on).
Refused, one line each: several processes, fp16's GradScaler (one loss scale per run), the workers
loader (its processes draw from the global RNGs), an optimizer whose step is not elementwise (lamb,
lars: per-tensor norms would mix the seeds), and seeds whose runs differ in anything but the seed
(another architecture, epoch or step).

That batched step is what ``seeds_step`` "batched" runs (:class:`Stack`), and "auto" on CUDA for
two seeds or more. The other form, "interleaved" (:class:`Interleaved`; "auto" on the CPU and for
one seed), steps each seed's own :class:`.loop.Loop` in turn, under its RNGs: its separate run's
kernels, so each seed is its run bit for bit (fp16 and lamb not refused: each seed keeps its own
scaler and optimizer); the seeds share the process (start-up, data, the compiled graph). A CPU
gains nothing from batching the seeds' arithmetic, and there the interleaved seeds took less time
than the batched ones and than separate runs (BENCHMARKS.md "Several seeds").
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, vmap

from ..api.common import autocast
from ..api.on_data import validation_metrics, validation_totals
from ..conv_mixer import ConvMixer
from ..errors import CmhsaError
from ..io.atomic import atomic_text
from ..io.folder import Folder, make_folder, remove_made
from ..io.outputs import Target
from ..model import VisionTransformer
from ..options.training import TrainConfig
from ..resources import sized_by
from ..text import json_text
from . import mixing
from .augment import Params
from .build import resolved_config
from .distributed import Context, setup, teardown
from .held import HeldBatch, HeldEvalLoader
from .loop import Loop, Scored
from .names import seed_folder
from .progress import Progress
from .run import RunFiles, RunResult, deterministic_kernels, prepared, train_epochs
from .run_folder import run_folder
from .state import numpy_state, rng_state, saved_numpy_state, set_rng_state
from .step import FUSED, assign_gradients, laid_out, tallied, update, with_autograd_traced

# phase 1's convolution in a stack, unless `conv_form` says otherwise: under vmap the pixel form's
# conv2d runs as one grouped conv of S groups, whose backward took 2.3 times two separate ones on
# the CPU (2 seeds); the token form's products batch as matmuls (BENCHMARKS.md, "Several seeds")
STACK_CONV_FORM = "tokens"
# device types whose stacks evaluate every seed in one batched forward (Stack.validation). Not the
# CPU: there vmap's eager forward took 1.2 to 2.9 times the seeds' own evaluations (its linear
# layers' bias adds are passes over memory a plain forward fuses; bench/investigations/stacked_eval.py,
# BENCHMARKS.md "Several seeds"). On a GPU a small model's evaluation is bound by its launches, and
# one forward launches for all seeds; that gain is not yet measured (the same bench on CUDA)
BATCHED_EVALUATION = {"cuda"}
# device types whose `seeds` runs of 2 seeds or more, at `seeds_step` auto, step every seed as one
# batched computation (Stack); elsewhere each seed's own step in turn (Interleaved). Not the CPU:
# there a stack's epochs took longer than its seeds' own (a CPU gains nothing from batching the
# seeds' arithmetic) and, compiled, its larger graph took longer to compile than one seed's, which
# the other seeds' steps then reuse (BENCHMARKS.md "Several seeds"). On a GPU one batched step
# launches for all seeds
BATCHED_STEP = {"cuda"}
MAX_SEEDS = 64  # one process's stack: beyond this the batched kernels gain nothing and memory grows


def seed_configs(cfg: TrainConfig) -> list[TrainConfig]:
    """One config per seed of ``cfg.runtime.seeds``: the run with that seed, in its own folder
    (:func:`seed_folder`); ``{seed}`` in a checkpoint `init` stands for the seed (each seed's phase 2
    from its own phase-1 model). Each keeps ``seeds``: config.json's note of the seeds beside it."""
    seeds = cfg.runtime.seeds
    if not seeds:
        raise CmhsaError("`seeds` is empty: name the seeds to train together")
    if len(set(seeds)) != len(seeds):
        raise CmhsaError(f"`seeds` names a seed twice: {' '.join(map(str, seeds))}")
    if len(seeds) > MAX_SEEDS:
        raise CmhsaError(f"`seeds`: at most {MAX_SEEDS} in one process, got {len(seeds)}")
    if cfg.given and "seed" in cfg.given:
        raise CmhsaError("give `seed` (one run) or `seeds` (several, stacked), not both")
    init = cfg.start.init
    # each seed is given as `seed N` would give it, so each seed folder's `resume` is checked as that
    # run's own would be (a folder holding another seed's run is refused); empty: every field counts
    given = cfg.given | {"seed"} if cfg.given else cfg.given
    return [
        cfg.replace(
            seed=s, out=str(seed_folder(cfg.runtime.out, s)), init=init.replace("{seed}", str(s)), given=given
        )
        for s in seeds
    ]


def run_seeds(
    cfg: TrainConfig, *, progress: Progress | None = None, stop_after_steps: int | None = None
) -> list[RunResult]:
    """Train the seeds ``cfg.runtime.seeds`` of the run ``cfg`` describes, stacked (module
    docstring); one result per seed, in their order. ``stop_after_steps``: as :func:`.run.run`."""
    configs = seed_configs(cfg)
    ctx, threads = setup(cfg.runtime.device), torch.get_num_threads()
    try:
        if ctx.distributed:
            raise CmhsaError("`seeds` trains the seeds in one process: run it without torchrun")
        with deterministic_kernels(cfg.runtime.deterministic):
            return _run_seeds([resolved_config(c) for c in configs], ctx, progress, stop_after_steps)
    finally:
        torch.set_num_threads(threads)
        teardown(ctx)


def _run_seeds(
    configs: list[TrainConfig], ctx: Context, progress: Progress | None, stop_after_steps: int | None
) -> list[RunResult]:
    reporter = progress or Progress()
    wrote: list[list[Path]] = [[] for _ in configs]
    out = Path(configs[0].runtime.out).expanduser().parent  # the folder the user gave
    made = make_folder(out, "run folder")
    try:
        # every seed's folder entered by its name in the user's (never through a link, only this
        # user's folder), held and locked for the whole run
        with Folder.open(out) as parent, contextlib.ExitStack() as held:
            # every output of the stack checked before its first step, as a single run's are: a
            # seeds.json that is a folder, a FIFO or a link is refused now, not after training
            parent.check_replaceable(SEEDS_JSON)
            folders = [
                held.enter_context(run_folder(c, ctx, w, parent)) for c, w in zip(configs, wrote, strict=True)
            ]
            built = [
                prepared(c, ctx, f, reporter.for_seed(c.seed, lead=i == 0))
                for i, (c, f) in enumerate(zip(configs, folders, strict=True))
            ]
            reporter.flush_notes(len(configs))  # what every seed's set-up noted, once
            stack = seeds_stepper([loop for loop, _ in built])
            files = [
                RunFiles(loop, f, replaces, w)
                for (loop, replaces), f, w in zip(built, folders, wrote, strict=True)
            ]
            how = "one batched step" if stack.batched else "each seed's own step in turn"
            reporter.log(
                f"{len(configs)} seeds in one process ({', '.join(str(c.seed) for c in configs)}; {how}, "
                "`seeds_step`): the progress bar is the first seed's, and its images/s each seed's"
            )
            seeds, batch = len(configs), configs[0].recipe.batch_size
            # an allocation that fails is said as the stack's: S seeds' weights, moments and batches
            with sized_by(
                f"for {seeds} seeds stacked at batch {batch} each (`seeds`: every seed's model, optimizer "
                "and batch are held at once; train fewer seeds together)"
            ):
                results = train_epochs(stack, files, stop_after_steps)
            reporter.flush_notes(len(configs))
            if not any(r.stopped for r in results):
                summary = seeds_summary(
                    [c.seed for c in configs], [loop.state.metrics for loop in stack.loops]
                )
                atomic_text((Target(parent, SEEDS_JSON), json_text(summary) + "\n"))
                reporter.log(seeds_line(summary, parent.show(SEEDS_JSON)))
            return results
    except BaseException:
        if not any(wrote):  # nothing saved: no folder of the user's path made either
            remove_made(made)
        raise
    finally:
        reporter.flush_notes(len(configs))  # an interrupted or failed stack still says what it noted
        reporter.close()


SEEDS_JSON = "seeds.json"  # a finished stack's one result: each seed's top-1 and their mean ± half-range


def spread(values: list[float]) -> dict[str, float]:
    """Mean and half-range (half of max − min), as README's and EXPERIMENTS.md's tables report seeds."""
    return {"mean": sum(values) / len(values), "half_range": (max(values) - min(values)) / 2}


def seeds_summary(seeds: list[int], metrics: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Each seed's final top-1 (its last evaluated epoch) and best top-1 (and their epochs), and the
    mean ± half-range of both over the seeds: what a table needs of a `seeds` run."""
    rows = []
    for seed, rows_of_seed in zip(seeds, metrics, strict=True):
        evaluated = [r for r in rows_of_seed if "top1" in r]
        final = evaluated[-1]
        best = max(evaluated, key=lambda r: r["top1"])
        rows.append(
            {
                "seed": seed,
                "folder": seed_folder("", seed).name,
                "final_top1": final["top1"],
                "final_epoch": final["epoch"],
                "best_top1": best["top1"],
                "best_epoch": best["epoch"],
            }
        )
    return {
        "seeds": rows,
        "final_top1": spread([r["final_top1"] for r in rows]),
        "best_top1": spread([r["best_top1"] for r in rows]),
    }


def seeds_line(summary: dict[str, Any], where: Path) -> str:
    """The one line a finished stack ends with."""
    final, best = summary["final_top1"], summary["best_top1"]
    return (
        f"{len(summary['seeds'])} seeds: top-1 {final['mean']:.2f} ± {final['half_range']:.2f} at the "
        f"last epoch (mean ± half-range), best {best['mean']:.2f} ± {best['half_range']:.2f}; each "
        f"seed's in {where}"
    )


def seeds_step(form: str, device: torch.device, seeds: int) -> str:
    """How a `seeds` run of ``seeds`` seeds on ``device`` steps them at `seeds_step` ``form``:
    "batched" or "interleaved" as given; auto, batched for two seeds or more on the devices of
    BATCHED_STEP, else interleaved (one seed interleaved is its plain run: nothing to batch, where
    a batched stack of one trained 0.69 to 0.75 times a plain run's images/s on an H200)."""
    if form != "auto":
        return form
    return "batched" if device.type in BATCHED_STEP and seeds > 1 else "interleaved"


def seeds_stepper(loops: list[Loop]) -> Seeds:
    """The stepper of ``loops`` (one per seed): :class:`Stack` or :class:`Interleaved`, as
    :func:`seeds_step` says."""
    lead = loops[0]
    batched = seeds_step(lead.cfg.runtime.seeds_step, lead.ctx.device, len(loops)) == "batched"
    return Stack(loops) if batched else Interleaved(loops)


def stack_refusal(loops: list[Loop], batched: bool = True) -> str | None:
    """Why ``loops`` (one per seed) cannot train together in one process, as one stacked model
    (``batched``) or each seed's step in turn; None when they can."""
    lead = loops[0]
    if lead.prepare is None:
        return "the workers loader draws in its own processes; use `loader` device (or auto)"
    if batched and type(lead.state.optimizer) not in FUSED:
        return (
            f"`opt` {lead.cfg.recipe.opt}: one optimizer steps the stacked weights, so its step must be "
            "elementwise; use adamw, adam, sgd or momentum (or `seeds_step` interleaved)"
        )
    if batched and lead.cfg.recipe.grad_accum_steps > 1:
        return (
            "`grad_accum_steps`: a stack steps every seed at once, one batch each; use `seeds_step` "
            "interleaved"
        )
    if batched and lead.state.scaler.is_enabled():
        return (
            "fp16's GradScaler keeps one loss scale per run; use `amp` bf16 or none (or `seeds_step` "
            "interleaved)"
        )
    for loop in loops[1:]:
        a, b = lead.state, loop.state
        if b.model_config != a.model_config:
            return f"{loop.out} holds another architecture than {lead.out}"
        if (b.epoch, b.step, b.global_step) != (a.epoch, a.step, a.global_step):
            return (
                f"{loop.out} is at epoch {b.epoch + 1}, step {b.step} and {lead.out} at epoch {a.epoch + 1}, "
                f"step {a.step}; resume each alone to the same point first"
            )
        if loop.steps_per_epoch != lead.steps_per_epoch:
            return (
                f"{loop.out} has {loop.steps_per_epoch} steps per epoch and {lead.out} {lead.steps_per_epoch}"
            )
    return None


def stacked_weights(loops: list[Loop], params: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], Any]:
    """One ``nn.Parameter`` per parameter holding every seed's on a leading axis, each seed's
    parameters made its slices (its model, EMA and checkpoints read them as they are); and one
    optimizer over them: the lead seed's class, parameter groups and settings (every seed's are the
    same), with each seed's moments when resumed. The optimizer's step is elementwise, so it is
    every seed's own step at once."""
    with torch.no_grad():  # Parameters, as a model's are: static inputs of the compiled step (Stack)
        weights = [
            nn.Parameter(torch.stack([ps[k].detach() for ps in params]), requires_grad=p.requires_grad)
            for k, p in enumerate(params[0])
        ]
    for s, ps in enumerate(params):
        for k, p in enumerate(ps):
            p.data = weights[k][s]
    own = loops[0].state.optimizer
    index = {id(p): k for k, p in enumerate(params[0])}
    groups = [
        {
            **{k: v for k, v in g.items() if k != "params"},
            "params": [weights[index[id(p)]] for p in g["params"]],
        }
        for g in own.param_groups
    ]
    # the groups carry every setting; of the defaults, what the constructor takes (not its derived keys)
    takes = inspect.signature(type(own)).parameters
    optimizer = type(own)(groups, **{k: v for k, v in own.defaults.items() if k in takes})
    for k, w in enumerate(weights):
        states = [loop.state.optimizer.state.get(ps[k]) for loop, ps in zip(loops, params, strict=True)]
        if all(states):  # resumed: each seed's moments on the leading axis; the step count is shared
            optimizer.state[w] = {
                key: torch.stack([st[key] for st in states]) if v.shape == params[0][k].shape else v.clone()
                for key, v in states[0].items()
            }
    return weights, optimizer


def shared_validation(loops: list[Loop]) -> bool:
    """Whether every seed validates on the same images, labels and batches (the device loader's
    held validation split): then one batched forward evaluates them all. A `holdout` split is
    drawn by each seed's own permutation, so its seeds validate on different images."""
    lead = loops[0].val_loader
    if not isinstance(lead, HeldEvalLoader):
        return False
    return all(
        isinstance(v, HeldEvalLoader)
        and (v.batch_size, v.mean, v.std, v.rank, v.world)
        == (lead.batch_size, lead.mean, lead.std, lead.rank, lead.world)
        and torch.equal(v.images, lead.images)  # False for another shape
        and torch.equal(v.labels, lead.labels)
        for v in (loop.val_loader for loop in loops[1:])
    )


def clipped_per_seed(grads: list[torch.Tensor | None], max_norm: float) -> list[torch.Tensor | None]:
    """``clip_grad_norm_`` for each seed of the stacked gradients ``grads`` (seeds on the leading
    axis; None: unused): each seed's scaled by max_norm / (its total norm + 1e-6) where that is
    below 1. Pure, so the compiled step holds it."""
    present = [g for g in grads if g is not None]
    seeds = present[0].shape[0]
    norms = torch.stack([g.reshape(seeds, -1).norm(dim=1) for g in present], dim=1)  # (S, tensors)
    scale = (max_norm / (norms.norm(dim=1) + 1e-6)).clamp(max=1.0)
    return [None if g is None else g * scale.view(-1, *[1] * (g.dim() - 1)).to(g.dtype) for g in grads]


class Seeds:
    """What a :class:`.loop.Stepper` of several seeds holds, however it steps them: each seed's
    loop, and each seed's global-RNG state, swapped in around its draws."""

    batched = True  # whether the step is one batched computation of every seed

    def __init__(self, loops: list[Loop]) -> None:
        why = stack_refusal(loops, self.batched)
        if why is not None:
            raise CmhsaError(f"`seeds`: cannot train these seeds together: {why}")
        lead = loops[0]
        self.loops, self.ctx, self.dtype, self.mixup = loops, lead.ctx, lead.dtype, lead.mixup
        self.rngs = [rng_state() for _ in loops]  # each seed's, set as its epoch begins
        device = self.ctx.device
        self.index = (device.index or 0) if device.type == "cuda" else 0
        self.generator = (
            (torch.cuda.default_generators[self.index], "cuda")
            if device.type == "cuda"
            else (torch.default_generator, "torch")
        )

    @contextlib.contextmanager
    def stream(self, i: int) -> Iterator[None]:
        """Seed ``i``'s global RNGs (python, numpy, torch's) in place while it draws, kept after."""
        set_rng_state(self.rngs[i])
        try:
            yield
        finally:
            self.rngs[i] = rng_state()

    @contextlib.contextmanager
    def step_stream(self, i: int) -> Iterator[None]:
        """:meth:`stream` for a step's draws alone, at a step's cost: the generator of the device
        (drop-path masks) and numpy's (Mixup), the only global RNGs a step draws from."""
        gen, key = self.generator
        state = self.rngs[i]
        gen.set_state(state[key][self.index] if key == "cuda" else state[key])
        numpy = self.mixup is not None
        if numpy:
            np_state = np.random.get_state()
            np.random.set_state(numpy_state(state["numpy"]))
        try:
            yield
        finally:
            if key == "cuda":
                state["cuda"][self.index] = gen.get_state()  # rng_state()'s own list, one per GPU
            else:
                state["torch"] = gen.get_state()
            if numpy:
                state["numpy"] = saved_numpy_state(np.random.get_state())
                np.random.set_state(np_state)

    def batches(self) -> Iterator[tuple[tuple[Any, torch.Tensor], ...]]:
        """Every seed's batch of a step, from its own loader (their raw batches: the step augments them)."""
        return zip(*(loop.train_loader.batches() for loop in self.loops), strict=True)


class Interleaved(Seeds):
    """Each seed's own step in turn (:func:`.loop.train_one_step`, under its RNGs): its separate
    run's kernels, so each seed computes bit for bit what its run computes, and under ``--compile``
    every seed's step runs the one graph compiled for the first. What the seeds share is the
    process: its start-up, the data's loading, the compiling. The CPU's form (BATCHED_STEP)."""

    batched = False

    def step(self, batches: tuple[tuple[Any, torch.Tensor], ...]) -> None:
        """One optimizer step of every seed, on its batch (``batches[i]``: seed i's inputs, labels)."""
        for i, (loop, batch) in enumerate(zip(self.loops, batches, strict=True)):
            with self.step_stream(i):
                loop.step(batch)

    def settle(self) -> None:
        """Nothing to hand back: each seed's state is its own."""

    def validation(self, checked: Any) -> list[Scored | None]:
        """None each: every seed evaluates itself as its epoch ends."""
        return [None] * len(self.loops)


class Stack(Seeds):
    """The seeds' loops and their step as one batched computation (module docstring), the
    :class:`.loop.Stepper` the one epoch loop drives for ``--seeds`` (at ``seeds_step`` batched):
    the stacked forward, loss and backward, compiled into one graph under ``--compile``."""

    def __init__(self, loops: list[Loop]) -> None:
        super().__init__(loops)
        lead, device = loops[0], self.ctx.device
        model = lead.state.model
        # the model's structure for functional_call, weightless: each call is given every seed's weights
        self.structure = MaskedForward(copy.deepcopy(model).to("meta").train())
        # evaluation's structure, a copy of the weightless one: its convolution in the run's own
        # form (no backward to slow down)
        self.judge = copy.deepcopy(self.structure).eval()
        for mixer in self.structure.modules():  # vmap makes the pixel form's conv S groups: slower
            if isinstance(mixer, ConvMixer) and mixer.form == "auto":
                mixer.form = STACK_CONV_FORM
        # one batched forward evaluates several seeds where the device is one that gains by it; a
        # stack of one evaluates as its run does
        self.batched_validation = (
            len(loops) > 1 and device.type in BATCHED_EVALUATION and shared_validation(loops)
        )
        self.names = [f"model.{n}" for n, _ in model.named_parameters()]
        # index tables, the same for every seed (no state); every name of one shared by several
        # blocks, as the weightless copy holds one per block
        self.buffers = {f"model.{n}": b for n, b in model.named_buffers(remove_duplicate=False)}
        self.params = [list(loop.state.model.parameters()) for loop in loops]
        self.weights, self.optimizer = stacked_weights(loops, self.params)
        self.draws = lead.mixup is not None or any(b.drop_path.drop_prob > 0 for b in model.blocks)
        self.criterion, self.clip = lead.criterion, lead.cfg.recipe.clip_grad
        self.mask_dtype = self.dtype or next(model.parameters()).dtype  # the branches' output dtype
        self.graphs = lead.cfg.runtime.compile and self.ctx.device.type == "cuda"
        self.augment_inside = self.mixup is None  # else Mixup's numpy draws come between
        # Mixup/CutMix applied to every seed at once (mixing.py), unless this timm hides its draws
        self.batched_mixup = self.mixup is not None and mixing.drawable(self.mixup)
        self.learn: Any = self.stacked_learn
        if lead.cfg.runtime.compile:
            # CUDA graphs on CUDA. The weights go in as arguments; being Parameters, dynamo marks
            # them static, so each replay reads them in place, as a plain run's module parameters,
            # instead of copying every one into the graph's memory first (a plain tensor argument's lot)
            mode = "reduce-overhead" if self.graphs else None
            self.learn = with_autograd_traced(torch.compile(self.stacked_learn, mode=mode))

    def settle(self) -> None:
        self.share_moments()

    def validation(self, checked: Any) -> list[Scored | None]:
        """Every seed's validation scores (and its EMA's) from one batched forward of all seeds
        per validation batch, where their validation images are the same (:func:`shared_validation`)
        and the device is in BATCHED_EVALUATION; else None each (each seed evaluates alone). What
        each seed's own evaluation computes (:func:`convit_convert.api.on_data.evaluate`), up to
        the batched kernels' rounding. ``checked``: what the count of batches goes through."""
        if not self.batched_validation:
            return [None] * len(self.loops)
        self.checked = checked
        model = self.judged(self.weights)
        if self.loops[0].state.ema is None:
            return [Scored(m, None) for m in model]
        with torch.no_grad():  # each seed's EMA weights, stacked as its model's are
            emas = [list(loop.state.ema.module.parameters()) for loop in self.loops]  # type: ignore[union-attr]
            stacked = [torch.stack(ws) for ws in zip(*emas, strict=True)]
        return [Scored(m, e) for m, e in zip(model, self.judged(stacked), strict=True)]

    def judged(self, weights: list[torch.Tensor]) -> list[dict[str, float]]:
        """Each seed's validation loss, top-1 and top-5 of the stacked ``weights``, the seeds'
        logits of each batch from one vmap of the model in evaluation mode."""
        lead, device = self.loops[0], self.ctx.device
        named = dict(zip(self.names, weights, strict=True))
        sums = torch.zeros(len(self.loops), 4, dtype=torch.float64, device=device)
        forward = vmap(self.logits, in_dims=(0, None))
        run = Progress(lead.reporter.display)  # the run's line, not the lead seed's
        count = self.checked(run.counting(f"validating {len(self.loops)} seeds", len(lead.val_loader)))
        with torch.no_grad():
            for x, y in lead.val_loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                sums += validation_totals(forward(named, x), y)  # (S, B, classes) logits -> (S, 4)
                count(1)
        return [validation_metrics(s) for s in sums.cpu()]

    def logits(self, weights: dict[str, torch.Tensor], images: torch.Tensor) -> torch.Tensor:
        """One seed's logits in evaluation mode (vmap's view: no seed axis), as ``evaluate`` takes them."""
        with autocast(self.ctx.device, self.dtype):
            return functional_call(self.judge, (weights, self.buffers), (images, [])).float()

    def step(self, batches: tuple[tuple[Any, torch.Tensor], ...]) -> None:
        """One optimizer step of every seed, on its batch (``batches[i]``: seed i's inputs, labels)."""
        device, loops = self.ctx.device, self.loops
        inputs: Any = [x for x, _ in batches]
        labels = torch.stack([y for _, y in batches]).to(device, non_blocking=True)  # (S, B)
        if not self.augment_inside:  # Mixup draws between augmentation and the step: both outside
            images = self.augmented(inputs)
        masks: list[list[torch.Tensor]] = []
        mixes: list[Any] = []  # each seed's Mixup draw; or, with a timm that hides it, its mixed batch
        for i, loop in enumerate(loops):  # each seed's draws from its own RNGs, in its run's order
            with self.step_stream(i) if self.draws else contextlib.nullcontext():
                if self.batched_mixup:
                    mixes.append(mixing.draw(self.mixup, tuple(images.shape[1:])))
                elif self.mixup is not None:
                    mixes.append(self.mixup(images[i], labels[i]))
                masks.append(loop.state.model.drop_masks(labels.shape[1], self.mask_dtype, device))
        if self.batched_mixup:  # every seed mixed at once
            inputs, labels = mixing.mixed(self.mixup, mixes, images, labels)  # (S, B, classes) targets
        elif self.mixup is not None:
            inputs, labels = torch.stack([x for x, _ in mixes]), torch.stack([y for _, y in mixes])
        stacked_masks = [torch.stack(m) for m in zip(*masks, strict=True)]  # (S, B, 1, 1) each
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        tallies = torch.stack([loop.tally.values for loop in loops])  # (S, 2)
        values, skips, grads = self.learn(inputs, labels, stacked_masks, tallies, self.weights)
        # the sums are the next call's input: not the graph's memory, which that replay overwrites
        values = values.clone() if self.graphs else values
        for loop, v, skip in zip(loops, values.unbind(), skips.unbind(), strict=True):
            loop.tally.values, loop.tally.skip = v, skip
        assign_gradients([w for w in self.weights if w.requires_grad], grads)
        self.update(skips.amax())

    def augmented(self, inputs: list[Any]) -> torch.Tensor:
        """Every seed's raw batch (the device loader's :class:`.held.HeldBatch`) augmented by one
        call of the augmentation, (S, B, C, h, w): each sample is augmented by its own parameters,
        which its seed's loader drew, so the seeds' batches one after another augment as each alone."""
        noise = None if inputs[0].noise is None else torch.cat([b.noise for b in inputs])
        images = torch.cat([b.images for b in inputs])
        batch = HeldBatch(images, Params.cat([b.params for b in inputs]), noise)
        return self.loops[0].prepare(batch).unflatten(0, (len(inputs), -1))  # type: ignore[misc]

    def update(self, skip: torch.Tensor) -> None:
        """The end of :func:`.loop.train_one_step` for every seed at once (the gradients come
        clipped, each seed's to its own norm): one optimizer step over the stacked weights (each
        seed's learning rate is its own scheduler's, the same for all), then each seed's counters,
        EMA and scheduler. The step is skipped for every seed after a non-finite loss in any (the
        run stops at the next read-out)."""
        lead = self.loops[0]
        for group, own in zip(self.optimizer.param_groups, lead.state.optimizer.param_groups, strict=True):
            group["lr"] = own["lr"]
        update(self.optimizer, lead.state.scaler, skip)  # the scaler is off (fp16 is refused)
        self.optimizer.zero_grad(set_to_none=True)
        for loop in self.loops:
            st = loop.state
            st.global_step += 1
            if st.ema is not None:
                st.ema.update(st.model, step=st.global_step)
            st.scheduler.step_update(num_updates=st.global_step)

    def share_moments(self) -> None:
        """Each seed's optimizer holds its slice of the stacked optimizer's state (moments, step
        count), as its own run's optimizer would: what its checkpoint saves."""
        for s, loop in enumerate(self.loops):
            own = loop.state.optimizer
            for p, w in zip(self.params[s], self.weights, strict=True):
                if w in self.optimizer.state:
                    own.state[p] = {
                        k: v[s] if torch.is_tensor(v) and v.shape == w.shape else v
                        for k, v in self.optimizer.state[w].items()
                    }

    def stacked_learn(
        self,
        inputs: Any,
        labels: torch.Tensor,
        masks: list[torch.Tensor],
        tallies: torch.Tensor,
        weights: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor | None]]:
        """Every seed's augmentation (``inputs``: the raw batches; or (S, B, C, h, w) images where
        Mixup came first), forward under autocast, loss and gradients, as one batched computation
        over the stacked ``weights``: (the (S, 2) tallies with each seed's loss added, the (S,) skip
        flags, the gradients of the trainable stacked weights)."""
        images = self.augmented(inputs) if self.augment_inside else inputs
        named = dict(zip(self.names, weights, strict=True))
        losses = vmap(self.loss, randomness="error")(named, images, labels, masks)
        values, skips = tallied(tallies, losses, self.ctx)
        learned = [w for w in weights if w.requires_grad]
        grads = list(torch.autograd.grad(losses.sum(), learned, allow_unused=True))  # slice i: loss i's
        if self.clip is not None:  # each seed's to its own norm
            grads = clipped_per_seed(grads, self.clip)
        return values, skips, laid_out(learned, grads)

    def loss(
        self,
        weights: dict[str, torch.Tensor],
        images: torch.Tensor,
        labels: torch.Tensor,
        masks: list[torch.Tensor],
    ) -> torch.Tensor:
        """One seed's loss (vmap's view: no seed axis): the model with ``weights`` on ``images``."""
        with autocast(self.ctx.device, self.dtype):
            logits = functional_call(self.structure, (weights, self.buffers), (images, masks))
            return self.criterion(logits, labels)


class MaskedForward(nn.Module):
    """``model``'s forward with its drop-path masks given (functional_call calls a forward)."""

    def __init__(self, model: VisionTransformer) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
        """(B, C, H, W) images and :meth:`VisionTransformer.drop_masks`'s masks ([]: none) -> logits."""
        return self.model.forward_head(self.model.forward_features(images, masks or None))
