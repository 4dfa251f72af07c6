"""The options several commands share, declared once (one spelling, one default, one help text per
concept, as huggingface_hub's CLI shares its option aliases), the old spellings kept as hidden
aliases, and :func:`plain_help`, which makes every command's ``--help`` show each default once,
no type metavars, every numeric option's range (options.values.BOUNDS), and arguments named as the README
names them (``INPUT``, not ``{input}``)."""

from __future__ import annotations

import weakref
from typing import Annotated, Any, Optional

import typer

from ..errors import CmhsaError
from ..notices import notice
from ..options.values import BOUNDS, DATASET_NOTES, DATASETS, MAX_DEFAULT_WORKERS

DEVICE_HELP = "Where to run: auto (CUDA when there is one), cpu, cuda or cuda:N."
WORKERS_HELP = (
    f"Data-loading worker processes (workers loader) \\[default: min({MAX_DEFAULT_WORKERS}, CPUs)]."
)
THREADS_HELP = (
    "torch CPU threads (results depend on it on a CPU) \\[default: OMP_NUM_THREADS where set, else the CPUs "
    "this process may use that no other work at its priority keeps busy]."
)
DATA_HELP = (
    "Dataset: " + ", ".join(f"{d} ({DATASET_NOTES[d]})" if d in DATASET_NOTES else d for d in DATASETS) + "."
)


# The conversion's choices (ConversionSpec's fields), each help text written once: `cmhsa convert`
# declares them through the aliases below, `cmhsa train phase2` reads the same texts (its Flag rows)
CONVERSION_HELP = {
    "heads": "Attention heads (default: as many as the kernel's offsets, Theorem 1); extra heads are "
    "free, trainable heads that start with zero output weights.",
    "qk_dim": "Per-head query/key width (default: embed_dim, the paper's); exactness does not depend on it.",
    "sink": "A sink per head, so border patches are exact; --no-sink: the paper's construction "
    "(inexact at the border).",
    "pinning": "hard: the exact construction, attention fixed by a saturated bias; gated: each head also "
    "gets content attention behind a gate that starts at 0 (still exact).",
    "qk_init_std": "Std of a small random W_Q, W_K at conversion (0: the paper's zeros, where their "
    "gradients vanish); still exact.",
    "margin": "Logit margin: each pinned head attends to its patch to within e^-margin (the paper's "
    "M = 40); smaller is softer and less exact.",
    "tol": "Largest relative error the conversion's verification accepts (and, for ONNX input, the "
    "import check).",
}
Heads = Annotated[Optional[int], typer.Option(help=CONVERSION_HELP["heads"])]  # noqa: UP045
QkDim = Annotated[Optional[int], typer.Option(help=CONVERSION_HELP["qk_dim"])]  # noqa: UP045
Sink = Annotated[bool, typer.Option("--sink/--no-sink", help=CONVERSION_HELP["sink"])]
Pinning = Annotated[str, typer.Option(help=CONVERSION_HELP["pinning"])]
QkInitStd = Annotated[float, typer.Option(help=CONVERSION_HELP["qk_init_std"])]
Margin = Annotated[float, typer.Option(help=CONVERSION_HELP["margin"])]
Tol = Annotated[float, typer.Option(help=CONVERSION_HELP["tol"])]
# How a bare state dict is read (Geometry's fields): convert and inspect
BareImgSize = Annotated[Optional[str], typer.Option(help="Bare state dicts only: image size, H or HxW.")]  # noqa: UP045
BarePatchSize = Annotated[Optional[int], typer.Option(help="Bare state dicts only: patch size P.")]  # noqa: UP045
# A pass over a dataset (EvalOptions' and AttentionOptions' fields): eval and attention
BatchSize = Annotated[int, typer.Option(help="Batch size.")]
SyntheticSeed = Annotated[int, typer.Option(help="Seed of --data synthetic.")]
# A numerical check's (Verification's fields), for convert's and verify's checks alike
VerifyDtype = Annotated[str, typer.Option(help="The check's dtype: float32 or float64.")]
VerifyBatch = Annotated[int, typer.Option(help="Random images per check.")]


def output_option(help: str) -> Any:
    """-o/--output: every path a command writes."""
    return typer.Option("--output", "-o", readable=False, help=help, show_default=False)


