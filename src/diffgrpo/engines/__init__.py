"""Gradient engines: interchangeable strategies that turn a rollout into ``.grad``.

``ENGINES`` maps a config name to a class constructed with the :class:`~diffgrpo.config.EngineConfig`.
A config value may also be ``module:Class`` for user engines.
"""
from __future__ import annotations

from .. import plugins
from ..config import EngineConfig
from ._steps import SELECTION_MODES, select_steps
from .awm import AWMEngine
from .base import Engine, EngineContext
from .dgpo import DGPOEngine
from .jagg import JaggEngine
from .nft import NFTEngine
from .recompute import RecomputeEngine
from .retain import RetainEngine
from .reweight import ReweightEngine
from .single_step import SingleStepEngine

ENGINES: dict[str, type] = {
    "recompute": RecomputeEngine,
    "jagg": JaggEngine,
    "single_step": SingleStepEngine,
    "retain": RetainEngine,
    "reweight": ReweightEngine,
    "nft": NFTEngine,
    "awm": AWMEngine,
    "dgpo": DGPOEngine,
}
# engines that train on clean samples through the forward process (no per-step likelihood): they own the trained
# units (steps.* does not apply) and accept deterministic ODE rollouts (sampler.sde_type=ode)
FORWARD_ENGINES = ("nft", "awm", "dgpo")


def build_engine(cfg: EngineConfig) -> Engine:
    """Engine instance for ``cfg.name`` (registry key or ``module:Class``)."""
    name = cfg.name
    if name in ENGINES:
        return ENGINES[name](cfg)
    return plugins.resolve(name, key="engine.name")(cfg)


__all__ = ["ENGINES", "FORWARD_ENGINES", "Engine", "EngineContext", "build_engine", "select_steps", "SELECTION_MODES"]
