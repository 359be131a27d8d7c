"""The frozen KL reference of adapters that keep a copy of their initial weights (no LoRA to disable)."""
from __future__ import annotations

import contextlib


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


__all__ = ["frozen_reference"]
