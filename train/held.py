"""Datasets held as one uint8 tensor on the training device: a batch is an index gather, augmented
as a batch (:mod:`.augment`); no per-sample Python and no worker processes.

The training loader keeps :class:`convit_convert.loaders.EpochSampler`'s order (so a run's batches
are the workers path's batches) and draws the augmentation of 64 steps' global batches at once
from a generator seeded by (seed, epoch, chunk), of which each rank takes its rows: the result
does not depend on the number of processes, and a run stopped at any step resumes bit for bit
(the chunk is drawn again). The validation split is resized and centre-cropped once, as timm's
eval transform does (torchvision's antialiased resize), so an epoch's evaluation costs a forward pass.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ..data import ArrayImages
from ..errors import CmhsaError
from ..io.images import open_image, read_image
from ..loaders import EpochSampler, sample_seed
from ..resources import available_memory
from .augment import PARAM_FIELDS, AugmentSpec, Params, augment, grey, normalise, sample_params

MAX_BYTES = 2 << 30  # hold at most 2 GiB of decoded images; larger sets use the workers loader
# sample_seed indices (the sampler uses -1): chunk c of an epoch's augmentation parameters is drawn
# from CHUNK_STREAM - c, step j's erasing normals from NOISE_STREAM - j
CHUNK_STREAM = -2
NOISE_STREAM = -(1 << 40)
CHUNK_STEPS = 64  # steps whose parameters are drawn at once: the draw's ~100 small ops amortised
# the parameters the pixel ops read on the device (RandAugment's choices stay on the CPU, where
# its per-op selection reads them)
DEVICE_FIELDS = ("box", "flip", "jitter", "jitter_order", "erase")


def device_fields(spec: AugmentSpec) -> tuple[str, ...]:
    """The Params fields a chunk moves to the device: :data:`DEVICE_FIELDS`, and without
    RandAugment every field (its choices are then empty). A stack concatenates every field inside
    its compiled step, and one CPU tensor there makes inductor skip CUDA graphs for the whole step."""
    return DEVICE_FIELDS if spec.randaugment is not None else PARAM_FIELDS


def _array_source(ds: Dataset) -> tuple[Any, np.ndarray, list[int]] | None:
    """(images as an (N, H, W[, C]) uint8 array or a list of paths, labels, indices) without decoding."""
    if isinstance(ds, Subset):
        inner = _array_source(ds.dataset)
        if inner is None:
            return None
        imgs, labels, idx = inner
        return imgs, labels, [idx[i] for i in ds.indices]
    if isinstance(ds, ArrayImages):
        return ds.images, np.asarray(ds.labels), list(range(len(ds)))
    if (
        hasattr(ds, "data") and hasattr(ds, "targets") and isinstance(ds.data, np.ndarray)
    ):  # torchvision CIFAR
        return ds.data, np.asarray(ds.targets), list(range(len(ds.data)))
    if hasattr(ds, "samples") and hasattr(ds, "loader"):  # torchvision ImageFolder
        paths = [p for p, _ in ds.samples]
        return paths, np.asarray([t for _, t in ds.samples]), list(range(len(paths)))
    return None


def _folder_size(paths: list[str], indices: list[int]) -> tuple[int, int] | None:
    """The one (H, W) every image has (read from headers only), or None if they differ."""
    sizes = set()
    for i in indices:
        with open_image(paths[i]) as im:
            sizes.add((im.height, im.width))
        if len(sizes) > 1:
            return None
    return sizes.pop()


def held_side(img_size: tuple[int, int], crop_pct: float, scale_min: float) -> int:
    """The shorter side an image folder's images are held at: what neither the evaluation view
    (the shorter side resized to floor(size / crop_pct)) nor the smallest training crop (an area
    ``scale_min`` of the image, resized to the model's size) would need to enlarge."""
    size = max(img_size)
    return max(math.floor(size / crop_pct), math.ceil(size / math.sqrt(scale_min)))


def held_size(hw: tuple[int, int], side: int) -> tuple[int, int]:
    """(H, W) of an image of ``hw`` held with its shorter side at most ``side``, its ratio kept."""
    h, w = hw
    if min(h, w) <= side:
        return h, w
    return (side, max(1, round(w * side / h))) if h <= w else (max(1, round(h * side / w)), side)


def holdable(ds: Dataset, in_chans: int, side: int) -> str | None:
    """Why ``ds`` cannot be held as one tensor (None if it can): an image folder's images are
    sized as held (:func:`held_size`, ``side``), not as their files are."""
    src = _array_source(ds)
    if src is None:
        return "the dataset is not an in-memory array or an image folder"
    imgs, _, idx = src
    if isinstance(imgs, np.ndarray):
        hw = imgs.shape[1:3]
    else:
        with open_image(imgs[idx[0]]) as im:  # a first estimate, before reading every header
            h, w = held_size((im.height, im.width), side)
            if len(idx) * h * w * in_chans > MAX_BYTES:
                return f"its {len(idx)} images need more than {MAX_BYTES / 2**30:.0f} GiB as held"
        size = _folder_size(imgs, idx)
        if size is None:
            return "its images are not all one size"
        hw = held_size(size, side)
    need = len(idx) * hw[0] * hw[1] * in_chans
    if need > MAX_BYTES:
        return f"its images need {need / 2**30:.1f} GiB as held (more than {MAX_BYTES / 2**30:.0f} GiB)"
    if need > available_memory() // 4:  # the split, its augmented batches and the run beside it
        return f"its images need {need / 2**30:.1f} GiB as held, more than a quarter of the memory free now"
    return None


def hold(
    ds: Dataset, in_chans: int, device: torch.device, side: int, count: Any = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, C, H, W) uint8 images converted to ``in_chans`` as PIL converts them (an image folder's
    decoded straight to their held size, :func:`held_size`), and (N,) int64 labels, on ``device``;
    ``count(n)`` told of each image decoded. The caller has asked :func:`holdable`
    (``build.choose_loader`` does)."""
    src = _array_source(ds)
    if src is None:
        raise CmhsaError(
            "cannot hold the data on the device: it is not an in-memory array or an image folder"
        )
    imgs, labels, idx = src
    if isinstance(imgs, np.ndarray):
        x = torch.from_numpy(np.ascontiguousarray(imgs[idx]))
    else:
        mode, arrays = "RGB" if in_chans == 3 else "L", []
        with open_image(imgs[idx[0]]) as im:
            h, w = held_size((im.height, im.width), side)
        for i in idx:
            arrays.append(np.asarray(read_image(imgs[i], mode, size=(w, h))))
            if count is not None:
                count(1)
        x = torch.from_numpy(np.stack(arrays))
    x = x[..., None] if x.ndim == 3 else x  # grey (N, H, W) -> (N, H, W, 1)
    x = x.permute(0, 3, 1, 2).to(device)
    if x.shape[1] != in_chans:  # PIL's convert: grey -> RGB repeats, RGB -> L weighs
        x = x.expand(-1, 3, -1, -1) if in_chans == 3 else grey(x.float()).to(torch.uint8)
    y = torch.as_tensor(labels[idx], dtype=torch.long, device=device)
    return x.contiguous(), y


def eval_view(
    images: torch.Tensor, img_size: tuple[int, int], crop_pct: float, interpolation: str
) -> torch.Tensor:
    """timm's eval transform before ToTensor, on the whole split: shorter side resized to
    floor(size / crop_pct) (torchvision's antialiased tensor resize), then the centre crop; uint8."""
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms.v2 import functional as TF

    scale = math.floor(img_size[0] / crop_pct)
    mode = InterpolationMode(interpolation)
    out = []
    for chunk in images.split(4096):  # bounded temporary memory
        r = TF.resize(chunk, [scale], interpolation=mode, antialias=True)
        out.append(TF.center_crop(r, list(img_size)))
    return torch.cat(out)


@dataclass
class HeldBatch:
    """One step's inputs before augmentation: this rank's images and their parameters."""

    images: torch.Tensor  # (n, C, H, W) uint8, on the images' device
    params: Params  # the per-sample choices; the fields of device_fields(spec) on the device
    noise: torch.Tensor | None  # (n, C, h, w) erasing normals, None without erasing


@dataclass
class HeldLoader:
    """Training batches of held images: ``for x, y in loader`` gives this rank's augmented batch
    (float32, normalised, on the images' device) and labels, in :class:`EpochSampler`'s order.
    The training step takes :meth:`batches` and augments inside the step (:meth:`prepare`), so a
    compiled step includes the augmentation."""

    images: torch.Tensor
    labels: torch.Tensor
    sampler: EpochSampler
    spec: AugmentSpec
    seed: int

    def __len__(self) -> int:
        return len(self.sampler) // self.sampler.bs

    def chunk(self, c: int, steps_in_epoch: int) -> list[Params]:
        """Steps c·CHUNK_STEPS.. of the epoch: their global batches' parameters drawn at once from a
        generator seeded by (seed, epoch, c), on the CPU (then the pixel ops' fields moved to the
        device in one copy each), split into this rank's rows per step."""
        s, dev = self.sampler, self.images.device
        steps = min(CHUNK_STEPS, steps_in_epoch - c * CHUNK_STEPS)
        g = torch.Generator().manual_seed(sample_seed(self.seed, s.epoch, CHUNK_STREAM - c))
        p = sample_params(self.spec, steps * s.bs * s.world, tuple(self.images.shape[-2:]), g)
        on_device = device_fields(self.spec)
        p = Params(**{k: v.to(dev) if k in on_device else v for k, v in vars(p).items()})
        return p.split(s.bs)[s.rank :: s.world]

    def noise(self, step: int) -> torch.Tensor | None:
        """Erasing's normals for step ``step``'s global batch, drawn on the device; this rank's rows."""
        if self.spec.reprob == 0:
            return None
        s, dev = self.sampler, self.images.device
        dg = torch.Generator(device=dev).manual_seed(sample_seed(self.seed, s.epoch, NOISE_STREAM - step))
        shape = (s.bs * s.world, self.images.shape[1], *self.spec.out_size)
        return torch.randn(shape, generator=dg, device=dev)[s.rank * s.bs : (s.rank + 1) * s.bs]

    def batches(self) -> Iterator[tuple[HeldBatch, torch.Tensor]]:
        """This epoch's steps from the sampler's start: (the step's inputs, labels)."""
        s, dev = self.sampler, self.images.device
        order = torch.tensor(s.indices(), dtype=torch.long, device=dev)
        first, last = s.start // s.bs, len(order) // s.bs
        per_step = order[: last * s.bs].split(s.bs)
        params: list[Params] = []
        for step in range(first, last):
            if step == first or step % CHUNK_STEPS == 0:
                params = self.chunk(step // CHUNK_STEPS, last)
            idx = per_step[step]
            batch = HeldBatch(self.images[idx], params[step % CHUNK_STEPS], self.noise(step))
            yield batch, self.labels[idx]

    def prepare(self, batch: HeldBatch) -> torch.Tensor:
        """A step's augmented (n, C, h, w) float32 images."""
        return augment(batch.images, batch.params, self.spec, batch.noise)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for batch, y in self.batches():
            yield self.prepare(batch), y


@dataclass
class HeldEvalLoader:
    """Validation batches of held, already resized and cropped images: every image once over all
    ranks (strided), normalised per batch."""

    images: torch.Tensor  # (N, C, h, w) uint8, the eval view
    labels: torch.Tensor
    batch_size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]
    rank: int = 0
    world: int = 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        idx = torch.arange(self.rank, len(self.labels), self.world, device=self.images.device)
        for chunk in idx.split(self.batch_size):
            yield normalise(self.images[chunk].float(), self.mean, self.std), self.labels[chunk]

    def __len__(self) -> int:
        return -(-len(range(self.rank, len(self.labels), self.world)) // self.batch_size)
