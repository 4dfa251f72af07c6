"""cmhsa's models for Hugging Face transformers, with no cmhsa installed.

This file travels in every folder ``cmhsa export --format timm`` writes, and transformers loads it
from there with ``trust_remote_code=True``:

    from transformers import AutoModelForImageClassification, pipeline
    model = AutoModelForImageClassification.from_pretrained(FOLDER, trust_remote_code=True)
    classify = pipeline("image-classification", model=FOLDER, trust_remote_code=True)

It imports torch and transformers only (nothing else, not even Python's own modules), reads no
file and touches no network itself (transformers reads the folder's config.json and
model.safetensors), and runs nothing from the weights' metadata.
The classes, under ``model_type`` "cmhsa" (names stable, docs/sharing.md):

- ``CmhsaConfig``: the folder's config.json as timm wrote it (``architecture`` cmhsa_conv or
  cmhsa_attn, ``model_args.cmhsa_config``: the whole model config, ``pretrained_cfg``: its input,
  ``label_names``: the classes);
- ``CmhsaForImageClassification``: the model, every parameter named as in model.safetensors:
  patch embedding, pre-LN blocks whose token mixer is a K×K convolution over the pixel view of the
  tokens (phase 1, ``conv``) or multi-head self-attention with a relative position bias per head,
  an optional sink and optional gated pinning (phase 2, ``attn``), final norm, mean over tokens, head;
- ``CmhsaImageProcessor``: timm's evaluation transform, which ``cmhsa eval`` and ``cmhsa predict``
  use: the image in the model's channels (PIL's "L" or "RGB"), the shorter side resized to
  floor(size / crop_pct), a centre crop, scaled to 0..1 and normalised.

cmhsa's tests build both kinds from cmhsa's own model and compare logits to 1e-5
(tests/test_hub_code.py): a change to cmhsa's model that this file does not follow fails there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.image_processing_utils import BaseImageProcessor, BatchFeature
from transformers.modeling_outputs import ImageClassifierOutput

KINDS = {"cmhsa_conv": "conv", "cmhsa_attn": "attn"}  # timm's architecture names -> model kind
LUMA = (0.299, 0.587, 0.114)  # PIL's convert("L"): a grey model given RGB takes its luma
PIL_FILTERS = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}


class CmhsaConfig(PretrainedConfig):
    """config.json as cmhsa writes it for timm; ``cmhsa_config`` is the model's whole config."""

    model_type = "cmhsa"

    def __init__(
        self,
        architecture: str = "cmhsa_attn",
        model_args: dict[str, object] | None = None,
        pretrained_cfg: dict[str, object] | None = None,
        label_names: list[str] | None = None,
        **kwargs: object,
    ) -> None:
        self.architecture = architecture
        self.model_args = model_args or {}
        self.cmhsa_config = dict(self.model_args.get("cmhsa_config", {}))
        self.pretrained_cfg = dict(pretrained_cfg or {})
        self.label_names = label_names
        kwargs.pop("model_type", None)  # transformers reads a timm config.json as "timm_wrapper"
        n = int(self.cmhsa_config.get("num_classes", kwargs.pop("num_classes", 2)))
        kwargs.pop("num_classes", None)
        if "id2label" not in kwargs:  # the recorded class names, else the output's number
            names = label_names if label_names is not None else [str(i) for i in range(n)]
            kwargs["id2label"] = dict(enumerate(names))
        super().__init__(**kwargs)
        self.num_classes = n

    @property
    def kind(self) -> str:
        return KINDS[self.architecture]

    @classmethod
    def get_config_dict(cls, pretrained_model_name_or_path: object, **kwargs: object) -> object:
        """config.json, whose ``model_type`` transformers sets to its TimmWrapper's (the folder is
        timm's too): here it is cmhsa's."""
        config_dict, kwargs = super().get_config_dict(pretrained_model_name_or_path, **kwargs)
        if config_dict.get("model_type") == "timm_wrapper":
            config_dict["model_type"] = cls.model_type
        return config_dict, kwargs


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
            self.weight = nn.Parameter(torch.zeros(embed_dim, patch_size * patch_size * in_chans))
            self.bias = nn.Parameter(torch.zeros(embed_dim))
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


