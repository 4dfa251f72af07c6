"""Two-phase training (the paper's Section 4), installed as ``convit_convert.train``: config (flags),
data, phases (the model each phase trains), recipe (timm's), state (what a checkpoint holds),
epoch (one epoch), run (build and loop), evaluate, progress, plot."""
