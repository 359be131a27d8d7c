"""The feature spaces and plug-ins of the guards (:mod:`diffgrpo.guards` computes and judges the values):

  CLIP_REWARDS              the CLIP-class rewards whose CLIP model ``eval.guard_features=clip`` shares
  clip_features(images, …)  unit-norm CLIP image embeddings (B, D) (video: the mean over its frames), in chunks;
                            cost: one CLIP image forward a sample (a frame of a video)
  clip_reward(cfg)          the run's first CLIP-class reward, or None
  feature_kind(cfg)         ``eval.guard_features`` resolved (``auto``: digits / shapes for the built-in model on
                            those tasks, none on shapes_video, else clip when a CLIP-class reward is configured, else
                            none)
  diversity_space(cfg)      the diversity objectives' space: feature_kind, or ``detections`` (the shapes checker's
                            detection vectors, :mod:`rewards.shapes_features`) on the shapes tasks where it is none
                            or shapes
  task_reference(cfg, meta) eval/fid's feature map and reference features on the shapes task (the encoder of
                            :mod:`rewards.shapes_encoder`, scenes rendered for the evaluation prompts); None: the
                            digit classifier and the digits test split
  plugin(spec, key)         a registry reward or an importable ``module:function`` named by a config key
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import plugins
from .errors import ConfigError
from .rewards import REWARDS, clip_models, shapes_encoder

CLIP_REWARDS = {"pickscore": (clip_models.PICKSCORE_MODEL, clip_models.PICKSCORE_PROCESSOR),
                "clip_score": (clip_models.CLIP_L14, ""), "aesthetic": (clip_models.CLIP_L14, "")}
FEATURES = ("auto", "digits", "shapes", "clip", "none")
DETECTION_TASKS = ("shapes", "shapes_video")  # the built-in model's tasks scored by the shapes checker


@torch.no_grad()
def clip_features(images: torch.Tensor, model: str, processor: str, device, dtype: str,
                  batch_size: int) -> torch.Tensor:
    """Unit-norm CLIP image embeddings (B, D) float32 (video: the mean over its F frames), in chunks."""
    proc, net = clip_models.load_clip(model, processor, device, dtype)
    B, F = images.shape[0], images.shape[2] if images.dim() == 5 else 1
    frames = images if images.dim() == 4 else images.permute(0, 2, 1, 3, 4).reshape(B * F, *images.shape[1:2],
                                                                                      *images.shape[-2:])
    e = torch.cat([clip_models.image_embeds(proc, net, frames[i:i + batch_size])
                   for i in range(0, frames.shape[0], batch_size)])  # (B·F, D)
    return e.view(B, F, -1).mean(1).cpu()


def clip_reward(cfg) -> str | None:
    """The run's first CLIP-class reward (training rewards first, then guard rewards), or None."""
    return next((n for n in [*cfg.reward.weights, *cfg.eval.guard_rewards] if n in CLIP_REWARDS), None)


def feature_kind(cfg) -> str:
    """``eval.guard_features`` resolved: digits, shapes, clip, none or a module:function."""
    kind = cfg.eval.guard_features
    if kind != "auto":
        return kind
    if cfg.model.name == "tiny":
        return cfg.train.task if cfg.train.task in ("digits", "shapes") else "none"
    return "clip" if clip_reward(cfg) is not None else "none"


def diversity_space(cfg) -> str:
    """The feature space the diversity objectives measure samples in: :func:`feature_kind` when the guards have
    one, else ``detections`` for the built-in model's shapes tasks (the guards' own space there is none or the
    shapes encoder's: the checker's detections name what the objectives compare), else none."""
    kind = feature_kind(cfg)
    if kind in ("none", "shapes") and cfg.model.name == "tiny" and cfg.train.task in DETECTION_TASKS:
        return "detections"
    return kind


def task_reference(cfg, metadata: list[dict]) -> tuple[Callable, torch.Tensor] | None:
    """eval/fid's and eval/guard/kid's (feature map, reference features (N, D)) where the guards' space is shapes: the
    shapes encoder and scenes rendered for the evaluation records ``metadata``; None elsewhere (the built-in digits:
    the digit classifier and the digits test split)."""
    if feature_kind(cfg) != "shapes":
        return None
    return shapes_encoder.features, shapes_encoder.reference_features(metadata, cfg.model.image_size)


def plugin(spec: str, key: str) -> Callable:
    """A registry reward or an importable ``module:function`` named by config key ``key`` (ConfigError otherwise)."""
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ConfigError(f"{key}: unknown reward {spec!r}; choose one of {sorted(REWARDS)} or package.module:function")
    fn = plugins.resolve(spec, key=key, hint="; give a registry reward or package.module:function")
    if not callable(fn):
        raise ConfigError(f"{key}: {spec!r} is not callable")
    return fn


__all__ = ["CLIP_REWARDS", "FEATURES", "clip_features", "clip_reward", "diversity_space", "feature_kind",
           "plugin", "task_reference"]