def relative_index(grid: tuple[int, int], device: torch.device) -> torch.Tensor:
    """(N, N): query (y, x) to key (y + dy, x + dx) reads bias entry (dy + Gh - 1, dx + Gw - 1)."""
    gh, gw = grid
    ys, xs = torch.meshgrid(torch.arange(gh, device=device), torch.arange(gw, device=device), indexing="ij")
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
    g_h the gate clamped to [0, 1]. Output: proj of the heads' weighted values."""

    def __init__(self, c: dict[str, object], grid: tuple[int, int]) -> None:
        super().__init__()
        dim, h = c["embed_dim"], c["num_heads"]
        self.heads, self.qk_dim, self.v_dim, self.grid = h, c["qk_dim"], c["v_dim"], grid
        self.q, self.k = nn.Linear(dim, h * self.qk_dim), nn.Linear(dim, h * self.qk_dim)
        self.v, self.proj = nn.Linear(dim, h * self.v_dim), nn.Linear(h * self.v_dim, dim)
        table = (h, 2 * grid[0] - 1, 2 * grid[1] - 1)
        self.rel_pos_bias = nn.Parameter(torch.zeros(table))
        self.sink = nn.Parameter(torch.zeros(h)) if c["sink"] else None
        gated = c.get("pinning") == "gated"
        self.gate = nn.Parameter(torch.zeros(h)) if gated else None
        self.content_bias = nn.Parameter(torch.zeros(table)) if gated else None

    def bias(self, table: torch.Tensor) -> torch.Tensor:
        """(heads, N, N): a relative position table gathered for every query and key."""
        index = relative_index(self.grid, table.device)
        return table.flatten(1)[:, index]

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
            g = self.gate.clamp(0, 1).view(1, -1, 1, 1)
            positional = softmax_with_sink(self.bias(self.rel_pos_bias), self.sink)
            weights = (1 - g) * positional + g * (qk + self.bias(self.content_bias)).softmax(dim=-1)
        return self.proj((weights.to(v.dtype) @ v).transpose(1, 2).reshape(b, n, -1))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """Pre-LN: x + mixer(norm1(x)), then x + mlp(norm2(x)); the mixer named by the kind (conv, attn)."""

    def __init__(self, c: dict[str, object], kind: str, grid: tuple[int, int]) -> None:
        super().__init__()
        dim, eps = c["embed_dim"], c["norm_eps"]
        self.kind = kind
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=eps), nn.LayerNorm(dim, eps=eps)
        if kind == "conv":
            self.conv = ConvMixer(c["hidden_chans"], c["kernel_size"], c["dilation"], grid, c["patch_size"])
        else:
            self.attn = Attention(c, grid)
        self.mlp = Mlp(dim, c["mlp_hidden_dim"])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + getattr(self, self.kind)(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CmhsaForImageClassification(PreTrainedModel):
    """pixel_values (B, C, H, W) -> logits (B, num_classes): patch_embed, blocks, norm, mean, head."""

    config_class = CmhsaConfig
    main_input_name = "pixel_values"
    base_model_prefix = "cmhsa"
    _no_split_modules = ["Block"]  # noqa: RUF012 (transformers' class attributes are lists)

    def __init__(self, config: CmhsaConfig) -> None:
        super().__init__(config)
        c = config.cmhsa_config
        self.image_shape = (c["in_chans"], *c["img_size"])
        p = c["patch_size"]
        grid = (c["img_size"][0] // p, c["img_size"][1] // p)
        linear = c["patch_embed"] == "linear"
        self.patch_embed = PatchEmbed(p, c["in_chans"], c["embed_dim"], linear)
        self.blocks = nn.ModuleList(Block(c, config.kind, grid) for _ in range(c["depth"]))
        self.norm = nn.LayerNorm(c["embed_dim"], eps=c["norm_eps"])
        self.head = nn.Linear(c["embed_dim"], c["num_classes"])
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """What a fresh model starts from (a folder's weights replace all of it): ViT's init."""
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)

    def images(self, x: torch.Tensor) -> torch.Tensor:
        """The images as the model takes them: a grey model given RGB takes its luma (PIL's "L")."""
        c, h, w = self.image_shape
        if c == 1 and x.ndim == 4 and x.shape[1] == 3:
            x = (x * torch.tensor(LUMA, dtype=x.dtype, device=x.device).view(1, 3, 1, 1)).sum(1, keepdim=True)
        if tuple(x.shape[1:]) != (c, h, w):
            raise ValueError(f"expected pixel_values of shape (B, {c}, {h}, {w}), got {tuple(x.shape)}")
        return x

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs: object,
    ) -> ImageClassifierOutput | tuple[torch.Tensor, ...]:
        x = self.patch_embed(self.images(pixel_values))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x).mean(dim=1))
        loss = None if labels is None else F.cross_entropy(logits, labels)
        if return_dict is False:
            return (logits,) if loss is None else (loss, logits)
        return ImageClassifierOutput(loss=loss, logits=logits)


class CmhsaImageProcessor(BaseImageProcessor):
    """timm's evaluation transform from config.json's ``pretrained_cfg`` (as ``cmhsa predict``):
    each image (a PIL image, as transformers' pipeline gives it) in the model's channels, the
    shorter side resized to floor(size / crop_pct) (non-square sizes: both sides kept in ratio),
    centre crop (zeros where the image is smaller), then (x / 255 - mean) / std."""

    model_input_names = ["pixel_values"]  # noqa: RUF012 (as transformers declares it)

    def __init__(self, pretrained_cfg: dict[str, object] | None = None, **kwargs: object) -> None:
        for key in ("architecture", "model_args", "label_names", "num_classes", "num_features", "auto_map"):
            kwargs.pop(key, None)  # the rest of config.json, where transformers reads this from
        super().__init__(**kwargs)
        cfg = dict(pretrained_cfg or {})
        self.pretrained_cfg = cfg
        self.channels, self.height, self.width = (int(v) for v in cfg["input_size"])
        self.crop_pct = float(cfg.get("crop_pct", 0.875))
        self.resample = PIL_FILTERS[cfg.get("interpolation", "bicubic")]
        self.image_mean, self.image_std = list(cfg["mean"]), list(cfg["std"])

    @classmethod
    def get_image_processor_dict(cls, pretrained_model_name_or_path: object, **kwargs: object) -> object:
        """Read from config.json, as transformers reads a timm folder's (no preprocessor_config.json:
        with one, transformers' TimmWrapper route would read that instead of timm's config)."""
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
        images = images if isinstance(images, (list, tuple)) else [images]
        pixel_values = torch.stack([self.tensor(image) for image in images])
        return BatchFeature(data={"pixel_values": pixel_values}, tensor_type=None)

    def __call__(self, images: object, **kwargs: object) -> BatchFeature:
        return self.preprocess(images, **kwargs)
