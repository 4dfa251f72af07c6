"""DeiT's training augmentation on a whole batch, on the device, with per-sample random parameters.

timm's path (``create_transform``) augments one PIL image at a time: random-resized crop, flip,
RandAugment (or colour jitter when RandAugment is off), to-tensor, normalise, random erasing.
This module draws the same parameters from the same distributions for a whole batch at once, on
the CPU from one seeded ``torch.Generator`` (so a batch's augmentation depends on (seed, epoch,
step) only, and the rank split of a global batch does not change it), then applies them to the
batch's uint8 images where they live (CPU or GPU) with ``grid_sample`` and tensor arithmetic.

What is the same as timm, and tested against it (tests/test_augment.py): the parameter
distributions (crop boxes from torchvision's rejection sampler, flip rate, RandAugment's op choice,
probability, magnitude noise and level functions read from timm's own parsed policy, colour
jitter's factors and order, erasing's rate, area and aspect ratio) and each RandAugment op's pixel
function against timm's PIL op. The random-resized crop is PIL's own two-pass resize written as
two batched matrix products (bicubic a = −0.5 or bilinear, antialiased when a crop shrinks),
within one grey level of PIL. What differs: RandAugment's rotate, shear and translate resample
with ``grid_sample``, whose bicubic kernel is a = −0.75 (PIL's is −0.5); they fill outside the
image with timm's fill colour as PIL does, but sample the edge pixels with border clamping.

Why not kornia: its RandAugment and random-resized crop sample their own distributions from the
global RNG of the data's device (not timm's, and not reproducible across ranks), and it needs a
compiled companion package (kornia-rs) that the GPU machine cannot install.

Supported: RandAugment policies ``rand-*`` (every op of timm's ``rand`` transform sets except
GaussianBlur/GaussianBlurRand), colour jitter (brightness, contrast, saturation; no hue), random
erasing with one box (modes pixel, rand, const), interpolation bicubic, bilinear or nearest.
Anything else is refused by :func:`check_supported` in one line; ``--loader workers`` runs it.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import CmhsaError
from ..options.training import RecipeConfig

RATIO = (3 / 4, 4 / 3)  # RandomResizedCrop's aspect-ratio range (timm's default)
INTERPOLATIONS = ("bicubic", "bilinear", "nearest")
GEOMETRIC = ("Rotate", "ShearX", "ShearY", "TranslateX", "TranslateY", "TranslateXRel", "TranslateYRel")
UNSUPPORTED_OPS = ("GaussianBlur", "GaussianBlurRand")


# the policy ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RandAugmentPolicy:
    """A timm ``rand-*`` policy as parsed by timm itself (``rand_augment_transform``)."""

    ops: tuple[str, ...]
    num_layers: int
    prob: float
    magnitude: float
    magnitude_std: float
    magnitude_max: float
    weights: tuple[float, ...] | None
    translate_pct: float
    translate_const: float

    @classmethod
    def parse(cls, config: str, img_size: tuple[int, int], mean: tuple[float, ...]) -> RandAugmentPolicy:
        from timm.data.auto_augment import rand_augment_transform

        hparams = dict(
            translate_const=int(min(img_size) * 0.45), img_mean=tuple(round(255 * m) for m in mean)
        )
        ra = rand_augment_transform(config, hparams)
        ops = tuple(op.name for op in ra.ops)
        bad = sorted(set(ops) & set(UNSUPPORTED_OPS))
        if bad:
            raise CmhsaError(
                f"`aa` {config!r}: the device loader has no {', '.join(bad)}; use `loader` workers"
            )
        op0 = ra.ops[0]
        weights = None if ra.choice_weights is None else tuple(float(w) for w in ra.choice_weights)
        return cls(
            ops,
            int(ra.num_layers),
            float(op0.prob),
            float(op0.magnitude),
            float(op0.magnitude_std),
            float(op0.magnitude_max or 10.0),
            weights,
            float(op0.hparams.get("translate_pct", 0.45)),
            float(op0.hparams["translate_const"]),
        )


@dataclass(frozen=True)
class AugmentSpec:
    """Everything the batch augmentation does, from a recipe (:func:`augment_spec`)."""

    out_size: tuple[int, int]
    scale: tuple[float, float]
    hflip: float
    interpolation: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    randaugment: RandAugmentPolicy | None
    color_jitter: float | None  # brightness = contrast = saturation strength; None: off
    reprob: float
    remode: str

    @property
    def fill(self) -> tuple[int, ...]:  # timm's RandAugment fill colour: the mean in 0..255
        return tuple(round(255 * m) for m in self.mean)


# the numbers an `aa` policy string may carry (timm's sections: rand-m9-n2-mstd0.5-mmax10-p0.5-inc1,
# augmix-m5-w3-d2-a1-b1): op counts and chain widths/depths of a few, magnitudes in timm's 0..10
# scale with room (mstd above 100 means uniform), probabilities and flags; bounded like any flag
AA_SECTIONS = {
    "n": 16,
    "m": 100,
    "mstd": 1000,
    "mmax": 100,
    "inc": 1,
    "p": 1,
    "w": 16,
    "d": 16,
    "a": 100,
    "b": 1,
}
MAX_AA_CHARS = 200


def check_aa_numbers(aa: str | None) -> None:
    """Every number in an ``aa`` policy string within :data:`AA_SECTIONS`'s range, before timm
    builds anything from it (``rand-n1000000`` would apply a million ops to every image)."""
    if aa in (None, "", "none"):
        return
    if len(aa) > MAX_AA_CHARS:
        raise CmhsaError(f"`aa` is {len(aa)} characters; a timm policy string is a few dozen")
    for section in str(aa).split("-")[1:]:
        m = re.fullmatch(r"([a-z]+)(\d[\d.]*)", section)
        if m is None or m.group(1) not in AA_SECTIONS:
            continue  # not a number (t..., a policy name): timm's own parser judges it
        key, value = m.group(1), m.group(2)
        try:
            x = float(value)
        except ValueError:
            raise CmhsaError(f"`aa` {aa!r}: {section!r} is not a number") from None
        if not 0 <= x <= AA_SECTIONS[key]:
            raise CmhsaError(f"`aa` {aa!r}: {key} must be 0 ≤ x ≤ {AA_SECTIONS[key]}, got {value}")


def check_supported(aa: str | None, interpolation: str, remode: str) -> None:
    """One line for what the device loader cannot do (``loader`` workers can)."""
    if aa not in (None, "", "none") and not str(aa).startswith("rand"):
        raise CmhsaError(
            f"`aa` {aa!r}: the device loader runs RandAugment (rand-*) only; use `loader` workers"
        )
    if interpolation not in INTERPOLATIONS:
        raise CmhsaError(
            f"`interpolation` {interpolation!r}: the device loader takes "
            f"{', '.join(INTERPOLATIONS)}; use `loader` workers"
        )
    if remode not in ("pixel", "rand", "const"):
        raise CmhsaError(f"`remode` {remode!r}: the device loader takes pixel, rand or const")


def augment_spec(
    cfg: RecipeConfig, out_size: tuple[int, int], mean: tuple[float, ...], std: tuple[float, ...]
) -> AugmentSpec:
    """The augmentation a recipe (``TrainConfig.recipe``) asks for, as timm's ``create_transform``
    would build it."""
    check_supported(cfg.aa, cfg.interpolation, cfg.remode)
    ra = None
    if cfg.aa not in (None, "", "none"):
        ra = RandAugmentPolicy.parse(cfg.aa, out_size, mean)
    jitter = None if ra is not None or not cfg.color_jitter else float(cfg.color_jitter)  # timm: off under RA
    return AugmentSpec(
        out_size,
        tuple(cfg.scale),
        float(cfg.hflip),
        cfg.interpolation,
        tuple(mean),
        tuple(std),
        ra,
        jitter,
        float(cfg.reprob),
        cfg.remode,
    )


# parameters --------------------------------------------------------------------------------------


@dataclass
class Params:
    """Per-sample parameters of a batch of n (CPU tensors, first dimension n)."""

    box: torch.Tensor  # (n, 4) int64: top, left, height, width of the crop
    flip: torch.Tensor  # (n,) bool
    ra_op: torch.Tensor  # (n, L) int64: index into the policy's ops
    ra_apply: torch.Tensor  # (n, L) bool
    ra_arg: torch.Tensor  # (n, L) float64: the op's argument (timm's level_fn of the magnitude)
    jitter: torch.Tensor  # (n, 3) float64: brightness, contrast, saturation factors
    jitter_order: torch.Tensor  # (n, 3) int64: a permutation of (0, 1, 2)
    erase: torch.Tensor  # (n, 5) int64: applied, top, left, height, width

    def split(self, size: int) -> list[Params]:
        """Consecutive blocks of ``size`` samples (one op per field, not per block)."""
        parts = [getattr(self, name).split(size) for name in PARAM_FIELDS]
        return [Params(*block) for block in zip(*parts, strict=True)]

    @staticmethod
    def cat(blocks: list[Params]) -> Params:
        """``blocks`` one after another, as one batch (one op per field, not per block)."""
        return Params(*(torch.cat([getattr(b, name) for b in blocks]) for name in PARAM_FIELDS))


# Params' field names, in order: a constant, so that torch.compile traces Params.cat inside the
# stacked step (dataclasses.fields there is a graph break)
PARAM_FIELDS = tuple(f.name for f in fields(Params))


def _uniform(n: int, lo: float, hi: float, g: torch.Generator, *shape: int) -> torch.Tensor:
    return lo + (hi - lo) * torch.rand(n, *shape, generator=g, dtype=torch.float64)


def crop_boxes(
    n: int, size: tuple[int, int], scale: tuple[float, float], ratio: tuple[float, float], g: torch.Generator
) -> torch.Tensor:
    """torchvision's / timm's RandomResizedCrop.get_params for n images of ``size`` (H, W): 10
    tries of (area, log-ratio), the first that fits wins, else the centre crop clamped to
    ``ratio``. Returns (n, 4) int64 top, left, height, width."""
    h_img, w_img = size
    area = h_img * w_img
    target = _uniform(n, scale[0], scale[1], g, 10) * area
    aspect = torch.exp(_uniform(n, math.log(ratio[0]), math.log(ratio[1]), g, 10))
    w = torch.round(torch.sqrt(target * aspect)).long()  # round half to even, as Python's round
    h = torch.round(torch.sqrt(target / aspect)).long()
    ok = (w <= w_img) & (h <= h_img)
    first = torch.where(ok.any(1), ok.long().argmax(1), torch.full((n,), -1))
    in_ratio = w_img / h_img
    if in_ratio < min(ratio):
        fw, fh = w_img, round(w_img / min(ratio))
    elif in_ratio > max(ratio):
        fw, fh = round(h_img * max(ratio)), h_img
    else:
        fw, fh = w_img, h_img
    pick = first.clamp(min=0)[:, None]
    bh = torch.where(first >= 0, h.gather(1, pick)[:, 0], fh)
    bw = torch.where(first >= 0, w.gather(1, pick)[:, 0], fw)
    u = torch.rand(n, 2, generator=g, dtype=torch.float64)  # randint(0, H - h) inclusive
    top = torch.where(first >= 0, (u[:, 0] * (h_img - bh + 1)).long(), (h_img - fh) // 2)
    left = torch.where(first >= 0, (u[:, 1] * (w_img - bw + 1)).long(), (w_img - fw) // 2)
    return torch.stack([top, left, bh, bw], 1)


def erase_boxes(n: int, size: tuple[int, int], prob: float, g: torch.Generator) -> torch.Tensor:
    """timm's RandomErasing (one box, area 0.02..1/3, aspect 0.3..1/0.3, 10 tries) for n images:
    (n, 5) int64 applied, top, left, height, width (applied 0 when skipped or no try fitted)."""
    h_img, w_img = size
    applied = torch.rand(n, generator=g, dtype=torch.float64) <= prob  # timm: skip if random() > p
    target = _uniform(n, 0.02, 1 / 3, g, 10) * (h_img * w_img)
    aspect = torch.exp(_uniform(n, math.log(0.3), math.log(1 / 0.3), g, 10))
    h = torch.round(torch.sqrt(target * aspect)).long()  # timm's erasing: h from area · aspect
    w = torch.round(torch.sqrt(target / aspect)).long()
    ok = (w < w_img) & (h < h_img)
    first = ok.long().argmax(1)[:, None]
    bh, bw = h.gather(1, first)[:, 0], w.gather(1, first)[:, 0]
    u = torch.rand(n, 2, generator=g, dtype=torch.float64)
    top, left = (u[:, 0] * (h_img - bh + 1)).long(), (u[:, 1] * (w_img - bw + 1)).long()
    return torch.stack([(applied & ok.any(1)).long(), top, left, bh, bw], 1)


def level_args(name: str, m: torch.Tensor, sign: torch.Tensor, policy: RandAugmentPolicy) -> torch.Tensor:
    """timm's LEVEL_TO_ARG[name](m) for a tensor of magnitudes (``sign`` ±1: its random negation)."""
    lv = m / 10.0
    if name == "Rotate":
        return lv * 30.0 * sign
    if name in ("ShearX", "ShearY"):
        return lv * 0.3 * sign
    if name in ("TranslateXRel", "TranslateYRel"):
        return lv * policy.translate_pct * sign
    if name in ("TranslateX", "TranslateY"):
        return lv * policy.translate_const * sign
    if name in ("Color", "Contrast", "Brightness", "Sharpness"):
        return lv * 1.8 + 0.1
    if name.endswith("Increasing") and name[: -len("Increasing")] in (
        "Color",
        "Contrast",
        "Brightness",
        "Sharpness",
    ):
        return (1.0 + lv * 0.9 * sign).clamp(min=0.1)
    if name == "Posterize":
        return torch.floor(lv * 4)
    if name == "PosterizeIncreasing":
        return 4 - torch.floor(lv * 4)
    if name == "PosterizeOriginal":
        return torch.floor(lv * 4) + 4
    if name == "Solarize":
        return torch.floor(lv * 256).clamp(max=256)
    if name == "SolarizeIncreasing":
        return 256 - torch.floor(lv * 256).clamp(max=256)
    if name == "SolarizeAdd":
        return torch.floor(lv * 110).clamp(max=128)
    if name == "Desaturate":
        return (1.0 - (0.5 + 0.5 * lv).clamp(0.5, 1.0)).clamp(0.0, 1.0)  # the Color factor it applies
    return torch.zeros_like(m)  # AutoContrast, Equalize, Invert: no argument


