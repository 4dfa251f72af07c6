"""``cmhsa train phase1|phase2``: a thin command over :mod:`convit_convert.train`.

Imports typer only: torch, timm and torchvision load when a command runs, so ``cmhsa --help``
stays fast. The training flags are one table (OPTION_ROWS) shared by both phases; each becomes a
``--kebab-case`` option whose default is TrainConfig's; the typed flags become one TrainConfig
(``TrainConfig.from_flags``). A flag left out stays "not given", which
lets phase 2 take the architecture from its ``--init`` checkpoint and complain only about flags
that were typed and disagree.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Annotated, Any, NamedTuple, Optional

import typer

from ..errors import CmhsaError
from ..options.training import DEFAULT_RULES, PEAK_LR, PRESETS, WARMUP_FRACTION, ModelFlags, TrainConfig
from ..text import json_text
from .common import EXIT_FAIL, console, path_opt
from .options import (
    CONVERSION_HELP,
    DATA_DIR_HELP,
    DATA_HELP,
    DEVICE_HELP,
    WORKERS_HELP,
    alias_option,
    output_option,
    use_alias,
)

MODEL = "Model"
PHASE2 = "Phase 2"
RECIPE = "Recipe (DeiT's, as the paper)"
RUN = "Running"


class Flag(NamedTuple):
    """One option of `cmhsa train phase1/phase2`: its TrainConfig field (the default comes from
    there; the range from options.values.BOUNDS), type, --help panel and text, and the phases that take it."""

    name: str
    type: Any
    panel: str
    help: str
    phases: tuple[str, ...] = ("phase1", "phase2")


def preset_help() -> str:
    """--preset's help, written from the presets themselves (options/training.py's PRESETS)."""

    def flags(values: dict[str, Any]) -> str:
        shown = {k: " ".join(map(str, v)) if isinstance(v, tuple) else v for k, v in values.items()}
        return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in shown.items())

    model = {k: getattr(ModelFlags, k) for k in PRESETS["cpu"] if hasattr(ModelFlags, k)}
    scratch, from_checkpoint = PEAK_LR["cpu"]
    return (
        f"The value of every flag not given. paper: the paper's model and recipe ({flags(model)}, "
        f"DeiT's augmentation). cpu: the EXPERIMENTS.md model and recipe, sized for a few CPU cores: "
        f"{flags(PRESETS['cpu'])}, --warmup-epochs {WARMUP_FRACTION['cpu']:g} x --epochs, --lr "
        f"{scratch:g} ({from_checkpoint:g} from a checkpoint)."
    )


OPTION_ROWS: list[Flag] = [
    Flag("data", str, "Data", DATA_HELP),
    Flag("data_dir", str, "Data", DATA_DIR_HELP),
    Flag(
        "download", bool, "Data", "Let torchvision download CIFAR into --data-dir (never without this flag)."
    ),
    Flag("num_classes", int, "Data", "Classes of --data synthetic."),
    Flag(
        "train_samples",
        int,
        "Data",
        "Train on a fixed, seeded subset of this many training images (short runs).",
    ),
    Flag(
        "val_samples",
        int,
        "Data",
        "Evaluate each epoch on the first this many validation images (the same "
        "for every seed; default: all).",
    ),
    Flag(
        "holdout",
        int,
        "Data",
        "Evaluate each epoch on this many training-split images left out of "
        "--train-samples' subset, instead of the validation split: tune on them "
        "and the validation images stay unseen.",
    ),
    Flag(
        "loader",
        str,
        "Data",
        "device: the data held as one tensor on the training device, augmented "
        "per batch there (train/held.py); workers: timm's per-image transforms "
        "in worker processes (any dataset, any timm augmentation); auto: device "
        "when the data fits (2 GiB decoded, one image size) and the augmentation "
        "is one it runs.",
    ),
    Flag("preset", str, MODEL, preset_help()),
    Flag("img_size", int, MODEL, "Image size (the data is resized to it)."),
    Flag(
        "in_chans",
        int,
        MODEL,
        "Image channels: 3 (RGB) or 1 (grayscale); every image is converted to it. With --init the "
        "checkpoint decides (default: its channels; another value is refused).",
    ),
    Flag("patch_size", int, MODEL, "Patch size P."),
    Flag(
        "hidden_chans",
        int,
        MODEL,
        "Channels of the pixel view of a token; embed_dim = P² · hidden_chans. 3 = identity patch embedding.",
    ),
    Flag("depth", int, MODEL, "Blocks."),
    Flag("mlp_ratio", float, MODEL, "MLP width / embed_dim."),
    Flag("kernel_size", int, MODEL, "Phase-1 convolution K."),
    Flag("dilation", int, MODEL, "Phase-1 convolution dilation."),
    Flag("drop_path", float, MODEL, "Stochastic depth rate."),
    Flag(
        "init",
        str,
        MODEL,
        "A checkpoint to start from: a conv checkpoint (.safetensors) or a timm folder cmhsa wrote of "
        "one; a fresh run from its weights (a new optimizer and schedule, warm-up included); the model "
        "is the checkpoint's, and data with another number of classes gets a new head (fine-tuning). "
        "{seed} stands for each seed of --seeds. Or 'random'.",
        phases=("phase1",),
    ),
    Flag(
        "init",
        str,
        PHASE2,
        "Conv-phase checkpoint (converted exactly, verified), attention "
        "checkpoint, a timm folder cmhsa wrote of either (data with another number of classes gets a "
        "new head: fine-tuning), 'random', or a start without a conv phase: 'mimetic' "
        "(W_Q·W_Kᵀ ≈ αI, W_V·W_O ≈ −βI, Trockman & Kolter) or 'impulse' (each "
        "head pinned to one offset of the K×K window, gated, all else random; "
        "Zheng et al.).",
        phases=("phase2",),
    ),
    Flag(
        "mimetic_alpha",
        float,
        PHASE2,
        "--init mimetic: W_Q,hᵀ·W_K,h = α(Z + I) per head (the published α₁ = β₁).",
        phases=("phase2",),
    ),
    Flag(
        "mimetic_beta",
        float,
        PHASE2,
        "--init mimetic: Σ_h W_V,hᵀ·W_O,hᵀ = β(Z − I) (the published α₂ = β₂).",
        phases=("phase2",),
    ),
    Flag(
        "impulse_offsets",
        str,
        PHASE2,
        "--init impulse: conversion (head r pinned to the conversion's r-th "
        "offset) or random (each head an offset drawn from the window).",
        phases=("phase2",),
    ),
    Flag("heads", int, PHASE2, CONVERSION_HELP["heads"], phases=("phase2",)),
    Flag("qk_dim", int, PHASE2, CONVERSION_HELP["qk_dim"], phases=("phase2",)),
    Flag("sink", bool, PHASE2, CONVERSION_HELP["sink"], phases=("phase2",)),
    Flag("pinning", str, PHASE2, CONVERSION_HELP["pinning"], phases=("phase2",)),
    Flag(
        "freeze_attention",
        bool,
        PHASE2,
        "Ablation: keep W_Q, W_K, the biases, sinks and gates as converted (W_V, "
        "W_O and the MLPs still train).",
        phases=("phase2",),
    ),
    Flag(
        "attn_lr_mult",
        float,
        PHASE2,
        "Learning-rate multiplier for W_Q, W_K, the gates and the relative-position biases.",
        phases=("phase2",),
    ),
    Flag("qk_init_std", float, PHASE2, CONVERSION_HELP["qk_init_std"], phases=("phase2",)),
    Flag("margin", float, PHASE2, CONVERSION_HELP["margin"], phases=("phase2",)),
    Flag("verify_tol", float, PHASE2, CONVERSION_HELP["tol"], phases=("phase2",)),
    Flag("epochs", int, RECIPE, "Epochs."),
    Flag("batch_size", int, RECIPE, "Batch per process (a micro-batch with --grad-accum-steps)."),
    Flag(
        "grad_accum_steps",
        int,
        RECIPE,
        "Micro-batches of --batch-size per optimizer update (timm's name): each update sees N x "
        "--batch-size images, the learning rate scaled for that batch; progress and metrics count updates.",
    ),
    Flag(
        "lr",
        float,
        RECIPE,
        "Peak learning rate at a global batch of --lr-base-batch (scaled linearly, as DeiT).",
    ),
    Flag("lr_base_batch", int, RECIPE, "Global batch at which --lr applies."),
    Flag("min_lr", float, RECIPE, "Final cosine learning rate (scaled like --lr)."),
    Flag("warmup_lr", float, RECIPE, "Learning rate at the start of warm-up (scaled like --lr)."),
    Flag("warmup_epochs", int, RECIPE, "Linear warm-up epochs (0: none, Section 4.3)."),
    Flag("sched", str, RECIPE, "timm scheduler name."),
    Flag("weight_decay", float, RECIPE, "AdamW weight decay."),
    Flag("opt", str, RECIPE, "timm optimizer name."),
    Flag("opt_eps", float, RECIPE, "Optimizer epsilon."),
    Flag("opt_betas", tuple[float, float], RECIPE, "Optimizer betas."),
    Flag("clip_grad", float, RECIPE, "Clip the gradient norm to this (default: no clipping)."),
    Flag("aa", str, RECIPE, "timm auto-augment policy ('none' to disable)."),
    Flag("color_jitter", float, RECIPE, "Colour jitter (unused while auto-augment is on, as in timm)."),
    Flag("reprob", float, RECIPE, "Random erasing probability."),
    Flag("remode", str, RECIPE, "Random erasing mode."),
    Flag("interpolation", str, RECIPE, "Resize interpolation."),
    Flag("scale", tuple[float, float], RECIPE, "Random-resized-crop area range."),
    Flag("hflip", float, RECIPE, "Horizontal flip probability (0 for digits and text)."),
    Flag("crop_pct", float, RECIPE, "Eval centre-crop fraction."),
    Flag("mixup", float, RECIPE, "Mixup alpha (0 with --cutmix 0: off)."),
    Flag("cutmix", float, RECIPE, "CutMix alpha."),
    Flag("mixup_prob", float, RECIPE, "Probability of mixing a batch."),
    Flag("mixup_switch_prob", float, RECIPE, "Probability of CutMix instead of Mixup."),
    Flag("smoothing", float, RECIPE, "Label smoothing."),
    Flag("model_ema", bool, RECIPE, "Keep an EMA of the weights (evaluated and saved as *-ema.safetensors)."),
    Flag("model_ema_decay", float, RECIPE, "EMA decay."),
    Flag("seed", int, RUN, "Seed of everything random."),
    Flag(
        "seeds",
        str,
        RUN,
        "Several seeds of this run, comma-separated (0,1,2), trained together in one process (how: "
        "--seeds-step), each in -o/--output/seedN as its own --seed N run would be; {seed} in a "
        "checkpoint --init stands for each seed (docs/training.md: Several seeds in one process).",
    ),
    Flag(
        "seeds_step",
        str,
        RUN,
        "How --seeds steps its seeds: batched (every seed's step one batched computation), "
        "interleaved (each seed's own step in turn, its separate run's kernels), auto: batched on "
        "CUDA for 2 seeds or more, else interleaved (BENCHMARKS.md: Several seeds in one process).",
    ),
    Flag("device", str, RUN, DEVICE_HELP),
    Flag("amp", str, RUN, "auto (bf16 on CUDA, none on CPU), bf16, fp16 or none."),
    Flag(
        "compile",
        bool,
        RUN,
        "torch.compile the training step up to the update (CUDA graphs on a "
        "GPU); the model's forward only under torchrun or fp16.",
    ),
    Flag(
        "conv_form",
        str,
        RUN,
        "How the phase-1 convolution is computed, the same function either way: "
        "tokens (Theorem 1's products: two tensor-core products per block), pixels "
        "(F.conv2d on the pixel view), auto: tokens on CUDA, pixels on the CPU "
        "(the faster on each, BENCHMARKS.md).",
        ("phase1",),
    ),
    Flag(
        "deterministic",
        bool,
        RUN,
        "Deterministic CUDA kernels: bit-identical re-runs and resumes on a GPU, "
        "somewhat slower; a resume in another environment (threads, CPU code "
        "path, versions) is refused. CPU runs repeat bit for bit at the same "
        "threads and CPU code path (docs/training.md: When two runs are bit-identical).",
    ),
    Flag("workers", int, RUN, WORKERS_HELP),
    Flag(
        "threads",
        int,
        RUN,
        "torch CPU threads per process; CPU results depend on it (docs/training.md: When two runs are "
        "bit-identical). At most 4 per CPU of this machine: more only wait on each other.",
    ),
    Flag(
        "resume",
        bool,
        RUN,
        "Continue the run in -o/--output from checkpoint-last.pt (a larger "
        "--epochs extends it; a new --lr restarts the schedule from there).",
    ),
    Flag(
        "overwrite",
        bool,
        RUN,
        "Start a new run in an -o/--output folder that holds another run's "
        "outputs (its model, metrics, config and checkpoints are removed once "
        "the new run has saved its first checkpoint; never the --init file); "
        "without it such a folder is refused.",
    ),
    Flag("keep", int, RUN, "Also keep the newest N end-of-epoch checkpoints."),
    Flag(
        "log_every",
        int,
        RUN,
        "Steps between read-outs of the loss from the device (log lines, stop requests under "
        "torchrun); a log also gets a line, and the bar its loss, every 10 s of wall time between "
        "them (one device read), and the bar moves with every step.",
    ),
    Flag(
        "eval_every",
        int,
        RUN,
        "Evaluate every N epochs and at the last (metrics.csv leaves the validation columns of the "
        "others empty): long runs of small models spend much of their time evaluating.",
    ),
    Flag(
        "report_to",
        str,
        RUN,
        "none, or tensorboard: TensorBoard event files in -o/--output's tensorboard/ (losses, learning "
        "rate, images/s, validation, each block's gates and attention distance, the config; pip "
        "install tensorboard, or cmhsa's `tensorboard` extra). `tensorboard --logdir RUN` shows them.",
    ),
    Flag(
        "export_onnx",
        bool,
        RUN,
        "At the end, also write the model as ONNX (vit.onnx / conv.onnx), "
        "checked in onnxruntime as by cmhsa export.",
    ),
    Flag(
        "export_timm",
        bool,
        RUN,
        "At the end, also write the model as timm's pretrained folder timm/ "
        "(model.safetensors, config.json and the model card README.md, for "
        "timm.create_model('local-dir:DIR') and the Hugging Face Hub), checked "
        "by loading it with timm as by cmhsa export --format timm.",
    ),
]


def _option(name: str, typ: Any, help_text: str, panel: str, default: Any) -> inspect.Parameter:
    flag = "--" + name.replace("_", "-")
    decls = [f"{flag}/--no-{name.replace('_', '-')}"] if typ is bool else [flag]
    shown = DEFAULT_RULES.get(name, default)
    if isinstance(shown, tuple):
        shown = " ".join(map(str, shown))
    elif typ is bool:  # as typer shows a flag pair's default everywhere else: sink, no-download
        shown = name.replace("_", "-") if shown else f"no-{name.replace('_', '-')}"
    if shown is not None and "default" not in help_text.lower():  # each default said once
        help_text = f"{help_text} \\[default: {shown}]"
    info = typer.Option(*decls, help=help_text, show_default=False, rich_help_panel=panel)
    return inspect.Parameter(
        name,
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[Optional[typ], info],  # noqa: UP045 (typer needs the Optional form at runtime here)
    )


def _train_command(phase: str) -> Any:
    defaults = TrainConfig.from_flags(phase=phase).to_dict()

    def command(**kwargs: Any) -> None:
        out = use_alias(kwargs.pop("output"), kwargs.pop("out"), "--out", "-o/--output")
        config_file, print_config = kwargs.pop("config"), kwargs.pop("print_config")
        if out is None and not print_config:
            raise CmhsaError("-o/--output is missing: give the run folder to write (created)")
        given = {k: v for k, v in kwargs.items() if v is not None}
        if "seeds" in given:
            given["seeds"] = seed_list(given["seeds"])
        flags, on_purpose = given, frozenset(given)
        if config_file is not None:  # the file's flags, then the ones typed beside it
            from_file, said = read_run_config(config_file, phase)
            flags, on_purpose = {**from_file, **given}, said | on_purpose
        cfg = TrainConfig.from_flags(phase=phase, out=str(out or "-"), given=on_purpose, **flags)
        if print_config:
            console.print(
                config_text(cfg, config_file), markup=False, highlight=False, soft_wrap=True, end=""
            )
            return
        _run_training(cfg)

    output = inspect.Parameter(
        "output",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[Optional[Path], output_option("Run folder to write (created). \\[required]")],  # noqa: UP045
    )
    old_out = inspect.Parameter(
        "out",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[Optional[Path], alias_option("--out", "-o/--output")],  # noqa: UP045
    )
    from_file = inspect.Parameter(
        "config",
        inspect.Parameter.KEYWORD_ONLY,
        default=None,
        annotation=Annotated[Optional[Path], path_opt(CONFIG_HELP, "--config")],  # noqa: UP045
    )
    printed = inspect.Parameter(
        "print_config",
        inspect.Parameter.KEYWORD_ONLY,
        default=False,
        annotation=Annotated[bool, typer.Option("--print-config", help=PRINT_CONFIG_HELP)],
    )
    params = [output, old_out, from_file, printed] + [
        _option(name, typ, help_text, panel, defaults[name])
        for name, typ, panel, help_text, phases in OPTION_ROWS
        if phase in phases
    ]
    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__name__ = phase
    command.__doc__ = {
        "phase1": "Phase 1: train the convolutional ViT (each block's attention replaced by a KxK conv), "
        "from random weights or a conv checkpoint (--init).",
        "phase2": "Phase 2: train the attention ViT, from a phase-1 checkpoint converted "
        "exactly (--init conv.safetensors, "
        "the paper's) or without one (--init impulse, the default; mimetic; random).",
    }[phase]
    return command


CONFIG_HELP = (
    "Flags from a file: a run's config.json (cmhsa train repeats that run), or a JSON or YAML file of "
    "flags by their names (lr: 7e-4); a flag typed beside it wins. -o/--output, --resume and "
    "--overwrite come from the command line, never the file, and what a run records of itself "
    "(environments, model, classes, best, ...) is ignored; any other key is refused."
)
PRINT_CONFIG_HELP = (
    "Print the resolved flags (the file's and the typed ones merged) in the file's format (JSON, or "
    "YAML for a .yaml/.yml --config) and exit: a file to edit and give to --config."
)
CONFIG_SUFFIXES = (".yaml", ".yml")
MAX_CONFIG_BYTES = 2**20


def read_run_config(path: Path, phase: str) -> tuple[dict[str, Any], frozenset[str]]:
    """--config's flags and those it gave on purpose (options.training.flags_from_file)."""
    from ..io.paths import parse_json, parse_yaml, read_text
    from ..options.training import flags_from_file

    text = read_text(path, MAX_CONFIG_BYTES, "config file")
    doc = (
        parse_yaml(text, path, "--config")
        if path.suffix.lower() in CONFIG_SUFFIXES
        else parse_json(text, path, "--config")
    )
    return flags_from_file(doc, phase, path)


