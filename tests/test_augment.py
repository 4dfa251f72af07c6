"""The device loader's batch augmentation (train/augment.py) against timm's per-image path.

References are timm's and torchvision's own code: ``RandomResizedCropAndInterpolation.get_params``,
``RandomErasing``, ``rand_augment_transform`` with its ops recorded as they run, the PIL ops in
``timm.data.auto_augment`` and timm's eval transform. Distributions are compared with two-sample
tests (Kolmogorov-Smirnov, chi-square) at fixed seeds, so each test is deterministic; the bound
p > 1e-3 would flag a real difference of a few percent at these sample sizes.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from PIL import Image
from scipy import stats

from convit_convert.errors import CmhsaError
from convit_convert.loaders import EpochSampler, build_transform, channel_stats
from convit_convert.options.training import TrainConfig
from convit_convert.train import augment as A
from convit_convert.train.held import HeldEvalLoader, HeldLoader, eval_view

N = 20_000


def spec_for(cfg: TrainConfig, size=(28, 28), chans=3) -> A.AugmentSpec:
    mean, std = channel_stats(chans)
    return A.augment_spec(cfg.recipe, size, mean, std)


# parameters --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("size", "scale"), [((28, 28), (0.08, 1.0)), ((20, 36), (0.5, 1.0)), ((8, 40), (0.9, 1.0))]
)
def test_crop_boxes_follow_timms_sampler(size, scale) -> None:
    """Area fraction, aspect ratio, offsets and the centre-crop fallback (the 8×40 image needs it
    often: no box of 90 % of its area fits the 3/4..4/3 ratio)."""
    from timm.data.transforms import RandomResizedCropAndInterpolation

    random.seed(0)
    img = Image.new("RGB", (size[1], size[0]))
    ref = np.array([RandomResizedCropAndInterpolation.get_params(img, scale, A.RATIO) for _ in range(N)])
    ours = A.crop_boxes(N, size, scale, A.RATIO, torch.Generator().manual_seed(0)).numpy()
    for b in (ref, ours):
        assert (b[:, 0] >= 0).all() and (b[:, 0] + b[:, 2] <= size[0]).all()
        assert (b[:, 1] >= 0).all() and (b[:, 1] + b[:, 3] <= size[1]).all()
    for stat in (
        lambda b: b[:, 2] * b[:, 3],  # area
        lambda b: np.log(b[:, 3] / b[:, 2]),  # aspect
        lambda b: b[:, 0],  # top
        lambda b: b[:, 1],  # left
    ):
        assert stats.ks_2samp(stat(ref), stat(ours)).pvalue > 1e-3
    full = lambda b: np.mean((b[:, 2] == size[0]) | (b[:, 3] == size[1]))  # noqa: E731
    assert abs(full(ref) - full(ours)) < 0.02


def test_erasing_follows_timms() -> None:
    """timm's RandomErasing (p 0.25, pixel mode, one box) run on zero images: how often and how
    much it erases, against ours."""
    from timm.data.random_erasing import RandomErasing

    random.seed(0)
    torch.manual_seed(0)
    n, size = 8000, (24, 32)
    x = torch.zeros(n, 1, *size)
    RandomErasing(0.25, mode="pixel", device="cpu")(x)
    ref_area = (x != 0).flatten(1).float().mean(1).numpy()
    e = A.erase_boxes(n, size, 0.25, torch.Generator().manual_seed(0))
    erased = A.erase(torch.zeros(n, 1, *size), e, "pixel", torch.randn(n, 1, *size) + 10)
    our_area = (erased != 0).flatten(1).float().mean(1).numpy()
    assert abs((ref_area > 0).mean() - (our_area > 0).mean()) < 0.02  # rate: 0.25, sd 0.005
    assert stats.ks_2samp(ref_area[ref_area > 0], our_area[our_area > 0]).pvalue > 1e-3


@pytest.mark.parametrize("policy", ["rand-m9-mstd0.5-inc1", "rand-m7-n3-mstd1-p0.7", "rand-m9-mstd101"])
def test_randaugment_ops_magnitudes_and_args_follow_timms(policy: str) -> None:
    """timm's RandAugment on an image, every op call recorded with its argument, against our
    sampled (op, applied, argument): the op set, how often each op runs and its arguments."""
    from timm.data.auto_augment import rand_augment_transform

    spec = spec_for(TrainConfig.from_flags(aa=policy), (32, 32))
    ra = rand_augment_transform(policy, {"translate_const": 14, "img_mean": spec.fill})
    calls: list[tuple[str, float]] = []
    for op in ra.ops:
        op.aug_fn = lambda img, *a, _name=op.name, **_: (calls.append((_name, a[0] if a else 0.0)), img)[1]
    random.seed(0)
    np.random.seed(0)
    img = Image.new("RGB", (32, 32))
    n = 6000
    for _ in range(n):
        ra(img)
    policy_ = spec.randaugment
    assert policy_.ops == tuple(op.name for op in ra.ops) and policy_.num_layers == ra.num_layers
    p = A.sample_params(spec, n, (32, 32), torch.Generator().manual_seed(0))
    ours = [
        (policy_.ops[j], a)
        for j, a, on in zip(
            p.ra_op.flatten().tolist(),
            p.ra_arg.flatten().tolist(),
            p.ra_apply.flatten().tolist(),
            strict=True,
        )
        if on
    ]
    names = list(policy_.ops)
    counts = [
        [sum(c[0] == nm for c in calls) for nm in names],
        [sum(c[0] == nm for c in ours) for nm in names],
    ]
    assert stats.chi2_contingency(counts).pvalue > 1e-3
    for nm in names:
        a = [v for k, v in calls if k == nm]
        b = [v for k, v in ours if k == nm]
        if len(set(a)) > 1:
            assert stats.ks_2samp(a, b).pvalue > 1e-3, nm
        else:
            assert set(a) == set(b), nm


def test_flip_and_colour_jitter_parameters() -> None:
    cfg = TrainConfig.from_flags(aa="none", color_jitter=0.3, hflip=0.5)
    p = A.sample_params(spec_for(cfg), N, (28, 28), torch.Generator().manual_seed(0))
    assert abs(p.flip.double().mean().item() - 0.5) < 0.015  # 4 standard deviations
    assert p.jitter.min() >= 0.7 and p.jitter.max() <= 1.3 and abs(p.jitter.mean() - 1.0) < 0.01
    orders = {tuple(r) for r in p.jitter_order.tolist()}
    assert len(orders) == 6  # every order of brightness, contrast, saturation (torchvision: randperm)
    assert (
        spec_for(TrainConfig.from_flags(aa="rand-m9-mstd0.5-inc1", color_jitter=0.3)).color_jitter is None
    )  # timm: off under RA


def test_unsupported_augmentation_is_one_line() -> None:
    with pytest.raises(CmhsaError, match=r"RandAugment \(rand-\*\) only"):
        A.check_supported("original", "bicubic", "pixel")
    with pytest.raises(CmhsaError, match="`interpolation` 'random'"):
        A.check_supported(None, "random", "pixel")
    with pytest.raises(CmhsaError, match="GaussianBlur"):
        spec_for(TrainConfig.from_flags(aa="rand-m9-t3a"))


# pixels ------------------------------------------------------------------------------------------

OPS = [
    ("AutoContrast", 0.0),
    ("Equalize", 0.0),
    ("Invert", 0.0),
    ("Posterize", 2),
    ("Posterize", 0),
    ("Solarize", 100),
    ("SolarizeAdd", 50),
    ("Color", 0.3),
    ("Color", 1.7),
    ("Contrast", 0.4),
    ("Contrast", 1.6),
    ("Brightness", 0.5),
    ("Brightness", 1.5),
    ("Sharpness", 0.2),
    ("Sharpness", 1.8),
    ("Rotate", 17.0),
    ("Rotate", -25.0),
    ("ShearX", 0.2),
    ("ShearY", -0.3),
    ("TranslateXRel", 0.3),
    ("TranslateYRel", -0.2),
]


@pytest.mark.parametrize("chans", [3, 1])
@pytest.mark.parametrize(("name", "arg"), OPS)
def test_ops_match_timms_pil_ops(name: str, arg: float, chans: int) -> None:
    """Each op against timm's PIL function on a random image (bilinear, where PIL and
    grid_sample use the same kernel): within one grey level (PIL rounds its float results in
    fixed point), and exact for the table and blend ops."""
    from timm.data import auto_augment as aa

    rng = np.random.default_rng(0)
    shape = (20, 24, 3) if chans == 3 else (20, 24)
    img = rng.integers(0, 256, size=shape, dtype=np.uint8)
    img[:5] = rng.integers(40, 60, size=img[:5].shape)  # a flat region (Equalize, AutoContrast)
    mean = (0.485, 0.456, 0.406) if chans == 3 else (0.449,)
    spec = A.AugmentSpec((20, 24), (0.08, 1.0), 0.5, "bilinear", mean, mean, None, None, 0.0, "pixel")
    fill = spec.fill if chans == 3 else spec.fill[0]
    if name == "Posterize" and arg == 0:
        ref = np.zeros_like(img)  # cmhsa's timm path: 0 bits is a black image (data._posterize)
    else:
        args = () if name in ("AutoContrast", "Equalize", "Invert") else (arg,)
        ref = np.asarray(
            aa.NAME_TO_OP[name](Image.fromarray(img), *args, fillcolor=fill, resample=Image.BILINEAR)
        )
    x = torch.from_numpy(img).float()
    x = x[None, None] if chans == 1 else x.permute(2, 0, 1)[None]
    out = A.apply_op(name, x, torch.tensor([float(arg)], dtype=torch.float64), spec)[0]
    out = out[0] if chans == 1 else out.permute(1, 2, 0)
    diff = np.abs(out.numpy().astype(int) - ref.astype(int))
    exact = name not in A.GEOMETRIC and name != "AutoContrast"
    assert diff.max() <= (0 if exact else 1), (name, diff.max())


@pytest.mark.parametrize("chans", [3, 1])
def test_colour_jitter_matches_pil_applied_in_each_samples_order(chans: int) -> None:
    """The batched colour jitter against PIL's ImageEnhance (what torchvision's ColorJitter calls
    on a PIL image) applied image by image, op by op in each sample's order, with its factors:
    exact, since every op is a PIL blend (as for the RandAugment ops above). 12 images, every one
    of the 6 orders twice."""
    from PIL import ImageEnhance

    rng = np.random.default_rng(1)
    n = 12
    shape = (n, 10, 9, 3) if chans == 3 else (n, 10, 9)
    imgs = rng.integers(0, 256, size=shape, dtype=np.uint8)
    factors = torch.from_numpy(rng.uniform(0.2, 1.8, size=(n, 3)))  # --color-jitter up to 0.8
    orders = torch.tensor([p for p in itertools.permutations(range(3))] * 2)
    enhance = (ImageEnhance.Brightness, ImageEnhance.Contrast, ImageEnhance.Color)
    refs = []
    for img, f, order in zip(imgs, factors.tolist(), orders.tolist(), strict=True):
        im = Image.fromarray(img)
        for op in order:
            im = enhance[op](im).enhance(f[op])
        refs.append(np.asarray(im))
    x = torch.from_numpy(imgs).float()
    x = x[:, None] if chans == 1 else x.permute(0, 3, 1, 2)
    out = A.color_jitter(x, factors, orders)
    out = out[:, 0] if chans == 1 else out.permute(0, 2, 3, 1)
    assert np.array_equal(out.numpy().astype(np.uint8), np.stack(refs))


@pytest.mark.parametrize("mode", ["bicubic", "bilinear"])
def test_resized_crop_and_flip_match_pil(mode: str) -> None:
    """The random-resized crop's resampling against torchvision's resized_crop on a PIL image
    (crop, then PIL's resize): a whole image and a crop upsampled 13 -> 28 px, a crop shrunk
    40×30 -> 16 px (PIL antialiases), and a flipped one; within one grey level (PIL computes in
    fixed point)."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    rng = np.random.default_rng(1)
    for size_in, out, boxes in (
        ((13, 13), (28, 28), [[0, 0, 13, 13], [2, 3, 8, 9], [2, 3, 8, 9]]),
        ((64, 50), (16, 16), [[5, 7, 40, 30], [0, 0, 64, 50], [20, 1, 44, 49]]),
    ):
        img = rng.integers(0, 256, size=(*size_in, 3), dtype=np.uint8)
        x = torch.from_numpy(img).permute(2, 0, 1)[None].float().repeat(3, 1, 1, 1)
        flip = torch.tensor([False, False, True])
        ours = A.resized_crop(x, torch.tensor(boxes), flip, out, mode).permute(0, 2, 3, 1).numpy()
        for k, (top, left, h, w) in enumerate(boxes):
            ref = TF.resized_crop(Image.fromarray(img), top, left, h, w, list(out), InterpolationMode(mode))
            ref = np.asarray(TF.hflip(ref) if flip[k] else ref).astype(int)
            assert np.abs(ours[k] - ref).max() <= 1, (size_in, boxes[k])


def test_eval_view_matches_timms_eval_transform() -> None:
    """Resize (shorter side to floor(28 / 0.875) = 32, bicubic, antialiased) and centre crop,
    done once on the whole split, against timm's per-image eval transform: within one grey level
    (torchvision's tensor resize rounds where PIL's fixed-point resize truncates)."""
    rng = np.random.default_rng(2)
    imgs = rng.integers(0, 256, size=(5, 28, 28, 3), dtype=np.uint8)
    tf = build_transform((28, 28), False, None, 3)
    mean, std = channel_stats(3)
    ref = torch.stack([tf(Image.fromarray(i)) for i in imgs])
    view = eval_view(torch.from_numpy(imgs).permute(0, 3, 1, 2).contiguous(), (28, 28), 0.875, "bicubic")
    x, _ = next(iter(HeldEvalLoader(view, torch.zeros(5, dtype=torch.long), 8, mean, std)))
    assert ((x - ref).abs() * torch.tensor(std).view(1, 3, 1, 1) * 255).max() <= 1.0 + 1e-4


# the loader --------------------------------------------------------------------------------------


def test_batches_do_not_depend_on_the_rank_split_and_resume_at_any_step() -> None:
    """Full DeiT augmentation (RandAugment, erasing): one process of batch 16 against two ranks
    of batch 8 (their rows side by side), and a loader started at step 2 of the epoch."""
    cfg = TrainConfig.from_flags()
    spec = spec_for(cfg, (16, 16))
    assert spec.randaugment is not None and spec.reprob > 0
    images = torch.randint(0, 256, (64, 3, 12, 12), dtype=torch.uint8)
    labels = torch.arange(64)

    def loader(rank: int, world: int, bs: int) -> HeldLoader:
        s = EpochSampler(64, rank=rank, world=world, batch_size=bs, seed=5, shuffle=True)
        s.set_epoch(3)
        return HeldLoader(images, labels, s, spec, seed=5)

    one = list(loader(0, 1, 16))
    two = [list(loader(r, 2, 8)) for r in range(2)]
    assert len(one) == len(two[0]) == 4
    for j, (x, y) in enumerate(one):
        assert torch.equal(torch.cat([two[0][j][0], two[1][j][0]]), x)
        assert torch.equal(torch.cat([two[0][j][1], two[1][j][1]]), y)
    late = loader(0, 1, 16)
    late.sampler.set_epoch(3, start_batch=2)
    rest = list(late)
    assert len(rest) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(rest, one[2:], strict=True))
    other = loader(0, 1, 16)
    other.sampler.set_epoch(4)
    assert not torch.equal(next(iter(other))[0], one[0][0])


