"""``dgpo``: Direct Group Preference Optimization (Luo, Hu, Tang 2025, arXiv:2510.08425) — group-level DPO on clean
samples of deterministic ODE rollouts.

Estimator. Each prompt's group of rollout samples is split by the sign of the advantage into a positive set G⁺
(A > 0) and a negative set G⁻ (A < 0); the policy learns the group preference G⁺ ≻ G⁻ by maximum likelihood of a
Bradley–Terry model whose group reward is the advantage-weighted Diffusion-DPO implicit reward
β·log p_θ/p_ref ≈ −β·(e_θ − e_ref) of its members. For unit j (time t_j, noise ε; ``engines/_forward.py``) with
x_t = (1−t)x_0 + tε, target u = ε − x_0 and the flow-matching errors e_θ = mean((v_θ(x_t, t) − u)²),
e_ref = mean((v_ref(x_t, t) − u)²) (the frozen reference, no grad):
    s_{g,j} = β · Σ_{i∈g} ŵ_ij·A_i·(e_θ,ij − e_ref,ij),      ŵ_ij = w_ij / Σ_{k∈g} w_kj,
    L = Σ_{g,j} (W_gj/β)·softplus(s_{g,j}) + β_KL·Σ w·mean((v_θ − v_ref)²),      W_gj = Σ_{i∈g} w_ij,
with A the clamped advantages (|A| ≤ c, c = ``engine.adv_clip``; clamped, not rescaled), β = ``engine.dgpo_beta``
and w the rollout's aggregation weights (``losses.aggregation_weights``; uniform within a group, so ŵ = 1/G). Since
A > 0 on G⁺ and A < 0 on G⁻, −s = R(G⁺) − R(G⁻) and softplus(s) = −log σ(R(G⁺) − R(G⁻)). The gradient is
    ∇L = Σ_{i,j} w_ij·σ(s_{g(i),j})·A_i·∇e_θ,ij,
an advantage-weighted flow-matching gradient whose per-group weight σ(s) falls towards 0 as the group preference is
learnt (and equals 1/2 while θ = θ_ref): the DPO saturation that bounds how far the policy moves. A zero advantage
contributes nothing; all-zero advantages give a zero gradient.

Recipe (defaults, agreeing with the released Luo-Yihong/DGPO code): β = 100 (its ``beta_dpo``); c = 5 (its
``adv_clip_max``); K = 4 units per sample (its ``num_train_timesteps``) at distinct grid indices drawn from
0 … ⌊0.6·T⌋ (its ``trunc_steps`` 6 of 10 sampling steps, the high-noise end of the grid; ``engine.dgpo_time_fraction``),
the same K times for the whole batch; the same noise ε for every member of a group at a unit (its
``use_shared_noise``), so the members' errors differ by their samples only; the reference is the frozen initial model
(LoRA disabled, or a frozen copy) without CFG; CFG-free training forwards; deterministic ODE rollouts with the
current θ (``engine.forward_rollout=ode``); KL β_KL = ``loss.beta`` with the unweighted mean((v_θ − v_ref)²)
(the release uses 0.02 / 1e-3).
Where we differ: the release steps the optimizer once per unit time (K updates per batch); we take one update over
all K units (``train.num_inner_epochs`` for more). It adds a PPO-style clip of e_θ against an EMA of θ
(``clip_dsm``, clip range 1e-2) and, after ``switch_ema_ref`` updates, samples with that EMA; we keep neither (no
old-policy forwards), so a large learning rate is bounded only by the σ(s) saturation and the KL term. It samples
with DPM-Solver; we with the family's Euler ODE on the shifted grid. The units' draws are made once per rollout at
planning time (inner epochs and data-parallel ranks see the same units). Its group sums are all-reduced over ranks
(groups spread over GPUs); here groups stay whole on a rank (``dist.group_layout=local``; ``spread`` is refused).

Exact with respect to: not ``recompute``'s objective (no transition density); the gradient of the stated loss,
identical under any chunking (``engine.micro_batch_size``), world size or LoRA.
Cost per sample: K forwards with grad + K sample-backwards + K no-grad reference forwards (the reference is part of
the loss, whatever β_KL); with ``engine.micro_batch_size`` > 0 (chunks that may split a group) K more no-grad
forwards of θ to form every group's s before the first backward. On top of T no-grad rollout forwards. With the
default chunking (one chunk per unit index j: the batch's B samples, every group whole) s is formed inside the
chunk from the detached e_θ of its own grad forward.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from ..config import EngineConfig, RunConfig
from ..errors import ConfigError
from ..losses import aggregate
from ..metering import engine_run
from ..types import BatchPlan, EngineStats, Rollout
from ._forward import (
    ForwardState,
    check_forward_config,
    conditional_only,
    count_unit_backward,
    plan_units,
    unit_batches,
    unit_inputs,
    velocity_kl,
)
from .base import (
    EngineContext,
    kl_weights,
    no_rollout_hooks,
    plain_sampling,
    unit_sample_weights,
    weighted_kl,
)

DGPO_UNITS = 4  # the released recipe's num_train_timesteps
DGPO_TIME_FRACTION = 0.6  # the released recipe's trunc_steps 6 of 10 sampling steps: grid indices 0 … ⌊0.6·T⌋


# ---------------------------------------------------------------------- pure pieces
def truncated_grid_times(T: int, batch: int, k: int, fraction: float,
                         generator: torch.Generator | None = None) -> torch.Tensor:
    """K distinct grid indices drawn uniformly from 0 … ⌊fraction·T⌋ (capped at T−1, so t > 0), in random order,
    the same for every sample of the batch. → (batch, K) long."""
    top = max(0, min(T - 1, int(fraction * T)))
    if not 1 <= k <= top + 1:
        raise ValueError(f"dgpo: K={k} units need K distinct grid indices among 0 … {top}")
    idx = torch.randperm(top + 1, generator=generator)[:k]  # (K,)
    return idx.unsqueeze(0).expand(batch, k).clone()


def group_shared_noise(group_ids: torch.Tensor, k: int, shape: tuple[int, ...],
                       generator: torch.Generator) -> torch.Tensor:
    """One standard-normal ε per (group, unit), repeated over the group's members. → (B, K, *shape)."""
    _, inv = torch.unique(group_ids.cpu(), return_inverse=True)  # (B,) 0 … n_groups−1
    eps = torch.randn(int(inv.max()) + 1, k, *shape, generator=generator)  # (n_groups, K, *S)
    return eps[inv]


