"""Two-phase training (the paper's Section 4), installed as ``convit_convert.train``:

- the flags: ``TrainConfig`` (:mod:`convit_convert.options.training`), built from the flat flags;
- `run.py`: a run, looped over epochs, its model written; `build.py`: a run built from its config
  (data, model, recipe, resumed state); `run_folder.py`: the run's held folder and the names it
  checks; `names.py`: the names of what a run writes, free of torch;
- `stacked.py`: ``--seeds``, several seeds of one run in one process, stepped batched or in turn;
- `phases.py`: the model each phase trains; `recipe.py`: timm's optimizer, scheduler, Mixup, loss;
- `augment.py`: timm's training augmentation on the device; `held.py`: datasets held on the device;
- `mixing.py`: timm's Mixup/CutMix for a stack of seeds, each seed's draws applied to all at once;
- `loop.py`: the training loop, from a batch to the optimizer's update, and each epoch's
  evaluation; `step.py`: what its step leans on (the device-side tally and skip, the compiled form);
- `state.py`: what a checkpoint holds; `distributed.py`: torchrun's processes, or one;
- `progress.py`: a run's progress, its numbers computed once and its events written by a display;
  `profiling.py`: what counts a step's work; `arms.py`: an experiment's runs in parallel;
- `plot.py`: ``cmhsa plot``'s curves and ``cmhsa attention``'s heat maps; `tensorboard.py`:
  ``--report-to tensorboard``'s event files.

The data sources are :mod:`convit_convert.data`'s (evaluation: :mod:`convit_convert.api.on_data`).

One step, in reading order (the loop nanoGPT's train.py holds, here in one function):

1. ``loop.train_one_epoch``: a batch from the loader (``loop.until_stopped``), one step, and a
   read-out every ``--log-every`` steps (``loop.read_out``: the only time the host waits for the
   device), then the epoch's evaluation (``loop.epoch_metrics``); it drives a ``loop.Stepper``, the
   run's ``Loop`` or ``--seeds``' ``stacked.Stack`` or ``stacked.Interleaved``, and
   ``run.train_epochs`` calls it until the last epoch;
2. ``loop.train_one_step``: the batch to the device and augmented there (the device loader's
   ``prepare``: ``held.HeldLoader``, then ``augment.py``), Mixup/CutMix, forward under autocast,
   the loss, ``step.Tally.add``, backward, clipping, ``step.update`` (the optimizer's step,
   skipped on the device after a non-finite loss), zero_grad, the EMA and the scheduler;
3. with ``--compile``, ``step.CompiledStep.__call__`` computes the middle (augmentation to
   gradients) as one graph.

``build.build`` makes those objects once, each passed by keyword into a ``loop.Loop``:
``build.data_and_model``, ``recipe.build_recipe`` (timm's optimizer, scheduler, Mixup, loss),
``state.RunState`` (``build.resume_state`` when resuming), ``step.CompiledStep``."""
