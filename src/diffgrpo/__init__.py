"""diffgrpo: fast, composable GRPO post-training for diffusion models."""
from ._version import __version__
from .config import RunConfig
from .errors import ConfigError, RewardError, TrainingError
from .trainer import Trainer
from .types import EngineStats, Rollout, StepOut
from .validation import (
           validate,  # installs the whole-config check RunConfig.from_overrides runs
)

__all__ = ["Trainer", "RunConfig", "ConfigError", "RewardError", "TrainingError", "Rollout", "StepOut", "EngineStats", "validate",
           "__version__"]
