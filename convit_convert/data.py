"""Datasets and loaders: CIFAR-10/100, an image folder, scikit-learn's digits, Fashion-MNIST (IDX files),
synthetic images.

Every source yields (PIL image, label) and goes through timm's ``create_transform`` (DeiT's
augmentation in training). Determinism: the loader's sampler yields ``(epoch, index)`` pairs and
each sample's augmentation is seeded from (seed, epoch, index), so a run's batches do not depend on
the number of workers, the number of processes, or where a run was stopped and resumed.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, Subset

from .errors import CmhsaError, first_line
from .io.folder import make_folder, remove_made
from .io.images import open_image, read_image
from .io.paths import open_regular, require_regular
from .labels import DIGITS, FASHION_MNIST, recordable
from .options.values import DATASETS, EVAL_CROP_PCT, EVAL_INTERPOLATION, MAX_DEFAULT_WORKERS
from .resources import check_fits

NEEDS_DIR = ("cifar10", "cifar100", "imagefolder")  # the datasets only `data_dir` can give
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist
MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch, index) over the seed space


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * MIX + epoch) * MIX + index) % (1 << 63)


@dataclass
class DataSpec:
    """What the model needs to know about a dataset: its splits, classes, and the channels its
    images carry (1: grey, which a 3-channel model sees three times over)."""

    train: Dataset
    val: Dataset
    num_classes: int
    in_chans: int = 3
    classes: tuple[str, ...] | None = None  # the outputs' names, where known (labels.py)


class ArrayImages(Dataset):
    """(N, H, W, 3) uint8 images and labels held in memory, served as PIL images."""

    def __init__(self, images: np.ndarray, labels: Sequence[int]) -> None:
        self.images, self.labels = images, [int(v) for v in labels]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Any, int]:
        from PIL import Image

        return Image.fromarray(self.images[i]), self.labels[i]


def digits(val_fraction: float = 0.2, seed: int = 0) -> DataSpec:
    """scikit-learn's bundled 8×8 digits (1797 images, 10 classes), as grey RGB; a fixed split."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise CmhsaError(
            "`data` digits needs scikit-learn: pip install 'cmhsa[digits]' (in a "
            "source checkout: pip install -e '.[digits]')"
        ) from None
    d = load_digits()
    img = np.clip(d.images * (255.0 / 16.0), 0, 255).astype(np.uint8)
    img = np.repeat(img[..., None], 3, axis=3)
    perm = np.random.default_rng(seed).permutation(len(img))
    n_val = round(len(img) * val_fraction)
    val, train = perm[:n_val], perm[n_val:]
    return DataSpec(
        ArrayImages(img[train], d.target[train]),
        ArrayImages(img[val], d.target[val]),
        10,
        in_chans=1,
        classes=DIGITS,
    )


