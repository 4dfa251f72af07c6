"""What each value a user gives may be, written once (no torch): the range of every number
(:data:`BOUNDS`, by parameter name: a flag of any command and the same value read back from a file
are held to one table; NaN and infinities are never in range), and the names and defaults several
layers read (the datasets, the evaluation transform, phase 1's forms, the devices, the tolerance).

Sizes are bounded generously (far above the paper's models) but finitely, by the same limits as a
model file's config (``config.LIMITS``); what the sizes imply together (memory) is checked by the
library, which knows the model (``resources.check_fits``). The CLI shows each range in ``--help``
and checks it before a command runs (cli/bounds.py).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any

from ..config import LIMITS
from ..errors import CmhsaError

DATASETS = ("cifar100", "cifar10", "imagefolder", "digits", "fashion-mnist", "synthetic")
DATASET_NOTES = {  # what --help says beside a dataset's name
    "imagefolder": "DIR/train, DIR/val",
    "digits": "scikit-learn's",
    "fashion-mnist": "Debian's dataset-fashion-mnist",
}
MAX_DEFAULT_WORKERS = 4  # loaders.default_workers: at most this many, and never more than the CPUs
EVAL_INTERPOLATION = "bicubic"  # the resize of `cmhsa eval`, of training's evaluation, of the exports
EVAL_CROP_PCT = 0.875  # timm's default crop: a 224 px crop of a 256 px resize
CONV_FORMS = ("auto", "pixels", "tokens")  # how phase 1's convolution computes (conv_mixer.py)
REPORT_TO = ("none", "tensorboard")  # where a run reports besides its own files (HF's report_to)
SEEDS_STEPS = ("auto", "batched", "interleaved")  # how a `seeds` run steps its seeds (train/stacked.py)
IMPULSE_OFFSETS = ("conversion", "random")  # --init impulse: the offsets its heads are pinned to (starts.py)
# The largest relative error a verification or an import check accepts. float32 rounding of the
# paper's model (d = 768, 9 heads) measures 2e-7 to 5e-7 (BENCHMARKS.md, "Conversion"); an
# inexact construction (no sink at the border) is off by 1e-2 and more.
DEFAULT_TOL = 1e-5
DEVICE_NAME = re.compile(r"auto|cpu|cuda(?::(\d{1,4}))?")  # group 1: the GPU's index
AMPS = ("auto", "bf16", "fp16", "none")
DTYPES = ("float32", "float64")

CPUS = os.cpu_count() or 1


@dataclass(frozen=True)
class Bound:
    """lo ≤ x ≤ hi, either end open when asked; always finite."""

    lo: float
    hi: float
    lo_open: bool = False
    hi_open: bool = False

    def text(self) -> str:
        lo, hi = num(self.lo), num(self.hi)
        return f"{lo} {'<' if self.lo_open else '≤'} x {'<' if self.hi_open else '≤'} {hi}"

    def holds(self, x: float) -> bool:
        if isinstance(x, float) and not math.isfinite(x):
            return False
        above = x > self.lo if self.lo_open else x >= self.lo
        below = x < self.hi if self.hi_open else x <= self.hi
        return above and below


def num(x: float) -> str:
    """1000000 rather than 1e+06, 0.5 as 0.5, nan as nan."""
    return (
        str(int(x))
        if isinstance(x, int) or (math.isfinite(x) and x == int(x) and abs(x) < 1e16)
        else f"{x:g}"
    )


SEED = Bound(0, 2**32 - 1)  # numpy's seeds are 32-bit
PROB = Bound(0, 1)
COUNT = Bound(1, 10**9)  # images, epochs, steps


def size(name: str) -> Bound:
    """1 to the largest a model file may claim (config.LIMITS): a flag and a file agree."""
    return Bound(1, LIMITS[name])


BOUNDS: dict[str, Bound] = {
    # sizes of the model
    "img_size": size("img_size"),
    "in_chans": size("in_chans"),
    "patch_size": size("patch_size"),
    "patch": size("patch_size"),
    "hidden_chans": size("hidden_chans"),
    "depth": size("depth"),
    "mlp_ratio": Bound(0, 64, lo_open=True),
    "kernel_size": size("kernel_size"),
    "kernel": size("kernel_size"),
    "dilation": size("dilation"),
    "channels": Bound(1, 65536),
    "heads": size("num_heads"),
    "qk_dim": size("qk_dim"),
    "v_dim": size("v_dim"),
    "num_classes": Bound(2, LIMITS["num_classes"]),
    "norm_eps": Bound(0, 1, lo_open=True, hi_open=True),
    # conversion and checks
    "margin": Bound(0, 1e4, lo_open=True),
    "qk_init_std": Bound(0, 10),
    "tol": Bound(0, 1e6),
    "verify_tol": Bound(0, 1e6),
    "batch": Bound(1, 65536),
    "opset": Bound(17, 99),
    "calib_images": Bound(1, 10**7),
    "heldout_images": Bound(1, 10**7),
    "images": Bound(1, 10**7),
    "mimetic_alpha": Bound(0, 100),
    "mimetic_beta": Bound(0, 100),
    # data and recipe
    "train_samples": COUNT,
    "val_samples": COUNT,
    "holdout": COUNT,
    "epochs": Bound(1, 10**6),
    "batch_size": Bound(1, 65536),
    "lr": Bound(0, 10, lo_open=True),
    "lr_base_batch": Bound(1, 10**7),
    "min_lr": Bound(0, 10),
    "warmup_lr": Bound(0, 10),
    "warmup_epochs": Bound(0, 10**6),
    "weight_decay": Bound(0, 10),
    "opt_eps": Bound(0, 1, lo_open=True),
    "opt_betas": Bound(0, 1, hi_open=True),
    "clip_grad": Bound(0, 1e6, lo_open=True),
    "color_jitter": Bound(0, 10),
    "reprob": PROB,
    "scale": Bound(0, 1, lo_open=True),
    "hflip": PROB,
    "crop_pct": Bound(0.1, 1),  # eval resizes to img_size / crop_pct: at most 10x the model's size
    "mixup": Bound(0, 100),
    "cutmix": Bound(0, 100),
    "mixup_prob": PROB,
    "mixup_switch_prob": PROB,
    "smoothing": Bound(0, 1, hi_open=True),
    "model_ema_decay": Bound(0, 1, hi_open=True),
    "drop_path": Bound(0, 1, hi_open=True),
    "attn_lr_mult": Bound(0, 1e4, lo_open=True),
    "grad_accum_steps": Bound(1, 1024),
    # running
    "seed": SEED,
    "seeds": SEED,  # each of them
    "workers": Bound(0, 4 * CPUS),
    "threads": Bound(1, 4 * CPUS),
    "keep": Bound(0, 10**4),
    "top_k": Bound(1, 1000),  # predict's classes per image (a table of 1000 columns is no longer read)
    "log_every": COUNT,
    "eval_every": COUNT,
}


def check(name: str, value: Any, path: object = None) -> None:
    """Raise CmhsaError naming the parameter (`name`, which the CLI prints as its flag) unless
    `value` (a number, or a tuple or list of them; None: not given) is in BOUNDS[name]. A bool or
    anything else that is no number is refused too: the range is of numbers."""
    bound = BOUNDS.get(name)
    if bound is None or value is None:
        return
    for x in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(x, bool) or not isinstance(x, (int, float)):
            raise CmhsaError(f"`{name}` must be a number, got {x!r}", path)
        if not bound.holds(x):
            raise CmhsaError(f"`{name}` must be {bound.text()}, got {num(x)}", path)
