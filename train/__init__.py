"""Two-phase training (the paper's Section 4), installed as ``convit_convert.train``:

- `config.py`: ``TrainConfig``, built from the flat flags;
- `run.py`: a run, built (data, model, recipe, resumed state), looped over epochs, its model written;
- `phases.py`: the model each phase trains; `recipe.py`: timm's optimizer, scheduler, Mixup, loss;
- `augment.py`: timm's training augmentation on the device; `held.py`: datasets held on the device;
- `step.py`: one training step; `epoch.py`: the steps of an epoch and its read-outs;
- `state.py`: what a checkpoint holds; `distributed.py`: torchrun's processes, or one;
- `progress.py`: a run's progress as events; `arms.py`: an experiment's runs in parallel;
- `plot.py`: ``cmhsa plot``'s curves and ``cmhsa attention``'s heat maps.

The data sources are :mod:`convit_convert.data`'s (evaluation: :mod:`convit_convert.api.on_data`)."""