def sample_params(spec: AugmentSpec, n: int, in_size: tuple[int, int], g: torch.Generator) -> Params:
    """Every random choice of n samples' augmentation, drawn from ``g`` in a fixed order."""
    box = crop_boxes(n, in_size, spec.scale, RATIO, g)
    flip = torch.rand(n, generator=g, dtype=torch.float64) < spec.hflip  # torchvision: rand < p
    ra = spec.randaugment
    layers = ra.num_layers if ra else 0
    if ra is None:
        op = torch.zeros(n, 0, dtype=torch.long)
    elif ra.weights is None:  # np.random.choice(ops, L, replace=True)
        op = torch.randint(len(ra.ops), (n, layers), generator=g)
    else:  # np.random.choice(ops, L, replace=False, p=weights)
        w = torch.tensor(ra.weights, dtype=torch.float64).expand(n, -1)
        op = torch.multinomial(w, layers, replacement=False, generator=g)
    apply = torch.rand(n, layers, generator=g, dtype=torch.float64) <= (ra.prob if ra else 0.0)
    arg = torch.zeros(n, layers, dtype=torch.float64)
    if ra is not None:
        if ra.magnitude_std == float("inf"):
            m = _uniform(n, 0.0, ra.magnitude, g, layers)
        elif ra.magnitude_std > 0:
            m = ra.magnitude + ra.magnitude_std * torch.randn(n, layers, generator=g, dtype=torch.float64)
        else:
            m = torch.full((n, layers), ra.magnitude, dtype=torch.float64)
        m = m.clamp(0.0, ra.magnitude_max)
        sign = torch.where(torch.rand(n, layers, generator=g, dtype=torch.float64) > 0.5, -1.0, 1.0)
        for j, name in enumerate(ra.ops):
            sel = op == j
            arg[sel] = level_args(name, m[sel], sign[sel], ra)
    cj = spec.color_jitter or 0.0
    jitter = _uniform(n, max(0.0, 1 - cj), 1 + cj, g, 3)
    order = torch.rand(n, 3, generator=g).argsort(1)
    erase = erase_boxes(n, spec.out_size, spec.reprob, g)
    return Params(box, flip, op, apply, arg, jitter, order, erase)


