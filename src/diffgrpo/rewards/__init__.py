"""Reward registry and the weighted multi-reward combinator.

A reward is any callable ``fn(images, prompts, metadata) -> (B,)`` (tensor, array or list of floats).
Config names are registry keys or ``module:function`` plug-ins. A reward that raises stops the run with a
:class:`RewardError` naming it; NaN/inf values mark that sample invalid, so it is excluded from the group
statistics and the loss instead of being averaged in.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..errors import ConfigError, RewardError, suggest
from .image import digit_alignment, jpeg_compressibility, jpeg_incompressibility

RewardFn = Callable[..., object]

REWARDS: dict[str, RewardFn] = {
    "digit_alignment": digit_alignment,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
}


def resolve_reward(name: str) -> RewardFn:
    """Registry key or ``package.module:function`` → callable. Raises ConfigError for unknown names."""
    if name in REWARDS:
        return REWARDS[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ConfigError(f"reward.weights: cannot import reward {name!r} ({e})") from None
        if not callable(fn):
            raise ConfigError(f"reward.weights: {name!r} is not callable")
        return fn
    raise ConfigError(f"reward.weights: unknown reward {name!r}{suggest(name, list(REWARDS))}; "
                      f"choose one of {sorted(REWARDS)} or module:function")


def _call_with_retry(name: str, fn: RewardFn, images, prompts, metadata, log):
    """Call a reward; a raising call is retried once (transient failures: a scoring server, a file lock)."""
    try:
        return fn(images, prompts, metadata)
    except Exception as e:  # noqa: BLE001 - reported with the reward's name
        log(f"warning: reward {name!r} raised {type(e).__name__}: {e}; retrying once")
    try:
        return fn(images, prompts, metadata)
    except Exception as e:  # noqa: BLE001
        raise RewardError(f"reward {name!r} raised {type(e).__name__}: {e} (after one retry); every sample of "
                          f"the batch lacks this reward, so the run stops") from e


def compute_rewards(weights: dict[str, float], images: torch.Tensor, prompts: list[str],
                    metadata: list[dict], log=print) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of the configured rewards. → (total (B,) with NaN where any component is not finite,
    components {name: (B,)}). A reward that raises is retried once, then stops the run with RewardError."""
    B = len(prompts)
    total = torch.zeros(B)
    comps: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        val = _call_with_retry(name, resolve_reward(name), images, prompts, metadata, log)
        val = torch.as_tensor(val, dtype=torch.float32).detach().cpu().reshape(-1)
        if val.numel() != B:
            raise RewardError(f"reward {name!r} returned {val.numel()} values for {B} samples")
        comps[name] = val
        total = total + float(w) * val
    total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("nan")))
    return total, comps
