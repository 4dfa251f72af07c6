"""The operations layer: what the CLI's commands (and ``cmhsa train``) do, as library calls that
return typed reports with ``to_dict()`` (the CLI renders them). One module per operation:

- :mod:`.common`: ``load_checkpoint`` (any format), ``save_checkpoint`` (a model to a path), device /
  dtype / autocast choices;
- :mod:`.convert`: ``convert_checkpoint`` / ``convert_file`` (``Conversion``, ``ConvertReport``);
- :mod:`.sweep`: ``heads_sweep`` (``HeadsSweep``), ``checkpoint_head_count``;
- :mod:`.verify`: ``verify_files`` (``VerifyReport``);
- :mod:`.export`: ``export_file``, ``export_checkpoint`` (a model in memory), with ``ExportOptions``
  (``ExportReport``);
- :mod:`.inspection`: ``inspect_file`` (``Inspection``);
- :mod:`.on_data`: ``evaluate_checkpoint`` (``EvalReport``), ``attention_on_data``
  (``AttentionReport``), ``calibration_from_data`` (``Calibration``): the ones that read a dataset;
- :mod:`.predict`: ``predict_files`` / ``predict_images`` (``PredictReport``): a model's top classes for
  image files;
- :mod:`.exported_onnx`: ``open_exported`` (``ExportedOnnx``): an ONNX file cmhsa exported, run as
  shipped in onnxruntime, for ``predict`` and ``eval``.

What each operation takes is a typed object with its defaults and ranges
(:mod:`convit_convert.options.operations`: ``Geometry``, ``Verification``, ``CalibrationSource``,
``EvalOptions``, ``AttentionOptions``, ``PredictOptions``; ``ConversionSpec``; ``ExportOptions``),
re-exported here.

Bad input raises :class:`~convit_convert.errors.CmhsaError` before anything is written; a check
that fails is a report with ``passed`` False. Importing this package imports torch, not the data
stack: :mod:`.on_data` and :mod:`.predict` (torchvision, timm's transforms on use) are imported by name.
"""

from __future__ import annotations

from ..options.conversion import ConversionSpec
from ..options.operations import (
    AttentionOptions,
    CalibrationSource,
    EvalOptions,
    Geometry,
    PredictOptions,
    Verification,
)
from .common import as_float32, load_checkpoint, resolve_device, save_checkpoint
from .convert import (
    Conversion,
    ConvertReport,
    convert_checkpoint,
    convert_file,
    converted_model,
    make_calibration,
)
from .export import ExportOptions, ExportReport, export_checkpoint, export_file
from .inspection import Inspection, inspect_file
from .sweep import HeadsSweep, SweepRow, checkpoint_head_count, heads_sweep
from .verify import VerifyReport, verify_files

__all__ = [
    "AttentionOptions",
    "CalibrationSource",
    "Conversion",
    "ConversionSpec",
    "ConvertReport",
    "EvalOptions",
    "ExportOptions",
    "ExportReport",
    "Geometry",
    "HeadsSweep",
    "Inspection",
    "PredictOptions",
    "SweepRow",
    "Verification",
    "VerifyReport",
    "as_float32",
    "checkpoint_head_count",
    "convert_checkpoint",
    "convert_file",
    "converted_model",
    "export_checkpoint",
    "export_file",
    "heads_sweep",
    "inspect_file",
    "load_checkpoint",
    "make_calibration",
    "resolve_device",
    "save_checkpoint",
    "verify_files",
]
