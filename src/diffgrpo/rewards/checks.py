"""The checks of a run's rewards before any model loads: reward names, ``reward.options`` (each option one the
reward takes, of the right type and range, the required ones present), plug-ins' and supplied callables'
signatures, optional packages, and whether each reward can apply to the model (images or text completions).
Every problem is a one-line ConfigError naming the key."""
from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Mapping

import torch

from ..errors import ConfigError, suggest
from ..sandbox import BACKENDS as SANDBOX_BACKENDS
from ..types import DTYPES
from . import calling, registry
from .registry import (
    MODEL_REWARDS,
    OPTION_REWARDS,
    PATH_OPTIONS,
    REQUIRED_OPTIONS,
    REWARDS,
    TASK_REWARD,
    TEXT_REWARDS,
    resolve_reward,
)

_DTYPES = tuple(DTYPES)  # float32, bfloat16, float16


def _check_number(key: str, value, tp) -> object:
    """A bool, int or float option value against its type and range → the coerced value."""
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: value {value!r} must be true or false")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: value {value!r} must be an integer")
        if value < 1:
            raise ConfigError(f"{key}: value {value!r} is out of range; must be >= 1")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}: value {value!r} must be a finite number")
    name = key.rsplit(".", 1)[-1]
    if name in ("threshold", "nms_iou", "min_confidence") and not 0.0 <= value <= 1.0:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be in [0, 1]")
    if name in ("divide_by", "timeout") and not value > 0:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be > 0")
    return float(value)


def _check_device(key: str, value: str) -> None:
    """A ``device`` option: a torch device this machine has."""
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"{key}: value {value!r} is not a torch device; choose e.g. 'cpu', 'cuda' or "
                          "'cuda:1' (default: the policy's device)") from None
    have = torch.cuda.device_count() if dev.type == "cuda" else None
    if have is not None and (have == 0 or (dev.index or 0) >= have):  # known now, not at the first scoring
        raise ConfigError(f"{key}: value {value!r} is not a device of this machine ({have} CUDA device(s)); "
                          "choose one it has, or remove the option (default: the policy's device)")


def _check_option(key: str, value, tp) -> object:
    """One ``reward.options.<name>.<option>`` value against its type and range → the coerced value."""
    if tp in (bool, int, float):
        return _check_number(key, value, tp)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: value {value!r} must be a non-empty string")
    if key.endswith(".backend") and value not in SANDBOX_BACKENDS:
        raise ConfigError(f"{key}: value {value!r} is not allowed; choose one of {list(SANDBOX_BACKENDS)}")
    if key.endswith(".dtype") and value not in _DTYPES:
        raise ConfigError(f"{key}: value {value!r} is not allowed; choose one of {list(_DTYPES)}")
    if key.endswith(".url") and not value.startswith(("http://", "https://")):
        raise ConfigError(f"{key}: value {value!r} must be an http:// or https:// URL")
    if key.endswith(".device"):
        _check_device(key, value)
    if key.rsplit(".", 1)[-1] in PATH_OPTIONS and value.startswith(("/", "./", "../", "~")) and \
            not os.path.exists(os.path.expanduser(value)):
        raise ConfigError(f"{key}: {value!r} names a local path that does not exist (a hub id has no leading / . "
                          "or ~)")
    return value


def check_options(weights: Mapping[str, float], options: Mapping[str, Mapping]) -> None:
    """``reward.options``: each key a model reward listed in ``reward.weights``, each option one it takes, with a
    value of the right type and range. Raises a one-line ConfigError naming the key."""
    takes = {**MODEL_REWARDS, **OPTION_REWARDS}
    for name, opts in options.items():
        key = f"reward.options.{name}"
        if name not in takes and name in weights and (":" in name or name in registry.SUPPLIED):
            if not isinstance(opts, Mapping):
                raise ConfigError(f"{key}: value {opts!r} must be a mapping of keyword arguments, e.g. {{scale: 2}}")
            continue  # a plug-in's options: checked against its signature (check_rewards)
        if name not in takes:
            raise ConfigError(f"{key}: {name!r} takes no options{suggest(name, list(takes))}; options "
                              f"apply to {sorted(takes)}")
        if name not in weights:
            raise ConfigError(f"{key}: reward {name!r} is not in reward.weights {sorted(weights)}; add it there "
                              f"or remove its options")
        if not isinstance(opts, Mapping):
            raise ConfigError(f"{key}: value {opts!r} must be a mapping of options, e.g. {{batch_size: 8}}")
        allowed = takes[name].options
        for opt, value in opts.items():
            if opt not in allowed:
                raise ConfigError(f"{key}.{opt}: unknown option{suggest(str(opt), list(allowed))}; {name} takes "
                                  f"{sorted(allowed)}")
            _check_option(f"{key}.{opt}", value, allowed[opt])
        for opt in REQUIRED_OPTIONS.get(name, ()):
            if opt not in opts:
                raise ConfigError(f"{key}.{opt}: required for reward {name!r}, e.g. reward.options={{{name}: {{{opt}: "
                                  "...}}")


