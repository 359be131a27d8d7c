"""The family registry: ``config.MODEL_FAMILIES`` maps each ``model.name`` to a key here (see ``family.Family``)."""
from __future__ import annotations

from .dllm.family import DLLMFamily
from .flow.family import FlowFamily

FAMILIES: dict[str, type] = {"flow": FlowFamily, "dllm": DLLMFamily}

__all__ = ["FAMILIES"]
