"""What each operation takes besides a conversion spec or export options, as typed objects the
library owns (no torch): every default stated once, here, and every number held to its range in
:data:`~convit_convert.bounds.BOUNDS` when an object is made. The CLI's flags read their defaults
from these fields (a flag and its field share a name); ``tests/test_options.py`` fails when a
command's default or range differs from the library's.

- :class:`Geometry`: how to read a bare conv-phase state dict (convert, inspect);
- :class:`Verification`: how a numerical check runs (convert, verify);
- :class:`VerifyOptions`: ``cmhsa verify``'s tolerance and seed;
- :class:`CalibrationSource`: the images an approximate conversion fits on (convert, heads);
- :class:`HeadsQuery`: ``cmhsa heads``'s kernel, patch, dilation and channels;
- :class:`EvalOptions` and :class:`AttentionOptions`: ``cmhsa eval`` and ``cmhsa attention``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Union

from .bounds import check
from .config import NORM_EPS
from .defaults import DATASETS, EVAL_CROP_PCT
from .errors import CmhsaError

# The largest relative error a verification or an import check accepts. float32 rounding of the
# paper's model (d = 768, 9 heads) measures 2e-7 to 5e-7 (BENCHMARKS.md, "Exactness of the converted
# model"); an inexact construction (no sink at the border) is off by 1e-2 and more.
DEFAULT_TOL = 1e-5
DEVICE_NAME = re.compile(r"auto|cpu|cuda(?::(\d{1,4}))?")  # group 1: the GPU's index
AMPS = ("auto", "bf16", "fp16", "none")
DTYPES = ("float32", "float64")


def check_device_name(name: object) -> None:
    """``name`` is one a user may give (which GPUs exist is checked where one is used)."""
    if not isinstance(name, str) or not DEVICE_NAME.fullmatch(name):
        raise CmhsaError(f"`device` must be auto, cpu, cuda or cuda:N, got {name!r}")


def fits(value: Any, hint: Any) -> bool:
    """Whether ``value`` is of the type ``hint`` names, as a typed flag would give it: a bool is no
    number, an int is a float, a tuple has its length."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is Literal:
        return value in args
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and len(value) == len(args) and all(map(fits, value, args))
    if origin is not None:
        return isinstance(value, origin)
    return not isinstance(hint, type) or isinstance(value, hint)


TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "text"}


def type_text(hint: Any) -> str:
    """``hint`` in words, for a refusal: "an integer or none", "2 numbers"."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (Union, types.UnionType):
        return " or ".join(type_text(a) for a in args)
    if hint is type(None):
        return "none"
    if typing.get_origin(hint) is tuple:
        return f"{len(args)} {'integers' if args[0] is int else 'numbers'}"
    return TYPE_WORDS.get(hint, getattr(hint, "__name__", str(hint)))


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """The resolved annotations of a dataclass's fields (once per class)."""
    return typing.get_type_hints(cls)


@dataclass(frozen=True)
class Checked:
    """A frozen set of options, checked when made, as the command line checks its flags: each
    field's value of its annotated type, each number against BOUNDS (by field name), each name
    against ``CHOICES``; ``device`` fields against the device names. ``FLAG_OF`` names a field's
    flag where the two are spelled apart (a refusal names the flag's parameter)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {}
    FLAG_OF: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = field_types(type(self))
        for f in dataclasses.fields(self):
            value, name = getattr(self, f.name), self.FLAG_OF.get(f.name, f.name)
            if not fits(value, hints[f.name]):
                raise CmhsaError(f"`{name}` must be {type_text(hints[f.name])}, got {value!r}")
            check(name, value)
            allowed = self.CHOICES.get(f.name)
            optional = value is None and f.default is None  # a field whose default is "none given"
            if allowed is not None and not optional and value not in allowed:
                raise CmhsaError(f"`{name}` must be one of {', '.join(allowed)}, got {value!r}")
        device = getattr(self, "device", None)
        if device is not None:
            check_device_name(device)

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class Geometry(Checked):
    """What a bare conv-phase state dict cannot say about itself: the image size (H, W) and patch
    size P (both needed to read one; for a file that states its own they must agree with it), the
    convolutions' dilation and LayerNorm's eps."""

    img_size: tuple[int, int] | None = None
    patch_size: int | None = None
    dilation: int = 1
    norm_eps: float = NORM_EPS


@dataclass(frozen=True)
class Verification(Checked):
    """How a numerical check runs: ``batch`` random images (seeded by the caller), in ``dtype``, on
    ``device`` (auto: CUDA when there is one)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"dtype": DTYPES}

    dtype: str = "float32"
    batch: int = 4
    device: str = "auto"


@dataclass(frozen=True)
class PredictOptions(Checked):
    """``cmhsa predict``: each image's ``top_k`` classes and probabilities, in batches of
    ``batch_size``, preprocessed as ``cmhsa eval`` does (an ONNX file: as its metadata_props say)."""

    top_k: int = 5
    batch_size: int = 64
    device: str = "auto"


@dataclass(frozen=True)
class VerifyOptions(Checked):
    """``cmhsa verify``'s verdict: every relative error at most ``tol`` on random images drawn from
    ``seed``. Seed 0 is the conversion's own check (ConversionSpec.seed), so a second check of the
    same files draws other images by default."""

    tol: float = DEFAULT_TOL
    seed: int = 1


@dataclass(frozen=True)
class CalibrationSource(Checked):
    """The images an approximate conversion is fitted and measured on: ``calib_images`` seeded
    random images of ``calib``'s training split and its first ``heldout_images`` validation images
    (``calib`` None: N(0, 1) noise images, the statistics of normalised inputs)."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"calib": DATASETS}

    calib: str | None = None
    data_dir: str | None = None
    calib_images: int = 256
    heldout_images: int = 512
    seed: int = 0


@dataclass(frozen=True)
class HeadsQuery(Checked):
    """``cmhsa heads``: the kernel size K, patch size P, dilation D and pixel channels C whose head
    counts are asked (theory.head_count); K and P None: a checkpoint's."""

    kernel_size: int | None = None
    patch_size: int | None = None
    dilation: int = 1
    channels: int | None = None


@dataclass(frozen=True)
class EvalOptions(Checked):
    """``cmhsa eval``: ``data``'s validation split in batches of ``batch_size``, preprocessed as the
    model's evaluation transform (``crop_pct``); ``workers`` None: data.default_workers()."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"data": DATASETS, "amp": AMPS}

    data: str
    data_dir: str | None = None
    download: bool = False
    batch_size: int = 128
    device: str = "auto"
    amp: str = "none"
    workers: int | None = None
    crop_pct: float = EVAL_CROP_PCT
    seed: int = 0


@dataclass(frozen=True)
class AttentionOptions(Checked):
    """``cmhsa attention``: the first ``images`` validation images of ``data``, in batches of
    ``batch_size``."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"data": DATASETS}

    data: str
    data_dir: str | None = None
    images: int = 1000
    batch_size: int = 100
    device: str = "auto"
    workers: int = 0
    crop_pct: float = EVAL_CROP_PCT
    seed: int = 0
