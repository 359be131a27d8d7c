"""``retain``: LeanGRPO's recompute-free schedule that keeps the rollout's graphs.

Estimator: the selected steps' rollout forwards run **with grad** and their graphs are kept (the sampler
detaches x_{k+1}, so graphs never chain across steps); the KL reference forward (no grad) also runs during
the rollout. After rewards and advantages, the loss Σ_ik w_ik·L_ik is built with ``step_loss`` on the retained
velocities, with ℓ_old = the rollout's log-prob (so r ≡ 1), and back-propagated in ONE backward call.
Exact relative to ``recompute`` on the first update after a rollout (θ = θ_old). Later inner epochs
(epoch > 0) have moved θ, so they fall back to ``recompute`` (metric ``fallback_recompute = 1``).
Cost per selected step: 0 extra forwards + 1 backward (≈ 2F) instead of 3F; the rollout's T forwards stay.
Memory: the activations of every selected step of every in-flight trajectory; bound it with
``engine.wave_size`` (complete groups per rollout wave, each wave trained before the next starts; the
flow family splits the batch, ``flow/waves.py``). Global-std advantages couple every group, so waves are
refused with ``advantage.std_mode=global``.
Source: LeanGRPO (recompute-free GRPO schedules), "Retain".

The retained graphs themselves (:class:`~diffgrpo.engines._graph.RetainedSteps`, ``retain_hooks``) live in
``_graph.py``, which ``jagg`` and ``single_step`` (``engine.evaluation=retain``) use as well.
"""
from __future__ import annotations

import torch

from ..config import EngineConfig, RunConfig
from ..errors import ConfigError
from ..metering import engine_run
from ..types import BatchPlan, EngineStats, Rollout, RolloutHooks
from ._graph import RetainedSteps, recompute_fallback, recompute_pairs, retain_hooks
from .base import (
    EngineContext,
    StatsAccumulator,
    count_backward,
    keep_plan,
    plain_sampling,
    step_loss,
    unit_sample_weights,
)


# ---------------------------------------------------------------------- the engine
def check_retain_config(cfg: RunConfig) -> None:
    """Rollout waves need advantages that a wave's groups determine alone."""
    if cfg.engine.wave_size and cfg.advantage.std_mode == "global":
        raise ConfigError("engine.wave_size: rollout waves need per-group advantages; advantage.std_mode=global "
                          "couples every group, so use engine.wave_size=0 (whole batch) or std_mode=group")


class RetainEngine:
    """LeanGRPO-Retain (see the module docstring). Config: ``engine.wave_size``."""

    name = "retain"
    wave_size = 0  # groups per rollout wave (engine.wave_size, set per instance)
    config_keys = ("wave_size",)  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(check_retain_config)

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.wave_size = int(cfg.wave_size)

    plan = keep_plan
    sample_weights = unit_sample_weights

    sampling = plain_sampling

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan,
                      cond: dict[str, torch.Tensor]) -> RolloutHooks | None:
        hooks, plan.engine_state = retain_hooks(ctx, cond, plan.selected)
        return hooks

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        store = rollout.traj.engine_state
        store = store if isinstance(store, RetainedSteps) else None
        if epoch > 0 or store is None or store.released:
            if store is not None:
                store.release()
            return recompute_fallback(ctx, rollout, self.name)
        with engine_run(ctx, self.name) as stats:
            stats.retained_graphs = store.num_graphs
            missing = rollout.selected & ~store.mask  # pairs the rollout did not retain (exact fallback)
            total = None
            n = 0
            for k, idx, v, v_ref in store.items:
                loss, terms = step_loss(ctx, rollout, idx, k, v, v_ref)
                total = loss if total is None else total + loss
                acc.add(terms)
                n += len(idx)
            if bool(missing.any()):
                recompute_pairs(ctx, rollout, stats, acc, missing, last_backward=total is None)
            if total is not None:
                total.backward()
                count_backward(ctx, stats, n)
            store.release()
        stats.seconds["rollout_extra"] = store.seconds
        stats.metrics.update(acc.metrics())
        stats.metrics["fallback_recompute"] = 0.0
        return stats