def flow_error(v: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """e = mean((v − u)²) over non-batch elements. v, u (n, *S) → (n,)."""
    return ((v - u) ** 2).mean(tuple(range(1, v.dim())))


def group_index(gid: torch.Tensor, col: torch.Tensor) -> torch.Tensor:
    """Index of each unit's (group, unit column) pair, 0 … P−1. gid, col (n,) long → (n,) long."""
    _, inv = torch.unique(torch.stack([gid, col], 1), dim=0, return_inverse=True)
    return inv


def group_sum(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Σ of x over the units sharing an index, handed back to every unit. x (n,), index (n,) → (n,)."""
    tot = torch.zeros(int(index.max()) + 1, dtype=x.dtype, device=x.device).index_add_(0, index, x)
    return tot[index]


def group_margin(adv: torch.Tensor, delta: torch.Tensor, w: torch.Tensor, index: torch.Tensor,
                 beta: float) -> torch.Tensor:
    """s = β·Σ_{i∈g} ŵ_i·A_i·Δ_i with ŵ_i = w_i/Σ_{k∈g} w_k (0 in a group of zero weight), handed to every unit of
    the group. adv, delta (e_θ − e_ref), w, index (n,) → (n,)."""
    W = group_sum(w, index)
    w_hat = torch.where(W > 0, w / W.clamp(min=1e-30), torch.zeros_like(w))
    return beta * group_sum(w_hat * adv * delta, index)


def dgpo_loss_value(s: torch.Tensor, w: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-unit share of L: (w/β)·softplus(s); summed over a group's units it is (W/β)·softplus(s). (n,) → (n,)."""
    return w * F.softplus(s) / beta


def check_config(cfg: RunConfig) -> None:
    """Rules of the dgpo engine on a whole run config (a one-line ConfigError naming the key): the forward
    engines' rules, a local group layout, K distinct high-noise times."""
    check_forward_config(cfg)
    if cfg.dist.mode != "none" and cfg.dist.group_layout == "spread":
        raise ConfigError("dist.group_layout: value 'spread' is not allowed with engine.name=dgpo (a group's "
                          "preference margin sums over all its members, kept whole on one rank); use 'local'")
    T, e = cfg.sampler.num_steps, cfg.engine
    top = max(0, min(T - 1, int(e.dgpo_time_fraction * T)))
    k = e.forward_timesteps if e.forward_timesteps > 0 else min(DGPO_UNITS, top + 1)
    if k > top + 1:
        raise ConfigError(f"engine.forward_timesteps: value {k} is out of range; dgpo draws distinct grid indices "
                          f"0 … {top} (engine.dgpo_time_fraction={e.dgpo_time_fraction}, sampler.num_steps={T}): "
                          f"must be <= {top + 1} (0 = the paper's recipe)")


# ---------------------------------------------------------------------- the engine
class DGPOEngine:
    """Direct Group Preference Optimization. Config: ``engine.dgpo_beta``, ``engine.dgpo_time_fraction``,
    ``engine.adv_clip``, ``engine.forward_timesteps``, ``engine.forward_rollout``; ``loss.beta`` (KL).

    Hooks: :meth:`plan` (units, their times and group-shared noise; ODE rollout) and :meth:`backward`."""

    name = "dgpo"
    config_keys = ("forward_timesteps", "forward_rollout", "adv_clip", "dgpo_beta", "dgpo_time_fraction")
    check_config = staticmethod(check_config)
    wave_size = 0

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.beta = float(cfg.dgpo_beta)
        self.adv_clip = float(cfg.adv_clip)
        self.fraction = float(cfg.dgpo_time_fraction)
        self.k = int(cfg.forward_timesteps)
        self.ode = str(cfg.forward_rollout) == "ode"

    def num_units(self, T: int) -> int:
        top = max(0, min(T - 1, int(self.fraction * T)))
        return self.k if self.k > 0 else min(DGPO_UNITS, top + 1)

    def plan(self, plan: BatchPlan, generator: torch.Generator) -> None:
        B, T = plan.selected.shape
        K = self.num_units(T)
        plan_units(plan, truncated_grid_times(T, B, K, self.fraction, generator), ode=self.ode, generator=generator)
        noise = group_shared_noise(plan.group_ids, K, tuple(plan.x0.shape[1:]), generator)  # (B, K, *S)
        plan.engine_state.noise = noise.to(device=plan.x0.device, dtype=torch.float32)

    sampling = plain_sampling
    rollout_hooks = no_rollout_hooks
    sample_weights = unit_sample_weights

    def _reference(self, ctx: EngineContext, traj, state: ForwardState, work, keep_v: bool):
        """Per chunk: (e_ref (n,), v_ref (n, *S) when the KL term needs it, else None), all in one reference block."""
        out = []
        with torch.no_grad(), ctx.policy.reference():
            for rows, cols in work:
                t, _, x_t, u, cond = unit_inputs(traj, state, rows, cols)
                v_ref = ctx.policy.velocity(x_t, t, cond)
                out.append((flow_error(v_ref, u), v_ref if keep_v else None))
        return out

    def _margins(self, ctx, rollout, state, work, refs, adv_all) -> torch.Tensor:
        """s of every unit (B, K) from no-grad forwards of θ (chunks that may split a group)."""
        B, K = state.idx.shape
        delta = torch.zeros(B, K, device=rollout.traj.xs.device)
        with torch.no_grad():
            for (rows, cols), (e_ref, _) in zip(work, refs):
                t, _, x_t, u, cond = unit_inputs(rollout.traj, state, rows, cols)
                delta[rows, cols] = flow_error(ctx.policy.velocity(x_t, t, cond), u) - e_ref
        rows, cols = rollout.selected[:, :K].nonzero(as_tuple=True)
        s = torch.zeros(B, K, device=delta.device)
        if rows.numel():
            idx = group_index(rollout.group_ids[rows], cols)
            s[rows, cols] = group_margin(adv_all[rows], delta[rows, cols], rollout.loss_weights[rows, cols], idx,
                                         self.beta)
        return s

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        state = rollout.traj.engine_state
        if not isinstance(state, ForwardState):
            raise ValueError("dgpo trains the units its own plan drew; build the batch plan with the dgpo engine")
        traj, pol = rollout.traj, ctx.policy
        K = state.idx.shape[1]
        whole = ctx.micro_batch_size <= 0  # one chunk per unit column: every group whole inside its chunk
        work = unit_batches(rollout.selected, K, ctx.micro_batch_size)
        adv_all = rollout.advantages.clamp(-self.adv_clip, self.adv_clip)  # (B,)
        tot = {"loss": 0.0, "kl": 0.0, "sig": 0.0, "margin": 0.0, "n": 0}
        with engine_run(ctx, self.name) as stats, conditional_only(pol):
            refs = self._reference(ctx, traj, state, work, keep_v=ctx.beta > 0)
            s_all = None if whole else self._margins(ctx, rollout, state, work, refs, adv_all)
            for j, ((rows, cols), (e_ref, v_ref)) in enumerate(zip(work, refs)):
                t, _, x_t, u, cond = unit_inputs(traj, state, rows, cols)  # (n,), (n, *S) ×3
                final = j == len(work) - 1
                with torch.enable_grad(), (contextlib.nullcontext() if final else ctx.no_sync()):
                    v = pol.velocity(x_t, t, cond)  # (n, *S) with graph
                    e = flow_error(v, u)  # (n,)
                    adv, w = adv_all[rows], rollout.loss_weights[rows, cols]
                    if whole:
                        s = group_margin(adv, e.detach() - e_ref, w, group_index(rollout.group_ids[rows], cols),
                                         self.beta)
                    else:
                        s = s_all[rows, cols]
                    sig = torch.sigmoid(s)  # (n,) the group's DPO weight, no grad
                    kl = velocity_kl(v, v_ref)
                    kl_w = weighted_kl(kl, kl_weights(ctx, rollout, rows, state.idx[rows, cols]))
                    surrogate = sig * adv * e + ctx.beta * kl_w  # ∇ Σ w·surrogate = ∇L
                    aggregate(surrogate, w).backward()
                count_unit_backward(stats, len(rows))
                tot["loss"] += float((dgpo_loss_value(s, w, self.beta) + w * ctx.beta * kl_w.detach()).sum())
                tot["kl"] += float(kl.detach().sum())
                tot["sig"] += float(sig.sum())
                tot["margin"] += float(s.sum())
                tot["n"] += len(rows)
        n = max(tot["n"], 1)
        stats.metrics.update({"loss": tot["loss"], "kl": tot["kl"] / n, "dgpo_sigmoid_mean": tot["sig"] / n,
                              "dgpo_margin_mean": tot["margin"] / n, "trained_pairs": float(tot["n"])})
        return stats
