"""Processes and devices: one process per GPU under torchrun (DDP), or a single process.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK; without them this is a single process. Under torchrun a
process group is always created, one process included (so ``torchrun --nproc-per-node 1`` runs the
same DDP and collective path as eight). The backend is NCCL on CUDA and gloo on CPU (which is how
the tests run two processes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..api.common import pick_device


@dataclass(frozen=True)
class Context:
    rank: int
    world: int
    local_rank: int
    device: torch.device
    backend: str | None = None  # "nccl" / "gloo" under torchrun, None for a plain process

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.backend is not None


def setup(device: str) -> Context:
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ  # by torchrun
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = pick_device(device, local_rank)
    backend = None
    if launched:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        backend = dist.get_backend()
    return Context(rank, world, local_rank, dev, backend)


def all_reduce_sum(t: torch.Tensor, ctx: Context) -> torch.Tensor:
    if ctx.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def barrier(ctx: Context) -> None:
    if ctx.distributed:
        dist.barrier()


def teardown(ctx: Context) -> None:
    if ctx.distributed and dist.is_initialized():
        dist.destroy_process_group()
