"""What every gradient-forming method meters: network calls, sample-backwards, peak memory and time.

A flow engine and the masked-LM likelihood method both turn a rollout into ``.grad``; both report what it cost
in one :class:`~diffgrpo.types.EngineStats`. :func:`engine_run` reads the forward counters of the policy held
by any context with a ``policy`` attribute, :func:`record_backward` counts backward calls, :class:`MemoryMeter`
measures peak memory and :func:`chunks` splits rows into micro-batches.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Protocol

import torch

from .types import EngineStats


class Metered(Protocol):
    """A context whose policy counts its forwards (``policy.counters``: ``forwards_grad``, ``forwards_nograd``)
    and names its device (``policy.device``)."""

    policy: Any


def chunks(idx: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Split a 1-D index tensor into pieces of at most ``size`` (0: one piece)."""
    if idx.numel() == 0:
        return []
    return [idx] if size <= 0 else list(idx.split(size))


def record_backward(stats: EngineStats, sample_backwards: int, calls: int = 1) -> None:
    """Count ``calls`` backward calls through ``sample_backwards`` network inputs in all."""
    stats.backward_calls += calls
    stats.sample_backwards += sample_backwards


class MemoryMeter:
    """Peak memory during a block.

    CUDA: ``torch.cuda.max_memory_allocated`` (reset at entry). CPU: peak bytes of tensors saved for
    backward and still alive (the activation memory that engines trade), tracked with saved-tensor hooks;
    parameters saved by layers are not counted.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.live = 0
        self.peak = 0
        self._ctx = None

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        meter = self
        refs: dict[int, list[int]] = {}  # storage pointer -> [holders, bytes]; views of one storage count once

        class _Held:
            __slots__ = ("t", "key")

            def __init__(self, t, key):
                self.t, self.key = t, key

            def __del__(self):
                if self.key is not None:
                    ent = refs[self.key]
                    ent[0] -= 1
                    if ent[0] == 0:
                        meter.live -= ent[1]
                        del refs[self.key]

        def pack(t):
            base = t._base if t._base is not None else t
            if isinstance(base, torch.nn.Parameter) or t.device.type != "cpu":
                return _Held(t, None)
            key = t.untyped_storage().data_ptr()
            if key in refs:
                refs[key][0] += 1
            else:
                refs[key] = [1, t.untyped_storage().nbytes()]
                meter.live += refs[key][1]
                meter.peak = max(meter.peak, meter.live)
            return _Held(t, key)

        self._ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda h: h.t)
        self._ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = int(torch.cuda.max_memory_allocated(self.device))
        elif self._ctx is not None:
            self._ctx.__exit__(*exc)
        return False


@contextlib.contextmanager
def engine_run(ctx: Metered, name: str, phase: str = "train"):
    """Times the block, measures peak memory and converts the policy's forward counters into EngineStats."""
    stats = EngineStats(engine=name)
    before = dict(ctx.policy.counters)
    device = ctx.policy.device
    t0 = time.perf_counter()
    with MemoryMeter(device) as mem:
        yield stats
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    stats.seconds[phase] = stats.seconds.get(phase, 0.0) + time.perf_counter() - t0
    stats.peak_memory_bytes = max(stats.peak_memory_bytes, mem.peak)
    stats.forwards_grad += ctx.policy.counters["forwards_grad"] - before["forwards_grad"]
    stats.forwards_nograd += ctx.policy.counters["forwards_nograd"] - before["forwards_nograd"]


__all__ = ["MemoryMeter", "Metered", "chunks", "engine_run", "record_backward"]
