"""A training run's configuration: one field per ``cmhsa train`` flag, the paper's recipe
(Appendix B, DeiT's) as defaults.

The model fields are the flags as given; the model actually trained (its :class:`ViTConfig`, which
may come from ``--init``) is resolved by :mod:`.phases` and saved beside this config, never written
back into it. Saved as ``config.json`` in the run folder and inside every ``checkpoint-last.pt``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from ..spec import DEFAULT_MARGIN, DEFAULT_TOL, ConversionSpec

PHASE_LR = {"phase1": 5e-4, "phase2": 5e-5}  # peak learning rates the paper used (Appendix B)
# fields that change how a run executes but not what it computes: a resumed run may change them
RUNTIME_FIELDS = ("device", "workers", "threads", "compile", "resume", "log_every", "keep", "out", "export_onnx",
                  "deterministic", "given")  # fmt: skip
LOADERS = ("auto", "device", "workers")
INIT_STARTS = ("mimetic", "impulse")  # phase-2 starts built without a checkpoint (convit_convert/starts.py)


@dataclass(frozen=True)
class TrainConfig:
    """Frozen: a run resolves its defaults into a copy (``dataclasses.replace``), never into the
    caller's config."""

    phase: str = "phase1"  # "phase1" (ConvViT) or "phase2" (attention ViT)
    out: str = "runs/run"
    # data
    data: str = "cifar100"
    data_dir: str | None = None
    download: bool = False
    num_classes: int = 10  # synthetic data only; the others know theirs
    train_samples: int | None = None  # a fixed, seeded subset of the training set (short runs)
    val_samples: int | None = None  # the first images of the validation set (cheaper per-epoch evaluation)
    # auto: the data held on the device and augmented per batch (train/held.py) when it fits, else
    # timm's per-image transforms in worker processes (convit_convert/data.py)
    loader: str = "auto"
    # model (the paper's CMHSA-5)
    img_size: int = 224
    in_chans: int = 3  # 3: RGB, 1: grayscale (images are converted to what the model takes)
    patch_size: int = 16
    hidden_chans: int = 3
    depth: int = 6
    mlp_ratio: float = 4.0
    kernel_size: int = 5
    dilation: int = 1
    drop_path: float = 0.1
    # phase 2
    # conv checkpoint, attn checkpoint, "random", or a start: "impulse" (the default: the best-measured
    # start without a checkpoint at 120 epochs, EXPERIMENTS.md "Which start?"), "mimetic"
    init: str = "impulse"
    mimetic_alpha: float = 0.7  # init mimetic: W_Q,hᵀ W_K,h = α(Z + I); Trockman & Kolter's α₁ = β₁
    mimetic_beta: float = 0.4  # init mimetic: Σ_h W_V,hᵀ W_O,hᵀ = β(Z − I); their α₂ = β₂
    impulse_offsets: str = "conversion"  # init impulse: heads pinned to Δ in order, or "random" offsets in Δ
    heads: int | None = None  # default: as many as the conversion needs
    qk_dim: int | None = None  # default: embed_dim (the paper's)
    sink: bool = True
    pinning: str | None = None  # default: "gated" from a checkpoint or impulse, else "hard" (EXPERIMENTS.md)
    freeze_attention: bool = False  # ablation: W_Q, W_K, biases, sinks and gates stay as converted
    attn_lr_mult: float | None = (
        None  # lr multiplier of W_Q, W_K, gates, biases; default 10 from a checkpoint, else 1
    )
    qk_init_std: float = 0.0
    margin: float = DEFAULT_MARGIN
    verify_tol: float = DEFAULT_TOL
    # optimisation (DeiT / the paper)
    epochs: int = 200
    batch_size: int = 128  # per process
    lr: float | None = None  # peak lr at a global batch of lr_base_batch; default per phase
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
    # augmentation and regularisation (DeiT)
    aa: str = "rand-m9-mstd0.5-inc1"
    color_jitter: float = 0.3
    reprob: float = 0.25
    remode: str = "pixel"
    interpolation: str = "bicubic"
    scale: tuple[float, float] = (0.08, 1.0)  # RandomResizedCrop's area range
    hflip: float = 0.5
    crop_pct: float = 0.875
    mixup: float = 0.8
    cutmix: float = 1.0
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    smoothing: float = 0.1
    model_ema: bool = False
    model_ema_decay: float = 0.99996
    # running
    seed: int = 0
    device: str = "auto"
    amp: str = "auto"  # auto = bf16 on CUDA, none on CPU
    compile: bool = False
    deterministic: bool = False  # deterministic CUDA kernels (CPU runs are deterministic anyway)
    workers: int | None = None  # workers loader only; default: train/recipe.default_workers
    threads: int | None = None  # torch CPU threads; default: train/recipe.default_threads
    resume: bool = False
    keep: int = 0
    log_every: int = 50
    export_onnx: bool = False
    # the fields set on purpose (the CLI: the flags typed). With --init they must agree with the
    # checkpoint; on --resume they are the ones that may differ from the saved run. Empty: all.
    given: frozenset[str] = frozenset()

    @property
    def from_checkpoint(self) -> bool:
        """Phase 2 starting from a checkpoint (converted, or an attention model) rather than at random."""
        return self.phase == "phase2" and self.init not in ("random", *INIT_STARTS)

    @property
    def pinning_used(self) -> str:
        return self.pinning or ("gated" if self.from_checkpoint or self.init == "impulse" else "hard")

    @property
    def conversion_spec(self) -> ConversionSpec:
        """The conversion phase 2 starts from (``--init`` a conv checkpoint), or whose attention
        layout a start without a checkpoint takes (heads, qk_dim, sink, pinning)."""
        return ConversionSpec(
            heads=self.heads, qk_dim=self.qk_dim, sink=self.sink, pinning=self.pinning_used,
            qk_init_std=self.qk_init_std, margin=self.margin, seed=self.seed, tol=self.verify_tol,
        )  # fmt: skip

    @property
    def attn_lr_scale(self) -> float:
        return self.attn_lr_mult if self.attn_lr_mult is not None else (10.0 if self.from_checkpoint else 1.0)

    @property
    def peak_lr(self) -> float:
        return PHASE_LR[self.phase] if self.lr is None else self.lr

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["opt_betas"], d["scale"] = list(self.opt_betas), list(self.scale)
        d["given"] = sorted(self.given)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in known}
        for name in ("opt_betas", "scale"):
            if name in kwargs:
                kwargs[name] = tuple(kwargs[name])
        kwargs["given"] = frozenset(kwargs.get("given", ()))
        return cls(**kwargs)

    def training_differences(self, other: TrainConfig) -> list[str]:
        """Fields ``other`` sets differently that would change what a resumed run computes (only
        those in ``other.given``, when it says which)."""
        a, b = self.to_dict(), other.to_dict()
        names = [k for k in a if k not in RUNTIME_FIELDS and a[k] != b[k]]
        return [k for k in names if k in other.given] if other.given else names
