"""diffgrpo: fast, composable GRPO post-training for diffusion models."""
from .config import RunConfig
from .errors import ConfigError, RewardError, TrainingError
from .trainer import Trainer
from .types import EngineStats, Rollout, StepOut
from .validation import (
           validate,  # installs the whole-config check RunConfig.from_overrides runs
)

__version__ = "0.1.0"
__all__ = ["Trainer", "RunConfig", "ConfigError", "RewardError", "TrainingError", "Rollout", "StepOut", "EngineStats", "validate",
           "__version__"]