@pytest.mark.parametrize("aa", ["none", "rand-m9-mstd0.5-inc1"])
def test_augmented_images_match_timms_in_distribution(aa: str) -> None:
    """scikit-learn's digits (grey, 8 px) augmented to 28 px by timm's per-image transform
    (crop 0.5-1, flip, colour jitter 0.3 or RandAugment) and by the batch path: the same pixel
    mean, spread and mean horizontal gradient (how sharp the images are), 1,000 images each.
    Tolerances from the batch path's own draw-to-draw spread on these images (6 seeds: mean
    σ 0.015, spread σ 0.8%): 0.05 and 3% are about 2.5-3 σ of the difference of two draws."""
    from convit_convert.data import build_data
    from convit_convert.loaders import Seeded
    from convit_convert.train.held import hold

    spec = build_data("digits", None, (28, 28))
    cfg = TrainConfig.from_flags(aa=aa, mixup=0.0, cutmix=0.0, reprob=0.0, scale=(0.5, 1.0))
    timm_path = Seeded(spec.train, build_transform((28, 28), True, cfg.recipe, 1), 0, "L")
    ref = torch.stack([timm_path[(0, i)][0] for i in range(1000)])
    x, _ = hold(spec.train, 1, torch.device("cpu"), 64)
    aug = spec_for(cfg, (28, 28), chans=1)
    ours = A.augment(
        x[:1000], A.sample_params(aug, 1000, (8, 8), torch.Generator().manual_seed(0)), aug, None
    )
    assert ours.mean().item() == pytest.approx(ref.mean().item(), abs=0.05)
    assert ours.std().item() == pytest.approx(ref.std().item(), rel=0.03)
    sharp = lambda t: (t[..., 1:] - t[..., :-1]).abs().mean().item()  # noqa: E731
    assert sharp(ours) == pytest.approx(sharp(ref), rel=0.03)


