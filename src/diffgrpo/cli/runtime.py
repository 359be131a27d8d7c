"""Process settings the command line applies before a model loads: the CPU thread count.

On a CPU the built-in models are tiny (a few hundred thousand weights): each matmul is microseconds of work, so
torch's intra-op thread pool costs more in synchronisation than it gains, and on a shared 2-core machine a second
thread makes a run several times slower. The rule, in order of precedence:

  1. ``OMP_NUM_THREADS`` in the environment: left to torch (the user or the launcher chose);
  2. ``model.cpu_threads=N`` (N >= 1): N threads;
  3. ``model.cpu_threads=0`` (auto): one thread for the built-in models (``tiny``, ``tiny_mlm``) on a CPU device,
     torch's own default (one per physical core) for everything else (a real pipeline, or any GPU run).
"""
from __future__ import annotations

import os

import torch

from ..distributed import launched_local_rank, resolve_device

# built-in models small enough that one CPU thread is fastest
TINY_MODELS = ("tiny", "tiny_mlm", "tiny_block")


def cpu_threads(setting: int, *, model_name: str, device: str, environ: dict | None = None) -> int | None:
    """The intra-op thread count to set, or None to leave torch's choice (see the module docstring).

    ``setting``: ``model.cpu_threads``; ``device``: the resolved torch device of the policy."""
    environ = os.environ if environ is None else environ
    if environ.get("OMP_NUM_THREADS", "").strip():
        return None
    if setting > 0:
        return int(setting)
    if model_name in TINY_MODELS and device == "cpu":
        return 1
    return None


def apply_cpu_threads(cfg) -> int:
    """Set torch's thread count for the run ``cfg`` (a RunConfig) by :func:`cpu_threads`; → the count in use."""
    device = resolve_device(cfg.model.device, launched_local_rank())
    n = cpu_threads(cfg.model.cpu_threads, model_name=cfg.model.name, device=device)
    if n is not None and n != torch.get_num_threads():
        torch.set_num_threads(n)
    return torch.get_num_threads()


__all__ = ["TINY_MODELS", "apply_cpu_threads", "cpu_threads"]