def config_text(cfg: TrainConfig, like: Path | None) -> str:
    """The run's flags as --config reads them, in ``like``'s format (YAML for .yaml/.yml, else
    JSON): what the run would record in config.json, less this invocation's own."""
    from ..options.training import INVOCATION_FLAGS
    from ..text import yaml_text

    flags = {k: v for k, v in cfg.to_dict().items() if k not in INVOCATION_FLAGS}
    yaml = like is not None and like.suffix.lower() in CONFIG_SUFFIXES
    return yaml_text(flags) if yaml else json_text(flags) + "\n"


SEED_DIGITS = len(str(2**32 - 1))  # a seed's longest spelling: SEED's upper bound


def seed_list(text: str) -> tuple[int, ...]:
    """--seeds 0,1,2 as (0, 1, 2); anything else is refused naming the flag (the digits counted
    before any is read as a number: Python refuses to convert 4,300 of them)."""
    parts = [p.strip() for p in text.split(",")]
    shown = text if len(text) <= 40 else text[:37] + "..."
    if not all(p.isascii() and p.isdigit() for p in parts):
        raise CmhsaError(f"`seeds` must be integers separated by commas (0,1,2), got {shown!r}")
    if any(len(p.lstrip("0")) > SEED_DIGITS for p in parts):
        raise CmhsaError(f"`seeds` must each be 0 ≤ x ≤ {2**32 - 1}, got {shown!r}")
    return tuple(int(p) for p in parts)


