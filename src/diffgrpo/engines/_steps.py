"""Step selection: which (trajectory, step) pairs receive gradients. Shared by every engine.

The final step (into σ = 0) is deterministic and never selected. With T sampling steps the trainable
steps are 0 … T−2 (K_max = T−1 of them).
  all             every trainable step
  first_fraction  the first ceil(fraction·K_max) trainable steps (FlowGRPO's timestep_fraction)
  random          a random subset of ceil(fraction·K_max) steps per trajectory (DanceGRPO)
  window          window_size consecutive steps from window_start, or from a random start per trajectory
                  when window_start = −1 (sliding-window schemes)
"""
from __future__ import annotations

import math

import torch

from ..config import RunConfig

SELECTION_MODES = ("all", "first_fraction", "random", "window")


def select_steps(mode: str, num_steps: int, batch: int, *, fraction: float = 1.0, window_start: int = -1,
                 window_size: int = 4, generator: torch.Generator | None = None) -> torch.Tensor:
    """→ selected (batch, num_steps) bool; column num_steps−1 is always False."""
    k_max = num_steps - 1
    sel = torch.zeros(batch, num_steps, dtype=torch.bool)
    if k_max < 1:
        return sel
    n = max(1, min(k_max, math.ceil(fraction * k_max - 1e-9)))
    if mode == "all":
        sel[:, :k_max] = True
    elif mode == "first_fraction":
        sel[:, :n] = True
    elif mode == "random":
        for i in range(batch):
            sel[i, torch.randperm(k_max, generator=generator)[:n]] = True
    elif mode == "window":
        size = min(window_size, k_max)
        if window_start >= 0:
            if window_start + size > k_max:
                raise ValueError(f"steps.window_start={window_start} with window_size={size} exceeds the "
                                 f"{k_max} trainable steps")
            sel[:, window_start:window_start + size] = True
        else:
            starts = torch.randint(0, k_max - size + 1, (batch,), generator=generator)
            for i, s in enumerate(starts.tolist()):
                sel[i, s:s + size] = True
    else:
        raise ValueError(f"steps.mode must be one of {SELECTION_MODES}, got {mode!r}")
    return sel


def selected_per_trajectory(cfg: RunConfig) -> int:
    """How many steps ``steps.*`` selects per trajectory (the final step is never trained)."""
    k_max = cfg.sampler.num_steps - 1
    if cfg.steps.mode == "all":
        return k_max
    if cfg.steps.mode == "window":
        return min(cfg.steps.window_size, k_max)
    return max(1, min(k_max, math.ceil(cfg.steps.fraction * k_max - 1e-9)))
