"""A thin distributed layer: one trainer for 1 or N processes.

Everything here is a no-op at world size 1 (no process group). Under ``torchrun`` (or any launcher that sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) :func:`init_from_env` creates the default process group.

  info()                  → WorldInfo(rank, world_size, local_rank)
  all_gather(t)           → (world·n, …) concatenation of every rank's (n, …) tensor (same n on every rank)
  all_reduce_mean_(t)     in-place mean over ranks; every call is counted in ``COUNTERS["allreduce"]``
  no_sync(module)         context suppressing DDP's gradient all-reduce (nullcontext without DDP)
  wrap_ddp(module)        DistributedDataParallel at world size > 1, the module itself otherwise
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import torch.distributed as dist

COUNTERS = {"allreduce": 0}  # gradient all-reduces issued through this module (per process)


class WorldInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def info() -> WorldInfo:
    """Rank, world size and local rank of this process (0, 1, 0 without a process group)."""
    if not is_initialized():
        return WorldInfo(0, 1, 0)
    return WorldInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def init_from_env(backend: str | None = None) -> WorldInfo:
    """Create the default process group when launched by torchrun (WORLD_SIZE > 1); otherwise do nothing."""
    if is_initialized():
        return info()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend=backend)
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return info()


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """(n, …) on every rank → (world·n, …) in rank order. Identity at world size 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def all_reduce_mean_(t: torch.Tensor) -> torch.Tensor:
    """Average ``t`` over ranks in place (DDP's gradient convention) and count the call. No-op at world 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return t
    COUNTERS["allreduce"] += 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t.div_(dist.get_world_size())
    return t


def no_sync(module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` for a wrapped module, FSDP2's ``set_requires_gradient_sync(False)``, else a no-op."""
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def _fsdp():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return _fsdp()
    return contextlib.nullcontext()


def wrap_ddp(module: torch.nn.Module, **kw) -> torch.nn.Module:
    """DistributedDataParallel around ``module`` at world size > 1; the module itself otherwise."""
    if not is_initialized() or dist.get_world_size() == 1:
        return module
    return torch.nn.parallel.DistributedDataParallel(module, **kw)


__all__ = ["COUNTERS", "WorldInfo", "info", "init_from_env", "all_gather", "all_reduce_mean_", "no_sync",
           "wrap_ddp", "is_initialized"]
