"""A training run's configuration, in groups: the data, the model flags, phase 2's start, the
conversion (a :class:`ConversionSpec`), the recipe (the paper's, Appendix B, DeiT's, as defaults)
and how the run executes. Frozen; built from the flat flags once (:meth:`TrainConfig.from_flags`).

The model fields are the flags as given; the model actually trained (its :class:`ViTConfig`, which
may come from ``--init``) is resolved by :mod:`.phases` and saved beside this config, never written
back into it. Saved flat, one key per ``cmhsa train`` flag, as ``config.json`` in the run folder and
inside every ``checkpoint-last.pt``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import CmhsaError
from ..text import json_text
from .checked import Checked
from .conversion import ConversionSpec
from .values import (
    AMPS,
    CONV_FORMS,
    DATASETS,
    EVAL_CROP_PCT,
    EVAL_INTERPOLATION,
    IMPULSE_OFFSETS,
    REPORT_TO,
    SEEDS_STEPS,
)

LOADERS = ("auto", "device", "workers")
INIT_STARTS = ("mimetic", "impulse")  # phase-2 starts built without a checkpoint (convit_convert/starts.py)

# --preset: flag defaults in one word. "paper": the paper's model and recipe (the fields' defaults).
# "cpu": the model and recipe of EXPERIMENTS.md's tables, sized for 2 CPU cores (28 px, P 4, d 48,
# 2 blocks, K 5; no RandAugment, Mixup, CutMix or random erasing, which need far more epochs than
# a CPU gives), warm-up a tenth of --epochs. A flag given overrides its preset value.
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {},
    "cpu": dict(
        img_size=28,
        patch_size=4,
        hidden_chans=3,
        depth=2,
        mlp_ratio=4.0,
        kernel_size=5,
        drop_path=0.1,
        aa="none",
        mixup=0.0,
        cutmix=0.0,
        reprob=0.0,
        scale=(0.5, 1.0),
        hflip=0.5,
        smoothing=0.1,
        batch_size=64,
        lr_base_batch=64,
        workers=0,
    ),
}
WARMUP_FRACTION = {"cpu": 0.1}  # presets whose warm-up is a fraction of --epochs
# Default peak learning rates at lr_base_batch: (from scratch, phase 2 from a checkpoint). From
# scratch covers phase 1 and phase 2 from random, impulse or mimetic: starting from a checkpoint's
# trained weights is what takes the 10x lower rate. The paper's (Appendix B): 5e-4 and 5e-5 at 512;
# cpu: EXPERIMENTS.md's, 2e-3 and 2e-4 at 64 (the paper's 10:1).
PEAK_LR = {"paper": (5e-4, 5e-5), "cpu": (2e-3, 2e-4)}
CHECKPOINT_ATTN_LR_MULT = 10.0  # attn_lr_mult's default from a checkpoint (1 otherwise)


def _sci(x: float) -> str:
    """5e-4, not 0.0005: learning rates as people write them."""
    mantissa, exponent = f"{x:e}".split("e")
    return f"{float(mantissa):g}e{int(exponent)}"


# The flat flags spelled apart from their group's field: flag -> (group, field). A group's refusal
# names the flag (DataConfig.FLAG_OF; the conversion's in from_flags), so both read this one table.
_RENAMED = {"data": ("data", "name"), "data_dir": ("data", "dir"), "verify_tol": ("conversion", "tol")}


def flags_of(group: str) -> dict[str, str]:
    """The fields of ``group`` whose flag has another name: field -> flag."""
    return {attr: flag for flag, (g, attr) in _RENAMED.items() if g == group}


# The flags whose default is a rule, not a value: the rule in words, beside the code that applies it
# (from_flags, peak_lr, attn_lr_scale, loaders.default_threads); --help shows these
DEFAULT_RULES = {
    "lr": "{} from scratch (phase 1; phase 2 from random, impulse or mimetic), {} from a checkpoint "
    "(--init: phase 2's, the paper's, or phase 1 restarted); --preset cpu: {}, {}".format(
        *map(_sci, (*PEAK_LR["paper"], *PEAK_LR["cpu"]))
    ),
    "threads": "OMP_NUM_THREADS where set, else the CPUs this process may use",
    "pinning": "gated from a conv-phase --init and impulse, hard from random and mimetic",
    "attn_lr_mult": f"{CHECKPOINT_ATTN_LR_MULT:g} from a checkpoint, 1 otherwise",
    "seeds": "none: one run, of --seed",
}


@dataclass(frozen=True)
class DataConfig(Checked):
    """What the run trains and evaluates on."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"name": DATASETS, "loader": LOADERS}
    FLAG_OF: ClassVar[dict[str, str]] = flags_of("data")

    name: str = "cifar100"  # flag: data
    dir: str | None = None  # flag: data_dir
    download: bool = False
    num_classes: int = 10  # synthetic data only; the others know theirs
    train_samples: int | None = None  # a fixed, seeded subset of the training set (short runs)
    val_samples: int | None = None  # the first images of the validation set (cheaper per-epoch evaluation)
    # evaluate on this many training-split images outside train_samples' subset instead of the
    # validation split: for tuning, so the images a table reports stay unseen
    holdout: int | None = None
    # auto: the data held on the device and augmented per batch (train/held.py) when it fits, else
    # timm's per-image transforms in worker processes (convit_convert/data.py)
    loader: str = "auto"