def device_option() -> Any:
    return typer.Option("--device", help=DEVICE_HELP)


def workers_option() -> Any:
    return typer.Option("--workers", help=WORKERS_HELP, show_default=False)


def threads_option() -> Any:
    return typer.Option("--threads", help=THREADS_HELP, show_default=False)


def data_option() -> Any:
    """--data with no default, for a command that reads a dataset: marked required, as typer marks
    a required option (the library's own error names it when it is missing)."""
    return typer.Option("--data", help=f"{DATA_HELP} \\[required]", show_default=False)


DATA_DIR_HELP = (
    "Folder of the dataset: cifar10/cifar100 (torchvision's), imagefolder (train/ and val/), "
    "fashion-mnist (default: Debian's /usr/share/datasets/fashion-mnist)."
)


def data_dir_option(help: str = DATA_DIR_HELP) -> Any:
    return typer.Option("--data-dir", help=help)


def calibration_options(needs: str) -> dict[str, Any]:
    """--calib, --data-dir, --calib-images, --heldout-images: an approximate conversion's images
    (convert --approximate, heads --checkpoint), each help text saying which flag ``needs`` them."""
    return {
        "calib": typer.Option(
            "--calib",
            help=f"{needs}: calibration data, as train's --data ({', '.join(DATASETS)}); "
            "default: N(0, 1) noise images.",
        ),
        "data_dir": data_dir_option("--calib: the dataset's folder, as train's --data-dir."),
        "calib_images": typer.Option(
            "--calib-images", help=f"{needs}: calibration images (from the training split)."
        ),
        "heldout_images": typer.Option(
            "--heldout-images",
            help=f"{needs}: held-out images the errors are measured on (the validation split, "
            "with its labels).",
        ),
    }


def alias_option(old: str, new: str) -> Any:
    """A hidden old spelling of ``new``, kept for one release (README, "Command line")."""
    return typer.Option(old, hidden=True, help=f"Old spelling of {new}.", show_default=False)


def use_alias(value: Any, old_value: Any, old: str, new: str) -> Any:
    """The value of an option typed under its new or its old spelling; one line on stderr for the old."""
    if old_value is None:
        return value
    if value is not None and value != old_value:
        raise CmhsaError(f"{old} and {new} are one option (the old and the new spelling); give it once")
    notice(f"{old} is now {new}; the old spelling goes in the next release")
    return old_value


def missing_data(command: str) -> str:
    return f"--data is missing: {command} needs a dataset, one of {', '.join(DATASETS)}"


TIDIED: weakref.WeakSet[Any] = weakref.WeakSet()  # commands plain_help has done (kept here, not on them)


def plain_help(command: Any) -> None:
    """Every option and argument of ``command`` (a built click command or group, and everything under
    it) tidied for ``--help``, once: no type metavar (``<int>``), arguments shown by name in
    capitals, and no default shown by typer where the help already states one or the default is None."""
    if command in TIDIED:
        return
    TIDIED.add(command)
    # the command's own context class (click's Context, wherever this typer keeps click): no import
    # of click or of typer's private modules
    for param in command.get_params(command.context_class(command)):  # the --help option included
        is_argument = param.param_type_name == "argument"
        if param.metavar is None:
            param.metavar = param.name.upper() if is_argument else ""
        if is_argument:  # typer 0.29 writes a required one as {NAME} and adds its type; the README's form
            name = param.metavar + ("..." if param.nargs != 1 else "")
            # overridden only where this typer has them (the first is click's private method): a
            # typer without them shows its own form of the usage line, and works
            if callable(getattr(param, "_usage_display_name", None)):
                param._usage_display_name = lambda n=name: n
            if callable(getattr(param, "display_type_rich", None)):
                param.display_type_rich = lambda ctx: None
        if param.default is None or "default" in (getattr(param, "help", None) or "").lower():
            param.show_default = False
        bound = BOUNDS.get(param.name or "")
        if bound is not None and not is_argument and "[range:" not in (param.help or ""):
            param.help = f"{param.help or ''} \\[range: {bound.text()}]".strip()
    for sub in getattr(command, "commands", {}).values():
        plain_help(sub)
