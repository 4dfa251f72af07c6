"""The operations layer: what the CLI's commands (and ``cmhsa train``) do, as library calls that
return typed reports with ``to_dict()`` (the CLI renders them). One module per operation:

- :mod:`.common`: ``load_checkpoint`` (any format), device / dtype / autocast choices, output checks;
- :mod:`.convert`: ``convert_checkpoint`` / ``convert_file`` (``Conversion``, ``ConvertReport``);
- :mod:`.sweep`: ``heads_sweep`` (``HeadsSweep``);
- :mod:`.verify`: ``verify_files`` (``VerifyReport``);
- :mod:`.export`: ``export_file``, ``export_checkpoint`` (a model in memory), with ``ExportOptions``
  (``ExportReport``);
- :mod:`.inspection`: ``inspect_file`` (``Inspection``);
- :mod:`.on_data`: ``evaluate_checkpoint`` (``EvalReport``), ``attention_on_data``
  (``AttentionReport``), ``calibration_from_data`` (``Calibration``): the ones that read a dataset.

Bad input raises :class:`~convit_convert.errors.CmhsaError` before anything is written; a check
that fails is a report with ``passed`` False. Importing this package imports torch, not the data
stack: :mod:`.on_data` (torchvision, timm's transforms on use) is imported by name.
"""

from __future__ import annotations

from .common import as_float32, load_checkpoint, resolve_device
from .convert import Conversion, ConvertReport, convert_checkpoint, convert_file, converted_model
from .export import ExportOptions, ExportReport, export_checkpoint, export_file
from .inspection import Inspection, inspect_file
from .sweep import HeadsSweep, SweepRow, heads_sweep
from .verify import VerifyReport, verify_files

__all__ = [
    "Conversion",
    "ConvertReport",
    "ExportOptions",
    "ExportReport",
    "HeadsSweep",
    "Inspection",
    "SweepRow",
    "VerifyReport",
    "as_float32",
    "convert_checkpoint",
    "convert_file",
    "converted_model",
    "export_checkpoint",
    "export_file",
    "heads_sweep",
    "inspect_file",
    "load_checkpoint",
    "resolve_device",
    "verify_files",
]
