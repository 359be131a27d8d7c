"""Reward registry and the weighted multi-reward combinator.

A reward is any callable ``fn(images, prompts, metadata) -> (B,)`` (tensor, array or list of floats), or one in
TRL's keyword convention ``fn(prompts=, completions=, <metadata field>=, **kwargs)`` (``rewards.calling``; the
signature is checked at validation). Config names are registry keys, ``module:function`` plug-ins (the current
directory is importable; ``__main__:fn`` names a function of a notebook or script) or names given to
``Trainer(cfg, rewards={name: fn})`` (:func:`supply`); ``reward.options.<name>`` reach a plug-in as keywords.
``http`` scores with a server (``rewards.http``). An image edit's metadata also holds ``source_images`` (its
sources as (3, H, W) tensors in [0, 1], ``sources.attach``): the keyword ``source_images=`` in TRL's convention. A reward that raises is retried once, then stops
the run with a :class:`RewardError` naming it; one that returns anything but B real numbers (a string, None, a
dict, the wrong shape) or calls ``sys.exit`` stops it at once with a one-line RewardError naming it (only
KeyboardInterrupt passes through). NaN/inf values mark that sample invalid, so it is excluded from the group
statistics and the loss instead of being averaged in.

Model-based rewards (``pickscore``, ``clip_score``, ``aesthetic``, ``ocr``, ``geneval``; :data:`MODEL_REWARDS`) are
built by :func:`make_rewards` for a device (the policy's by default) with per-reward options from
``reward.options`` (hub ids, dtype, batch size, ...); their models load lazily, once per process, under a lock
(``rewards.loading``), so scoring may run in a worker thread. Their registry entries in :data:`REWARDS` use the
default options on the default device. :func:`check_rewards` refuses, before anything loads, options a reward does
not take, a reward whose optional package is missing, and a reward that cannot apply to the model.
"""
from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from .. import sources
from ..errors import ConfigError, RewardError, suggest
from ..sandbox import BACKENDS as SANDBOX_BACKENDS
from ..threads import CallTimeout, call_with_timeout, signal_expected
from ..types import DTYPES
from . import calling, clip_models, edit, geneval, ocr, verifiers
from .http import http as http_reward
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
    "verify_math": verifiers.verify_math,
    "verify_code": verifiers.verify_code,
    "verify_code_pass_at_1": verifiers.verify_code_pass_at_1,
}


@dataclass(frozen=True)
class ModelReward:
    """A registry reward backed by a model: ``build(device, **options) → fn(images, prompts, metadata) → (B,)``;
    ``options``: option name → type (what ``reward.options.<name>`` may set); ``requires``: importable module →
    pip package (the ``rewards`` extra)."""
    build: Callable[..., RewardFn]
    options: dict = field(default_factory=dict)
    requires: dict = field(default_factory=dict)


_CLIP_OPTS = {"model": str, "processor": str, "dtype": str, "batch_size": int, "device": str}
MODEL_REWARDS: dict[str, ModelReward] = {
    "pickscore": ModelReward(clip_models.pickscore, {**_CLIP_OPTS, "divide_by": float}),
    "clip_score": ModelReward(clip_models.clip_score, dict(_CLIP_OPTS)),
    "clip_direction": ModelReward(edit.clip_direction, dict(_CLIP_OPTS)),  # image edits: result vs its source
    "aesthetic": ModelReward(clip_models.aesthetic, {**_CLIP_OPTS, "head": str}),
    "ocr": ModelReward(ocr.ocr, {"min_confidence": float, "det_limit_side_len": int},
                       requires={"rapidocr_onnxruntime": "rapidocr-onnxruntime"}),
    "geneval": ModelReward(geneval.geneval,
                           {"detector": str, "clip": str, "dtype": str, "batch_size": int, "device": str,
                            "threshold": float, "nms_iou": float, "strict": bool}),
    # a reward served elsewhere: reward.options.http.url is required
    "http": ModelReward(http_reward, {"url": str, "timeout": float, "attempts": int, "batch_size": int, "token": str}),
}
# options naming a model: a hub id or a local path (checked to exist before anything loads)
_PATH_OPTIONS = ("model", "processor", "head", "detector", "clip")
# options a model reward cannot do without
REQUIRED_OPTIONS = {"http": ("url",)}


