"""Scoring a batch: the run's reward callables (:func:`make_rewards`, each optionally time-limited), each reward
called on its own copy of the inputs and retried once, its return value checked to be B real numbers, and the
weighted sum of the components (:func:`compute_rewards`).

A reward that raises is retried once, then stops the run with a :class:`RewardError` naming it; one that returns
anything but B real numbers (a string, None, a dict, the wrong shape) or calls ``sys.exit`` (or ``os._exit``:
:func:`..plugins.no_exit`) stops it at once with
a one-line RewardError naming it (only KeyboardInterrupt passes through). NaN/inf values mark that sample invalid,
so it is excluded from the group statistics and the loss instead of being averaged in; a ``None`` in a list of
scores is such a NaN ("not scored"), as TRL reads a reward that does not apply to some samples. The metadata reaches each
reward as given: a family adds what its rewards read (an image edit's ``source_images``, ``sources.attach``).
"""
from __future__ import annotations

import copy
from collections.abc import Mapping

import torch

from .. import plugins
from ..errors import RewardError
from ..threads import CallTimeout, call_with_timeout, signal_expected
from .registry import RewardFn, build, resolve_reward


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
            # every call gets its own copy of the inputs: a reward that edits them in place cannot change a later
            # reward's input, a retry's, or the saved samples
            with plugins.no_exit(f"reward {name!r}", RewardError):  # os._exit: a RewardError, not a silent end
                return fn(images.clone() if isinstance(images, torch.Tensor) else list(images), list(prompts),
                          copy.deepcopy(metadata))
        except KeyboardInterrupt:
            if signal_expected():  # a signal (the run's second SIGINT/SIGTERM, or Ctrl-C without a run)
                raise
            raise RewardError(f"reward {name!r} raised KeyboardInterrupt itself (no signal arrived); a reward "
                              "returns scores or raises an exception, so the run stops here") from None
        except RewardError:  # final: a timeout, or e.g. http after its own retries
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


def _none_as_nan(v):
    """One sample's score with ``None`` (not scored) as NaN; a (B, 1) row ``[None]`` too."""
    if v is None:
        return float("nan")
    if isinstance(v, (list, tuple)):
        return [float("nan") if x is None else x for x in v]
    return v


def _as_scores(name: str, val, B: int) -> torch.Tensor:
    """A reward's return value → (B,) float32 on the CPU, or a one-line RewardError saying what came back.

    Accepted: a tensor, array, list or tuple of B real numbers, shaped (B,) or (B, 1). NaN/inf stay (they mark a
    sample invalid), and so does a ``None`` entry of a list or tuple: it becomes NaN (TRL's "not scored")."""
    def bad(what: str) -> RewardError:
        return RewardError(f"reward {name!r} returned {what}; expected (B,) numbers, one per sample")

    if val is None:
        raise bad("None")
    if isinstance(val, (str, bytes)):
        raise bad(f"a {type(val).__name__} {_one_line(repr(val), 60)}")
    if isinstance(val, dict):
        raise bad(f"a dict with keys {_one_line(list(val)[:8], 80)}")
    if isinstance(val, (list, tuple)):
        val = [_none_as_nan(v) for v in val]
    try:
        t = torch.as_tensor(val.detach() if torch.is_tensor(val) else val)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise bad(f"a {type(val).__name__} that does not convert to numbers") from None
    if t.is_complex():
        raise bad(f"a {type(val).__name__} of complex numbers")
    if t.dim() == 0:
        raise bad(f"a single number ({type(val).__name__}) for {B} sample{'' if B == 1 else 's'}")
    if t.dim() == 2 and t.shape[1] == 1:
        t = t[:, 0]  # (B, 1) → (B,)
    if t.dim() != 1 or t.shape[0] != B:
        raise bad(f"shape {tuple(t.shape)} for {B} sample{'' if B == 1 else 's'}")
    t = t.to(device="cpu")
    big = torch.isfinite(t) & (t.double().abs() > torch.finfo(torch.float32).max)
    if big.any():  # finite, but float32 (the rewards' precision) would make it inf
        raise bad(f"{float(t[big][0]):.4g}, a finite number beyond float32's range (±3.4e38); scale the scores")
    return t.to(dtype=torch.float32)


def compute_rewards(weights: dict[str, float], images: torch.Tensor, prompts: list[str],
                    metadata: list[dict], log=print, *, rewards: Mapping[str, RewardFn] | None = None
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted sum of the configured rewards. → (total (B,) with NaN where any component is not finite,
    components {name: (B,)}). A reward that raises is retried once, then stops the run with RewardError; one that
    returns something other than B numbers, or calls ``sys.exit``, stops it at once with a one-line RewardError.
    ``rewards``: name → callable built by :func:`make_rewards` (device and options bound); names it lacks resolve
    through the registry. Thread-safe: model rewards load under a lock."""
    B = len(prompts)
    total = torch.zeros(B)  # (B,)
    comps: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        fn = rewards[name] if rewards is not None and name in rewards else resolve_reward(name)
        val = _as_scores(name, _call_with_retry(name, fn, images, prompts, metadata, log), B)  # (B,)
        comps[name] = val
        total = total + float(w) * val
    total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("nan")))
    return total, comps


class RewardTimeout(RewardError):
    """A reward call ran past ``reward.timeout`` (never retried: it would hang again)."""


def time_limited(name: str, fn: RewardFn, timeout: float) -> RewardFn:
    """``fn`` stopped after ``timeout`` seconds with a one-line RewardError (``threads.call_with_timeout``)."""
    def call(images, prompts, metadata):
        try:
            return call_with_timeout(fn, timeout, images, prompts, metadata)
        except CallTimeout:
            raise RewardTimeout(f"reward {name!r} returned nothing within reward.timeout={timeout:g} s; the run "
                                "stops (raise reward.timeout for a slow reward, or 0 for no limit)") from None
    return call


def make_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping] | None = None, device=None, *,
                 timeout: float = 0.0) -> dict[str, RewardFn]:
    """name → reward callable for ``compute_rewards(..., rewards=...)``: model rewards built for ``device`` (the
    policy's; ``reward.options.<name>.device`` overrides it) with their ``reward.options``; other names resolved
    through the registry (``registry.build``). Nothing loads here: models load on the first call, once per
    process. ``timeout`` (``reward.timeout``, seconds; 0: none): a call taking longer stops the run with a one-line
    RewardError (not retried), its thread left behind as a daemon (``threads.call_with_timeout``)."""
    options = options or {}
    out: dict[str, RewardFn] = {}
    for name in weights:
        fn = build(name, options.get(name), device)
        out[name] = fn if not timeout else time_limited(name, fn, float(timeout))
    return out



def tag_means(values: torch.Tensor, metadata: list) -> dict[str, float]:
    """Mean of ``values`` (N,) per prompt category (each record's ``tag``, GenEval's metadata field), NaNs left out;
    empty unless every record has a tag. GenEval's overall score is the mean of these means, not of the samples."""
    tags = [m.get("tag") if isinstance(m, Mapping) else None for m in metadata]
    if not tags or not all(isinstance(t, str) for t in tags):
        return {}
    out = {}
    for tag in dict.fromkeys(tags):
        v = values[[i for i, t in enumerate(tags) if t == tag]]  # (n_tag,)
        out[tag] = float(v[torch.isfinite(v)].mean()) if torch.isfinite(v).any() else float("nan")
    return out


__all__ = ["RewardTimeout", "compute_rewards", "make_rewards", "tag_means", "time_limited"]
