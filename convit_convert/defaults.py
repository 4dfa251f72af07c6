"""Names and values several layers read, defined once (no torch): the datasets cmhsa reads and the
evaluation transform (timm's: resize the shorter side to size / crop_pct, centre crop)."""

DATASETS = ("cifar100", "cifar10", "imagefolder", "digits", "fashion-mnist", "synthetic")
DATASET_NOTES = {  # what --help says beside a dataset's name
    "imagefolder": "DIR/train, DIR/val",
    "digits": "scikit-learn's",
    "fashion-mnist": "Debian's dataset-fashion-mnist",
}
MAX_DEFAULT_WORKERS = 4  # data.default_workers: at most this many, and never more than the CPUs
EVAL_INTERPOLATION = "bicubic"  # the resize of `cmhsa eval`, of training's evaluation, of the exports
EVAL_CROP_PCT = 0.875  # timm's default crop: a 224 px crop of a 256 px resize
CONV_FORMS = ("auto", "pixels", "tokens")  # how phase 1's convolution computes (conv_mixer.py)
IMPULSE_OFFSETS = ("conversion", "random")  # --init impulse: the offsets its heads are pinned to (starts.py)
