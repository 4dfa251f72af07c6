"""Two-phase training (the paper's Section 4), installed as ``convit_convert.train``:

- `config.py`: ``TrainConfig``, built from the flat flags;
- `run.py`: a run, built (data, model, recipe, resumed state), looped over epochs, its model written;
- `phases.py`: the model each phase trains; `recipe.py`: timm's optimizer, scheduler, Mixup, loss;
- `augment.py`: timm's training augmentation on the device; `held.py`: datasets held on the device;
- `step.py`: one training step; `epoch.py`: the steps of an epoch and its read-outs;
- `state.py`: what a checkpoint holds; `distributed.py`: torchrun's processes, or one;
- `progress.py`: a run's progress as events; `arms.py`: an experiment's runs in parallel;
- `plot.py`: ``cmhsa plot``'s curves and ``cmhsa attention``'s heat maps.

The data sources are :mod:`convit_convert.data`'s (evaluation: :mod:`convit_convert.api.on_data`).

One step, in reading order (the loop nanoGPT's train.py holds, here in two files):

1. ``epoch.train_one_epoch``: a batch, ``loop.step(inputs, y)``, the EMA, the scheduler, and a
   read-out of the loss every ``--log-every`` steps (the only time the host waits for the device);
2. ``step.TrainStep.__call__``: the batch to the device and augmented there (the device loader's
   ``prepare``: ``held.HeldLoader``, then ``augment.py``), Mixup/CutMix;
3. ``step.TrainStep._learn``: forward under autocast, the loss, its gradients, the loss tally;
4. ``step.TrainStep.update``: gradient clipping and the optimizer's step, skipped on the device
   after a non-finite loss.

``run.build`` makes those objects once: ``run.data_and_model``, ``recipe.build_recipe`` (timm's
optimizer, scheduler, Mixup, loss), ``state.RunState`` (``run.resume_state`` when resuming),
``step.TrainStep``."""