def synthetic(
    img_size: tuple[int, int], num_classes: int = 10, n_train: int = 512, n_val: int = 128, seed: int = 0
) -> DataSpec:
    """Learnable noise: each class is a fixed random low-frequency colour pattern; a sample is its
    class's pattern, randomly shifted, plus pixel noise. For tests and smoke runs."""
    h, w = img_size
    # float64 while it is made: the images, their noise and the result, and the class templates
    check_fits(8 * h * w * 3 * (3 * (n_train + n_val) + num_classes), f"synthetic data at {h}x{w} px")
    rng = np.random.default_rng(seed)
    coarse = rng.uniform(0, 255, size=(num_classes, 4, 4, 3))
    templates = coarse.repeat(-(-h // 4), axis=1)[:, :h].repeat(-(-w // 4), axis=2)[:, :, :w]

    def make(n: int) -> ArrayImages:
        labels = rng.integers(0, num_classes, size=n)
        shifts = rng.integers(-max(1, h // 8), max(1, h // 8) + 1, size=(n, 2))
        imgs = np.stack(
            [np.roll(templates[c], tuple(s), axis=(0, 1)) for c, s in zip(labels, shifts, strict=True)]
        )
        imgs = 0.7 * imgs + rng.normal(0, 40, size=imgs.shape)
        return ArrayImages(np.clip(imgs, 0, 255).astype(np.uint8), labels)

    return DataSpec(make(n_train), make(n_val), num_classes)


IDX_RANKS = {"images": 3, "labels": 1}
MAX_IDX_BYTES = 2**31  # the data an IDX file may hold (Fashion-MNIST's training images: 47 MB)


def read_idx(path: Path, rank: int | None = None) -> np.ndarray:
    """An IDX file (gzipped or not) as a uint8 array: the format MNIST and Fashion-MNIST ship in.
    The header is checked (rank, every dimension at least 1, at most MAX_IDX_BYTES of data) before
    the data is read, and no more than the header's size is ever decompressed (a gzip bomb stops
    there); a truncated or corrupt file is CmhsaError."""
    import gzip
    import zlib

    def exact(f: Any, n: int) -> bytes:
        data = f.read(n)
        if len(data) != n:
            raise CmhsaError(f"truncated: the IDX header promises {n:,} more bytes than the file holds", path)
        return data

    try:
        with open_regular(path, what="IDX file") as raw:
            f: Any = gzip.GzipFile(fileobj=raw, mode="rb") if path.suffix == ".gz" else raw
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] != 8:
                raise CmhsaError("not an IDX file of unsigned bytes", path)
            ok = head[3] == rank if rank is not None else 1 <= head[3] <= 4
            if not ok:
                raise CmhsaError(f"IDX rank {head[3]}, expected {rank or '1 to 4'}", path)
            dims = [int.from_bytes(exact(f, 4), "big") for _ in range(head[3])]
            total = int(np.prod(dims, dtype=object))
            if min(dims) < 1 or total > MAX_IDX_BYTES:
                raise CmhsaError(
                    f"IDX dimensions {dims}: each must be at least 1, {MAX_IDX_BYTES:,} bytes in all", path
                )
            body = exact(f, total)
            if f.read(1):
                raise CmhsaError(f"holds more than the {total:,} bytes its IDX header {dims} says", path)
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise CmhsaError(
            f"truncated or corrupt gzip data ({first_line(e) or type(e).__name__})", path
        ) from None
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror or e})", path) from None
    return np.frombuffer(body, np.uint8).reshape(dims)


def fashion_mnist(root: Path) -> DataSpec:
    """Fashion-MNIST's official 60k / 10k split, 28×28 grey, 10 classes (MIT licence), from IDX files."""
    names = {
        "train": "train-images-idx3-ubyte",
        "train_labels": "train-labels-idx1-ubyte",
        "val": "t10k-images-idx3-ubyte",
        "val_labels": "t10k-labels-idx1-ubyte",
    }
    found = {}
    for key, name in names.items():
        path = next((root / n for n in (name + ".gz", name) if os.path.lexists(root / n)), None)
        if path is None:
            raise CmhsaError(
                f"no {name}[.gz] here: install Fashion-MNIST with `apt-get install dataset-fashion-mnist` "
                "or give `data_dir` a folder with its four IDX files",
                root,
            )
        found[key] = read_idx(path, IDX_RANKS["labels" if key.endswith("labels") else "images"])
        if key.endswith("labels") and found[key].max() >= 10:
            raise CmhsaError(f"label {found[key].max()} in a 10-class dataset", path)
    for split in ("train", "val"):
        if len(found[split]) != len(found[split + "_labels"]):
            raise CmhsaError(
                f"{split}: {len(found[split])} images but {len(found[split + '_labels'])} labels", root
            )
    return DataSpec(
        ArrayImages(found["train"], found["train_labels"]),
        ArrayImages(found["val"], found["val_labels"]),
        10,
        in_chans=1,
        classes=FASHION_MNIST,
    )


def cifar(name: str, root: Path, download: bool) -> DataSpec:
    from torchvision.datasets import CIFAR10, CIFAR100

    cls = CIFAR10 if name == "cifar10" else CIFAR100
    made = make_folder(root) if download else []  # a failed download leaves no folder it made
    try:
        train = cls(str(root), train=True, download=download)
        val = cls(str(root), train=False, download=download)
    except RuntimeError as e:  # torchvision: "Dataset not found or corrupted. ..."
        remove_made(made)
        hint = "" if download else " (pass `download` to fetch it)"
        raise CmhsaError(f"{name} not found or corrupt: {str(e).split('.')[0]}{hint}", root) from None
    except OSError as e:  # a failed download: urllib's URLError, a refused connection, a full disk
        remove_made(made)
        why = getattr(e, "reason", None) or e.strerror or e
        raise CmhsaError(
            f"cannot download {name} from {cls.url} ({why}); place {cls.filename} (or its extracted "
            f"{cls.base_folder}) in `data_dir` and run without `download`",
            root,
        ) from None
    n = len(train.classes)
    return DataSpec(train, val, n, classes=recordable(train.classes, n, root))


def load_image(path: str, resize_to: int | None = None) -> Any:
    """An image folder's loader (torchvision's default, through the one image reader): RGB;
    ``resize_to``: the shorter side the evaluation transform resizes to, checked before decoding."""
    return read_image(path, "RGB", resize_to)


IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's


def is_image_name(name: str) -> bool:
    """Whether a file's name is an image's (torchvision's IMG_EXTENSIONS)."""
    return name.lower().endswith(IMAGE_SUFFIXES)


def _image_file(path: str) -> bool:
    """An image folder's entry: an image's name, and a regular file (a FIFO would block a worker)."""
    if not is_image_name(path):
        return False
    try:
        st = os.stat(path)
    except OSError as e:
        raise CmhsaError(f"cannot read ({e.strerror})", path) from None
    require_regular(st, path, "image file", fix="remove it from the image folder")
    return True


def image_folder(root: Path, val_only: bool = False, resize_to: int | None = None) -> DataSpec:
    """``root``'s train/ and val/ class folders; with ``val_only`` (evaluation), val/ alone (the
    train split then empty). ``resize_to``: the shorter side evaluation resizes an image to (each
    image's resized size is checked before it is decoded)."""
    from torchvision.datasets import ImageFolder

    splits = ("val",) if val_only else ("train", "val")
    for split in splits:
        if not (root / split).is_dir():
            raise CmhsaError(f"imagefolder needs {split}/ (class folders of images) inside", root)

    class Scanned(ImageFolder):  # torchvision's class, with a walk that ends (scan_images)
        @staticmethod
        def make_dataset(directory: Any, class_to_idx: dict[str, int], *args: Any, **kw: Any) -> Any:
            return scan_images(Path(directory), class_to_idx)

    try:
        loader = functools.partial(load_image, resize_to=resize_to)
        found = [Scanned(str(root / s), loader=loader, is_valid_file=_image_file) for s in splits]
    except (FileNotFoundError, RuntimeError) as e:
        raise CmhsaError(f"not a usable image folder ({first_line(e, 200)})", root) from None
    val = found[-1]
    if val_only:
        n = len(val.classes)
        return DataSpec(
            Subset(val, []),
            val,
            n,
            in_chans=sampled_channels(val),
            classes=recordable(val.classes, n, root / "val"),
        )
    train = found[0]
    if train.classes != val.classes:
        raise CmhsaError("train/ and val/ have different class folders", root)
    n = len(train.classes)
    classes = recordable(train.classes, n, root / "train")
    return DataSpec(train, val, n, in_chans=sampled_channels(train), classes=classes)


# an image folder's scan is bounded: ImageNet-21k has 14 M images in 22 k folders
MAX_IMAGES = 50_000_000
MAX_FOLDERS = 1_000_000


def scan_images(directory: Path, class_to_idx: dict[str, int]) -> list[tuple[str, int]]:
    """Each class folder's images as (path, class index), in torchvision's order (by folder path,
    then file name). Links to folders are followed, but every folder is visited once (two links
    that point at each other end, where ``os.walk(followlinks=True)`` never does; once per class:
    a link to another class's folder is read as torchvision reads it), and at most
    MAX_FOLDERS folders and MAX_IMAGES images are taken; a class with no image is refused
    (FileNotFoundError, as torchvision raises it)."""
    found: list[tuple[str, int]] = []
    empty: list[str] = []
    count = folders = 0
    for name in sorted(class_to_idx):
        seen: set[tuple[int, int]] = set()  # per class: a link to another class's folder reads it
        listed: list[tuple[str, list[str]]] = []
        for folder, entries in folders_once(directory / name, seen, "image folder"):
            folders += 1
            if folders > MAX_FOLDERS:
                raise CmhsaError(
                    f"holds more than {MAX_FOLDERS:,} folders; cmhsa scans at most that", directory
                )
            files = [e.path for e in entries if not e.is_dir() and _image_file(e.path)]
            listed.append((folder, files))
            count += len(files)
            if count > MAX_IMAGES:
                raise CmhsaError(
                    f"holds more than {MAX_IMAGES:,} images; cmhsa scans at most that", directory
                )
        found += [(path, class_to_idx[name]) for _, files in sorted(listed) for path in files]
        if not any(files for _, files in listed):
            empty.append(name)
    if empty:  # torchvision's words
        raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. ")
    return found


def folders_once(
    root: Path, seen: set[tuple[int, int]], what: str = "folder"
) -> Iterator[tuple[str, list[os.DirEntry]]]:
    """Each folder under ``root`` with its entries sorted by name, depth first in name order. Links
    to folders are followed (as torchvision does), but each folder once, by device and inode
    (remembered in ``seen``): two links that point at each other end, where
    ``os.walk(followlinks=True)`` never does. An unreadable folder is a CmhsaError naming it, as
    ``what``; callers bound how many they take."""
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        try:
            st = os.stat(folder)
            if (st.st_dev, st.st_ino) in seen:
                continue  # a loop, or a second link to a folder already walked
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(folder) as it:
                entries = sorted(it, key=lambda e: e.name)
            subfolders = [e.path for e in reversed(entries) if e.is_dir()]  # follows a link
        except OSError as e:
            raise CmhsaError(f"cannot read the {what} ({e.strerror})", folder) from None
        yield folder, entries
        stack += subfolders


GREY_MODES = ("1", "L", "LA", "I", "I;16", "F")  # PIL's modes of single-channel images
SAMPLED = 16  # images an image folder's channels are judged by (their headers only)


def sampled_channels(folder: Any) -> int:
    """1 where every one of up to SAMPLED images spread over an ImageFolder is grey, else 3: a grey
    folder is said, as Fashion-MNIST and digits are (the loader converts every image to the
    model's channels either way)."""
    samples = folder.samples
    if not samples:
        return 3
    picks = {samples[i * len(samples) // SAMPLED][0] for i in range(min(SAMPLED, len(samples)))}
    for path in picks:
        with open_image(path) as im:
            if im.mode not in GREY_MODES:
                return 3
    return 1


def build_data(
    name: str,
    data_dir: str | Path | None,
    img_size: tuple[int, int] | None = None,
    *,
    download: bool = False,
    num_classes: int = 10,
    seed: int = 0,
    train_samples: int | None = None,
    val_samples: int | None = None,
    holdout: int | None = None,
    val_only: bool = False,
    crop_pct: float = EVAL_CROP_PCT,
) -> DataSpec:
    """The named dataset's train and val splits, untransformed (``img_size``: the size synthetic
    images are made at; the other sources have their own); with ``train_samples``, a fixed
    subset of that many training images (seeded by ``seed``); with ``val_samples``, the first that
    many validation images (the same for every seed, so runs are compared on the same images); with
    ``holdout``, ``val`` is that many training images outside the subset instead (the next ones of
    the same seeded permutation), so tuning never sees the validation split. ``val_only``
    (evaluation): an image folder needs only val/; ``crop_pct`` (with ``img_size``): how much
    evaluation resizes an image before its centre crop, so that each image's resized size is checked
    before it is decoded. Bad folders and counts raise CmhsaError."""
    resize_to = None if img_size is None else math.floor(max(img_size) / crop_pct)
    spec = _build_data(name, data_dir, img_size, download, num_classes, seed, val_only, resize_to)
    if holdout is not None:
        if train_samples is None or val_samples is not None:
            raise CmhsaError(
                "`holdout` takes images the `train_samples` subset leaves out, and replaces `val_samples`"
            )
        _subset_size("holdout", holdout, spec.train, name)
        if train_samples + holdout > len(spec.train):  # type: ignore[arg-type]
            raise CmhsaError(
                f"`train_samples` + `holdout` must be at most {len(spec.train)} for `data` {name}"
            )  # type: ignore[arg-type]
    if train_samples is not None:
        n = _subset_size("train_samples", train_samples, spec.train, name)
        order = np.random.default_rng(seed).permutation(n)
        full, spec.train = spec.train, Subset(spec.train, np.sort(order[:train_samples]).tolist())
        if holdout is not None:
            spec.val = Subset(full, np.sort(order[train_samples : train_samples + holdout]).tolist())
    if val_samples is not None:
        _subset_size("val_samples", val_samples, spec.val, name)
        spec.val = Subset(spec.val, list(range(val_samples)))
    return spec


VALIDATION = {  # each dataset's validation split, as a model card says where its top-1 came from
    "digits": "cmhsa's fixed 20% of the digits, held out of training",
    "fashion-mnist": "Fashion-MNIST's official 10,000 test images",
    "cifar10": "CIFAR-10's official 10,000 test images",
    "cifar100": "CIFAR-100's official 10,000 test images",
    "imagefolder": "the image folder's own val/",
    "synthetic": "cmhsa's generated validation images",
}


def validation_split(name: str, holdout: int | None = None, val_samples: int | None = None) -> str:
    """Where a run's validation images came from, in words: ``holdout`` training images cmhsa held
    out, or the dataset's own validation split (its first ``val_samples``)."""
    if holdout is not None:
        return f"{holdout:,} of {name}'s training images, held out of training by cmhsa"
    split = VALIDATION.get(name, f"{name}'s validation split")
    return split if val_samples is None else f"the first {val_samples:,} of {split}"


def _subset_size(flag: str, count: int, split: Dataset, name: str) -> int:
    """The split's size, once ``count`` (flag ``flag``) is checked to fit in it."""
    n = len(split)  # type: ignore[arg-type]
    if not 0 < count <= n:
        raise CmhsaError(f"`{flag}` must be in 1..{n} for `data` {name}, got {count}")
    return n


def _build_data(
    name: str,
    data_dir: str | Path | None,
    img_size: tuple[int, int] | None,
    download: bool,
    num_classes: int,
    seed: int,
    val_only: bool = False,
    resize_to: int | None = None,
) -> DataSpec:
    if name not in DATASETS:
        raise CmhsaError(f"`data` must be one of {', '.join(DATASETS)}, got {name!r}")
    if name == "digits":
        return digits(seed=0)
    if name == "synthetic":
        if img_size is None:
            raise CmhsaError("`data` synthetic needs `img_size`")
        return synthetic(img_size, num_classes, seed=seed)
    if name == "fashion-mnist":
        root = Path(data_dir or FASHION_MNIST_DIR).expanduser()
        if not root.is_dir():
            raise CmhsaError(
                "no such folder: install Fashion-MNIST with `apt-get install dataset-fashion-mnist`", root
            )
        return fashion_mnist(root)
    if data_dir is None:  # every name left is in NEEDS_DIR
        raise CmhsaError(f"`data` {name} needs `data_dir`")
    root = Path(data_dir).expanduser()
    if not root.is_dir() and not (download and name.startswith("cifar")):
        raise CmhsaError("data folder does not exist", root)
    if name == "imagefolder":
        return image_folder(root, val_only, resize_to)
    return cifar(name, root, download)


POSTERIZE_OPS = ("Posterize", "PosterizeIncreasing", "PosterizeOriginal")


@contextlib.contextmanager
def posterize_kept_for_pillow_13() -> Iterator[None]:
    """timm's posterize ops as :func:`_posterize` while a transform is built: timm's AugmentOp reads
    its function from ``auto_augment.NAME_TO_OP`` when it is made, so the transform keeps the fixed
    op and timm's table is restored for everyone else in the process."""
    from timm.data import auto_augment

    saved = {name: auto_augment.NAME_TO_OP.get(name) for name in POSTERIZE_OPS}
    auto_augment.NAME_TO_OP.update(dict.fromkeys(POSTERIZE_OPS, _posterize))
    try:
        yield
    finally:
        for name, op in saved.items():
            if op is None:
                auto_augment.NAME_TO_OP.pop(name, None)
            else:
                auto_augment.NAME_TO_OP[name] = op


def _posterize(img: Any, bits_to_keep: int, **_: Any) -> Any:
    """timm's posterize, keeping 0 bits as Pillow < 13 did (a black image): Pillow 13 raises for 0,
    which rand-m9-mstd0.5-inc1 reaches whenever the magnitude noise lands on 10."""
    from PIL import Image, ImageOps

    if bits_to_keep >= 8:
        return img
    if bits_to_keep <= 0:
        return Image.new(img.mode, img.size)
    return ImageOps.posterize(img, bits_to_keep)


IMAGE_MODES = {3: "RGB", 1: "L"}  # the model's in_chans -> the PIL mode every image is converted to


def image_mode(in_chans: int, path: object = None) -> str:
    if in_chans not in IMAGE_MODES:
        raise CmhsaError(
            f"takes {in_chans}-channel images; the data path gives RGB (3 channels) or grayscale (1)", path
        )
    return IMAGE_MODES[in_chans]


def channel_stats(in_chans: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Normalisation mean and std: ImageNet's (DeiT's) for RGB, their channel averages for grey."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

    if in_chans == 3:
        return tuple(IMAGENET_DEFAULT_MEAN), tuple(IMAGENET_DEFAULT_STD)
    return (sum(IMAGENET_DEFAULT_MEAN) / 3,), (sum(IMAGENET_DEFAULT_STD) / 3,)


def cpus() -> int:
    """The CPUs this process may use."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_workers() -> int:
    """Workers of the workers loader when `workers` is not given: up to 4, never more than the CPUs
    this process may use (PyTorch warns above that). On 2 CPUs, 0, 1 and 2 workers ran the same
    in-memory data within this VM's run-to-run spread (BENCHMARKS.md, 'Training on a CPU')."""
    return min(MAX_DEFAULT_WORKERS, cpus())


def default_threads() -> int:
    """torch CPU threads when `threads` is not given: ``OMP_NUM_THREADS`` where it is a whole number
    of at least 1 (torchrun sets it to 1 for several processes per node; two of the test suite's
    workers on 2 cores set it too), never more than the CPUs this process may use; otherwise every
    one of those CPUs (BENCHMARKS.md, 'Training on a CPU': on 2 cores, 2 threads trained 1.3x
    (phase 1) and 1.7x (phase 2) faster than 1 with the device loader). Oversubscribed, torch's
    threads wait on each other: two tiny runs at once on 2 cores took 15 to 73 s each with 2
    threads each, 10 s with 1 (BENCHMARKS.md, 'Investigations')."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isascii() and given.isdigit() and len(given) <= 6 and int(given) >= 1:
        return min(int(given), cpus())
    return cpus()


def build_transform(
    img_size: tuple[int, int],
    training: bool,
    recipe: Any = None,
    in_chans: int = 3,
    *,
    interpolation: str = EVAL_INTERPOLATION,
    crop_pct: float = EVAL_CROP_PCT,
) -> Any:
    """DeiT's augmentation (timm ``create_transform``, settings from ``recipe``, a TrainConfig's recipe) for
    training; resize + centre crop for eval (``recipe``'s interpolation and crop_pct when given).
    ``in_chans`` 1 normalises one grey channel (images are converted to grey by the loader)."""
    from timm.data import create_transform

    image_mode(in_chans)
    mean, std = channel_stats(in_chans)
    args = recipe
    if training:
        with posterize_kept_for_pillow_13():
            return create_transform(
                input_size=(in_chans, *img_size),
                is_training=True,
                scale=tuple(args.scale),
                hflip=args.hflip,
                color_jitter=args.color_jitter,
                auto_augment=None if args.aa in (None, "", "none") else args.aa,
                interpolation=args.interpolation,
                re_prob=args.reprob,
                re_mode=args.remode,
                re_count=1,
                mean=mean,
                std=std,
            )
    return create_transform(
        input_size=(in_chans, *img_size),
        is_training=False,
        interpolation=interpolation if args is None else args.interpolation,
        crop_pct=crop_pct if args is None else args.crop_pct,
        mean=mean,
        std=std,
    )


class Seeded(Dataset):
    """Wraps a dataset and a transform; item ``(epoch, i)`` is sample ``i`` converted to ``mode``
    ('RGB' or 'L') and transformed with every RNG the transform may use (python, numpy, torch)
    seeded from (seed, epoch, i)."""

    def __init__(self, base: Dataset, transform: Any, seed: int, mode: str = "RGB") -> None:
        self.base, self.transform, self.seed, self.mode = base, transform, seed, mode

    def __len__(self) -> int:
        return len(self.base)  # type: ignore[arg-type]

    def __getitem__(self, key: tuple[int, int]) -> tuple[torch.Tensor, int]:
        epoch, i = key
        img, label = self.base[i]
        if hasattr(img, "mode") and img.mode != self.mode:
            img = img.convert(self.mode)
        s = sample_seed(self.seed, epoch, i)
        py_state, np_state = random.getstate(), np.random.get_state()
        with torch.random.fork_rng(devices=[]):
            random.seed(s)
            np.random.seed(s % (1 << 32))
            torch.manual_seed(s)
            x = self.transform(img)
        random.setstate(py_state)
        np.random.set_state(np_state)
        return x, label


class EpochSampler(Sampler):
    """This rank's share of a seeded permutation of the dataset per epoch, as ``(epoch, i)`` keys.

    Training: shuffled, the tail dropped so every rank gets the same number of whole batches, laid
    out so that the global batches do not depend on the number of processes.
    Evaluation: every sample exactly once over all ranks (a strided split, no padding).
    ``start`` skips the first samples of this rank's share (resuming inside an epoch).
    """

    def __init__(self, n: int, *, rank: int, world: int, batch_size: int, seed: int, shuffle: bool) -> None:
        self.n, self.rank, self.world, self.bs, self.seed, self.shuffle = (
            n,
            rank,
            world,
            batch_size,
            seed,
            shuffle,
        )
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        self.epoch, self.start = epoch, start_batch * self.bs

    def indices(self) -> list[int]:
        if not self.shuffle:
            return list(range(self.rank, self.n, self.world))
        g = torch.Generator().manual_seed(sample_seed(self.seed, self.epoch, -1))
        perm = torch.randperm(self.n, generator=g)
        # global batch j is perm[j·G : (j+1)·G], G = world · batch; rank r takes its r-th slice,
        # so W processes of batch B see exactly the batches one process of batch W·B would
        g_bs = self.bs * self.world
        full = perm[: self.n // g_bs * g_bs].view(-1, self.world, self.bs)
        return full[:, self.rank].reshape(-1).tolist()

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter([(self.epoch, i) for i in self.indices()[self.start :]])

    def __len__(self) -> int:  # len(self.indices()) - start, without drawing the permutation
        if self.shuffle:
            n = self.n // (self.bs * self.world) * self.bs
        else:
            n = len(range(self.rank, self.n, self.world))
        return max(0, n - self.start)


def epoch_sampler(
    n: int, *, training: bool, batch_size: int, seed: int, rank: int, world: int
) -> EpochSampler:
    """The sampler of a split of ``n`` images (both loaders use it); a training split smaller than
    one global batch is refused."""
    sampler = EpochSampler(n, rank=rank, world=world, batch_size=batch_size, seed=seed, shuffle=training)
    if training and len(sampler) == 0:
        raise CmhsaError(
            f"the training set ({n} images over {world} process(es)) is smaller than "
            f"one batch of {batch_size}"
        )
    return sampler


def build_loader(
    dataset: Dataset,
    transform: Any,
    *,
    training: bool,
    batch_size: int,
    seed: int,
    rank: int = 0,
    world: int = 1,
    workers: int = 0,
    pin_memory: bool = False,
    in_chans: int = 3,
) -> DataLoader:
    n = len(dataset)  # type: ignore[arg-type]
    sampler = epoch_sampler(n, training=training, batch_size=batch_size, seed=seed, rank=rank, world=world)
    return DataLoader(
        Seeded(dataset, transform, seed, image_mode(in_chans)),
        batch_size=batch_size,
        sampler=sampler,
        num_workers=workers,
        pin_memory=pin_memory,
        persistent_workers=workers > 0,
        drop_last=training,
        # its own generator: each new iterator draws a base seed, which must not come from the
        # global one (drop path's), or a resumed epoch would see different drop-path masks
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=ignore_interrupts if workers > 0 else None,
    )


def ignore_interrupts(worker_id: int) -> None:
    """A loader worker ignores SIGINT: Ctrl-C reaches the whole process group, and it is the main
    process's to act on (finish the step, save, stop), which then ends its workers itself. (SIGTERM
    keeps its default: the loader ends a worker that does not stop with it; a training run treats a
    worker that a SIGTERM ended as part of that stop, train/loop.py.)"""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