def _run_training(cfg: TrainConfig) -> None:
    """Bad input exits 2 and a run that cannot go on exits 1 (cli/boundary.py renders both)."""
    from .progress import run_progress

    if cfg.runtime.seeds:  # several seeds stacked in one process: a result per seed
        from ..train.stacked import run_seeds

        results = run_seeds(cfg, progress=run_progress(console))
    else:
        from ..train.run import run

        results = [run(cfg, progress=run_progress(console))]
    stopped = next((r.stopped for r in results if r.stopped in ("SIGINT", "SIGTERM")), None)
    if stopped is not None:
        import signal

        raise typer.Exit(128 + int(getattr(signal, stopped)))
    from .export import print_export, print_timm_folder

    for result in results:
        if result.export is not None:  # --export-onnx, on rank 0 of a finished run
            print_export(result.export)
        if result.timm is not None:  # --export-timm, likewise
            print_timm_folder(result.timm)
    if any(r is not None and not r.passed for res in results for r in (res.export, res.timm)):
        raise typer.Exit(EXIT_FAIL)


train_app = typer.Typer(
    help="Two-phase training (the paper's Section 4): phase1 trains the conv ViT, phase2 the attention ViT.",
    no_args_is_help=True,
)
for _phase in ("phase1", "phase2"):
    train_app.command(_phase)(_train_command(_phase))


app = typer.Typer()
app.add_typer(train_app, name="train")