@dataclass(frozen=True)
class ModelFlags(Checked):
    """The model as the flags describe it (the paper's CMHSA-5); phase 2 from a checkpoint takes the
    checkpoint's, and these must agree with it where typed."""

    img_size: int = 224
    in_chans: int = 3  # 3: RGB, 1: grayscale (images are converted to what the model takes)
    patch_size: int = 16
    hidden_chans: int = 3
    depth: int = 6
    mlp_ratio: float = 4.0
    kernel_size: int = 5
    dilation: int = 1
    drop_path: float = 0.1


@dataclass(frozen=True)
class StartConfig(Checked):
    """Where the weights come from. Phase 2: a conv checkpoint, an attn checkpoint, "random", or a
    start built without a checkpoint: "impulse" (the default: the best-measured start without a
    checkpoint, at the plateau and at 120 epochs, EXPERIMENTS.md "Which start?") or "mimetic".
    Phase 1: "random" (its default, set by :meth:`TrainConfig.from_flags`) or a conv checkpoint,
    a fresh run from its weights."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"impulse_offsets": IMPULSE_OFFSETS}

    init: str = "impulse"
    mimetic_alpha: float = 0.7  # init mimetic: W_Q,hᵀ W_K,h = α(Z + I); Trockman & Kolter's α₁ = β₁
    mimetic_beta: float = 0.4  # init mimetic: Σ_h W_V,hᵀ W_O,hᵀ = β(Z − I); their α₂ = β₂
    impulse_offsets: str = "conversion"  # init impulse: heads pinned to Δ in order, or "random" offsets in Δ


@dataclass(frozen=True)
class RecipeConfig(Checked):
    """Optimisation, augmentation and regularisation (DeiT / the paper). The names timm reads
    (``opt``, ``sched``, ``aa``, ``remode``, ``interpolation``) are checked against timm's own
    registries and parsers when a run starts (recipe.check_recipe), not here: no timm import."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"amp": AMPS}

    epochs: int = 200
    batch_size: int = 128  # per process
    grad_accum_steps: int = 1  # micro-batches of batch_size per optimizer update (timm's name)
    lr: float | None = None  # peak lr at a global batch of lr_base_batch; default: PEAK_LR
    lr_base_batch: int = 512  # DeiT: lr scales with global batch / 512
    min_lr: float = 1e-5
    warmup_lr: float = 1e-6
    warmup_epochs: int = 5
    sched: str = "cosine"
    weight_decay: float = 0.05
    opt: str = "adamw"
    opt_eps: float = 1e-8
    opt_betas: tuple[float, float] = (0.9, 0.999)
    clip_grad: float | None = None
    attn_lr_mult: float | None = (
        None  # lr multiplier of W_Q, W_K, gates, biases; default 10 from a checkpoint, else 1
    )
    freeze_attention: bool = False  # ablation: W_Q, W_K, biases, sinks and gates stay as converted
    aa: str = "rand-m9-mstd0.5-inc1"
    color_jitter: float = 0.3
    reprob: float = 0.25
    remode: str = "pixel"
    interpolation: str = EVAL_INTERPOLATION
    scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop's area range
    hflip: float = 0.5
    crop_pct: float = EVAL_CROP_PCT
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    smoothing: float = 0.1
    model_ema: bool = False
    model_ema_decay: float = 0.99996
    amp: str = "auto"  # auto = bf16 on CUDA, none on CPU

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scale[0] > self.scale[1]:
            raise CmhsaError(f"`scale` must be min <= max, got {self.scale[0]} {self.scale[1]}")


