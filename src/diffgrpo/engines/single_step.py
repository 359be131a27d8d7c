"""``single_step``: Flash-GRPO — one trained step per sample, iso-temporal grouping, gradient rectification.

Estimator. Every prompt group g gets one step index k_g from the candidate set (``engine.candidate_steps``:
``first_half`` — the high-noise first half of the trainable steps 0 … T−2 —, ``all``, or a list ``0,1,2``),
shared by all G samples of the group, and the groups of a batch cover the candidates evenly (iso-temporal
grouping: advantages within a group are not confounded by timestep difficulty). The rollout is a
deterministic ODE at every step except k_g, where the configured SDE kernel injects the only noise; only
that transition is trained:
    ∇ = Σ_i w_i ∇_θ L_i,k_i(v_θ(x_{i,k_i}, σ_{k_i})),
with w_i the aggregation weight times the temporal rectification factor ρ_i = (1/c(σ_{k_i})) / mean_j(1/c(σ_{k_j})),
c(σ_k) = |∂μ/∂v| / s_k (see :func:`rectification_factor`; ``engine.rectify=false`` sets ρ ≡ 1).
Exact: on the same rollout (same loss weights, rectification included) it equals ``recompute`` restricted to
the selected steps; the forward of all selected samples runs as one batch (σ per sample), which changes
nothing but the floating-point summation order.
Cost per sample: 1 forward + 1 backward (≈ 3F; +1 no-grad reference forward when β > 0) on top of the
rollout's T no-grad forwards, against K forwards + K backwards for ``recompute`` on K steps: ideal
iteration speedup (T+3K)/(T+3).
Retained graph (``engine.evaluation=retain``, Flash-GRPO ∘ LeanGRPO Retain): the trained step k_i is planned
before sampling, so the rollout runs that one forward per sample with grad and keeps its graph (and, with
β > 0, runs the reference forward there too); on the first update (epoch 0, θ = θ_old) ``backward`` runs no
forward at all and back-propagates the loss built on the retained velocities in ONE backward call: per sample
0 forwards + 1 backward instead of 1 + 1 (ideal train-phase speedup 3/2 over recompute evaluation; ≈ 3K/2 over
``recompute`` on K steps). Exact (same gradient up to float summation order). Later epochs release the graphs
and recompute. ``stats.retained_graphs`` counts retained sample graphs (one per sample);
``stats.seconds["rollout_extra"]`` is the reference-forward time spent inside the rollout.
Source: Flash-GRPO (single-step GRPO training of video diffusion models with iso-temporal grouping and
temporal gradient rectification).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import EngineConfig, RunConfig
from ..errors import ConfigError
from ..metering import chunks, engine_run
from ..samplers import flow_sde
from ..types import BatchPlan, EngineStats, FlowTrajectory, Rollout, RolloutHooks
from ._graph import RetainedSteps, retain_hooks, usable_store
from .base import (
    EngineContext,
    StatsAccumulator,
    count_backward,
    plain_sampling,
    reference_velocity,
    step_loss,
    take_cond,
)

CANDIDATE_PRESETS = ("first_half", "all")


@dataclass
class SingleStepState:
    """Planned before sampling and carried by the plan and the trajectory: each sample's trained step, and the
    rollout graphs of those steps under ``engine.evaluation=retain``."""

    k: torch.Tensor  # (B,) long
    store: RetainedSteps | None = None


# ---------------------------------------------------------------------- pure functions
def _allowed(k_max: int | None) -> str:
    rng = f"in 0..{k_max - 1}" if k_max is not None else "(trainable steps 0..T-2)"
    return f"'first_half', 'all' or a comma list of distinct step indices {rng} (e.g. '0,1,2')"


def _parse_step_list(spec: str, k_max: int | None) -> list[int]:
    try:
        steps = [int(p) for p in spec.split(",") if p.strip() != ""]
    except ValueError:
        raise ConfigError(f"engine.candidate_steps: value {spec!r} is not allowed; use {_allowed(k_max)}") from None
    if not steps:
        raise ConfigError(f"engine.candidate_steps: value {spec!r} is empty; use {_allowed(k_max)}")
    bad = [k for k in steps if k < 0 or (k_max is not None and k >= k_max)]
    if bad:
        where = f"for T = {k_max + 1} sampling steps (step {k_max} is deterministic and never trained)" \
            if k_max is not None else "(steps are >= 0)"
        raise ConfigError(f"engine.candidate_steps: step(s) {bad} out of range {where}; use {_allowed(k_max)}")
    return sorted(set(steps))


def candidate_steps(spec: str, num_steps: int) -> list[int]:
    """Candidate step indices for ``spec`` on a grid of ``num_steps`` = T steps (trainable steps 0 … T−2).

    ``first_half``: steps 0 … ⌈(T−1)/2⌉−1 (the high-noise half); ``all``: 0 … T−2; ``"0,1,2"``: those steps,
    each within 0 … T−2, deduplicated and sorted. Raises ConfigError naming ``engine.candidate_steps``.
    """
    k_max = num_steps - 1
    spec = str(spec).strip()
    if k_max < 1:
        raise ConfigError(f"engine.candidate_steps: T = {num_steps} sampling steps leave no trainable step")
    if spec == "first_half":
        return list(range(max(1, math.ceil(k_max / 2))))
    if spec == "all":
        return list(range(k_max))
    return _parse_step_list(spec, k_max)


def check_candidate_spec(spec: str) -> None:
    """Syntax check of ``engine.candidate_steps`` before T is known (the range is checked at planning)."""
    s = str(spec).strip()
    if s not in CANDIDATE_PRESETS:
        _parse_step_list(s, None)


def group_steps(num_groups: int, candidates: list[int], generator: torch.Generator | None = None) -> torch.Tensor:
    """One step per group, covering the candidates evenly → (num_groups,) long.

    A concatenation of independently shuffled copies of the candidate list, cut at ``num_groups``: every
    candidate is used ⌊n/C⌋ or ⌈n/C⌉ times, and which ones get the extra use is random.
    """
    c = torch.tensor(candidates, dtype=torch.long)
    reps = -(-num_groups // len(candidates))  # ceil
    order = torch.cat([c[torch.randperm(len(c), generator=generator)] for _ in range(reps)])
    return order[:num_groups]


def rectification_factor(sigma: torch.Tensor, sigma_next: torch.Tensor, *, sde_type: str, noise_level: float,
                         cps_flowgrpo_compat: bool = False,
                         sigma_bounds: tuple[float, float] | None = None) -> torch.Tensor:
    """c(σ_k) = |∂μ/∂v| / s_k: the per-step scale of ∂ℓ_k/∂v for noise of a given norm. σ, σ_next (n,) → (n,).

    With μ = c_x·x + c_v·v (``flow_sde.kernel_coefficients``) and x_{k+1} = μ + s·ε, the Gaussian log-density
    gives ∂ℓ/∂v = c_v·(x_{k+1} − μ)/(s²·D) = c_v·ε/(s·D) (D = elements, ``mean`` reduction), so |∂L/∂v| ∝
    |A|·|ε|·|c_v|/s at r = 1. Per kernel (Δ = σ − σ', dt = −Δ):
      flow_sde   c = Δ·(1 + ε_k²(1−σ)/(2σ)) / (ε_k·√Δ),  ε_k = a·sqrt(σ/(1−σ̃))
      dance_sde  c = Δ·(1 + η²(1−σ)/(2σ)) / (η·√Δ)
      flash_sde  c = Δ·(1 + ε_k²(1−σ)/(2σ)) / (ε_k·√Δ),  ε_k = a·(σ_min + (σ_max − σ_min)·σ), (σ_max, σ_min) =
                 ``sigma_bounds`` (the grid's σ₁, σ_T); 1/c is Flash-GRPO's released weight table at a = 1
      cps        c = |σ·(1−σ') − σ'·cos(aπ/2)·(1−σ)| / (σ'·sin(aπ/2))
    FlowGRPO's CPS pseudo log-prob −mean((x'−μ)²) (``cps_flowgrpo_compat``) has ∂ℓ/∂v = 2c_v·s·ε/D instead,
    so there c = |c_v|·s (constants cancel in the normalisation). Undefined (0/0) where s = 0: the final
    step, which is never trained; it returns 1 there.
    """
    c_x, c_v, std = flow_sde.kernel_coefficients(sigma, sigma_next, sde_type=sde_type, noise_level=noise_level,
                                                 sigma_bounds=sigma_bounds)
    if cps_flowgrpo_compat and sde_type == "cps":
        c = c_v.abs() * std
    else:
        c = c_v.abs() / torch.where(std > 0, std, torch.ones_like(std))
    return torch.where((std > 0) & (c > 0), c, torch.ones_like(c))


def rectification_weights(factors: torch.Tensor, trained: torch.Tensor,
                          all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """ρ_i = (1/c_i) / mean over trained samples of 1/c, so the trained samples' mean weight is 1. (B,) → (B,).

    factors (B,) c(σ_{k_i}) > 0; trained (B,) bool. ``all_reduce`` (optional) sums a tensor across data-parallel
    ranks, making the mean global rather than per rank. Untrained samples get weight 1 (their loss weight is 0).
    """
    inv = torch.where(trained, 1.0 / factors, torch.zeros_like(factors))
    tot = torch.stack([inv.sum(), trained.float().sum()])  # (2,) Σ 1/c, count
    if all_reduce is not None:
        tot = all_reduce(tot)
    if float(tot[1]) == 0:
        return torch.ones_like(factors)
    mean_inv = tot[0] / tot[1]
    return torch.where(trained, inv / mean_inv, torch.ones_like(factors))


# ---------------------------------------------------------------------- the engine
def check_single_step_config(cfg: RunConfig) -> None:
    """``engine.candidate_steps`` on the run's grid (``sampler.num_steps``), before any model loads."""
    candidate_steps(cfg.engine.candidate_steps, cfg.sampler.num_steps)


class SingleStepEngine:
    """Flash-GRPO. Config: ``engine.candidate_steps``, ``engine.rectify``, ``engine.evaluation``.

    Hooks: :meth:`plan` (iso-temporal step per group, ODE-everywhere-else rollout), :meth:`rollout_hooks` (the
    trained step's graph under ``evaluation=retain``) and :meth:`sample_weights` (temporal gradient
    rectification, normalised over every rank through ``ctx.all_reduce``).
    """

    name = "single_step"
    config_keys = ("evaluation", "candidate_steps", "rectify")  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(check_single_step_config)

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.candidate_spec = str(cfg.candidate_steps)
        self.rectify = bool(cfg.rectify)
        self.evaluation = str(cfg.evaluation)
        if self.evaluation not in ("recompute", "retain"):
            raise NotImplementedError(f"single_step: engine.evaluation={self.evaluation!r} is not available; "
                                      "use 'recompute' or 'retain'")
        check_candidate_spec(self.candidate_spec)

    # -------------------------------------------------------------- planning (before sampling)
    def plan(self, plan: BatchPlan, generator: torch.Generator) -> None:
        """Pick k_g per prompt group (drawn from ``generator``), train only that step, SDE only there."""
        B, T = plan.selected.shape
        cands = candidate_steps(self.candidate_spec, T)
        _, group_index = torch.unique(plan.group_ids.cpu(), return_inverse=True)  # (B,) 0 … n_groups−1
        per_group = group_steps(int(group_index.max()) + 1, cands, generator)  # (n_groups,)
        k = per_group[group_index].to(plan.selected.device)  # (B,)
        sel = torch.zeros(B, T, dtype=torch.bool, device=plan.selected.device)
        sel[torch.arange(B, device=sel.device), k] = True
        plan.selected = sel
        plan.sde_mask = sel.clone()  # SDE kernel at k_i only, ODE elsewhere
        plan.engine_state = SingleStepState(k=k)

    wave_size = 0
    sampling = plain_sampling

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan,
                      cond: dict[str, torch.Tensor]) -> RolloutHooks | None:
        """``evaluation=retain``: keep the rollout graph of each sample's trained step (from the plan)."""
        if self.evaluation != "retain":
            return None
        hooks, store = retain_hooks(ctx, cond, plan.selected)
        if isinstance(plan.engine_state, SingleStepState):
            plan.engine_state = SingleStepState(k=plan.engine_state.k, store=store)
        else:  # a plan this engine did not make: the trained steps come from the selection
            plan.engine_state = SingleStepState(k=plan.selected.float().argmax(1).long(), store=store)
        return hooks

    # -------------------------------------------------------------- rectification (after rewards)
    @staticmethod
    def trained_steps(traj: FlowTrajectory, selected: torch.Tensor) -> torch.Tensor:
        """(B,) long: each sample's trained step (from the plan, else the first selected step)."""
        state = traj.engine_state
        k = state.k if isinstance(state, SingleStepState) else selected.float().argmax(1)
        return k.to(selected.device).long()

    def sample_weights(self, ctx: EngineContext, traj: FlowTrajectory, trained: torch.Tensor) -> torch.Tensor | None:
        """ρ (B,): 1/c(σ_k) of the kernel in use, mean 1 over trained samples (over every rank with
        ``ctx.all_reduce``); ones when ``rectify`` is off."""
        B = trained.shape[0]
        if not self.rectify:
            return torch.ones(B, device=trained.device)
        k = self.trained_steps(traj, trained)
        kern = ctx.kernel
        c = rectification_factor(traj.sigmas[k], traj.sigmas[k + 1], sde_type=kern["sde_type"],
                                 noise_level=kern["noise_level"],
                                 cps_flowgrpo_compat=kern.get("cps_flowgrpo_compat", False),
                                 sigma_bounds=kern.get("sigma_bounds") or flow_sde.sigma_bounds(traj.sigmas))
        return rectification_weights(c.to(trained.device), trained.any(1), ctx.all_reduce)

    # -------------------------------------------------------------- gradient
    def velocity_with_graph(self, ctx: EngineContext, rollout: Rollout, idx: torch.Tensor, k: torch.Tensor,
                            epoch: int, store: RetainedSteps | None = None) -> torch.Tensor:
        """v_θ (n, *S) with graph at the stored (x_{i,k_i}, σ_{k_i}) for samples ``idx`` (n,) at steps ``k`` (n,).

        Recompute evaluation: one forward with grad (σ per sample, so mixed steps share one batch). With the
        rollout's retained graphs (``store``, first update only): those rows, no forward.
        """
        if store is not None:
            return store.gather(idx, k)
        x = rollout.traj.xs[idx, k]  # (n, *S)
        with torch.enable_grad():
            return ctx.policy.velocity(x, rollout.traj.sigmas[k], take_cond(rollout.traj.cond, idx))

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        state = rollout.traj.engine_state
        store = usable_store(state.store if isinstance(state, SingleStepState) else None, epoch)
        with engine_run(ctx, self.name) as stats:
            trained = rollout.selected.any(1)  # (B,)
            k_all = self.trained_steps(rollout.traj, rollout.selected)  # (B,)
            if bool((rollout.selected.sum(1) > 1).any()):
                raise ValueError("single_step trains one step per sample, but the rollout selects several; "
                                 "build the batch plan with the single_step engine")
            if store is not None and not bool(store.mask[rollout.selected].all()):
                store.release()  # the rollout did not keep every trained step: recompute evaluation
                store = None
            # retained graphs: one chunk, so that one backward call covers graphs shared by several rows
            work = chunks(trained.nonzero().flatten(), 0 if store is not None else ctx.micro_batch_size)
            for j, idx in enumerate(work):
                k = k_all[idx]  # (n,)
                final = j == len(work) - 1
                with torch.enable_grad(), (contextlib.nullcontext() if final else ctx.no_sync()):
                    v = self.velocity_with_graph(ctx, rollout, idx, k, epoch, store)  # (n, *S)
                    loss = v.new_zeros(())
                    for step in k.unique().tolist():
                        pos = (k == step).nonzero().flatten()  # rows of this chunk at step `step`
                        if store is not None and ctx.beta > 0:  # reference forward ran in the rollout
                            v_ref = store.gather(idx[pos], k[pos], reference=True)
                        else:
                            v_ref = reference_velocity(ctx, rollout, idx[pos], step)
                        part, terms = step_loss(ctx, rollout, idx[pos], step, v[pos], v_ref)
                        loss = loss + part
                        acc.add(terms)
                    loss.backward()
                count_backward(ctx, stats, len(idx))
            if store is not None:
                store.settle(stats)
        stats.metrics.update(acc.metrics())
        if self.evaluation == "retain":
            stats.metrics["fallback_recompute"] = float(store is None)
        return stats
