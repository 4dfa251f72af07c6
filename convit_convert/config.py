"""Model configuration, kind included: the ``cmhsa.kind`` / ``cmhsa.config`` pair of docs/FORMAT.md
(no torch import)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

from .errors import CmhsaError
from .io.paths import parse_json
from .resources import check_fits
from .text import json_text

NORM_EPS = 1e-6  # LayerNorm eps of every model cmhsa builds (timm's ViTs use the same)

KINDS: tuple[str, ...] = ("conv", "attn")

_SHARED_INT = (
    "patch_size",
    "in_chans",
    "hidden_chans",
    "embed_dim",
    "depth",
    "mlp_hidden_dim",
    "num_classes",
    "kernel_size",
    "dilation",
)
_ATTN_INT = ("num_heads", "qk_dim", "v_dim")
PINNING = ("hard", "gated")  # how a converted head holds its offset (docs/FORMAT.md, version 2)
OPTIONAL = {"attn": {"pinning": "hard"}}  # keys version 1 files lack, with the value they meant
# the largest sizes a config may claim (the CLI's flags are bounded alike, in options/values.py);
# num_patches bounds the (N, N) relative-position index every attention block holds
LIMITS = {
    "img_size": 16384,
    "patch_size": 1024,
    "in_chans": 64,
    "hidden_chans": 4096,
    "embed_dim": 1 << 20,
    "depth": 1024,
    "mlp_hidden_dim": 1 << 22,
    "num_classes": 10**6,
    "kernel_size": 1025,
    "dilation": 1024,
    "num_heads": 4096,
    "qk_dim": 65536,
    "v_dim": 1 << 20,
}
MAX_PATCHES = 128 * 128
# the most parameters a model read from a file may claim, before its memory is checked: 16 GiB of
# float32, 50 times the paper's CMHSA-5 (each size above within its limit can multiply to far more)
MAX_PARAMS = 2**32

REQUIRED = {
    "conv": ("img_size", *_SHARED_INT, "patch_embed", "norm_eps"),
    "attn": ("img_size", *_SHARED_INT, "patch_embed", "norm_eps", *_ATTN_INT, "sink"),
}


@dataclass(frozen=True)
class ViTConfig:
    """Both model kinds. Tokens are flattened P×P pixel patches, so embed_dim = P² · hidden_chans.
    ``kind`` is "conv" (phase 1, a K×K convolution mixes tokens) or "attn" (phase 2, attention);
    the file format stores it apart, as ``cmhsa.kind``."""

    img_size: tuple[int, int]  # (H, W), multiples of patch_size
    patch_size: int
    in_chans: int
    hidden_chans: int
    embed_dim: int
    patch_embed: Literal["identity", "linear"]
    depth: int
    mlp_hidden_dim: int
    num_classes: int
    norm_eps: float
    kernel_size: int  # the phase-1 convolution (kept in attn configs: it names the offsets)
    dilation: int
    # attention (kind "attn") only
    num_heads: int | None = None
    qk_dim: int | None = None
    v_dim: int | None = None
    sink: bool | None = None
    pinning: Literal["hard", "gated"] | None = None  # gated: a per-head gate to content attention
    kind: Literal["conv", "attn"] = "conv"

    @classmethod
    def build(
        cls,
        img_size: int | tuple[int, int] = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        hidden_chans: int | None = None,
        depth: int = 6,
        mlp_ratio: float = 4.0,
        num_classes: int = 100,
        kernel_size: int = 5,
        dilation: int = 1,
        norm_eps: float = NORM_EPS,
        patch_embed: Literal["identity", "linear"] | None = None,
    ) -> ViTConfig:
        """A conv config from the usual knobs; defaults are the paper's model (CMHSA-5, CIFAR-100)."""
        hw = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        hidden = in_chans if hidden_chans is None else hidden_chans
        embed_dim = patch_size * patch_size * hidden
        if patch_embed is None:
            patch_embed = "identity" if hidden == in_chans else "linear"
        cfg = cls(
            img_size=(int(hw[0]), int(hw[1])),
            patch_size=patch_size,
            in_chans=in_chans,
            hidden_chans=hidden,
            embed_dim=embed_dim,
            patch_embed=patch_embed,
            depth=depth,
            mlp_hidden_dim=round(embed_dim * mlp_ratio),
            num_classes=num_classes,
            norm_eps=norm_eps,
            kernel_size=kernel_size,
            dilation=dilation,
        )
        cfg.validate()
        return cfg

    def with_attention(
        self,
        num_heads: int,
        qk_dim: int | None = None,
        v_dim: int | None = None,
        sink: bool = True,
        pinning: Literal["hard", "gated"] = "hard",
    ) -> ViTConfig:
        """The attn config sharing everything else; qk_dim and v_dim default to embed_dim."""
        return dataclasses.replace(
            self,
            num_heads=num_heads,
            qk_dim=self.embed_dim if qk_dim is None else qk_dim,
            v_dim=self.embed_dim if v_dim is None else v_dim,
            sink=sink,
            pinning=pinning,
            kind="attn",
        )

    def without_attention(self) -> ViTConfig:
        return dataclasses.replace(
            self, num_heads=None, qk_dim=None, v_dim=None, sink=None, pinning=None, kind="conv"
        )

    @property
    def grid_size(self) -> tuple[int, int]:
        """Patches per column and per row: (Gh, Gw)."""
        return self.img_size[0] // self.patch_size, self.img_size[1] // self.patch_size

    @property
    def num_patches(self) -> int:
        return math.prod(self.grid_size)

    def num_params(self) -> int:
        """Parameters of the model this config builds (model.py's layers, counted without torch)."""
        d, c, depth = self.embed_dim, self.hidden_chans, self.depth
        gh, gw = self.grid_size
        embed = self.in_chans * self.patch_size**2 * d + d if self.patch_embed == "linear" else 0
        if self.kind == "attn":
            h, qk, v = self.num_heads or 0, self.qk_dim or 0, self.v_dim or 0
            tables = (2 if self.pinning == "gated" else 1) * h * (2 * gh - 1) * (2 * gw - 1)
            mix = 2 * (d * h * qk + h * qk) + d * h * v + h * v + h * v * d + d + tables
            mix += (h if self.sink else 0) + (h if self.pinning == "gated" else 0)  # sinks, gates
        else:
            mix = c * c * self.kernel_size**2 + c
        mlp = 2 * d * self.mlp_hidden_dim + self.mlp_hidden_dim + d
        return embed + depth * (4 * d + mix + mlp) + 2 * d + d * self.num_classes + self.num_classes

    def activation_bytes(self, batch: int, training: bool = False) -> int:
        """float32 bytes a forward pass keeps alive for ``batch`` images: the largest per-block
        tensors (tokens, MLP hidden, attention weights), every block's when ``training`` keeps
        them for the backward pass. An estimate, for refusing sizes that cannot fit."""
        n = self.num_patches
        per_block = batch * n * (4 * self.embed_dim + self.mlp_hidden_dim)
        if self.kind == "attn":
            h = self.num_heads or 0
            per_block += (
                batch
                * h
                * (
                    n * (n + 1) * (3 if self.pinning == "gated" else 1)
                    + n * ((self.qk_dim or 0) * 2 + (self.v_dim or 0))
                )
            )
        return 4 * per_block * (self.depth if training else 2)

    def validate(self, path: object = None) -> None:
        """Raise CmhsaError (naming ``path``) unless this is a consistent config of its kind."""

        def bad(msg: str) -> CmhsaError:
            return CmhsaError(f"config: {msg}", path)

        kind = self.kind
        if kind not in KINDS:
            raise bad(f"kind must be 'conv' or 'attn', got {kind!r}")
        ints = _SHARED_INT + (_ATTN_INT if kind == "attn" else ())
        for name in ints:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(f"{name} must be a positive integer, got {v!r}")
        h, w = self.img_size
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in (h, w)):
            raise bad(f"img_size must be positive integers, got {h!r}x{w!r}")
        p = self.patch_size
        for name, limit in LIMITS.items():  # a file's claims are bounded like the CLI's flags
            v = getattr(self, name) if name != "img_size" else max(h, w)
            if isinstance(v, int) and v > limit:
                raise bad(f"{name} {v} is more than cmhsa supports ({limit})")
        if h % p or w % p:
            raise bad(f"img_size {h}x{w} is not a multiple of patch_size {p}")
        if (h // p) * (w // p) > MAX_PATCHES:
            raise bad(f"{h // p}x{w // p} patches is more than cmhsa supports ({MAX_PATCHES})")
        if self.embed_dim != p * p * self.hidden_chans:
            raise bad(
                f"embed_dim {self.embed_dim} != patch_size² · hidden_chans = {p * p * self.hidden_chans}"
            )
        if self.patch_embed not in ("identity", "linear"):
            raise bad(f"patch_embed must be 'identity' or 'linear', got {self.patch_embed!r}")
        if self.patch_embed == "identity" and self.in_chans != self.hidden_chans:
            raise bad(
                f"patch_embed 'identity' needs in_chans == hidden_chans "
                f"(got {self.in_chans} and {self.hidden_chans})"
            )
        if not isinstance(self.norm_eps, float) or not (0 < self.norm_eps < 1):
            raise bad(f"norm_eps must be a float in (0, 1), got {self.norm_eps!r}")
        if kind == "attn" and not isinstance(self.sink, bool):
            raise bad(f"sink must be true or false, got {self.sink!r}")
        if kind == "attn" and self.pinning not in PINNING:
            raise bad(f"pinning must be 'hard' or 'gated', got {self.pinning!r}")

    def to_dict(self) -> dict[str, Any]:
        """The ``cmhsa.config`` object: every field of this kind but ``kind`` itself."""
        d = dataclasses.asdict(self)
        d["img_size"] = list(self.img_size)
        return {k: d[k] for k in (*REQUIRED[self.kind], *OPTIONAL.get(self.kind, {}))}

    def to_json(self) -> str:
        return json_text(self.to_dict(), indent=None, sort_keys=True)

    @classmethod
    def from_dict(cls, d: Any, kind: str, path: object = None) -> ViTConfig:
        """Parse and validate; keys beyond the required ones are ignored (other tools may add some),
        except ones that describe a convolution cmhsa cannot convert."""
        if not isinstance(d, dict):
            raise CmhsaError("config: cmhsa.config must be a JSON object", path)
        if kind not in KINDS:
            raise CmhsaError(f"cmhsa.kind must be 'conv' or 'attn', got {kind!r}", path)
        missing = [k for k in REQUIRED[kind] if k not in d]
        if missing:
            raise CmhsaError(f"config: missing key(s) {', '.join(missing)}", path)
        check_supported_conv(d, path)
        img = d["img_size"]
        if (
            not isinstance(img, list | tuple)
            or len(img) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in img)
        ):
            raise CmhsaError(f"config: img_size must be [H, W] integers, got {img!r}", path)
        eps = d["norm_eps"]
        fields = {k: d[k] for k in REQUIRED[kind]} | {
            k: d.get(k, v) for k, v in OPTIONAL.get(kind, {}).items()
        }
        fields["img_size"] = (img[0], img[1])
        # JSON writers may emit 1e-06 as a float and 1 as an int; eps is a float either way
        fields["norm_eps"] = float(eps) if isinstance(eps, int | float) and not isinstance(eps, bool) else eps
        cfg = cls(**fields, kind=kind)
        cfg.validate(path)
        cfg.check_size(path)
        return cfg

    def check_size(self, path: object = None) -> None:
        """CmhsaError, before anything is allocated, when the model this config builds has more than
        MAX_PARAMS parameters or its float32 weights exceed the memory available: every config
        read from a file (a checkpoint, a timm folder, a resumed run) is sized here."""
        n = self.num_params()
        if n > MAX_PARAMS:
            raise CmhsaError(
                f"config: the model would have {n:,} parameters ({4 * n / 2**30:,.1f} GiB of float32), "
                f"more than cmhsa loads ({MAX_PARAMS:,})",
                path,
            )
        check_fits(4 * n, f"the model ({n:,} parameters)", path)

    @classmethod
    def from_json(cls, text: str, kind: str, path: object = None) -> ViTConfig:
        return cls.from_dict(parse_json(text, path, "cmhsa.config"), kind, path)


def check_supported_conv(d: dict[str, Any], path: object = None) -> None:
    """Refuse convolutions the exact construction does not cover: only stride 1, zero 'same'
    padding. cmhsa writes none of these keys; another tool's config may carry them."""
    stride = d.get("stride", 1)
    if stride not in (1, [1, 1]):
        raise CmhsaError(f"unsupported convolution: stride {stride} (only stride 1 is exact)", path)
    padding = d.get("padding", "same")
    if padding != "same":
        raise CmhsaError(f"unsupported convolution: padding {padding!r} (only 'same')", path)
    mode = d.get("padding_mode", "zeros")
    if mode != "zeros":
        raise CmhsaError(f"unsupported convolution: padding_mode {mode!r} (only 'zeros')", path)
    groups = d.get("groups", 1)
    if groups != 1:
        raise CmhsaError(f"unsupported convolution: groups {groups} (only dense convolutions)", path)
