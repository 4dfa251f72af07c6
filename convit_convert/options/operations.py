"""What each operation takes besides a conversion spec, as typed objects the library owns (no
torch): every default stated once, here, and every field checked when an object is made
(:class:`.checked.Checked`). The CLI's flags read their defaults
from these fields (a flag and its field share a name); ``tests/test_options.py`` fails when a
command's default or range differs from the library's.

- :class:`Geometry`: how to read a bare conv-phase state dict (convert, inspect);
- :class:`Verification`: how a numerical check runs (convert, verify);
- :class:`VerifyOptions`: ``cmhsa verify``'s tolerance and seed;
- :class:`CalibrationSource`: the images an approximate conversion fits on (convert, heads);
- :class:`HeadsQuery`: ``cmhsa heads``'s kernel, patch, dilation and channels;
- :class:`EvalOptions`, :class:`AttentionOptions`, :class:`PredictOptions`: ``cmhsa eval``,
  ``cmhsa attention``, ``cmhsa predict``;
- :class:`ExportOptions`: how ``cmhsa export`` writes and checks an ONNX file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import NORM_EPS
from .checked import Checked
from .values import AMPS, DATASETS, DEFAULT_TOL, DTYPES, EVAL_CROP_PCT

EXPORTERS = ("dynamo", "legacy")  # torch.onnx.export's two paths
EXPORT_FORMS = ("fused", "trained")  # attention models: W_V·W_O folded, or as trained


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
    ``batch_size``, preprocessed as ``cmhsa eval`` does (an ONNX file: as its metadata_props say);
    ``threads`` None: loaders.default_threads()."""

    top_k: int = 5
    batch_size: int = 64
    device: str = "auto"
    threads: int | None = None


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
    model's evaluation transform (``crop_pct``); ``workers`` None: loaders.default_workers();
    ``threads`` None: loaders.default_threads()."""

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
    threads: int | None = None


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


@dataclass(frozen=True)
class ExportOptions(Checked):
    """How ``cmhsa export`` writes and checks: validated when made, each default stated once. The
    opset's range starts at 17, the first with LayerNormalization."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"exporter": EXPORTERS, "form": EXPORT_FORMS}

    opset: int | None = None  # ai.onnx opset; None: the exporter's
    tol: float = 1e-4  # largest relative error of onnxruntime against PyTorch
    exporter: str = "dynamo"  # or "legacy" (TorchScript)
    form: str = "fused"  # attention models: "fused" (W_V·W_O folded) or "trained"
    device: str = "auto"  # onnxruntime provider of the check: auto, cpu, cuda or cuda:N
    seed: int = 0  # of the check images
