"""``nft``: DiffusionNFT (Zheng et al. 2025, arXiv:2509.16117) — negative-aware flow matching on clean samples.

Estimator. For each rollout sample x_0 (the sampler's final state) and each of its K units (time t, fresh noise ε;
``engines/_forward.py``) with x_t = (1−t)x_0 + tε and target u = ε − x_0, the implicit positive and negative
policies mix the network with the old policy v_old (an EMA of θ, no grad):
    v⁺ = β·v_θ + (1−β)·v_old,        v⁻ = (1+β)·v_old − β·v_θ,
and with the optimality probability r = clip(A, −c, c)/(2c) + 1/2 ∈ [0, 1] (c = ``engine.adv_clip``) the loss is
    L = (c/β)·[ r·ℓ(v⁺) + (1−r)·ℓ(v⁻) ] + β_KL·mean((v_θ − v_ref)²),
    ℓ(v) = mean((x̂_0 − x_0)²) / sg(mean|x̂_0 − x_0|),   x̂_0 = x_t − t·v   (so x̂_0 − x_0 = t·(u − v)),
the paper's r‖v⁺ − u‖² + (1−r)‖v⁻ − u‖² with the released code's adaptive per-sample weight t/mean|t(v − u)| (an
x_0-space error normalised by its own detached mean magnitude). The units' losses are summed with the rollout's
aggregation weights (``losses.aggregation_weights``: "mean" = the mean over all units, as the released code does).
r = 1/2 (a zero advantage) gives a gradient 2β²·w·(v_θ − v_old): zero while θ = θ_old, otherwise a pull towards
θ_old (the method's implicit trust region).

Recipe (defaults, agreeing with the released NVlabs/DiffusionNFT code): β = 1 (``engine.nft_beta``); c = 5
(its ``adv_clip_max``); K = ⌊0.99·T⌋ distinct times of the sampling grid per sample in random order (its
``timestep_fraction`` 0.99 over the per-sample shuffled grid); θ_old ← d·θ_old + (1−d)·θ after every update with
d = min(0.001·updates, 0.5) (its ``decay_type`` 1; ``engine.old_decay_rate`` / ``old_decay_max``); rollouts with
θ_old and a deterministic ODE sampler (``engine.forward_rollout=ode``), CFG-free training forwards (the conditional
branch only, whatever ``model.guidance_scale`` the rollout used). The KL term uses ``loss.beta`` (the release
uses 1e-4; our default 0 keeps no reference copy) with the release's unweighted mean((v_θ − v_ref)²).
Where we differ: the release samples with a second-order solver; we use the family's Euler ODE on the shifted grid
(any ODE works — the loss never sees the sampler). The release draws the units' noise afresh in each training pass;
we draw it once per rollout at planning time, so inner epochs and data-parallel ranks see the same units. Old-policy
weights live in memory only: a resumed run restarts with θ_old = θ.

Exact with respect to: nothing of ``recompute``'s — this is a different objective (no likelihood ratio, no
transition density), so ``bench engines``' gradient cosine against recompute is not an accuracy measure. Exact
in the sense that matters for the engine contract: the gradient of the stated loss, identical under any chunking
(``engine.micro_batch_size``), world size or LoRA.
Cost per sample: K forwards with grad + K sample-backwards, + K no-grad forwards of θ_old once θ_old ≠ θ
(none on the first iteration, when θ_old = θ bit for bit, or while d = 0), + K no-grad reference forwards when
β_KL > 0; on top of T no-grad rollout forwards (of θ_old). No per-step trajectory is used beyond x_0.
Floor: the θ_old forwards are evaluated at the units' noised inputs, which the rollout never visits, so no
implementation avoids them: at K = T − 1 the train phase costs 4/3 of ``recompute``'s (cost-model ideal 0.75×);
measured 0.70× (0.93 of that ideal) with ``bench engines`` (docs/engines.md, "The engines' floors"); the x₀ loss, its
adaptive weight and the θ_old swap add about 2 % of an iteration.
Units run one index j at a time (the batch's B samples per chunk, like ``recompute``'s one step at a time) or in
chunks of ``engine.micro_batch_size``, so peak activation memory is one chunk's forward. Once θ_old ≠ θ, the
θ_old velocities of all units are computed first, inside one swap of the parameters to θ_old, and kept (B·K
velocities, the size of the units' inputs) instead of swapping twice per chunk.
"""
from __future__ import annotations

import contextlib

import torch

from ..config import EngineConfig
from ..losses import aggregate
from ..metering import engine_run
from ..types import BatchPlan, EngineStats, Rollout
from ._forward import (
    ForwardState,
    OldPolicy,
    check_forward_config,
    clip_advantages,
    conditional_only,
    count_unit_backward,
    grid_times,
    plan_units,
    reference_velocity,
    unit_batches,
    unit_inputs,
    velocity_kl,
)
from .base import (
    EngineContext,
    kl_weights,
    no_rollout_hooks,
    trainable_params,
    unit_sample_weights,
    weighted_kl,
)

NFT_TIME_FRACTION = 0.99  # the released recipe's timestep_fraction: ⌊0.99·T⌋ grid times per sample