# pixel functions (uint8 values held as float, (k, C, H, W)) --------------------------------------


def grey(x: torch.Tensor) -> torch.Tensor:
    """PIL's convert('L'): (R·19595 + G·38470 + B·7471 + 2^15) >> 16; grey images stay as they are."""
    if x.shape[1] == 1:
        return x
    w = torch.tensor([19595.0, 38470.0, 7471.0], device=x.device).view(1, 3, 1, 1)
    return torch.floor(((x * w).sum(1, keepdim=True) + 32768) / 65536)


def blend(degenerate: torch.Tensor, x: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """PIL's Image.blend for uint8 images: degenerate + f·(x − degenerate), clipped, truncated."""
    f = factor.view(-1, 1, 1, 1).to(x)
    return torch.floor((degenerate + f * (x - degenerate)).clamp(0, 255))  # not addcmul: it rounds otherwise


def grey_mean(g: torch.Tensor) -> torch.Tensor:
    """(n, 1, 1, 1): each grey image's mean level, rounded (PIL's ImageEnhance.Contrast)."""
    return torch.floor(g.mean((1, 2, 3), keepdim=True) + 0.5)


def brightness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return blend(torch.zeros_like(x), x, f)


def contrast(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return blend(grey_mean(grey(x)).expand_as(x), x, f)


def color(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    return blend(grey(x).expand_as(x), x, f)


def sharpness(x: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """PIL's ImageFilter.SMOOTH (3×3, centre 5, the rest 1, /13, rounded) inside, edges kept."""
    c = x.shape[1]
    k = torch.ones(3, 3, device=x.device)
    k[1, 1] = 5.0
    smooth = F.conv2d(x, (k / 13).expand(c, 1, 3, 3), groups=c)
    degenerate = x.clone()
    degenerate[:, :, 1:-1, 1:-1] = torch.floor(smooth + 0.5)
    return blend(degenerate, x, f)


def autocontrast(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """PIL's ImageOps.autocontrast (cutoff 0): each channel's min..max stretched to 0..255."""
    lo = x.amin((2, 3), keepdim=True)
    hi = x.amax((2, 3), keepdim=True)
    scale = 255.0 / (hi - lo).clamp(min=1)
    out = torch.floor(((x - lo) * scale).clamp(0, 255))
    return torch.where(hi > lo, out, x)


def equalize(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    """PIL's ImageOps.equalize per channel: step = (pixels − count of the last used level) // 255;
    lut[i] = (step // 2 + pixels below i) // step, at most 255; channels with one level or step 0
    unchanged."""
    k, c, h, w = x.shape
    v = x.long().view(k * c, h * w)
    hist = torch.zeros(k * c, 256, dtype=torch.long, device=x.device)
    hist.scatter_add_(1, v, torch.ones_like(v))
    levels = torch.arange(256, device=x.device)
    last = torch.where(hist > 0, levels, -1).amax(1, keepdim=True)
    step = (h * w - hist.gather(1, last)) // 255
    below = hist.cumsum(1) - hist
    lut = ((step // 2 + below) // step.clamp(min=1)).clamp(max=255)  # Image.point clips the table
    out = lut.gather(1, v).view(k, c, h, w).to(x)
    keep = (step == 0).view(k, c, 1, 1)
    return torch.where(keep, x, out)


def invert(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
    return 255 - x


def posterize(x: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Keep ``bits`` high bits (0 bits: a black image, as cmhsa's timm path does for Pillow ≥ 13)."""
    q = torch.pow(2.0, (8 - bits).clamp(0, 8)).view(-1, 1, 1, 1).to(x)
    return torch.floor(x / q) * q


def solarize(x: torch.Tensor, thresh: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= thresh.view(-1, 1, 1, 1).to(x), 255 - x, x)


def solarize_add(x: torch.Tensor, add: torch.Tensor) -> torch.Tensor:
    return torch.where(x < 128, (x + add.view(-1, 1, 1, 1).to(x)).clamp(max=255), x)


def affine(x: torch.Tensor, m: torch.Tensor, fill: tuple[int, ...], mode: str) -> torch.Tensor:
    """PIL's Image.transform(AFFINE, m): output pixel centre (x, y) reads the input at
    (m0·x + m1·y + m2, m3·x + m4·y + m5), pixel centres at i + 0.5; outside the image: ``fill``."""
    _k, c, h, w = x.shape
    m = m.to(device=x.device, dtype=torch.float32)
    ys = torch.arange(h, device=x.device, dtype=torch.float32) + 0.5
    xs = torch.arange(w, device=x.device, dtype=torch.float32) + 0.5
    gy, gx = torch.meshgrid(ys, xs, indexing="ij")
    sx = m[:, 0, None, None] * gx + m[:, 1, None, None] * gy + m[:, 2, None, None]
    sy = m[:, 3, None, None] * gx + m[:, 4, None, None] * gy + m[:, 5, None, None]
    inside = ((sx >= 0) & (sx < w) & (sy >= 0) & (sy < h))[:, None]
    grid = torch.stack([2 * sx / w - 1, 2 * sy / h - 1], -1)
    out = F.grid_sample(x, grid, mode=mode, padding_mode="border", align_corners=False)
    out = torch.floor(out.clamp(0, 255) + 0.5)
    f = torch.tensor(fill, device=x.device, dtype=x.dtype).view(1, -1, 1, 1).expand(1, c, 1, 1)
    return torch.where(inside, out, f)


def affine_matrix(name: str, a: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(k, 6) PIL affine matrices (output -> input) of timm's rotate / shear / translate ``name``
    with arguments ``a`` on h×w images."""
    one, zero = torch.ones_like(a), torch.zeros_like(a)
    if name == "Rotate":  # PIL Image.rotate: counter-clockwise about the centre
        t = -torch.deg2rad(a)
        cos, sin = torch.cos(t), torch.sin(t)
        cx, cy = w / 2.0, h / 2.0
        return torch.stack([cos, sin, cx - cos * cx - sin * cy, -sin, cos, cy + sin * cx - cos * cy], 1)
    if name == "ShearX":
        return torch.stack([one, a, zero, zero, one, zero], 1)
    if name == "ShearY":
        return torch.stack([one, zero, zero, a, one, zero], 1)
    rel = name.endswith("Rel")
    if name.startswith("TranslateX"):
        return torch.stack([one, zero, a * (w if rel else 1), zero, one, zero], 1)
    return torch.stack([one, zero, zero, zero, one, a * (h if rel else 1)], 1)


def geometric(name: str, x: torch.Tensor, a: torch.Tensor, fill: tuple[int, ...], mode: str) -> torch.Tensor:
    """One of timm's rotate / shear / translate on k images with their k arguments."""
    return affine(x, affine_matrix(name, a, x.shape[2], x.shape[3]), fill, mode)


POINT_OPS = {
    "AutoContrast": autocontrast,
    "Equalize": equalize,
    "Invert": invert,
    "Posterize": posterize,
    "Solarize": solarize,
    "SolarizeAdd": solarize_add,
    "Color": color,
    "Contrast": contrast,
    "Brightness": brightness,
    "Sharpness": sharpness,
    "Desaturate": color,
}


def apply_op(name: str, x: torch.Tensor, arg: torch.Tensor, spec: AugmentSpec) -> torch.Tensor:
    """One RandAugment op (timm's name) on k images with their k arguments."""
    if name in GEOMETRIC:
        return geometric(name, x, arg, spec.fill, spec.interpolation)
    for suffix in ("Increasing", "Original"):
        name = name.removesuffix(suffix)
    return POINT_OPS[name](x, arg)


# the batch -----------------------------------------------------------------------------------------


def _pil_filter(t: torch.Tensor, mode: str) -> torch.Tensor:
    """PIL's resampling filters: bicubic with a = −0.5 (support 2), bilinear (support 1)."""
    t = t.abs()
    if mode == "bilinear":
        return (1 - t).clamp(min=0)
    a = -0.5
    near = ((a + 2) * t - (a + 3)) * t * t + 1
    far = (((t - 5) * t + 8) * t - 4) * a
    return torch.where(t < 1, near, torch.where(t < 2, far, torch.zeros_like(t)))


def made_once(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn``'s result cached per arguments in eager code; inside a graph torch.compile is
    tracing, ``fn`` itself (its result becomes a constant of the graph)."""
    cached = functools.lru_cache(maxsize=16)(fn)

    @functools.wraps(fn)
    def get(*args: Any) -> torch.Tensor:
        return fn(*args) if torch.compiler.is_compiling() else cached(*args)

    return get


@made_once
def resize_table(size_in: int, size_out: int, mode: str, device: str = "cpu") -> torch.Tensor:
    """(size_in, size_out, size_in) float32: row L − 1 holds the weights of PIL's resize of a crop
    of length L to ``size_out`` (Resample.c's precompute_coeffs), in crop coordinates. Output u is
    centred at (u + 0.5)·scale in the crop, taps within the filter's support (scaled by ``scale``
    when shrinking: antialiased) and inside the crop, normalised to sum 1. Made once per image
    size: a batch's crops then cost an index and a gather (:func:`resize_weights`)."""
    support = 2.0 if mode == "bicubic" else 1.0
    lengths = torch.arange(1, size_in + 1, dtype=torch.float64)
    scale = (lengths / size_out)[:, None, None]  # (L, 1, 1)
    fscale = scale.clamp(min=1.0)
    centre = (torch.arange(size_out, dtype=torch.float64)[None, :, None] + 0.5) * scale  # (L, out, 1)
    pos = torch.arange(size_in, dtype=torch.float64)[None, None, :]  # in the crop
    lo = torch.trunc(centre - support * fscale + 0.5).clamp(min=0)
    hi = torch.minimum(torch.trunc(centre + support * fscale + 0.5), lengths[:, None, None])
    w = _pil_filter((pos - centre + 0.5) / fscale, mode) * ((pos >= lo) & (pos < hi))
    return (w / w.sum(-1, keepdim=True)).float().to(device)


@made_once
def _positions(size: int, device: str) -> torch.Tensor:
    return torch.arange(size, device=device)


def resize_weights(
    start: torch.Tensor, length: torch.Tensor, size_in: int, size_out: int, mode: str
) -> torch.Tensor:
    """(..., size_out, size_in) weights of PIL's resize of each crop [start, start + length) of an
    axis to ``size_out``: :func:`resize_table`'s row for each crop's length, shifted to its start
    (``start``, ``length``: (...) int64). On their device, in a fixed number of ops."""
    dev = str(start.device)
    table = resize_table(size_in, size_out, mode, dev)
    rel = _positions(size_in, dev) - start[..., None]  # (..., size_in): image position in each crop
    idx = rel.clamp(min=0).unsqueeze(-2).expand(*rel.shape[:-1], size_out, size_in)
    return table[length - 1].gather(-1, idx) * (rel >= 0).unsqueeze(-2)


def resized_crop(x: torch.Tensor, box: torch.Tensor, flip: torch.Tensor, size: tuple[int, int], mode: str):
    """Each image's box resized to ``size`` as torchvision's ``resized_crop`` does on a PIL image
    (crop, then PIL's two-pass resize: horizontal, rounded to uint8, then vertical, rounded), then
    mirrored where ``flip``. Bicubic and bilinear are PIL's filters (antialiased when a crop
    shrinks); nearest reads the pixel under each output centre."""
    _, _, h_in, w_in = x.shape
    h, w = size
    dev = x.device
    if mode == "nearest":
        b = box.to(device=dev, dtype=torch.float32)
        u = torch.arange(w, device=dev, dtype=torch.float32) + 0.5
        v = torch.arange(h, device=dev, dtype=torch.float32) + 0.5
        cols = (b[:, 1, None] + u * (b[:, 3, None] / w)).floor().long().clamp(0, w_in - 1)  # (n, w)
        rows = (b[:, 0, None] + v * (b[:, 2, None] / h)).floor().long().clamp(0, h_in - 1)  # (n, h)
        out = x.gather(2, rows[:, None, :, None].expand(-1, x.shape[1], -1, w_in))
        out = out.gather(3, cols[:, None, None, :].expand(-1, x.shape[1], h, -1))
    else:
        b = box.to(dev)
        if (h_in, h) == (w_in, w):  # both axes' weights in one lookup
            wy, wx = resize_weights(b[:, :2], b[:, 2:], h_in, h, mode).unbind(1)
        else:
            wy = resize_weights(b[:, 0], b[:, 2], h_in, h, mode)
            wx = resize_weights(b[:, 1], b[:, 3], w_in, w, mode)
        n, c = x.shape[:2]
        out = torch.bmm(x.view(n, c * h_in, w_in), wx.transpose(1, 2))  # horizontal pass: (n, C·H, w)
        out = torch.floor(out.clamp(0, 255) + 0.5)
        if c == 1:  # vertical pass
            out = torch.bmm(wy, out).view(n, 1, h, w)
        else:
            out = torch.matmul(wy[:, None], out.view(n, c, h_in, w))
        out = torch.floor(out.clamp(0, 255) + 0.5)  # (n, C, h, w)
    flip = flip.to(dev).view(-1, 1, 1, 1)
    return torch.where(flip, out.flip(-1), out)


@made_once
def _levels(values: tuple[float, ...], device: str) -> torch.Tensor:
    """(1, C, 1, 1) float32 per-channel constants × 255 (made once, not per batch)."""
    return torch.tensor(values, dtype=torch.float32, device=device).view(1, -1, 1, 1) * 255


def normalise(x: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """ToTensor + Normalize on 0..255 values: (x / 255 − mean) / std, per channel."""
    dev = str(x.device)
    return (x - _levels(tuple(mean), dev)) / _levels(tuple(std), dev)


def augment(images: torch.Tensor, p: Params, spec: AugmentSpec, noise: torch.Tensor | None) -> torch.Tensor:
    """(n, C, H, W) uint8 images -> (n, C, h, w) float32, augmented as ``p`` says and normalised.
    ``noise``: (n, C, h, w) standard normals for erasing in mode pixel (its first channel-column
    in mode rand); None when ``spec.reprob`` is 0."""
    dev = images.device
    x = resized_crop(images.float(), p.box, p.flip, spec.out_size, spec.interpolation)
    ra = spec.randaugment
    if ra is not None:
        for layer in range(ra.num_layers):
            op, applied, arg = p.ra_op[:, layer], p.ra_apply[:, layer], p.ra_arg[:, layer]
            geo = torch.tensor([name in GEOMETRIC for name in ra.ops])[op] & applied
            if geo.any():  # every geometric op of this layer in one resampling
                sel = torch.nonzero(geo)[:, 0]
                m = torch.zeros(len(sel), 6, dtype=torch.float64)
                for j in torch.unique(op[sel]).tolist():
                    rows = op[sel] == j
                    m[rows] = affine_matrix(ra.ops[j], arg[sel][rows], *spec.out_size)
                sd = sel.to(dev)
                x[sd] = affine(x[sd], m, spec.fill, spec.interpolation)
            for j in torch.unique(op[applied & ~geo]).tolist():
                sel = torch.nonzero(applied & (op == j))[:, 0]
                sd = sel.to(dev)
                x[sd] = apply_op(ra.ops[j], x[sd], arg[sel].to(dev), spec)
    elif spec.color_jitter:
        x = color_jitter(x, p.jitter.to(dev), p.jitter_order.to(dev))
    x = normalise(x, spec.mean, spec.std)
    if spec.reprob > 0:
        x = erase(x, p.erase.to(dev), spec.remode, noise)
    return x


def color_jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """torchvision's ColorJitter (brightness, contrast, saturation) on PIL images, batched: slot s
    applies op ``order[:, s]`` (0 brightness, 1 contrast, 2 saturation) with its factor from
    ``factors`` (n, 3). Each is a PIL blend towards a degenerate image (black, the grey mean, the
    grey image), so a slot is one blend whose degenerate image is picked per sample."""
    n = x.shape[0]
    f = factors.gather(1, order).to(x)  # (n, 3): slot s's factor
    plan = torch.stack(
        [f, (order == 1).to(x), (order == 2).to(x)], 1
    )  # (n, 3, 3): factor, contrast?, colour?
    for slot in plan.view(n, 3, 3, 1, 1, 1).unbind(2):
        factor, is_contrast, is_colour = slot.unbind(1)  # (n, 1, 1, 1) each
        g = grey(x)
        d = torch.addcmul(grey_mean(g) * is_contrast, g, is_colour)  # exact: the picks are 0 or 1
        x = blend(d, x, factor)
    return x


def erase(x: torch.Tensor, e: torch.Tensor, mode: str, noise: torch.Tensor | None) -> torch.Tensor:
    """timm's RandomErasing with the boxes ``e`` (applied, top, left, height, width)."""
    _n, _c, h, w = x.shape
    rows = torch.arange(h, device=x.device)[None, :, None]
    cols = torch.arange(w, device=x.device)[None, None, :]
    top, left, bh, bw = (e[:, i, None, None] for i in range(1, 5))
    mask = (e[:, 0, None, None] > 0) & (rows >= top) & (rows < top + bh) & (cols >= left) & (cols < left + bw)
    if mode == "pixel":
        value = noise
    elif mode == "rand":
        value = noise[:, :, :1, :1].expand_as(x)
    else:
        value = torch.zeros_like(x)
    return torch.where(mask[:, None], value.to(x), x)
