"""``recompute``: the FlowGRPO / DanceGRPO baseline.

Estimator: for every selected (i, k), re-run the network forward **with grad** at the stored (x_k, σ_k),
score the stored x_{k+1} with the step density, and back-propagate w_ik·L_ik:
    ∇ = Σ_ik w_ik ∇_θ L_ik(v_θ(x_k, σ_k)).
Exact: this is the reference gradient every other engine is compared against. On the first update after a
rollout θ = θ_old, so the recomputed log-prob equals the rollout's and r ≡ 1.
Cost per selected step: 1 forward + 1 backward (≈ 3F) per sample (+1 no-grad reference forward when β > 0),
on top of the rollout's T no-grad forwards. Steps are processed one at a time, in chunks of
``micro_batch_size`` samples, so peak activation memory is one chunk's forward.
"""
from __future__ import annotations

from ..config import EngineConfig
from ..metering import engine_run
from ..types import EngineStats, Rollout
from ._graph import recompute_pairs
from .base import (
    EngineContext,
    StatsAccumulator,
    keep_plan,
    no_config_rules,
    no_rollout_hooks,
    plain_sampling,
    unit_sample_weights,
)


class RecomputeEngine:
    """The baseline (see the module docstring). No plan, rollout or weighting hooks: those are no-ops."""

    name = "recompute"
    config_keys = ()  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(no_config_rules)

    def __init__(self, cfg: EngineConfig | None = None):
        self.cfg = cfg

    plan = keep_plan
    wave_size = 0
    sampling = plain_sampling
    rollout_hooks = no_rollout_hooks
    sample_weights = unit_sample_weights

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        with engine_run(ctx, self.name) as stats:
            recompute_pairs(ctx, rollout, stats, acc, rollout.selected)
        stats.metrics.update(acc.metrics())
        return stats
