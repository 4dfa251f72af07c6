"""A run's state, which saves and loads itself: the one definition of what ``checkpoint-last.pt``
holds, everything a stopped run needs to continue exactly where it stopped.

Written atomically (temp file in the run folder, then rename), so a crash while saving keeps the
previous checkpoint. ``--keep N`` also keeps the last N end-of-epoch copies. Read back with
``weights_only=True``, like every other file cmhsa reads.
"""

from __future__ import annotations

import math
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..config import ViTConfig
from ..errors import CmhsaError, first_line
from ..io.atomic import atomic_names, recover
from ..io.checkpoint import load_pickled
from ..io.folder import Folder
from ..options.training import TrainConfig
from .names import LAST, NUMBERED

# an end-of-epoch copy (`keep`): exactly the names numbered_name gives, never a user's look-alike


def numbered_name(epoch: int) -> str:
    """The end-of-epoch copy of epoch ``epoch`` (`keep`)."""
    return f"checkpoint-epoch{epoch:04d}.pt"


def own_storage(obj: Any) -> Any:
    """``obj`` (a state dict) with every tensor that is a view of a larger one copied: torch.save
    writes a view's whole storage (a stacked run's weights are slices of every seed's)."""
    if torch.is_tensor(obj):
        whole = obj.untyped_storage().nbytes() == obj.numel() * obj.element_size()
        return obj if whole else obj.clone()
    if isinstance(obj, dict):
        return {k: own_storage(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [own_storage(v) for v in obj]
    return obj


def saved_numpy_state(state: tuple) -> tuple:
    """numpy's RNG state (``np.random.get_state()``) as a checkpoint keeps it: the keys as a tensor."""
    name, keys, pos, has_gauss, gauss = state
    return (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss)


def numpy_state(saved: tuple) -> tuple:
    """:func:`saved_numpy_state`'s inverse, for ``np.random.set_state``."""
    name, keys, pos, has_gauss, gauss = saved
    return (name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss)


def rng_state() -> dict[str, Any]:
    """Every global RNG the training loop uses, as tensors and plain values (loadable with weights_only)."""
    state = {
        "python": random.getstate(),
        "numpy": saved_numpy_state(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(numpy_state(state["numpy"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def cpu_name() -> str:
    """The processor's model, as /proc/cpuinfo names it (else the platform's word for it): two CPUs
    of one code path (AVX-512) but another model can still round differently (oneDNN picks kernels
    by the model: a rerun of the same run elsewhere parted after 8 epochs)."""
    import platform

    try:
        with open("/proc/cpuinfo", "rb") as f:
            for line in f.read(1 << 16).decode("utf-8", "replace").splitlines():
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return " ".join(value.split())[:120]
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device | str = "cpu", world: int = 1) -> dict[str, Any]:
    """Where a run computes, as far as it changes the numbers: torch's CPU threads (reductions are
    summed in another order with another count), the processor and the CPU code path torch picked
    (AVX-512 or AVX2 kernels round differently), the device, the process count and the library
    versions."""
    import timm

    return {
        "cpu": cpu_name(),
        "threads": torch.get_num_threads(),
        "device": torch.device(device).type,
        "world_size": world,
        "torch": str(torch.__version__),  # a TorchVersion, which weights_only loading refuses
        "timm": str(timm.__version__),
        "cpu_capability": str(torch.backends.cpu.get_cpu_capability()),
    }


def environment_changes(saved: Any, now: dict[str, Any]) -> list[str]:
    """What differs between the environment a checkpoint was last saved in (its ``environments``'
    last entry) and this one, as ``name before -> now`` (an old checkpoint that recorded none:
    nothing to compare)."""
    last = saved[-1] if isinstance(saved, list) and saved and isinstance(saved[-1], dict) else {}
    return [f"{k} {last[k]} -> {v}" for k, v in now.items() if k in last and last[k] != v]


def plain_records(x: Any, limit: int = 10_000) -> bool:
    """A list of at most ``limit`` flat dicts of short strings, numbers, bools and None: what a
    checkpoint's ``environments`` must be to be carried into config.json (else it starts anew)."""
    plain = (str, int, float, bool, type(None))
    return (
        isinstance(x, list)
        and len(x) <= limit
        and all(
            isinstance(e, dict)
            and all(isinstance(k, str) and isinstance(v, plain) and len(str(v)) < 200 for k, v in e.items())
            for e in x
        )
    )


def read_checkpoint(folder: Folder) -> dict[str, Any]:
    """The run folder's saved run state as a dict (its config and model config tell what to build
    before :meth:`RunState.load`). The file is untrusted input: read with ``weights_only=True`` and
    every field checked, so a damaged or crafted file is one line, never a traceback."""
    import pickle

    recover(folder)  # resuming writes into the run folder: first finish a save a kill -9 cut short
    path = folder.show(LAST)
    if not folder.exists(LAST):
        raise CmhsaError("no checkpoint to resume from (run without `resume` first)", path)
    try:
        with folder.open_read(LAST) as f:
            saved = load_pickled(f, path)
    except CmhsaError:
        raise
    except pickle.UnpicklingError:
        raise CmhsaError(
            "holds objects other than tensors and plain values, so cmhsa will not "
            "load it (it could run code); "
            "it was not written by cmhsa train: start a new run in another `out`",
            path,
        ) from None
    except Exception as e:
        raise CmhsaError(f"cannot read the training checkpoint ({type(e).__name__}: {e})", path) from None
    problem = _checkpoint_problem(saved)
    if problem:
        raise CmhsaError(f"is not a usable cmhsa training checkpoint: {problem}", path)
    return saved


def _checkpoint_problem(saved: Any) -> str | None:
    """What is wrong with a loaded checkpoint-last.pt's structure, or None."""
    if not isinstance(saved, dict):
        return f"a {type(saved).__name__}, not a dict"
    kinds: dict[str, type | tuple[type, ...]] = {
        "model": dict,
        "optimizer": dict,
        "scheduler": dict,
        "scaler": dict,
        "config": dict,
        "model_config": dict,
        "kind": str,
        "init": dict,
        "epoch": int,
        "step": int,
        "global_step": int,
        "metrics": list,
        "partial": dict,
        "rng": (dict, type(None)),
    }
    for key, kind in kinds.items():
        if key not in saved:
            return f"no {key!r}"
        if not isinstance(saved[key], kind) or isinstance(saved[key], bool):
            return f"{key!r} is a {type(saved[key]).__name__}"
    if min(saved["epoch"], saved["step"], saved["global_step"]) < 0:
        return "negative epoch or step counters"
    if max(saved["epoch"], saved["step"], saved["global_step"]) > 2**53:
        return "epoch or step counters beyond any run's"
    if len(saved["metrics"]) != saved["epoch"] or not all(isinstance(r, dict) for r in saved["metrics"]):
        return f"{len(saved['metrics'])} metrics rows for {saved['epoch']} finished epochs"
    if not all(isinstance(v, torch.Tensor) for v in saved["model"].values()):
        return "'model' holds something other than tensors"
    opt = saved["optimizer"]
    if not isinstance(opt.get("state"), dict) or not isinstance(opt.get("param_groups"), list):
        return "'optimizer' has no state / param_groups"
    rng = saved["rng"]
    if rng is not None:
        numpy_state = rng.get("numpy")
        if not (
            isinstance(rng.get("python"), tuple)
            and isinstance(rng.get("torch"), torch.Tensor)
            and rng["torch"].dtype == torch.uint8
            and isinstance(numpy_state, tuple)
            and len(numpy_state) == 5
            and isinstance(numpy_state[1], torch.Tensor)
        ):
            return "'rng' is not the RNG state cmhsa saves"
    return None


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def same_structure(saved: Any, fresh: Any, where: str) -> str | None:
    """What differs in kind between a saved value and the one the run built fresh (dict keys, list
    lengths, numbers, strings, tensor shapes and dtypes), or None: state that loads into an object
    without checks of its own (a scheduler's ``__dict__``, a scaler's) is held to what it replaces."""
    if isinstance(fresh, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != fresh.shape or saved.dtype != fresh.dtype:
            return f"{where} is not a {fresh.dtype} tensor of shape {list(fresh.shape)}"
        return None
    if isinstance(fresh, bool) or fresh is None or isinstance(fresh, str):
        return None if type(saved) is type(fresh) else f"{where} is {type(saved).__name__}"
    if _number(fresh):
        return None if _number(saved) else f"{where} is {saved!r}, not a finite number"
    if isinstance(fresh, dict):
        if not isinstance(saved, dict) or set(saved) != set(fresh):
            return f"{where} does not hold {sorted(map(str, fresh))}"
        return next((p for k in fresh if (p := same_structure(saved[k], fresh[k], f"{where}.{k}"))), None)
    if isinstance(fresh, list | tuple):
        if not isinstance(saved, list | tuple) or len(saved) != len(fresh):
            return f"{where} is not a sequence of {len(fresh)}"
        pairs = enumerate(zip(saved, fresh, strict=True))
        return next((p for i, (a, b) in pairs if (p := same_structure(a, b, f"{where}[{i}]"))), None)
    return None


_HYPER = ("lr", "initial_lr", "betas", "eps", "weight_decay")  # what every step reads


def optimizer_problem(saved: dict[str, Any], optimizer: Any) -> str | None:
    """The saved optimizer state against the optimizer built for the model: the same groups with
    the same settings (numbers finite, betas in [0, 1)), and each parameter's state tensors of its
    shape (or scalars, like ``step``)."""
    groups = saved["param_groups"]
    fresh = optimizer.state_dict()["param_groups"]
    if len(groups) != len(fresh) or not all(isinstance(g, dict) for g in groups):
        return f"optimizer: {len(groups)} parameter groups, the run has {len(fresh)}"
    shapes: dict[Any, torch.Size] = {}
    for i, (g, f) in enumerate(zip(groups, fresh, strict=True)):
        for k, v in f.items():
            if k == "params" or (k not in g and k not in _HYPER):  # flags another torch version lacks
                continue
            if k not in g:
                return f"optimizer group {i} has no {k!r}"
            if v is None or isinstance(v, bool):  # foreach, fused, ...: None or a bool, whichever torch wrote
                if g[k] is not None and not isinstance(g[k], bool):
                    return f"optimizer group {i}.{k} is {g[k]!r}"
            elif problem := same_structure(g[k], v, f"optimizer group {i}.{k}"):
                return problem
        betas = g.get("betas")
        if betas is not None and not all(0 <= b < 1 for b in betas):
            return f"optimizer group {i}: betas {betas} are not in [0, 1)"
        params = list(optimizer.param_groups[i]["params"])
        if not isinstance(g.get("params"), list) or len(g["params"]) != len(params):
            held = len(g.get("params") or [])
            return f"optimizer group {i} holds {held} parameters, the run has {len(params)}"
        shapes |= {pid: p.shape for pid, p in zip(g["params"], params, strict=True)}
    for pid, state in saved["state"].items():
        if pid not in shapes or not isinstance(state, dict):
            return f"optimizer state for an unknown parameter {pid!r}"
        for k, v in state.items():
            ok = (
                isinstance(v, torch.Tensor)
                and v.is_floating_point()
                and (v.shape == shapes[pid] or v.numel() == 1)
            ) or _number(v)
            if not ok:
                return f"optimizer state {k!r} of parameter {pid} is not a float tensor of its shape"
    return None


def fit_problem(saved: dict[str, Any], run: RunState, steps_per_epoch: int | None) -> str | None:
    """What in a saved state does not fit the run built to take it, or None."""
    epochs = run.config.recipe.epochs
    if saved["epoch"] > epochs:
        return f"{saved['epoch']} epochs done, more than the run's {epochs}"
    # step == steps_per_epoch is a stop after an epoch's last step, before its evaluation
    if steps_per_epoch is not None and saved["step"] > steps_per_epoch:
        return f"step {saved['step']} of an epoch of {steps_per_epoch} steps"
    if steps_per_epoch is not None and saved["global_step"] > (saved["epoch"] + 1) * steps_per_epoch:
        return f"global step {saved['global_step']} after {saved['epoch']} epochs of {steps_per_epoch} steps"
    fresh_partial = {"loss_sum": 0.0, "seconds": 0.0, "images": 0}
    problem = same_structure(saved["partial"], fresh_partial, "partial")
    if problem or min(saved["partial"].values()) < 0:
        return problem or "negative partial-epoch counters"
    problem = optimizer_problem(saved["optimizer"], run.optimizer)
    if problem:
        return problem
    for name in ("scheduler", "scaler"):
        problem = same_structure(saved[name], getattr(run, name).state_dict(), name)
        if problem:
            return problem
    return None


@dataclass
class RunState:
    """The objects a run trains and the counters that say how far it got."""

    config: TrainConfig
    model_config: ViTConfig
    init: dict[str, Any]  # where the weights came from
    model: nn.Module
    optimizer: Any
    scheduler: Any
    scaler: Any
    ema: Any = None
    epoch: int = 0  # epochs finished
    step: int = 0  # steps done in the unfinished epoch (0 at an epoch's end)
    global_step: int = 0
    metrics: list[dict[str, Any]] = field(default_factory=list)  # one row per finished epoch
    partial: dict[str, float] = field(default_factory=lambda: {"loss_sum": 0.0, "seconds": 0.0, "images": 0})
    rng: dict[str, Any] | None = None  # the RNGs at a mid-epoch save, restored when that epoch resumes
    # where it computed (:func:`environment`), each from the epoch and step it took over at
    environments: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        objects = ("model", "optimizer", "scheduler", "scaler")  # saved through their state_dict()
        counters = ("init", "epoch", "step", "global_step", "metrics", "partial")
        return {
            **{name: own_storage(getattr(self, name).state_dict()) for name in objects},
            **{name: getattr(self, name) for name in counters},
            "ema": None if self.ema is None else self.ema.state_dict(),
            "model_config": self.model_config.to_dict(),
            "kind": self.model_config.kind,
            "config": self.config.to_dict(),
            "rng": rng_state(),
            "environments": self.environments,
        }

    def load(self, saved: dict[str, Any], reschedule: Any = None, steps_per_epoch: int | None = None) -> None:
        """Restore from :func:`read_checkpoint`'s dict. ``reschedule(optimizer)``, when given, builds
        a fresh scheduler instead of loading the saved one (a resume that changed epochs or lr).
        State that does not fit what was built (types, shapes, parameter groups, counters past
        ``steps_per_epoch`` or the run's epochs) is a CmhsaError, before any of it is used."""
        problem = fit_problem(saved, self, steps_per_epoch)
        if problem is None:
            try:
                self._load(saved, reschedule)
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
                problem = f"{type(e).__name__}: {first_line(e, 200)}"
        if problem is not None:
            raise CmhsaError(
                f"`resume`: {LAST} does not fit the run it belongs to ({problem})", self.config.runtime.out
            )

    def _load(self, saved: dict[str, Any], reschedule: Any) -> None:
        self.model.load_state_dict(saved["model"])
        self.optimizer.load_state_dict(saved["optimizer"])
        if reschedule is None:
            self.scheduler.load_state_dict(saved["scheduler"])
        else:
            self.scheduler = reschedule(self.optimizer)
            self.scheduler.step(saved["epoch"])
        self.scaler.load_state_dict(saved["scaler"])
        if self.ema is not None and saved.get("ema") is not None:
            self.ema.load_state_dict(saved["ema"])
        self.epoch, self.step, self.global_step = saved["epoch"], saved["step"], saved["global_step"]
        self.metrics, self.partial = list(saved["metrics"]), dict(saved["partial"])
        self.rng = saved["rng"] if self.step > 0 else None
        if self.rng is not None:  # applied when the epoch resumes; try it now, so a bad one fails here
            current = rng_state()
            set_rng_state(self.rng)
            set_rng_state(current)

    def save(
        self, run_dir: Folder, keep: int, also: dict[str, Any] | None = None, committed: Any = None
    ) -> Path:
        """Write ``checkpoint-last.pt`` and the files ``also`` (name -> its text, or what writes it
        given a path) in the held run folder, all or none (:func:`atomic_names` commits them
        together); then call ``committed()``; at an epoch's end with ``keep`` > 0 also a numbered
        copy, pruning all but the newest ``keep``."""
        state = self.to_dict()
        also = also or {}
        with atomic_names((run_dir, LAST), *((run_dir, name) for name in also)) as tmps:
            torch.save(state, tmps[0])
            for tmp, content in zip(tmps[1:], also.values(), strict=True):
                if callable(content):
                    content(tmp)
                else:
                    tmp.write_text(content, encoding="utf-8")
        if committed is not None:
            committed()
        if keep > 0 and self.step == 0:
            numbered = (run_dir, numbered_name(self.epoch))
            with atomic_names(numbered) as (tmp,), run_dir.open_read(LAST) as src, open(tmp, "wb") as dst:
                shutil.copyfileobj(src, dst)  # copy the bytes, don't re-pickle
            old = sorted((n for n in run_dir.names() if NUMBERED.fullmatch(n)), key=lambda n: int(n[16:-3]))
            run_dir.remove_all(old[:-keep])
        return run_dir.show(LAST)