def adaptive_x0_loss(v: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """ℓ(v) = mean((x̂_0 − x_0)²) / sg(max(mean|x̂_0 − x_0|, 1e-5)), x̂_0 = x_t − t·v. (n, *S), t (n,) → (n,)."""
    tt = t.reshape(-1, *([1] * (v.dim() - 1)))
    err = x_t - tt * v - x0  # (n, *S)
    dims = tuple(range(1, v.dim()))
    scale = err.detach().abs().mean(dims).clamp(min=1e-5)  # (n,)
    return (err ** 2).mean(dims) / scale


def optimality(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """r = clip(A, −c, c)/(2c) + 1/2 ∈ [0, 1]. (n,) → (n,)."""
    return clip_advantages(adv, clip) / 2 + 0.5


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             r: torch.Tensor, beta: float, scale: float) -> torch.Tensor:
    """Per-unit DiffusionNFT policy loss (c/β)·[r·ℓ(v⁺) + (1−r)·ℓ(v⁻)]. v (with grad), v_old, x_t, x0 (n, *S);
    t, r (n,) → (n,)."""
    v_old = v_old.detach()
    v_pos = beta * v + (1 - beta) * v_old
    v_neg = (1 + beta) * v_old - beta * v
    return (r * adaptive_x0_loss(v_pos, x_t, x0, t) + (1 - r) * adaptive_x0_loss(v_neg, x_t, x0, t)) * scale / beta


class NFTEngine:
    """DiffusionNFT. Config: ``engine.nft_beta``, ``engine.adv_clip``, ``engine.forward_timesteps``,
    ``engine.forward_rollout``, ``engine.old_decay_rate``, ``engine.old_decay_max``; ``loss.beta`` (KL).

    Hooks: :meth:`plan` (units and their draws; ODE rollout), :meth:`sampling` (EMA step of θ_old, then the rollout
    with θ_old), :meth:`backward` (the loss above)."""

    name = "nft"
    config_keys = ("forward_timesteps", "forward_rollout", "adv_clip", "nft_beta", "old_decay_rate", "old_decay_max")  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(check_forward_config)

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.beta = float(cfg.nft_beta)
        self.adv_clip = float(cfg.adv_clip)
        self.k = int(cfg.forward_timesteps)
        self.ode = str(cfg.forward_rollout) == "ode"
        self.old = OldPolicy()

    def num_units(self, T: int) -> int:
        return self.k if self.k > 0 else max(1, int(NFT_TIME_FRACTION * T))

    def plan(self, plan: BatchPlan, generator: torch.Generator) -> None:
        B, T = plan.selected.shape
        times = grid_times(T, B, self.num_units(T), generator)
        plan_units(plan, times, ode=self.ode, generator=generator)

    wave_size = 0

    @contextlib.contextmanager
    def sampling(self, ctx: EngineContext):
        """θ_old ← EMA step (θ_old = θ on the first call), then the batch is sampled with θ_old."""
        self.old.update(trainable_params(ctx), self.cfg.old_decay_rate, self.cfg.old_decay_max)
        with self.old.active(trainable_params(ctx), ctx.policy.forward_module):
            yield

    rollout_hooks = no_rollout_hooks
    sample_weights = unit_sample_weights

    def _old_velocities(self, ctx: EngineContext, traj, state: ForwardState, work) -> list[torch.Tensor] | None:
        """v_old of every chunk's units (no grad), computed inside one swap of the parameters to θ_old (each swap
        copies every trainable parameter twice); None while θ_old equals θ (then v_old = v_θ, detached)."""
        if self.old.current:
            return None
        with torch.no_grad(), self.old.active(trainable_params(ctx), ctx.policy.forward_module):
            return [ctx.policy.velocity(x_t, t, cond)
                    for t, _, x_t, _, cond in (unit_inputs(traj, state, rows, cols) for rows, cols in work)]

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        state = rollout.traj.engine_state
        if not isinstance(state, ForwardState):
            raise ValueError("nft trains the units its own plan drew; build the batch plan with the nft engine")
        traj, pol = rollout.traj, ctx.policy
        K = state.idx.shape[1]
        work = unit_batches(rollout.selected, K, ctx.micro_batch_size)
        totals = {"loss": 0.0, "kl": 0.0, "r": 0.0, "n": 0}
        with engine_run(ctx, self.name) as stats, conditional_only(pol):
            v_olds = self._old_velocities(ctx, traj, state, work)  # one swap to θ_old for every chunk
            for j, (rows, cols) in enumerate(work):
                t, x0, x_t, _, cond = unit_inputs(traj, state, rows, cols)  # (n,), (n, *S) ×3
                v_ref = reference_velocity(ctx, x_t, t, cond)
                final = j == len(work) - 1
                with torch.enable_grad(), (contextlib.nullcontext() if final else ctx.no_sync()):
                    v = pol.velocity(x_t, t, cond)  # (n, *S) with graph
                    r = optimality(rollout.advantages[rows], self.adv_clip)
                    v_old = v.detach() if v_olds is None else v_olds[j]
                    per = nft_loss(v, v_old, x_t, x0, t, r, self.beta, self.adv_clip)
                    kl = velocity_kl(v, v_ref)
                    per = per + ctx.beta * weighted_kl(kl, kl_weights(ctx, rollout, rows, state.idx[rows, cols]))
                    w = rollout.loss_weights[rows, cols]
                    aggregate(per, w).backward()
                count_unit_backward(stats, len(rows))
                totals["loss"] += float((per.detach() * w).sum())
                totals["kl"] += float(kl.detach().sum())
                totals["r"] += float(r.sum())
                totals["n"] += len(rows)
        n = max(totals["n"], 1)
        stats.metrics.update({"loss": totals["loss"], "kl": totals["kl"] / n, "nft_r_mean": totals["r"] / n,
                              "old_decay": self.old.last_decay, "old_is_current": float(self.old.current),
                              "trained_pairs": float(totals["n"])})
        return stats

