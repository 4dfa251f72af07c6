"""Everything a user chooses, as frozen objects checked when made (no torch):

- `values.py`: what each value may be: the range of every number (``BOUNDS``), the names and
  defaults several layers read (datasets, evaluation transform, forms, devices, tolerance);
- `checked.py`: ``Checked``, the base of every option object (type, range and choices of each
  field checked on construction);
- `conversion.py`: ``ConversionSpec`` (what a conversion chooses) and ``ConversionPlan`` (a spec
  applied to a conv config);
- `operations.py`: what every other operation takes (``Geometry``, ``Verification``,
  ``VerifyOptions``, ``CalibrationSource``, ``HeadsQuery``, ``EvalOptions``, ``AttentionOptions``,
  ``PredictOptions``, ``ExportOptions``);
- `training.py`: ``TrainConfig``, a training run's flags in groups.

A model's own shape is :mod:`convit_convert.config`; the command line declares these objects'
fields as flags in :mod:`convit_convert.cli.options`.
"""