def test_auto_loader_holds_what_fits_and_says_why_not(tmp_path) -> None:
    """`loader` auto: one-size image folders are held (as PIL converts them: grey from RGB by
    PIL's weights), mixed sizes and unsupported augmentation fall back to workers with a reason."""
    from convit_convert.data import build_data
    from convit_convert.train.build import choose_loader
    from convit_convert.train.held import hold

    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(2):
                Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(
                    tmp_path / split / c / f"{i}.png"
                )
    spec = build_data("imagefolder", tmp_path, (16, 16))
    assert choose_loader(TrainConfig.from_flags(), spec, 3, (16, 16)) == ("device", "")
    x, y = hold(spec.train, 1, torch.device("cpu"), 64)
    path, label = spec.train.samples[0]
    assert x.shape == (4, 1, 10, 12) and y[0] == label
    assert torch.equal(x[0, 0], torch.from_numpy(np.array(Image.open(path).convert("L"))))
    assert choose_loader(TrainConfig.from_flags(aa="original"), spec, 3, (16, 16))[0] == "workers"
    Image.fromarray(np.zeros((5, 5, 3), dtype=np.uint8)).save(tmp_path / "train" / "a" / "small.png")
    loader, why = choose_loader(
        TrainConfig.from_flags(), build_data("imagefolder", tmp_path, (16, 16)), 3, (16, 16)
    )
    assert loader == "workers" and "not all one size" in why


def test_the_posterize_fix_stays_in_cmhsa_s_transforms() -> None:
    """build_transform gives its RandAugment ops data._posterize (0 bits: a black image, as Pillow < 13
    did) without rewriting timm's table for the rest of the process."""
    from types import SimpleNamespace

    from timm.data import auto_augment

    from convit_convert.loaders import _posterize, build_transform

    before = dict(auto_augment.NAME_TO_OP)
    recipe = SimpleNamespace(
        scale=(0.08, 1.0), hflip=0.5, color_jitter=0.4, aa="rand-m9-mstd0.5-inc1", interpolation="bicubic"
    )
    recipe.reprob, recipe.remode = 0.25, "pixel"
    tf = build_transform((32, 32), True, recipe, 3)
    ops = [op for t in tf.transforms if hasattr(t, "ops") for op in t.ops]
    assert any(op.name.startswith("Posterize") for op in ops)
    assert all(op.aug_fn is _posterize for op in ops if op.name.startswith("Posterize"))
    assert before == auto_augment.NAME_TO_OP
