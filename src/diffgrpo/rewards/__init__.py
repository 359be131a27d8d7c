"""Rewards: the registries, the scoring of a batch, and the checks made before any model loads.

A reward is any callable ``fn(images, prompts, metadata) -> (B,)`` (tensor, array or list of floats), or one in
TRL's keyword convention ``fn(prompts=, completions=, <metadata field>=, **kwargs)`` (``rewards.calling``; the
signature is checked at validation). Config names are registry keys, ``module:function`` plug-ins or names given
to ``Trainer(cfg, rewards={name: fn})`` (:func:`supply`); ``reward.options.<name>`` reach a plug-in as keywords.
``http`` scores with a server (``rewards.http``). An image edit's metadata also holds ``source_images`` (its
sources as (3, H, W) tensors in [0, 1], attached by the flow family with ``sources.attach``): the keyword
``source_images=`` in TRL's convention.

Model-based rewards (``pickscore``, ``clip_score``, ``aesthetic``, ``ocr``, ``geneval``; :data:`MODEL_REWARDS`) are
built by :func:`make_rewards` for a device (the policy's by default) with per-reward options from
``reward.options`` (hub ids, dtype, batch size, ...); their models load lazily, once per process, under a lock
(``rewards.loading``), so scoring may run in a worker thread.

  registry.py  the registries (:data:`REWARDS`, :data:`MODEL_REWARDS`, :data:`OPTION_REWARDS`, :data:`SUPPLIED`)
               and name resolution (:func:`resolve_reward`)
  scoring.py   :func:`make_rewards`, :func:`compute_rewards`: calls retried once, return values checked, the
               weighted sum (NaN/inf marks a sample invalid), ``reward.timeout``
  checks.py    :func:`check_rewards`, :func:`check_text_rewards`, :func:`check_options`: names, options, plug-in
               signatures and optional packages, before anything loads
"""
from __future__ import annotations

from ..errors import RewardError
from . import calling, checks, clip_models, edit, geneval, ocr, registry, scoring, verifiers
from .checks import check_options, check_rewards, check_text_rewards, missing_packages
from .registry import (
    MODEL_REWARDS,
    OPTION_REWARDS,
    PATH_OPTIONS,
    REQUIRED_OPTIONS,
    REWARDS,
    SUPPLIED,
    TASK_REWARD,
    TEXT_REWARDS,
    ModelReward,
    RewardFn,
    resolve_reward,
    supply,
    with_supplied,
)
from .scoring import RewardTimeout, compute_rewards, make_rewards, tag_means, time_limited

__all__ = [
    "MODEL_REWARDS",
    "OPTION_REWARDS",
    "PATH_OPTIONS",
    "REQUIRED_OPTIONS",
    "REWARDS",
    "SUPPLIED",
    "TASK_REWARD",
    "TEXT_REWARDS",
    "ModelReward",
    "RewardError",
    "RewardFn",
    "RewardTimeout",
    "calling",
    "check_options",
    "check_rewards",
    "check_text_rewards",
    "checks",
    "clip_models",
    "compute_rewards",
    "tag_means",
    "edit",
    "geneval",
    "make_rewards",
    "missing_packages",
    "ocr",
    "registry",
    "resolve_reward",
    "scoring",
    "supply",
    "time_limited",
    "verifiers",
    "with_supplied",
]
