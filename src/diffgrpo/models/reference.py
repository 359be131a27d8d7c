"""The frozen KL reference of adapters that keep a copy of their initial weights (no LoRA to disable)."""
from __future__ import annotations

import contextlib

from ..config import RunConfig


@contextlib.contextmanager
def frozen_reference(policy):
    """Context in which ``policy`` runs its frozen reference copy ``policy._ref`` (flag ``policy._use_ref``).

    Shared by the adapters that keep a frozen copy of the initial weights for the KL term."""
    if policy._ref is None:
        raise RuntimeError("reference policy requested but the policy was built without keep_reference "
                           "(set loss.beta > 0 to enable the KL term)")
    policy._use_ref, prev = True, policy._use_ref
    try:
        yield
    finally:
        policy._use_ref = prev


# engines whose loss reads the reference policy whatever loss.beta (dgpo's preference margin)
REFERENCE_ENGINES = ("dgpo",)


def needs_reference(cfg: RunConfig) -> bool:
    """Whether a run keeps the frozen reference: the KL term (loss.beta > 0) or an engine that reads it."""
    return cfg.loss.beta > 0 or cfg.engine.name in REFERENCE_ENGINES


__all__ = ["REFERENCE_ENGINES", "frozen_reference", "needs_reference"]