def _default_model_reward(name: str) -> RewardFn:
    """``REWARDS[name]`` of a model reward: default options on the default device, built on first call."""
    built: list[RewardFn] = []

    def fn(images, prompts, metadata=None):
        if not built:
            built.append(MODEL_REWARDS[name].build(None))
        return built[0](images, prompts, metadata)
    fn.__name__ = fn.__qualname__ = name
    return fn


REWARDS.update({name: _default_model_reward(name) for name in MODEL_REWARDS})

# text rewards built with reward.options (a sandbox pool: no model, no device)
_CODE_OPTS = {"backend": str, "workers": int, "timeout": float, "memory_mb": int, "url": str}
OPTION_REWARDS: dict[str, ModelReward] = {
    "verify_code": ModelReward(verifiers.build_verify_code, dict(_CODE_OPTS)),
    "verify_code_pass_at_1": ModelReward(lambda device=None, **o: verifiers.build_verify_code(device, pass_at_1=True,
                                                                                            **o), dict(_CODE_OPTS)),
}


# the name of a masked LM's own task verifier in reward.weights (its weight; default 1)
TASK_REWARD = "task"

# rewards handed to Trainer(cfg, rewards={name: fn}) in this process (names beside the registry's)
SUPPLIED: dict[str, RewardFn] = {}


def supply(rewards: Mapping[str, RewardFn]) -> None:
    """Make ``rewards`` (name → callable) resolvable by name in this process, as ``Trainer(cfg, rewards=...)`` does.
    A name may not shadow a registry reward or look like ``module:function``."""
    for name, fn in rewards.items():
        if not isinstance(name, str) or not name or ":" in name or name in REWARDS or name == TASK_REWARD:
            raise ConfigError(f"rewards: name {name!r} must be a new name (not a registry reward {sorted(REWARDS)}, "
                              f"not {TASK_REWARD!r}, and without ':')")
        if not callable(fn):
            raise ConfigError(f"rewards: {name!r} is a {type(fn).__name__}, not a callable")
        SUPPLIED[name] = fn


def with_supplied(cfg, rewards: Mapping[str, RewardFn]):
    """A copy of the run config ``cfg`` that trains on ``rewards`` (name → callable, :func:`supply`): its
    ``reward.weights`` become exactly these names, each with the weight ``cfg.reward.weights`` gives it, else 1."""
    import copy

    supply(rewards)
    cfg = copy.deepcopy(cfg)
    kept = {n: w for n, w in cfg.reward.weights.items() if n == TASK_REWARD}  # a masked LM's verifier weight
    cfg.reward.weights = {**kept, **{name: cfg.reward.weights.get(name, 1.0) for name in rewards}}
    return cfg


