"""The errors a user sees, each printed as one line by the command line, and the did-you-mean helper.

  ConfigError    a configuration key, value or combination is not acceptable (raised before any model loads)
  RewardError    a reward function failed or returned something unusable
  TrainingError  the run cannot continue (repeated non-finite updates, inconsistent checkpoint, occupied run dir)
"""
from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """A configuration value, key or combination is not acceptable."""


class RewardError(RuntimeError):
    """A reward function failed or returned something unusable."""


class TrainingError(RuntimeError):
    """The run cannot continue (repeated non-finite updates, inconsistent checkpoint, occupied run directory)."""


def suggest(name: str, options: list[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``options``, or an empty string."""
    close = difflib.get_close_matches(name, options, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


__all__ = ["ConfigError", "RewardError", "TrainingError", "suggest"]