def missing_packages(name: str) -> list[str]:
    """The pip packages a registry reward needs that this environment lacks (checked without importing them)."""
    spec = MODEL_REWARDS.get(name)
    if spec is None:
        return []
    return [pkg for mod, pkg in spec.requires.items() if importlib.util.find_spec(mod) is None]


def _check_options_and_plugins(weights: Mapping[str, float], options: Mapping[str, Mapping]) -> None:
    """For either family: the options a reward cannot do without, ``reward.options`` (:func:`check_options`), and
    that each plug-in or supplied callable can be called as a reward (its signature)."""
    for name, opts in REQUIRED_OPTIONS.items():
        if name in weights and name not in options:
            raise ConfigError(f"reward.options.{name}.{opts[0]}: required for reward {name!r}, e.g. "
                              f"reward.options={{{name}: {{{opts[0]}: 'http://127.0.0.1:8000/score'}}}}")
    check_options(weights, options)
    for name in weights:
        if name not in REWARDS:
            calling.check_signature(name, resolve_reward(name), options.get(name))


def check_text_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping]) -> None:
    """``reward.weights`` of a masked diffusion LM run, before anything loads: rewards added to the task's verifier
    (``task`` weighs the verifier itself). Image rewards are refused; plug-ins' signatures, ``reward.options`` and
    the required options are checked as for images. One-line ConfigErrors naming the key."""
    extra = {n: w for n, w in weights.items() if n != TASK_REWARD}
    images = sorted(n for n in extra if n in REWARDS and n not in TEXT_REWARDS and n != "http")
    if images:
        raise ConfigError(f"reward.weights: {images[0]!r} scores images and cannot score a masked diffusion LM's "
                          f"completions; choose text rewards ({', '.join(sorted(TEXT_REWARDS))}, http, a "
                          f"module:function) beside the task's verifier ('{TASK_REWARD}')")
    _check_options_and_plugins(extra, options)


def check_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping], *, model_name: str) -> None:
    """The reward section of a flow-matching run against its model, before anything loads (one-line ConfigErrors):

    - ``digit_alignment`` reads the built-in digits model's one-channel images (model.name=tiny only);
    - ``reward.options`` (see :func:`check_options`);
    - a registry reward whose optional package is missing names the package and the ``rewards`` extra.

    (A diffusion LM's reward.weights are checked by :func:`check_text_rewards`.)"""
    if "digit_alignment" in weights and model_name != "tiny":
        raise ConfigError(f"reward.weights: 'digit_alignment' scores the built-in one-channel digit images "
                          f"(model.name=tiny) and cannot apply to model.name={model_name}'s RGB output; choose "
                          f"e.g. pickscore, clip_score, aesthetic, ocr or geneval")
    text = sorted(n for n in weights if n in TEXT_REWARDS)
    if text:
        raise ConfigError(f"reward.weights: {text[0]!r} verifies text completions and cannot score "
                          f"model.name={model_name}'s images; choose e.g. pickscore, clip_score, aesthetic, ocr or "
                          f"geneval (text verifiers score masked diffusion LMs' completions)")
    _check_options_and_plugins(weights, options)
    for name in weights:
        missing = missing_packages(name)
        if missing:
            raise ConfigError(f"reward.weights: reward {name!r} needs {', '.join(missing)}, which is not installed; "
                              f"pip install 'diffgrpo[rewards]'")


__all__ = ["check_options", "check_rewards", "check_text_rewards", "missing_packages"]
