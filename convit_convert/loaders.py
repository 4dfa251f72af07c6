"""How images reach a model: timm's transforms (DeiT's augmentation in training, timm's evaluation
transform), the seeded sampler and the workers loader, and the workers and threads this machine
gives a run.

Determinism: the sampler yields ``(epoch, index)`` pairs and each sample's augmentation is seeded
from (seed, epoch, index), so a run's batches do not depend on the number of workers, the number
of processes, or where a run was stopped and resumed.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .errors import CmhsaError
from .options.values import EVAL_CROP_PCT, EVAL_INTERPOLATION, MAX_DEFAULT_WORKERS

MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, epoch, index) over the seed space


def sample_seed(seed: int, epoch: int, index: int) -> int:
    return ((seed * MIX + epoch) * MIX + index) % (1 << 63)


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
    """The PIL mode of every image a model of ``in_chans`` takes: RGB or grey, the images cmhsa's
    data, ``predict`` and an export's recorded preprocessing (ONNX metadata, timm's and
    transformers' configs) know; any other count is refused, naming ``path``."""
    if in_chans not in IMAGE_MODES:
        raise CmhsaError(
            f"takes {in_chans}-channel images; cmhsa's images (its data, predict, and the preprocessing an "
            "export records for onnxruntime, timm and transformers) are RGB (3 channels) or grey (1)",
            path,
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
    workers on 2 cores set it too), never more than the CPUs this process may use; otherwise those
    CPUs less the threads other work keeps running on them at this process's priority or above
    (:func:`busy_elsewhere`), at least 1. torch's threads wait on each other at every operation:
    where another process takes a CPU from one of them, the others wait too. On the 2-core VM with
    two busy processes beside it a quick-start run took 1.5 to 5 times as long on 2 threads as on 1;
    idle, or beside work of lower priority (``nice``), 2 threads were the faster (BENCHMARKS.md,
    "Threads on a busy machine")."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    if given.isascii() and given.isdigit() and len(given) <= 6 and int(given) >= 1:
        return min(int(given), cpus())
    busy = busy_elsewhere()
    return cpus() if busy is None else max(1, cpus() - busy)


def busy_elsewhere(samples: int = 3, apart: float = 0.02) -> int | None:
    """Threads of other processes running or ready to run, at this process's priority or above (a
    ``nice`` value no higher), the median of ``samples`` looks ``apart`` seconds apart: what would
    share the CPUs with a run's threads. None where /proc does not tell (not Linux)."""
    import glob
    import statistics
    import time

    me, ours = str(os.getpid()), os.getpriority(os.PRIO_PROCESS, 0)
    counts = []
    for i in range(samples):
        if i:
            time.sleep(apart)
        running = 0
        for stat in glob.glob("/proc/[0-9]*/task/[0-9]*/stat"):
            if stat.split("/", 3)[2] == me:
                continue
            try:
                with open(stat, "rb") as f:
                    fields = f.read(1024).rpartition(b")")[2].split()
            except OSError:  # the thread ended meanwhile
                continue
            # after "pid (comm)": state is the first field, nice the seventeenth
            if len(fields) > 16 and fields[0] == b"R" and int(fields[16]) <= ours:
                running += 1
        counts.append(running)
    if not glob.glob("/proc/[0-9]*/task"):
        return None
    return round(statistics.median(counts))


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
            # the CPU generator alone, which the transform draws from: torch.manual_seed would also
            # queue a seed for each accelerator torch knows and has not started (CUDA, XPU, MTIA),
            # formatting the caller's stack for each, a quarter of a small image's time per sample
            torch.default_generator.manual_seed(s)
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