def _import_module(mod: str):
    """``importlib.import_module`` with the current directory importable (``diffgrpo`` started as a console
    script does not put it on ``sys.path`` the way ``python script.py`` does)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return importlib.import_module(mod)


def resolve_reward(name: str) -> RewardFn:
    """Registry key, supplied name or ``package.module:function`` → callable. Raises ConfigError for unknown
    names."""
    if name in REWARDS:
        return REWARDS[name]
    if name in SUPPLIED:
        return SUPPLIED[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        try:
            fn = getattr(_import_module(mod), attr)
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
            # every call gets its own copy of the inputs: a reward that edits them in place cannot change a later
            # reward's input, a retry's, or the saved samples
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
    total = torch.zeros(B)
    comps: dict[str, torch.Tensor] = {}
    metadata = sources.attach(metadata)  # an edit's source images beside it: metadata["source_images"]
    for name, w in weights.items():
        fn = rewards[name] if rewards is not None and name in rewards else resolve_reward(name)
        val = _as_scores(name, _call_with_retry(name, fn, images, prompts, metadata, log), B)
        comps[name] = val
        total = total + float(w) * val
    total = torch.where(torch.isfinite(total), total, torch.full_like(total, float("nan")))
    return total, comps


def make_rewards(weights: Mapping[str, float], options: Mapping[str, Mapping] | None = None, device=None, *,
                 timeout: float = 0.0) -> dict[str, RewardFn]:
    """name → reward callable for ``compute_rewards(..., rewards=...)``: model rewards built for ``device`` (the
    policy's; ``reward.options.<name>.device`` overrides it) with their ``reward.options``; other names resolved
    through the registry. Nothing loads here: models load on the first call, once per process. ``timeout``
    (``reward.timeout``, seconds; 0: none): a call taking longer stops the run with a one-line RewardError (not
    retried), its thread left behind as a daemon (``threads.call_with_timeout``)."""
    options = options or {}
    out: dict[str, RewardFn] = {}
    for name in weights:
        if name in MODEL_REWARDS:
            opts = dict(options.get(name) or {})
            dev = opts.pop("device", "") or device
            fn = MODEL_REWARDS[name].build(None if dev is None else str(dev), **opts)
        elif name in OPTION_REWARDS:
            fn = OPTION_REWARDS[name].build(None, **dict(options.get(name) or {}))
        else:  # a plug-in: its options as keywords, TRL's keyword convention spread by name
            fn = calling.bind(resolve_reward(name), options.get(name))
        out[name] = fn if not timeout else time_limited(name, fn, float(timeout))
    return out


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


_DTYPES = tuple(DTYPES)  # float32, bfloat16, float16


def _check_option(key: str, value, tp) -> object:
    """One ``reward.options.<name>.<option>`` value against its type and range → the coerced value."""
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
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(f"{key}: value {value!r} must be a finite number")
        name = key.rsplit(".", 1)[-1]
        if name in ("threshold", "nms_iou", "min_confidence") and not 0.0 <= value <= 1.0:
            raise ConfigError(f"{key}: value {value!r} is out of range; must be in [0, 1]")
        if name in ("divide_by", "timeout") and not value > 0:
            raise ConfigError(f"{key}: value {value!r} is out of range; must be > 0")
        return float(value)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{key}: value {value!r} must be a non-empty string")
    if key.endswith(".backend") and value not in SANDBOX_BACKENDS:
        raise ConfigError(f"{key}: value {value!r} is not allowed; choose one of {list(SANDBOX_BACKENDS)}")
    if key.endswith(".dtype") and value not in _DTYPES:
        raise ConfigError(f"{key}: value {value!r} is not allowed; choose one of {list(_DTYPES)}")
    if key.endswith(".url") and not value.startswith(("http://", "https://")):
        raise ConfigError(f"{key}: value {value!r} must be an http:// or https:// URL")
    if key.endswith(".device"):
        try:
            dev = torch.device(value)
        except (RuntimeError, ValueError, TypeError):
            raise ConfigError(f"{key}: value {value!r} is not a torch device; choose e.g. 'cpu', 'cuda' or "
                              "'cuda:1' (default: the policy's device)") from None
        have = torch.cuda.device_count() if dev.type == "cuda" else None
        if have is not None and (have == 0 or (dev.index or 0) >= have):  # known now, not at the first scoring
            raise ConfigError(f"{key}: value {value!r} is not a device of this machine ({have} CUDA device(s)); "
                              "choose one it has, or remove the option (default: the policy's device)")
    if key.rsplit(".", 1)[-1] in _PATH_OPTIONS and value.startswith(("/", "./", "../", "~")) and \
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
        if name not in takes and name in weights and (":" in name or name in SUPPLIED):
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


# registry rewards that read text completions (masked diffusion LMs), never images
TEXT_REWARDS = frozenset({"verify_gsm8k", "verify_countdown", "verify_sudoku", "verify_json_schema", "d1_format",
                          "verify_math", "verify_code", "verify_code_pass_at_1"})


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
