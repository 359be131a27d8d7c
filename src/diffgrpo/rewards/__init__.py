"""Reward registry and the weighted multi-reward combinator.

A reward is any callable ``fn(images, prompts, metadata) -> (B,)`` (tensor, array or list of floats).
Config names are registry keys or ``module:function`` plug-ins. A reward that raises is retried once, then stops
the run with a :class:`RewardError` naming it; one that returns anything but B real numbers (a string, None, a
dict, the wrong shape) or calls ``sys.exit`` stops it at once with a one-line RewardError naming it (only
KeyboardInterrupt passes through). NaN/inf values mark that sample invalid, so it is excluded from the group
statistics and the loss instead of being averaged in.
"""
from __future__ import annotations

import importlib
from typing import Callable

import torch

from ..errors import ConfigError, RewardError, suggest
from . import verifiers
from .image import digit_alignment, jpeg_compressibility, jpeg_incompressibility

RewardFn = Callable[..., object]

REWARDS: dict[str, RewardFn] = {
    "digit_alignment": digit_alignment,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    # text verifiers (completions are strings; the reference is read from the prompt and metadata["answer"])
    "verify_gsm8k": verifiers.verify_gsm8k,
    "verify_countdown": verifiers.verify_countdown,
    "verify_sudoku": verifiers.verify_sudoku,
    "verify_json_schema": verifiers.verify_json_schema,
    "d1_format": verifiers.d1_format,
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


def _one_line(text: object, limit: int = 300) -> str:
    """An exception message or a value's repr on one line, at most ``limit`` characters."""
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _call_with_retry(name: str, fn: RewardFn, images, prompts, metadata, log):
    """Call a reward; a raising call is retried once (transient failures: a scoring server, a file lock).

    KeyboardInterrupt propagates. ``sys.exit`` or another BaseException that is not an Exception would end the
    process without a word about the reward: it becomes a RewardError at once (a bug, not retried)."""
    for attempt in (1, 2):
        try:
            return fn(images, prompts, metadata)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 - reported with the reward's name
            if attempt == 2:
                raise RewardError(f"reward {name!r} raised {type(e).__name__}: {_one_line(e)} (after one retry); "
                                  f"every sample of the batch lacks this reward, so the run stops") from e
            log(f"warning: reward {name!r} raised {type(e).__name__}: {_one_line(e)}; retrying once")
        except SystemExit as e:
            call = "sys.exit()" if e.code is None else f"sys.exit({_one_line(repr(e.code), 80)})"
            raise RewardError(f"reward {name!r} called {call}; a reward returns scores or raises an exception, "
                              f"so the run stops here") from None
        except BaseException as e:  # noqa: BLE001 - GeneratorExit, a user's BaseException subclass
            raise RewardError(f"reward {name!r} raised {type(e).__name__} (a BaseException, not an Exception): "
                              f"{_one_line(e)}; the run stops") from e
    raise AssertionError("unreachable")


def _as_scores(name: str, val, B: int) -> torch.Tensor:
    """A reward's return value → (B,) float32 on the CPU, or a one-line RewardError saying what came back.

    Accepted: a tensor, array, list or tuple of B real numbers, shaped (B,) or (B, 1). NaN/inf stay (they mark a
    sample invalid)."""
    def bad(what: str) -> RewardError:
        return RewardError(f"reward {name!r} returned {what}; expected (B,) numbers, one per sample")

    if val is None:
        raise bad("None")
    if isinstance(val, (str, bytes)):
        raise bad(f"a {type(val).__name__} {_one_line(repr(val), 60)}")
    if isinstance(val, dict):
        raise bad(f"a dict with keys {_one_line(list(val)[:8], 80)}")
    try:
        t = torch.as_tensor(val.detach() if torch.is_tensor(val) else val)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise bad(f"a {type(val).__name__} that does not convert to numbers") from None
    if t.is_complex():
        raise bad(f"a {type(val).__name__} of complex numbers")
    if t.dim() == 0:
        raise bad(f"a single number ({type(val).__name__}) for {B} sample{'' if B == 1 else 's'}")
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]
    if t.dim() != 1 or t.shape[0] != B:
        raise bad(f"shape {tuple(t.shape)} for {B} sample{'' if B == 1 else 's'}")
    return t.to(device="cpu", dtype=torch.float32)


def compute_rewards(weights: dict[str, float], images: torch.Tensor, prompts: list[str],
                    metadata: list[dict], log=print) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of the configured rewards. → (total (B,) with NaN where any component is not finite,
    components {name: (B,)}). A reward that raises is retried once, then stops the run with RewardError; one that
    returns something other than B numbers, or calls ``sys.exit``, stops it at once with a one-line RewardError."""
    B = len(prompts)
    total = torch.zeros(B)
    comps: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        val = _as_scores(name, _call_with_retry(name, resolve_reward(name), images, prompts, metadata, log), B)
        comps[name] = val
        total = total + float(w) * val
    total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("nan")))
    return total, comps
