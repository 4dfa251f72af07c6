"""Datasets: CIFAR-10/100, an image folder, scikit-learn's digits, Fashion-MNIST (IDX files),
synthetic images, each a source of (PIL image, label) pairs with its seeded subsets; the loaders
that feed them to a model are :mod:`convit_convert.loaders`'s."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import Dataset, Subset

from .errors import CmhsaError, first_line
from .io.folder import make_folder, remove_made
from .io.images import open_image, read_image
from .io.paths import open_regular, require_regular
from .labels import DIGITS, FASHION_MNIST, recordable
from .options.values import DATASETS, EVAL_CROP_PCT
from .resources import check_fits

NEEDS_DIR = ("cifar10", "cifar100", "imagefolder")  # the datasets only `data_dir` can give
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's dataset-fashion-mnist


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
        # each class's template rolled by the sample's shift, as np.roll would, gathered at once
        rows = (np.arange(h) - shifts[:, :1]) % h  # (n, h)
        cols = (np.arange(w) - shifts[:, 1:]) % w  # (n, w)
        imgs = templates[labels[:, None, None], rows[:, :, None], cols[:, None, :]]
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
