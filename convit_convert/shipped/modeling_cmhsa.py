"""cmhsa's models for Hugging Face transformers, with no cmhsa installed.

This file travels in every folder ``cmhsa export --format timm`` writes, and transformers loads it
from there with ``trust_remote_code=True``:

    from transformers import AutoImageProcessor, AutoModelForImageClassification, pipeline
    model = AutoModelForImageClassification.from_pretrained(FOLDER, trust_remote_code=True)
    processor = AutoImageProcessor.from_pretrained(FOLDER, trust_remote_code=True)
    classify = pipeline("image-classification", model=FOLDER, trust_remote_code=True)

It imports torch and transformers only (nothing else, not even Python's own modules), reads no
file and touches no network itself (transformers reads the folder's config.json and
model.safetensors), and runs nothing from the weights' metadata.
The classes, under ``model_type`` "cmhsa" (names stable, docs/sharing.md):

- ``CmhsaConfig``: the model's typed options, read from and written to config.json as timm and
  cmhsa write it (``architecture`` cmhsa_conv or cmhsa_attn, ``model_args.cmhsa_config``: every
  option, ``pretrained_cfg``: its input, ``label_names``: the classes); values this file does not
  implement are refused;
- ``CmhsaForImageClassification``: the model, every parameter named as in model.safetensors:
  patch embedding, pre-LN blocks whose token mixer is a K×K convolution over the pixel view of the
  tokens (phase 1, ``conv``) or multi-head self-attention with a relative position bias per head,
  an optional sink and optional gated pinning (phase 2, ``attn``), final norm, mean over tokens, head;
  stochastic depth (``drop_path_rate``) in training mode, as cmhsa trains it;
- ``CmhsaImageProcessor``: timm's evaluation transform, which ``cmhsa eval`` and ``cmhsa predict``
  use: the image in the model's channels (PIL's "L" or "RGB"), the shorter side resized to
  floor(size / crop_pct), a centre crop, scaled to 0..1 and normalised.

cmhsa's tests hold this file to cmhsa's own model (tests/test_hub_code.py): forward, gradients and
training-mode drop path, on every value of every option cmhsa's config type declares.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.modeling_outputs import ImageClassifierOutput

SHIPPED_BY = "0.2.0"  # the cmhsa release that wrote this file (held to cmhsa's version by its tests)
ARCHITECTURES = {"cmhsa_conv": "conv", "cmhsa_attn": "attn"}  # timm's architecture names -> kind
PATCH_EMBEDS = ("identity", "linear")
PINNINGS = ("hard", "gated")
# the options of both kinds, then attention's, as cmhsa's config names them (model_args.cmhsa_config)
MODEL_OPTIONS = (
    "img_size",
    "patch_size",
    "in_chans",
    "hidden_chans",
    "embed_dim",
    "patch_embed",
    "depth",
    "mlp_hidden_dim",
    "norm_eps",
    "kernel_size",
    "dilation",
)
ATTENTION_OPTIONS = ("num_heads", "qk_dim", "v_dim", "sink", "pinning")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's defaults (DeiT's)
PIL_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


def _refuse(message: str) -> ValueError:
    return ValueError(f"CmhsaConfig: {message}")


class CmhsaConfig(PretrainedConfig):
    """A cmhsa model's options. The defaults are the paper's CMHSA-5 after conversion (CIFAR-100,
    224 px, P = 16, d = 768, 6 blocks, 9 heads from a 5×5 kernel, sink on, hard pinning): what
    ``timm.create_model("cmhsa5_224")`` builds. ``architecture`` "cmhsa_conv" is phase 1's model
    (the attention options unused), "cmhsa_attn" phase 2's. The number of classes is
    ``num_labels`` (``num_classes`` is its other name), their names ``id2label``.
    ``drop_path_rate``: stochastic depth in training mode (cmhsa's recipe: 0.1 at the paper's size,
    0 for ``--preset cpu``), linear over the blocks as cmhsa and timm decay it.

    Read from config.json as cmhsa and timm write it (``model_args``, ``pretrained_cfg``,
    ``label_names``), and written back in the same layout, so the one file serves timm, cmhsa and
    transformers; a config.json that contradicts itself, or a value this file does not implement,
    is refused in one line naming the option."""

    model_type = "cmhsa"

    def __init__(
        self,
        architecture: str = "cmhsa_attn",
        img_size: tuple[int, int] | list[int] = (224, 224),
        patch_size: int = 16,
        in_chans: int = 3,
        hidden_chans: int = 3,
        embed_dim: int = 768,
        patch_embed: str = "identity",
        depth: int = 6,
        mlp_hidden_dim: int = 3072,
        norm_eps: float = 1e-6,
        kernel_size: int = 5,
        dilation: int = 1,
        num_heads: int | None = 9,
        qk_dim: int | None = 768,
        v_dim: int | None = 768,
        sink: bool | None = True,
        pinning: str | None = "hard",
        drop_path_rate: float = 0.0,
        model_args: dict[str, object] | None = None,
        pretrained_cfg: dict[str, object] | None = None,
        label_names: list[str] | None = None,
        **kwargs: object,
    ) -> None:
        options = {
            "img_size": img_size,
            "patch_size": patch_size,
            "in_chans": in_chans,
            "hidden_chans": hidden_chans,
            "embed_dim": embed_dim,
            "patch_embed": patch_embed,
            "depth": depth,
            "mlp_hidden_dim": mlp_hidden_dim,
            "norm_eps": norm_eps,
            "kernel_size": kernel_size,
            "dilation": dilation,
            "num_heads": num_heads,
            "qk_dim": qk_dim,
            "v_dim": v_dim,
            "sink": sink,
            "pinning": pinning,
        }
        num_classes = kwargs.pop("num_classes", None)
        num_features = kwargs.pop("num_features", None)
        kwargs.pop("model_type", None)  # transformers reads a timm config.json as "timm_wrapper"
        if model_args is not None:  # config.json: every option is model_args' (timm's layout)
            saved = model_args.get("cmhsa_config") if isinstance(model_args, dict) else None
            if not isinstance(saved, dict) or set(model_args) != {"cmhsa_config"}:
                raise _refuse("model_args must hold one object, cmhsa_config")
            unknown = sorted(set(saved) - {*MODEL_OPTIONS, *ATTENTION_OPTIONS, "num_classes"})
            if unknown:
                raise _refuse(f"model_args.cmhsa_config holds {unknown[0]!r}, an option this model lacks")
            kind_options = MODEL_OPTIONS + (
                ATTENTION_OPTIONS if ARCHITECTURES.get(architecture) == "attn" else ()
            )
            missing = [k for k in kind_options if k not in saved]
            if missing:
                raise _refuse(f"model_args.cmhsa_config lacks {missing[0]!r}")
            options.update({k: saved[k] for k in kind_options})
            if num_classes is not None and num_classes != saved.get("num_classes"):
                raise _refuse(f"num_classes {num_classes!r} but model_args' is {saved.get('num_classes')!r}")
            num_classes = saved.get("num_classes")
        if label_names is not None:
            if not isinstance(label_names, list) or not all(isinstance(n, str) for n in label_names):
                raise _refuse("label_names must be a list of strings")
            names = dict(enumerate(label_names))
            if "id2label" in kwargs and {int(k): v for k, v in dict(kwargs["id2label"]).items()} != names:
                raise _refuse("id2label and label_names name the classes differently")
            kwargs["id2label"] = names
        n = num_classes if num_classes is not None else kwargs.get("num_labels", 100)
        if "id2label" not in kwargs:  # the outputs' numbers, as cmhsa shows a model without names
            kwargs["id2label"] = {i: str(i) for i in range(_positive(n, "num_classes"))}
        if num_classes is not None and len(kwargs["id2label"]) != num_classes:
            raise _refuse(f"{len(kwargs['id2label'])} class names for num_classes {num_classes}")
        kwargs.pop("num_labels", None)
        super().__init__(**kwargs)
        self.architecture = architecture
        for name, value in options.items():
            setattr(self, name, list(value) if name == "img_size" and isinstance(value, tuple) else value)
        self.drop_path_rate = drop_path_rate
        self.license = (pretrained_cfg or {}).get("license") if isinstance(pretrained_cfg, dict) else None
        self.check()
        if num_features is not None and num_features != self.embed_dim:
            raise _refuse(f"num_features {num_features!r} but embed_dim is {self.embed_dim}")
        if pretrained_cfg is not None:
            self._check_input(pretrained_cfg)

    @property
    def kind(self) -> str:
        """ "conv" (phase 1) or "attn" (phase 2)."""
        return ARCHITECTURES[self.architecture]

    @property
    def num_classes(self) -> int:
        return self.num_labels

    @property
    def grid(self) -> tuple[int, int]:
        """Patches per column and per row."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    def check(self) -> None:
        """A ValueError naming the first option whose value this file does not implement, or whose
        sizes contradict each other (cmhsa's config refuses the same)."""
        if self.architecture not in ARCHITECTURES:
            raise _refuse(f"architecture {self.architecture!r} is not one of {', '.join(ARCHITECTURES)}")
        if self.patch_embed not in PATCH_EMBEDS:
            raise _refuse(f"patch_embed {self.patch_embed!r} is not one of {', '.join(PATCH_EMBEDS)}")
        ints = ["patch_size", "in_chans", "hidden_chans", "embed_dim", "depth", "mlp_hidden_dim"]
        ints += ["kernel_size", "dilation"] + (
            ["num_heads", "qk_dim", "v_dim"] if self.kind == "attn" else []
        )
        for name in ints:
            _positive(getattr(self, name), name)
        size = self.img_size
        if not isinstance(size, list | tuple) or len(size) != 2:
            raise _refuse(f"img_size must be [height, width], not {size!r}")
        for v in size:
            _positive(v, "img_size")
        if size[0] % self.patch_size or size[1] % self.patch_size:
            raise _refuse(f"img_size {list(size)} is not a multiple of patch_size {self.patch_size}")
        if self.embed_dim != self.patch_size**2 * self.hidden_chans:
            raise _refuse(f"embed_dim {self.embed_dim} is not patch_size² · hidden_chans")
        if self.patch_embed == "identity" and self.in_chans != self.hidden_chans:
            raise _refuse("patch_embed 'identity' needs in_chans equal to hidden_chans")
        if not isinstance(self.norm_eps, float | int) or not 0 < self.norm_eps < 1:
            raise _refuse(f"norm_eps must be a number in (0, 1), not {self.norm_eps!r}")
        if not isinstance(self.drop_path_rate, float | int) or not 0 <= self.drop_path_rate < 1:
            raise _refuse(f"drop_path_rate must be a number in [0, 1), not {self.drop_path_rate!r}")
        if self.kind == "attn":
            if self.pinning not in PINNINGS:
                raise _refuse(f"pinning {self.pinning!r} is not one of {', '.join(PINNINGS)}")
            if not isinstance(self.sink, bool):
                raise _refuse(f"sink must be true or false, not {self.sink!r}")

    def _check_input(self, pretrained_cfg: dict[str, object]) -> None:
        """config.json's pretrained_cfg describes this model's input and output."""
        want = self.input_cfg()
        for key in ("input_size", "num_classes"):
            have = pretrained_cfg.get(key, want[key])
            if (list(have) if isinstance(have, list | tuple) else have) != want[key]:
                raise _refuse(f"pretrained_cfg's {key} is {have!r}, the model's options make {want[key]!r}")

    def model_options(self) -> dict[str, object]:
        """model_args.cmhsa_config: the options of this kind and the number of classes."""
        names = MODEL_OPTIONS + (ATTENTION_OPTIONS if self.kind == "attn" else ())
        return {**{k: getattr(self, k) for k in names}, "num_classes": self.num_classes}

    def input_cfg(self) -> dict[str, object]:
        """timm's pretrained_cfg: how the model wants its images (cmhsa eval's transform) and where
        its head is."""
        grey = self.in_chans != 3
        mean = (sum(IMAGENET_MEAN) / 3,) * self.in_chans if grey else IMAGENET_MEAN
        std = (sum(IMAGENET_STD) / 3,) * self.in_chans if grey else IMAGENET_STD
        cfg = {
            "input_size": [self.in_chans, *self.img_size],
            "fixed_input_size": True,
            "mean": list(mean),
            "std": list(std),
            "interpolation": "bicubic",
            "crop_pct": 0.875,
            "num_classes": self.num_classes,
            "first_conv": "patch_embed" if self.patch_embed == "linear" else [],
            "classifier": "head",
        }
        return cfg if self.license is None else {**cfg, "license": self.license}

    def class_names(self) -> list[str] | None:
        """The classes' names, or None where they are the outputs' numbers."""
        names = [str(self.id2label[i]) for i in range(self.num_labels)]
        return None if names == [str(i) for i in range(self.num_labels)] else names

    def to_dict(self) -> dict[str, object]:
        """config.json in timm's layout (what cmhsa and timm read), beside transformers' own keys."""
        out = super().to_dict()
        for key in (*MODEL_OPTIONS, *ATTENTION_OPTIONS, "license", "architecture"):
            out.pop(key, None)
        out["architecture"] = self.architecture
        out["num_classes"] = self.num_classes
        out["num_features"] = self.embed_dim
        names = self.class_names()
        if names is not None:
            out["label_names"] = names
        out["model_args"] = {"cmhsa_config": self.model_options()}
        out["pretrained_cfg"] = self.input_cfg()
        return out

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: object, **kwargs: object) -> object:
        """config.json, whose ``model_type`` transformers sets to its TimmWrapper's (the folder is
        timm's too): here it is cmhsa's."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == "timm_wrapper":
            config_dict["model_type"] = cls.model_type
        return config_dict, kwargs


def _positive(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise _refuse(f"{name} must be a positive integer, not {value!r}")
    return value


def patchify(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) pixels -> (B, N, P²·C) tokens, patches row-major, each flattened channel-last."""
    b, c, h, w = x.shape
    x = x.reshape(b, c, h // p, p, w // p, p)
    return x.permute(0, 2, 4, 3, 5, 1).reshape(b, (h // p) * (w // p), p * p * c)


def unpatchify(x: torch.Tensor, grid: tuple[int, int], p: int) -> torch.Tensor:
    """(B, N, P²·C) tokens -> (B, C, H, W) pixels; the inverse of :func:`patchify`."""
    b, _, d = x.shape
    gh, gw = grid
    x = x.reshape(b, gh, gw, p, p, d // (p * p))
    return x.permute(0, 5, 1, 3, 2, 4).reshape(b, -1, gh * p, gw * p)


class PatchEmbed(nn.Module):
    """(B, C, H, W) -> (B, N, embed_dim): the flattened patch, through a linear map when it has one."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int, linear: bool) -> None:
        super().__init__()
        self.patch_size = patch_size
        if linear:
            self.weight = nn.Parameter(torch.empty(embed_dim, patch_size * patch_size * in_chans))
            self.bias = nn.Parameter(torch.empty(embed_dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = patchify(x, self.patch_size)
        return x if self.weight is None else F.linear(x, self.weight, self.bias)


class ConvMixer(nn.Conv2d):
    """Phase 1's token mixer: (B, N, P²·C) -> the same, a K×K 'same' convolution of the pixel view."""

    def __init__(self, channels: int, kernel: int, dilation: int, grid: tuple[int, int], p: int) -> None:
        super().__init__(channels, channels, kernel, padding="same", dilation=dilation)
        self.grid, self.p = grid, p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return patchify(super().forward(unpatchify(x, self.grid, self.p)), self.p)


def relative_index(grid: tuple[int, int]) -> torch.Tensor:
    """(N, N): query (y, x) to key (y + dy, x + dx) reads bias entry (dy + Gh - 1, dx + Gw - 1)."""
    gh, gw = grid
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    return (ys[None, :] - ys[:, None] + gh - 1) * (2 * gw - 1) + (xs[None, :] - xs[:, None] + gw - 1)


def softmax_with_sink(logits: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last axis with each head's sink logit (a key of value zero) in the
    denominator only; ``logits`` (..., heads, N, N), ``sink`` (heads,)."""
    if sink is None:
        return logits.softmax(dim=-1)
    lse = torch.logaddexp(logits.logsumexp(dim=-1, keepdim=True), sink.view(-1, 1, 1))
    return (logits - lse).exp()


class Attention(nn.Module):
    """Phase 2's token mixer, (B, N, dim) -> (B, N, dim). Per head h, for query q and key k:

        logits_h(q, k) = (W_Q x_q)·(W_K x_k) / sqrt(qk_dim) + rel_pos_bias[h, dy, dx]
        weights_h = softmax over the keys and the sink s_h (a key of value zero)

    gated pinning: weights_h = (1 - g_h) softmax(rel_pos_bias_h; s_h) + g_h softmax(q·k + content_bias_h),
    g_h the gate clamped to [0, 1] in the forward pass, its gradient passed through the clamp
    unchanged (so a gate pushed past 0 or 1 can come back; cmhsa trains it so). Output: proj of
    the heads' weighted values."""

    def __init__(self, config: CmhsaConfig) -> None:
        super().__init__()
        dim, h = config.embed_dim, config.num_heads
        self.heads, self.qk_dim, self.grid = h, config.qk_dim, config.grid
        self.q, self.k = nn.Linear(dim, h * config.qk_dim), nn.Linear(dim, h * config.qk_dim)
        self.v, self.proj = nn.Linear(dim, h * config.v_dim), nn.Linear(h * config.v_dim, dim)
        table = (h, 2 * self.grid[0] - 1, 2 * self.grid[1] - 1)
        self.rel_pos_bias = nn.Parameter(torch.empty(table))
        self.sink = nn.Parameter(torch.empty(h)) if config.sink else None
        gated = config.pinning == "gated"
        self.gate = nn.Parameter(torch.empty(h)) if gated else None
        self.content_bias = nn.Parameter(torch.empty(table)) if gated else None
        # built once; no file holds it (the loader rebuilds it in _init_weights)
        self.register_buffer("rel_pos_index", relative_index(self.grid), persistent=False)

    def bias(self, table: torch.Tensor) -> torch.Tensor:
        """(heads, N, N): a relative position table gathered for every query and key."""
        index = self.rel_pos_index
        return table.flatten(1).index_select(1, index.flatten()).view(-1, *index.shape)

    def gates(self) -> torch.Tensor:
        """(heads,): the gates clamped to [0, 1], the gradient passed straight through."""
        g = self.gate
        return g + (g.clamp(0, 1) - g).detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        h = self.heads
        q = self.q(x).view(b, n, h, -1).transpose(1, 2)
        k = self.k(x).view(b, n, h, -1).transpose(1, 2)
        v = self.v(x).view(b, n, h, -1).transpose(1, 2)
        qk = (q @ k.transpose(-2, -1)) * self.qk_dim**-0.5
        if self.gate is None:
            weights = softmax_with_sink(qk + self.bias(self.rel_pos_bias), self.sink)
        else:
            g = self.gates().view(1, -1, 1, 1)
            positional = softmax_with_sink(self.bias(self.rel_pos_bias), self.sink)
            weights = (1 - g) * positional + g * (qk + self.bias(self.content_bias)).softmax(dim=-1)
        return self.proj((weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class DropPath(nn.Module):
    """Stochastic depth per sample in training mode: x · mask / (1 - p), one 0/1 draw per sample
    (timm's and cmhsa's, drawn alike from torch's global generator)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.p == 0.0 or not self.training:
            return x
        mask = torch.empty((x.shape[0],) + (1,) * (x.ndim - 1), dtype=x.dtype, device=x.device)
        return x * mask.bernoulli_(1.0 - self.p) / (1.0 - self.p)


class Block(nn.Module):
    """Pre-LN: x + mixer(norm1(x)), then x + mlp(norm2(x)); the mixer named by the kind (conv, attn)."""

    def __init__(self, config: CmhsaConfig, drop_path: float) -> None:
        super().__init__()
        dim, eps = config.embed_dim, config.norm_eps
        self.kind = config.kind
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        if self.kind == "conv":
            sizes = (config.hidden_chans, config.kernel_size, config.dilation, config.grid, config.patch_size)
            self.conv = ConvMixer(*sizes)
        else:
            self.attn = Attention(config)
        self.mlp = Mlp(dim, config.mlp_hidden_dim)
        self.drop_path = DropPath(drop_path)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop_path(getattr(self, self.kind)(self.norm1(x)))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class CmhsaForImageClassification(PreTrainedModel):
    """pixel_values (B, C, H, W) -> logits (B, num_classes): patch_embed, blocks, norm, mean, head.

    The model is its own base (``base_model_prefix`` ""): its parameters carry the names of cmhsa's
    checkpoint format, which timm reads too, with no prefix."""

    config_class = CmhsaConfig
    main_input_name = "pixel_values"
    base_model_prefix = ""
    _no_split_modules = ["Block"]  # noqa: RUF012 (transformers' class attributes are lists)

    def __init__(self, config: CmhsaConfig) -> None:
        super().__init__(config)
        config.check()
        self.image_shape = (config.in_chans, *config.img_size)
        linear = config.patch_embed == "linear"
        self.patch_embed = PatchEmbed(config.patch_size, config.in_chans, config.embed_dim, linear)
        rates = torch.linspace(0, config.drop_path_rate, config.depth, device="cpu").tolist()
        self.blocks = nn.ModuleList(Block(config, rate) for rate in rates)
        self.norm = nn.LayerNorm(config.embed_dim, eps=config.norm_eps)
        self.head = nn.Linear(config.embed_dim, config.num_classes)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """A fresh model: cmhsa's init (truncated normal linear weights, zero biases, attention
        tables, sinks and gates at zero). While weights load, only a new head is made here: any
        other tensor the weights lack, or hold in another shape than config.json makes, is refused
        before its memory is filled."""
        fresh = [p for p in module.parameters(recurse=False) if not getattr(p, "_is_hf_initialized", False)]
        loading = any(getattr(p, "_is_hf_initialized", False) for p in self.parameters())
        if loading and fresh and module is not self.head:
            name = next(n for n, m in self.named_modules() if m is module)
            raise ValueError(
                f"the weights hold no tensor of the shape config.json makes for {name or 'the model'}: "
                "config.json does not describe these weights"
            )
        if isinstance(module, Attention):
            module.rel_pos_index.copy_(relative_index(module.grid))
            for table in (module.rel_pos_bias, module.sink, module.gate, module.content_bias):
                if table is not None:
                    nn.init.zeros_(table)
        elif isinstance(module, nn.Linear | PatchEmbed) and module.weight is not None:
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        elif isinstance(module, ConvMixer):
            module.reset_parameters()

    def check_images(self, x: torch.Tensor) -> torch.Tensor:
        """The images, if they are (B, C, H, W) of the model's input; the processor converts colour
        to grey for a grey model."""
        c, h, w = self.image_shape
        if x.ndim != 4 or tuple(x.shape[1:]) != (c, h, w):
            raise ValueError(f"expected pixel_values of shape (B, {c}, {h}, {w}), got {tuple(x.shape)}")
        return x

    def loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """By ``config.problem_type`` (inferred as transformers' classifiers infer it when unset):
        mean squared error, cross-entropy, or binary cross-entropy on the logits."""
        config, n = self.config, self.config.num_labels
        if config.problem_type is None:
            if n == 1:
                config.problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                config.problem_type = "single_label_classification"
            else:
                config.problem_type = "multi_label_classification"
        if config.problem_type == "regression":
            return F.mse_loss(logits.squeeze(), labels.squeeze().to(logits.dtype))
        if config.problem_type == "single_label_classification":
            return F.cross_entropy(logits.view(-1, n), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype))

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: object,
    ) -> ImageClassifierOutput | tuple[torch.Tensor, ...]:
        """``hidden_states``: the patch embedding's output and every block's, (B, N, embed_dim)."""
        config = self.config
        output_hidden_states = (
            config.output_hidden_states if output_hidden_states is None else output_hidden_states
        )
        return_dict = config.return_dict if return_dict is None else return_dict
        x = self.patch_embed(self.check_images(pixel_values))
        hidden = [x] if output_hidden_states else None
        for block in self.blocks:
            x = block(x)
            if hidden is not None:
                hidden.append(x)
        logits = self.head(self.norm(x).mean(dim=1))
        loss = None if labels is None else self.loss(logits, labels)
        states = None if hidden is None else tuple(hidden)
        if not return_dict:
            out = (logits,) if states is None else (logits, states)
            return out if loss is None else (loss, *out)
        return ImageClassifierOutput(loss=loss, logits=logits, hidden_states=states)


class CmhsaImageProcessor(BaseImageProcessor):
    """timm's evaluation transform from config.json's ``pretrained_cfg`` (as ``cmhsa predict``):
    each image (a PIL image, as transformers' pipeline gives it) in the model's channels (colour
    becomes grey for a grey model, PIL's "L"), the shorter side resized to floor(size / crop_pct)
    (non-square sizes: both sides kept in ratio), centre crop (zeros where the image is smaller),
    then (x / 255 - mean) / std."""

    model_input_names = ["pixel_values"]  # noqa: RUF012 (as transformers declares it)

    def __init__(self, pretrained_cfg: dict[str, object] | None = None, **kwargs: object) -> None:
        known = ("do_resize", "do_rescale", "do_normalize")  # BaseImageProcessor's own
        super().__init__(**{k: v for k, v in kwargs.items() if k in known})
        cfg = dict(pretrained_cfg or CmhsaConfig(depth=1).input_cfg())
        self.pretrained_cfg = cfg
        self.channels, self.height, self.width = (int(v) for v in cfg["input_size"])
        if self.channels not in (1, 3):
            raise ValueError(
                f"CmhsaImageProcessor: images of {self.channels} channels (this reads grey or RGB)"
            )
        self.crop_pct = float(cfg.get("crop_pct", 0.875))
        self.resample = PIL_FILTERS[cfg.get("interpolation", "bicubic")]
        self.image_mean, self.image_std = list(cfg["mean"]), list(cfg["std"])

    @classmethod
    def get_image_processor_dict(cls, pretrained_model_name_or_path: object, **kwargs: object) -> object:
        """Read from config.json, as transformers reads a timm folder's: one description of the
        input, which timm and cmhsa read too (a preprocessor_config.json beside it only names this
        class)."""
        kwargs.setdefault("image_processor_filename", "config.json")
        return super().get_image_processor_dict(pretrained_model_name_or_path, **kwargs)

    def resized(self, image: object) -> object:
        """timm's transforms_imagenet_eval, crop_mode "center", on a PIL image."""
        w, h = image.size
        scale = (int(self.height / self.crop_pct), int(self.width / self.crop_pct))  # floor: both > 0
        if scale[0] == scale[1]:  # torchvision's Resize(int): the shorter side
            short, long = (w, h) if w <= h else (h, w)
            new_short, new_long = scale[0], int(scale[0] * long / short)
            size = (new_short, new_long) if w <= h else (new_long, new_short)
        else:  # timm's ResizeKeepRatio
            ratio = min(h / scale[0], w / scale[1])
            size = (round(w / ratio), round(h / ratio))
        if size != (w, h):
            image = image.resize(size, resample=self.resample)
        (w, h), (cw, ch) = image.size, (self.width, self.height)
        left = -((cw - w) // 2) if cw > w else round((w - cw) / 2.0)
        top = -((ch - h) // 2) if ch > h else round((h - ch) / 2.0)
        return image.crop((left, top, left + cw, top + ch))

    def tensor(self, image: object) -> torch.Tensor:
        """(C, H, W) float32 from a PIL image: ToTensor's /255, then Normalize's (x - mean) / std."""
        if not hasattr(image, "convert"):
            from transformers.image_utils import to_pil_image

            image = to_pil_image(image)
        image = self.resized(image.convert("L" if self.channels == 1 else "RGB"))
        pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
        x = pixels.view(self.height, self.width, self.channels).permute(2, 0, 1).float().div(255)
        mean = torch.tensor(self.image_mean).view(-1, 1, 1)
        std = torch.tensor(self.image_std).view(-1, 1, 1)
        return x.sub(mean).div(std)

    def preprocess(self, images: object, return_tensors: str | None = "pt", **kwargs: object) -> BatchFeature:
        images = images if isinstance(images, list | tuple) else [images]
        pixel_values = torch.stack([self.tensor(image) for image in images])
        return BatchFeature(data={"pixel_values": pixel_values}, tensor_type=None)

    def __call__(self, images: object, **kwargs: object) -> BatchFeature:
        return self.preprocess(images, **kwargs)