@dataclass(frozen=True)
class RuntimeConfig(Checked):
    """How the run executes, not what it computes: a resumed run may change any of these."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "conv_form": CONV_FORMS,
        "seeds_step": SEEDS_STEPS,
        "report_to": REPORT_TO,
    }

    out: str = "runs/run"
    device: str = "auto"
    compile: bool = False
    conv_form: str = "auto"  # phase 1's convolution: "pixels", "tokens", or "auto" (conv_mixer.py)
    deterministic: bool = False  # deterministic CUDA kernels; a resume in another environment refused
    workers: int | None = None  # workers loader only; default: loaders.default_workers
    threads: int | None = None  # torch CPU threads; default: loaders.default_threads
    resume: bool = False
    overwrite: bool = False  # start anew in a folder holding another run's outputs (replacing them)
    keep: int = 0
    log_every: int = 50
    eval_every: int = 1  # epochs between evaluations (the last epoch is always evaluated)
    export_onnx: bool = False
    export_timm: bool = False  # timm's pretrained folder, out/timm/
    report_to: str = "none"  # "tensorboard": event files in out/tensorboard/ (train/tensorboard.py)
    # several seeds of this run trained together in one process, each in out/seed{N} (train/stacked.py);
    # in a seed's own config.json, the seeds it was trained beside
    seeds: tuple[int, ...] = ()
    # how those seeds step: "batched" (one batched computation of every seed), "interleaved" (each
    # seed's own step in turn), "auto" (batched on CUDA for 2 seeds or more, else interleaved)
    seeds_step: str = "auto"


# The flat flags (config.json's keys, in its order) -> (group, field); None: a field of TrainConfig.
# The conversion's flags are ConversionSpec's fields; its seed is the run's.
GROUPS = {
    "data": DataConfig,
    "model": ModelFlags,
    "start": StartConfig,
    "recipe": RecipeConfig,
    "runtime": RuntimeConfig,
}
_CONVERSION_FLAGS = ("heads", "qk_dim", "sink", "pinning", "qk_init_std", "margin", "verify_tol")
FLAG_FIELDS: dict[str, tuple[str | None, str]] = {
    "phase": (None, "phase"),
    "preset": (None, "preset"),
    "out": ("runtime", "out"),
    **{
        n: _RENAMED.get(n, ("data", n))
        for n in (
            "data",
            "data_dir",
            "download",
            "num_classes",
            "train_samples",
            "val_samples",
            "holdout",
            "loader",
        )
    },
    **{f.name: ("model", f.name) for f in dataclasses.fields(ModelFlags)},
    **{f.name: ("start", f.name) for f in dataclasses.fields(StartConfig)},
    **{n: _RENAMED.get(n, ("conversion", n)) for n in _CONVERSION_FLAGS},
    **{f.name: ("recipe", f.name) for f in dataclasses.fields(RecipeConfig)},
    "seed": (None, "seed"),
    **{f.name: ("runtime", f.name) for f in dataclasses.fields(RuntimeConfig) if f.name != "out"},
    "given": (None, "given"),
}
# fields that change how a run executes but not what it computes: a resumed run may change them
RUNTIME_FIELDS = (*(f.name for f in dataclasses.fields(RuntimeConfig)), "given")


def starts_from_checkpoint(phase: str, init: str) -> bool:
    """Whether ``init`` names a checkpoint (either phase), not one of the starts without one (phase 1
    takes only "random"; phase 2 also "impulse" and "mimetic")."""
    return init not in ("random", *INIT_STARTS)


PHASES = ("phase1", "phase2")


@dataclass(frozen=True)
class TrainConfig(Checked):
    """One training run. Build it with :meth:`from_flags` (what the CLI, the experiments and the
    tests do): it resolves the defaults that depend on other flags (the pinning). Frozen: a run
    resolves its own defaults into a copy (:meth:`replace`), never into the caller's config. Every
    group is checked when made, as the CLI checks the flags (types, ranges, choices): a refusal is
    one CmhsaError naming the flag."""

    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {"phase": PHASES, "preset": tuple(PRESETS)}

    phase: str = "phase1"  # "phase1" (ConvViT) or "phase2" (attention ViT)
    preset: str = "paper"  # the defaults of the flags not given (PRESETS), and of the learning rate
    seed: int = 0
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelFlags = field(default_factory=ModelFlags)
    start: StartConfig = field(default_factory=StartConfig)
    # the conversion phase 2 starts from (--init a conv checkpoint), or whose attention layout a
    # start without a checkpoint takes (heads, qk_dim, sink, pinning); its seed is this run's
    conversion: ConversionSpec = field(default_factory=ConversionSpec)
    recipe: RecipeConfig = field(default_factory=RecipeConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    # the flags set on purpose (the CLI: the flags typed). With --init they must agree with the
    # checkpoint; on --resume they are the ones that may differ from the saved run. Empty: all.
    given: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.conversion.seed != self.seed:  # one seed: the run's
            object.__setattr__(self, "conversion", self.conversion.replace(seed=self.seed))

    @classmethod
    def from_flags(cls, **flags: Any) -> TrainConfig:
        """The config the flat ``flags`` (``cmhsa train``'s, by their Python names) describe; the
        rest take their defaults. An unknown flag is a TypeError, as for a dataclass."""
        unknown = sorted(set(flags) - FLAG_FIELDS.keys())
        if unknown:
            raise TypeError(f"TrainConfig has no flag {', '.join(map(repr, unknown))}")
        preset = flags.get("preset", "paper")
        if preset not in PRESETS:
            raise CmhsaError(f"`preset` must be one of {', '.join(PRESETS)}, got {preset!r}")
        flags = {**PRESETS[preset], **flags}
        if flags.get("phase", "phase1") == "phase1" and "init" not in flags:
            flags["init"] = "random"  # phase 1's own start (StartConfig's default is phase 2's)
        if preset in WARMUP_FRACTION and "warmup_epochs" not in flags:
            epochs = flags.get("epochs", RecipeConfig.epochs)
            flags["warmup_epochs"] = (
                int(epochs * WARMUP_FRACTION[preset]) if isinstance(epochs, int) else epochs
            )
        groups: dict[str, dict[str, Any]] = {g: {} for g in (*GROUPS, "conversion")}
        top: dict[str, Any] = {}
        for name, value in flags.items():
            group, attr = FLAG_FIELDS[name]
            if name in ("opt_betas", "scale", "seeds") and isinstance(value, list):  # as JSON saves a tuple
                value = tuple(value)
            if name == "given" and isinstance(value, (list, tuple, set)):
                value = frozenset(value)
            (top if group is None else groups[group])[attr] = value
        made = {g: kind(**groups[g]) for g, kind in GROUPS.items()}
        phase, init = top.get("phase", "phase1"), made["start"].init
        if groups["conversion"].get("pinning") is None:  # gated where attention starts pinned and should move
            from_ckpt = starts_from_checkpoint(phase, init)
            groups["conversion"]["pinning"] = "gated" if from_ckpt or init == "impulse" else "hard"
        try:
            conversion = ConversionSpec(seed=top.get("seed", 0), **groups["conversion"])
        except CmhsaError as e:  # ConversionSpec names its fields (convert's flags): the run's are these
            message = e.message
            for attr, flag in flags_of("conversion").items():
                message = message.replace(f"`{attr}`", f"`{flag}`")
            raise CmhsaError(message) from None
        return cls(**top, **made, conversion=conversion)

    def replace(self, **flags: Any) -> TrainConfig:
        """A copy with the flat ``flags`` changed."""
        return TrainConfig.from_flags(**{**self.to_dict(), **flags})

    @property
    def from_checkpoint(self) -> bool:
        """Starting from a checkpoint's weights (phase 2: converted, or an attention model; phase 1:
        a conv model, a fresh run from it) rather than at random or a start without one."""
        return starts_from_checkpoint(self.phase, self.start.init)

    @property
    def update_batch(self) -> int:
        """The images of one optimizer update on each process: `grad_accum_steps` micro-batches of
        `batch_size`."""
        return self.recipe.batch_size * self.recipe.grad_accum_steps

    @property
    def attn_lr_scale(self) -> float:
        mult = self.recipe.attn_lr_mult
        return mult if mult is not None else (CHECKPOINT_ATTN_LR_MULT if self.from_checkpoint else 1.0)

    @property
    def peak_lr(self) -> float:
        """--lr, or its default: :data:`PEAK_LR` of the preset, by where the weights start."""
        if self.recipe.lr is not None:
            return self.recipe.lr
        scratch, after_checkpoint = PEAK_LR[self.preset]
        return after_checkpoint if self.from_checkpoint else scratch

    @staticmethod
    def owner(name: str) -> tuple[type, str]:
        """The object that holds the flat flag ``name`` (a group, the spec, TrainConfig) and its field."""
        group, attr = FLAG_FIELDS[name]
        return {None: TrainConfig, "conversion": ConversionSpec}.get(group) or GROUPS[group], attr  # type: ignore[return-value]

    def flag(self, name: str) -> Any:
        """The value of the flat flag ``name``."""
        group, attr = FLAG_FIELDS[name]
        return getattr(self if group is None else getattr(self, group), attr)

    def to_dict(self) -> dict[str, Any]:
        """Flat, one key per flag (config.json's format)."""
        d = {name: self.flag(name) for name in FLAG_FIELDS}
        d["opt_betas"], d["scale"] = list(d["opt_betas"]), list(d["scale"])
        d["given"] = sorted(self.given)
        return d

    def to_json(self) -> str:
        return json_text(self.to_dict()) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        """The config a :meth:`to_dict` (a config.json) describes; keys cmhsa no longer knows are ignored."""
        flags = {k: v for k, v in d.items() if k in FLAG_FIELDS}
        if "preset" not in d and flags.get("phase") == "phase2" and flags.get("lr") is None:
            flags["lr"] = PEAK_LR["paper"][
                1
            ]  # saved before presets: phase 2's default was 5e-5 from any start
        return cls.from_flags(**flags)

    def training_differences(self, other: TrainConfig) -> list[str]:
        """Flags ``other`` sets differently that would change what a resumed run computes (only
        those in ``other.given``, when it says which)."""
        a, b = self.to_dict(), other.to_dict()
        names = [k for k in a if k not in RUNTIME_FIELDS and a[k] != b[k]]
        return [k for k in names if k in other.given] if other.given else names


# --config FILE: what a run's config.json holds beyond its flags (what the run recorded of itself,
# ignored), and the flags of this invocation's own (the run folder and how it treats one: ignored,
# the command line decides)
RECORDED_KEYS = (
    "model",
    "kind",
    "init_info",
    "classes",
    "world_size",
    "backend",
    "loader_used",
    "threads_used",
    "environments",
    "scaled_lr",
    "best",
)
INVOCATION_FLAGS = ("out", "resume", "overwrite")


def flags_from_file(doc: Any, phase: str, where: object) -> tuple[dict[str, Any], frozenset[str]]:
    """The flags a config file holds (a run's config.json, or a JSON or YAML file of flags) for a
    run of ``phase``, and those it gave on purpose (a config.json's own ``given``; a file of flags:
    every one). What a run records of itself (:data:`RECORDED_KEYS`) and this invocation's own flags
    (:data:`INVOCATION_FLAGS`) are left out; a key that is none of these, or another phase's
    config, is refused in one line naming it. The values are checked as the CLI's are, when the
    config is made (:meth:`TrainConfig.from_flags`)."""
    if not isinstance(doc, dict) or not all(isinstance(k, str) for k in doc):
        raise CmhsaError("is not a mapping of flags to values (a run's config.json, or one like it)", where)
    unknown = [k for k in doc if k not in FLAG_FIELDS and k not in RECORDED_KEYS]
    if unknown:
        shown = unknown[0] if len(unknown[0]) <= 60 else unknown[0][:57] + "..."
        raise CmhsaError(f"holds {shown!r}, which is no flag of `cmhsa train {phase}`", where)
    other = doc.get("phase", phase)
    if other not in PHASES:
        raise CmhsaError(f"holds phase {str(other)[:20]!r}, not one of {', '.join(PHASES)}", where)
    if other != phase:
        raise CmhsaError(f"is a {other} run's config; give it to `cmhsa train {other}`", where)
    left = (*INVOCATION_FLAGS, "given", "phase")
    flags = {k: v for k, v in doc.items() if k in FLAG_FIELDS and k not in left}
    said = doc.get("given")
    if said is None:
        given = frozenset(flags)
    elif isinstance(said, list) and all(isinstance(k, str) and k in FLAG_FIELDS for k in said):
        given = frozenset(said) - set(INVOCATION_FLAGS)
    else:
        raise CmhsaError("holds a 'given' that is not a list of flags", where)
    return flags, given
