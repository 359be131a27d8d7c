"""diffgrpo: fast, composable GRPO post-training for diffusion models."""
from .config import ConfigError, RunConfig
from .trainer import Trainer
from .types import EngineStats, Rollout, StepOut

__version__ = "0.1.0"
__all__ = ["Trainer", "RunConfig", "ConfigError", "Rollout", "StepOut", "EngineStats", "__version__"]
