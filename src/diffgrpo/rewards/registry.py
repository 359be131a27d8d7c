"""The reward registries and name resolution: registry rewards, model rewards and the options they take, text
rewards built from options, names supplied in this process, and ``module:function`` plug-ins.

A config name resolves (:func:`resolve_reward`) to a registry key of :data:`REWARDS`, a name given to
``Trainer(cfg, rewards={name: fn})`` (:func:`supply`), or a ``module:function`` plug-in (``plugins.resolve``: the
current directory is importable; ``__main__:fn`` names a function of a notebook or script). :func:`build` makes
one reward of a run: a model reward for a device with its ``reward.options``, a text reward from its options, a
plug-in with its options bound as keywords (``rewards.calling``).
"""
from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from .. import plugins
from ..errors import ConfigError, suggest
from . import calling, clip_models, edit, geneval, ocr, verifiers
from .http import http as http_reward
from .image import digit_alignment, jpeg_compressibility, jpeg_incompressibility
from .shapes import shapes_correct, shapes_score
from .shapes_video import shapes_video_correct, shapes_video_score

RewardFn = Callable[..., object]

REWARDS: dict[str, RewardFn] = {
    "digit_alignment": digit_alignment,
    "jpeg_compressibility": jpeg_compressibility,
    "jpeg_incompressibility": jpeg_incompressibility,
    "shapes_correct": shapes_correct,  # the shapes task's checker: every constraint met (0/1)
    "shapes_score": shapes_score,  # the fraction of its constraints met
    "shapes_video_correct": shapes_video_correct,  # shapes_video: every frame and every motion right (0/1)
    "shapes_video_score": shapes_video_score,  # the fraction of its constraints met
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
PATH_OPTIONS = ("model", "processor", "head", "detector", "clip")
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

# registry rewards that read text completions (masked diffusion LMs), never images
TEXT_REWARDS = frozenset({"verify_gsm8k", "verify_countdown", "verify_sudoku", "verify_json_schema", "d1_format",
                          "verify_math", "verify_code", "verify_code_pass_at_1"})

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
    supply(rewards)
    cfg = copy.deepcopy(cfg)
    kept = {n: w for n, w in cfg.reward.weights.items() if n == TASK_REWARD}  # a masked LM's verifier weight
    cfg.reward.weights = {**kept, **{name: cfg.reward.weights.get(name, 1.0) for name in rewards}}
    return cfg


# what a command that scores nothing (diffgrpo sample, export) trains "on": a supplied name that every family
# accepts (no model, no plug-in, no other family's reward) and that refuses to score
UNSCORED = "unscored"


def unscored(images, prompts, metadata=None):
    raise ConfigError(f"reward.weights: {UNSCORED!r} stands in for a run's rewards where the command scores nothing "
                      "(diffgrpo sample, export); set reward.weights to score")


def unscored_overrides(overrides: list[str]) -> list[str]:
    """The overrides that give a command which scores nothing the stand-in reward :data:`UNSCORED` (supplied here)
    in place of the config's own (a run's plug-in, not run; a default that does not fit its model): none when the
    command line sets a ``reward.`` key itself."""
    if any(o.split("=", 1)[0].strip().startswith("reward.") for o in overrides):
        return []
    supply({UNSCORED: unscored})
    return [f"reward.weights={{{UNSCORED}: 1.0}}", "reward.options={}"]


def resolve_reward(name: str) -> RewardFn:
    """Registry key, supplied name or ``package.module:function`` → callable. Raises ConfigError for unknown
    names, malformed or failing plug-ins."""
    if name in REWARDS:
        return REWARDS[name]
    if name in SUPPLIED:
        return SUPPLIED[name]
    choose = f"; choose one of {sorted(REWARDS)} or package.module:function"
    if ":" in name:
        fn = plugins.resolve(name, key="reward.weights",
                             malformed="{key}: reward {spec!r} is not a valid module:function ({problem})" + choose,
                             failed="{key}: cannot import reward {spec!r} ({error})")
        if not callable(fn):
            raise ConfigError(f"reward.weights: {name!r} is not callable")
        return fn
    raise ConfigError(f"reward.weights: unknown reward {name!r}{suggest(name, list(REWARDS))}; "
                      f"choose one of {sorted(REWARDS)} or module:function")


def build(name: str, options: Mapping | None = None, device=None) -> RewardFn:
    """One reward of a run: a model reward built for ``device`` (``options["device"]`` overrides it), a text reward
    built from its options, otherwise the resolved name with its options as keywords (TRL's convention spread by
    name). Nothing loads here: models load on the first call, once per process."""
    opts = dict(options or {})
    if name in MODEL_REWARDS:
        dev = opts.pop("device", "") or device
        return MODEL_REWARDS[name].build(None if dev is None else str(dev), **opts)
    if name in OPTION_REWARDS:
        return OPTION_REWARDS[name].build(None, **opts)
    return calling.bind(resolve_reward(name), options)


__all__ = ["MODEL_REWARDS", "OPTION_REWARDS", "PATH_OPTIONS", "REQUIRED_OPTIONS", "REWARDS", "SUPPLIED", "TASK_REWARD",
           "TEXT_REWARDS", "UNSCORED", "ModelReward", "RewardFn", "build", "resolve_reward", "supply", "unscored",
           "unscored_overrides", "with_supplied"]
