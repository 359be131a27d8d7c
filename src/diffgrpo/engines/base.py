"""What every flow gradient engine shares: its context, its protocol, the per-step GRPO loss, its metrics.

An engine turns a finished :class:`~diffgrpo.types.Rollout` (rewards and advantages filled) into ``.grad``
of the policy's trainable parameters. It decides which forwards run with grad, how graphs are kept and when
``backward()`` runs; it never steps the optimizer and never rescales the loss (the aggregation weights in
``rollout.loss_weights`` own all normalisation). What an engine costs is metered by :mod:`diffgrpo.metering`.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .. import consistency
from ..config import RunConfig
from ..diversity.diversegrpo import early_step_weights
from ..losses import aggregate, gaussian_step_kl, policy_loss
from ..metering import record_backward
from ..samplers import flow_sde
from ..types import BatchPlan, EngineStats, FlowTrajectory, Rollout, RolloutHooks


@dataclass
class EngineContext:
    """Everything an engine may use besides the rollout. Built by the trainer once per run."""

    policy: Any  # adapter: velocity(x, sigma, cond), reference(), trainable_parameters(), counters
    kernel: dict  # keyword arguments of flow_sde.step: sde_type, noise_level, reduce, cps_flowgrpo_compat
    clip_range: float = 1e-4
    beta: float = 0.0
    kl_flowgrpo_compat: bool = False
    micro_batch_size: int = 0  # 0: one chunk per step
    sigmas: torch.Tensor | None = None  # (T+1,) the run's σ grid, for engines that work during the rollout
    no_sync: Any = field(default=contextlib.nullcontext)  # callable → context suppressing gradient all-reduce
    # the trainable parameters as the optimizer holds them (None: the policy's). Under FSDP2 these are the sharded
    # DTensors, while a module holds unsharded copies from its forward until the next backward (the root one even
    # across iterations), so engines must not re-read them from the modules.
    params: list | None = None
    forward_mult: int = 1  # network inputs per sample-forward: 2 under true classifier-free guidance, else 1
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # sums a tensor over ranks (None: one process)
    trust_region: str = "clip"  # loss.trust_region: PPO clip, or Flow-DPPO's KL mask (losses.policy_loss)
    ratio_norm: bool = False  # loss.ratio_norm: GRPO-Guard's normalised ratio under the clip
    kl_mask_bound: float = 1e-5  # loss.kl_mask_bound: the KL mask's bound (mean-reduced per-step KL)
    kl_step_power: float = 0.0  # diversity.step_weight_power: KL weight of grid step k ∝ σ_k^p (0: every step 1)


def trainable_params(ctx: EngineContext) -> list[torch.Tensor]:
    """The parameters whose ``.grad`` an engine fills (see ``EngineContext.params``)."""
    return list(ctx.params) if ctx.params is not None else list(ctx.policy.trainable_parameters())


class Engine(Protocol):
    """The contract of a flow-matching gradient engine. Every engine implements every hook (a no-op where it does
    not apply); the flow family calls them in this order each iteration:

    1. ``plan(plan, generator)`` before sampling: amend the :class:`~diffgrpo.types.BatchPlan` (trained steps,
       SDE/ODE steps, ``plan.engine_state``), drawing any randomness from ``generator`` (the step stream).
    2. ``sampling(ctx)``: the context the family samples the batch in (e.g. NFT's θ_old swapped in); the family
       samples in one piece, or, when the engine's ``wave_size`` > 0, in waves of that many complete groups with
       each wave's ``backward(ctx, wave, 0)`` accumulated into ``.grad`` before the next wave samples (Retain).
    3. ``rollout_hooks(ctx, plan, cond)`` (called while sampling, with the batch's encoded conditioning):
       grad-enabled rollout forwards the engine keeps or back-propagates during sampling, or None. Their state
       rides on ``plan.engine_state``.
    4. ``sample_weights(ctx, traj, trained)`` (called when the loss weights are formed): per-sample loss
       multipliers (B,) from the trained (B, T) steps, or None.
    5. ``backward(ctx, rollout, epoch)``: accumulate ∇ Σ w·L into ``.grad`` (epoch 0 = first update after the
       rollout); never steps the optimizer and never rescales the loss.

    Configuration: ``config_keys`` names the ``engine.*`` keys the engine reads besides ``name`` and
    ``micro_batch_size`` (any other one set is refused), and ``check_config(cfg)`` (a static method) raises
    ConfigError for a combination the engine cannot train; both run before any model loads.
    """

    name: str
    config_keys: tuple[str, ...]
    wave_size: int  # complete groups per rollout wave; 0 = the whole batch in one piece

    @staticmethod
    def check_config(cfg: RunConfig) -> None: ...

    def plan(self, plan: BatchPlan, generator: torch.Generator) -> None: ...

    def sampling(self, ctx: EngineContext) -> contextlib.AbstractContextManager: ...

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan,
                      cond: dict[str, torch.Tensor]) -> RolloutHooks | None: ...

    def sample_weights(self, ctx: EngineContext, traj: FlowTrajectory,
                       trained: torch.Tensor) -> torch.Tensor | None: ...

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats: ...


# The no-op hooks, for an engine to name in its class body where a hook does not apply (``plan = keep_plan``):
# every engine still states all of its hooks, without inheriting an implementation.
def no_config_rules(cfg: RunConfig) -> None:
    """``Engine.check_config`` of an engine with no rules beyond its keys' own."""


def keep_plan(engine, plan: BatchPlan, generator: torch.Generator) -> None:
    """``Engine.plan`` of an engine that trains the family's plan as it is."""


def plain_sampling(engine, ctx: EngineContext) -> contextlib.AbstractContextManager:
    """``Engine.sampling`` of an engine that samples with the policy as it is."""
    return contextlib.nullcontext()


def no_rollout_hooks(engine, ctx: EngineContext, plan: BatchPlan,
                     cond: dict[str, torch.Tensor]) -> RolloutHooks | None:
    """``Engine.rollout_hooks`` of an engine that does no work during sampling."""
    return None


def unit_sample_weights(engine, ctx: EngineContext, traj: FlowTrajectory,
                        trained: torch.Tensor) -> torch.Tensor | None:
    """``Engine.sample_weights`` of an engine that weighs every sample alike (no multipliers)."""
    return None


def count_backward(ctx: EngineContext, stats: EngineStats, samples: int, calls: int = 1) -> None:
    """Count ``calls`` backward calls through ``samples`` samples (×2 network inputs each under true CFG)."""
    record_backward(stats, samples * ctx.forward_mult, calls)


def take_cond(cond: dict[str, torch.Tensor], idx: torch.Tensor) -> dict[str, torch.Tensor]:
    """Rows ``idx`` of every conditioning tensor."""
    return {k: v[idx] for k, v in cond.items()}


def kl_step_weights(ctx: EngineContext, sigmas: torch.Tensor) -> torch.Tensor | None:
    """DiverseGRPO's per-step KL weights over the σ grid (T+1,) → (T,) with mean 1, or None at power 0."""
    if ctx.kl_step_power <= 0:
        return None
    return early_step_weights(sigmas, ctx.kl_step_power)


def kl_weights(ctx: EngineContext, rollout: Rollout, rows: torch.Tensor, steps) -> torch.Tensor | None:
    """The KL term's weight of the pairs (rows (n,), grid steps (n,) or one int): GARDO's per-sample gate
    (``rollout.kl_weights``) times DiverseGRPO's step weight → (n,), or None when every weight is 1 (the KL term
    then enters exactly as without them)."""
    w = None if rollout.kl_weights is None else rollout.kl_weights[rows].float()
    s = kl_step_weights(ctx, rollout.traj.sigmas)
    if s is not None:
        s = s.to(rollout.traj.sigmas.device)[steps].expand(len(rows))
        w = s if w is None else w * s
    return w


def weighted_kl(kl: torch.Tensor, w: torch.Tensor | None) -> torch.Tensor:
    """kl (n,) times the weights (n,) of :func:`kl_weights`; ``kl`` itself (the same tensor) when None."""
    return kl if w is None else kl * w.to(kl.device)


def reference_velocity(ctx: EngineContext, rollout: Rollout, idx: torch.Tensor, k: int) -> torch.Tensor | None:
    """v_ref (n, *S) at the stored (x_k, σ_k) under the reference policy, or None when β = 0. No grad."""
    if ctx.beta <= 0:
        return None
    with torch.no_grad(), ctx.policy.reference():
        sig = rollout.traj.sigmas[k].expand(len(idx))
        return ctx.policy.velocity(rollout.traj.xs[idx, k], sig, take_cond(rollout.traj.cond, idx))


def step_loss(ctx: EngineContext, rollout: Rollout, idx: torch.Tensor, k: int, v: torch.Tensor,
              v_ref: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted GRPO loss Σ_i w_ik·L_ik over trajectories ``idx`` at step k, as a function of v (n, *S).

    Returns (scalar loss, per-sample terms {"ratio", "clipped", "kl", "log_prob", "loss"} each (n,) detached;
    "loss" is w_ik·L_ik, whose sum over the update's pairs is the loss that update back-propagates; and the
    rollout–train consistency terms of :func:`diffgrpo.consistency.step_terms`).
    Differentiable w.r.t. ``v`` only through the closed-form step density, so engines can take
    ∂L/∂v cheaply (JAGG) or back-propagate into the network (recompute).
    """
    sig, sig_next = rollout.traj.sigmas[k], rollout.traj.sigmas[k + 1]
    out = flow_sde.step(v, sig, sig_next, rollout.traj.xs[idx, k], prev_sample=rollout.traj.xs[idx, k + 1], **ctx.kernel)
    adv = rollout.advantages[idx]
    kl_old = None  # exact per-step KL to the rollout policy, for the trust-region options only
    if ctx.trust_region != "clip" or ctx.ratio_norm:
        old_mean = flow_sde.step(rollout.traj.velocities[idx, k].detach(), sig, sig_next, rollout.traj.xs[idx, k],
                                 prev_sample=rollout.traj.xs[idx, k + 1], **ctx.kernel).mean
        kl_old = gaussian_step_kl(out.mean, old_mean, out.std, ctx.kernel.get("reduce", "mean"))
    loss, ratio, clipped = policy_loss(out.log_prob, rollout.traj.log_probs[idx, k], adv, ctx.clip_range,
                                       trust_region=ctx.trust_region, ratio_norm=ctx.ratio_norm, kl=kl_old,
                                       std=out.std, kl_bound=ctx.kl_mask_bound)
    kl = torch.zeros_like(loss)
    if ctx.beta > 0:
        if v_ref is None:
            raise ValueError("beta > 0 needs the reference velocity")
        ref_mean = flow_sde.step(v_ref, sig, sig_next, rollout.traj.xs[idx, k], prev_sample=rollout.traj.xs[idx, k + 1],
                                 **ctx.kernel).mean
        kl = flow_sde.gaussian_kl(out.mean, ref_mean.detach(), out.std, flowgrpo_compat=ctx.kl_flowgrpo_compat,
                                  sigma=sig, sigma_next=sig_next)
        loss = loss + ctx.beta * weighted_kl(kl, kl_weights(ctx, rollout, idx, k))
    w = rollout.loss_weights[idx, k]
    total = aggregate(loss, w)
    terms = {"ratio": ratio.detach(), "clipped": clipped, "kl": kl.detach(), "log_prob": out.log_prob.detach(),
             "loss": (loss.detach() * w).detach(),
             **consistency.step_terms(out.log_prob, rollout.traj.log_probs[idx, k], k, rollout.traj.num_steps,
                                      ctx.clip_range)}
    return total, terms


class StatsAccumulator:
    """Collects per-sample terms into the usual GRPO metrics (clip_ratio, kl, ratio_mean, ratio_max_dev), and
    ``loss`` (Σ w·L of the pairs added) when every term carried one, and the ``consistency/*`` metrics of the pairs
    added as ``fresh`` (their log-prob from a fresh forward at the stored state; see :mod:`diffgrpo.consistency`)."""

    def __init__(self):
        self.loss = 0.0
        self.has_loss = True  # false once a term without a loss was added (e.g. a closed-form gradient)
        self.n = 0
        self.clipped = 0.0
        self.kl = 0.0
        self.ratio = 0.0
        self.ratio_dev = 0.0
        self.consistency = consistency.Tally()

    def add(self, terms: dict[str, torch.Tensor], fresh: bool | torch.Tensor = False) -> None:
        """``fresh``: True, or a (n,) bool mask of the pairs whose velocity came from a fresh forward."""
        r = terms["ratio"]
        if "dlogp" in terms and (fresh is True or (isinstance(fresh, torch.Tensor) and bool(fresh.any()))):
            m = slice(None) if fresh is True else fresh
            self.consistency.add(terms["dlogp"][m], terms["bucket"][m], terms["outside"][m], terms["clip_range"])
        self.n += r.numel()
        if "loss" in terms:
            self.loss += float(terms["loss"].sum())
        else:
            self.has_loss = False
        self.clipped += float(terms["clipped"].float().sum())
        self.kl += float(terms["kl"].sum())
        self.ratio += float(r.sum())
        self.ratio_dev = max(self.ratio_dev, float((r - 1).abs().max())) if r.numel() else self.ratio_dev

    def metrics(self) -> dict[str, float]:
        n = max(self.n, 1)
        out = {"clip_ratio": self.clipped / n, "kl": self.kl / n, "ratio_mean": self.ratio / n,
               "ratio_max_dev": self.ratio_dev, "trained_pairs": float(self.n)}
        if self.has_loss and self.n:
            out["loss"] = self.loss
        return {**out, **self.consistency.metrics()}
