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

import contextlib

import torch

from ..types import EngineStats, Rollout
from .base import (EngineContext, StatsAccumulator, chunks, count_backward, engine_run, keep_plan, no_rollout_hooks,
                   one_wave, reference_velocity, step_loss, take_cond, unit_sample_weights)


def recompute_pairs(ctx: EngineContext, rollout: Rollout, stats: EngineStats, acc: StatsAccumulator,
                    pairs: torch.Tensor, *, last_backward: bool = True) -> None:
    """Exact per-step backward for the (trajectory, step) pairs in the boolean mask ``pairs`` (B, T).

    Shared by engines that fall back to exact treatment for some steps. Gradient sync is suppressed on every
    backward but the last one when ``last_backward`` (otherwise on all of them).
    """
    work = []
    for k in range(rollout.traj.num_steps):
        for idx in chunks(pairs[:, k].nonzero().flatten(), ctx.micro_batch_size):
            work.append((k, idx))
    for j, (k, idx) in enumerate(work):
        v_ref = reference_velocity(ctx, rollout, idx, k)
        sig = rollout.traj.sigmas[k].expand(len(idx))
        final = last_backward and j == len(work) - 1
        with (torch.enable_grad(), (contextlib.nullcontext() if final else ctx.no_sync())):
            v = ctx.policy.velocity(rollout.traj.xs[idx, k], sig, take_cond(rollout.traj.cond, idx))  # (n, *S) with graph
            loss, terms = step_loss(ctx, rollout, idx, k, v, v_ref)
            loss.backward()
        count_backward(ctx, stats, len(idx))
        acc.add(terms)


def recompute_fallback(ctx: EngineContext, rollout: Rollout, name: str) -> EngineStats:
    """Exact recompute of every selected pair, reported as engine ``name`` with ``fallback_recompute = 1``.

    Used by the recompute-free engines once θ has moved away from the rollout's θ_old (inner epochs > 0)."""
    acc = StatsAccumulator()
    with engine_run(ctx, name) as stats:
        recompute_pairs(ctx, rollout, stats, acc, rollout.selected)
    stats.metrics.update(acc.metrics())
    stats.metrics["fallback_recompute"] = 1.0
    return stats


class RecomputeEngine:
    """The baseline (see the module docstring). No plan, rollout or weighting hooks: those are no-ops."""

    name = "recompute"

    def __init__(self, cfg=None):
        self.cfg = cfg

    plan = keep_plan
    collect = one_wave
    rollout_hooks = no_rollout_hooks
    sample_weights = unit_sample_weights

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        with engine_run(ctx, self.name) as stats:
            recompute_pairs(ctx, rollout, stats, acc, rollout.selected)
        stats.metrics.update(acc.metrics())
        return stats
