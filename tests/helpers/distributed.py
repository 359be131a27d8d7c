"""Multi-process bootstraps: a free local port, a rank's rendezvous environment and gloo process group (for
``torch.multiprocessing.spawn`` workers), and the torchrun command line and environment of CLI subprocesses."""
from __future__ import annotations

import os
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]  # the repository: its src/ and tests/ importable in subprocesses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> None:
    """One thread, and the rendezvous variables torchrun would set for ``rank`` of ``world`` on 127.0.0.1."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))


def join_gloo(rank: int, world: int, port: int, timeout_s: float = 120) -> None:
    """:func:`rank_env`, then a gloo process group; a collective one rank never joins fails after ``timeout_s``
    instead of hanging the test run."""
    import torch.distributed as dist

    rank_env(rank, world, port)
    dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))


def leave_gloo() -> None:
    """A spawned rank's end once its results are written: a barrier (no collective in flight on either rank), the
    group destroyed, and the process ended without the interpreter's teardown, where gloo's threads can abort it
    (SIGABRT after a complete run, seen now and then on a loaded machine)."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def subprocess_env(**extra: str) -> dict:
    """The environment of a ``python -m ...`` child: one OpenMP thread, this checkout's src/ and tests importable."""
    root = str(ROOT)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([root + "/src", root]), **extra)


def torchrun(nproc: int = 2, port: int | None = None) -> list[str]:
    """The command prefix of ``nproc`` local ranks under torchrun on 127.0.0.1 (a free port unless given)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
            "127.0.0.1", "--master_port", str(free_port() if port is None else port)]
