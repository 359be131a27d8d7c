"""What the forward-process engines (``nft``, ``awm``) share: training units on clean samples, timestep draws,
the noised inputs, the old policy kept as an EMA of θ, CFG-free forwards.

A forward-process engine trains on the rollout's clean samples x_0 only (``traj.xs[:, -1]``; σ = 0 is the data end
of the grid), never on a transition of the sampler, so it needs no per-step likelihood and works with any sampler,
ODE included. Each sample i gets K *units* j: a time t_ij ∈ (0, 1] and fresh noise ε_ij drawn at planning time (so an
update, its inner epochs and a data-parallel run all see the same draws), the noised input
    x_t = (1 − t)·x_0 + t·ε,       target velocity u = ε − x_0,
and a loss on v_θ(x_t, t). Unit j of sample i lives in column j of the rollout's (B, T) ``selected`` /
``loss_weights``, so ``losses.aggregation_weights`` normalises over units exactly as over steps (K ≤ T).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..config import RunConfig, changed_keys
from ..ema import swapped
from ..errors import ConfigError
from ..types import BatchPlan
from .base import take_cond


@dataclass
class ForwardState:
    """Planned draws of a forward-process batch (rides on ``plan.engine_state`` / ``traj.engine_state``)."""

    idx: torch.Tensor  # (B, K) long: each unit's time as an index k of the σ grid (t = σ_k, k < T so t > 0)
    noise: torch.Tensor  # (B, K, *S) standard-normal ε of each unit
    old_log_prob: torch.Tensor | None = None  # (B, K) awm: ℓ_old of the first update (for inner epochs > 0)


def check_forward_config(cfg: RunConfig) -> None:
    """nft / awm own their training units: the step-selection and step-ratio keys do not apply to them."""
    e = cfg.engine
    default = RunConfig()
    for key in changed_keys(cfg.steps, default.steps, "steps.") + [
            k for k in ("loss.clip_range", "loss.kl_flowgrpo_compat", "loss.trust_region", "loss.kl_mask_bound",
                        "loss.ratio_norm")
            if getattr(cfg.loss, k.split(".")[1]) != getattr(default.loss, k.split(".")[1])]:
        alt = {"loss.clip_range": "; awm's ratio clip is engine.awm_clip_range"}.get(key, "")
        raise ConfigError(f"{key}: does not apply to engine.name={e.name} (a forward-process engine trains "
                          f"engine.forward_timesteps units per clean sample, not sampler steps){alt}; remove it")
    T = cfg.sampler.num_steps
    if e.forward_timesteps > T:
        raise ConfigError(f"engine.forward_timesteps: value {e.forward_timesteps} is out of range; at most one unit "
                          f"per grid time: must be <= sampler.num_steps={T} (0 = the paper's recipe)")



# ---------------------------------------------------------------------- timestep draws (pure)
def grid_times(T: int, batch: int, k: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """DiffusionNFT's times: per sample, K distinct grid indices of σ_0 … σ_{T−1} (σ_T = 0 excluded) in a random
    order (an independent permutation per sample, the first K kept). → (batch, K) long."""
    if not 1 <= k <= T:
        raise ValueError(f"grid_times: K={k} must be in 1 … T={T}")
    return torch.stack([torch.randperm(T, generator=generator)[:k] for _ in range(batch)])  # (batch, K)


def stratified_grid_times(T: int, batch: int, k: int, fraction: float = 0.9,
                          generator: torch.Generator | None = None) -> torch.Tensor:
    """AWM's released ``discrete_wo_init`` times: grid indices 1 … ⌊fraction·T⌋ cut into K strata
    (``linspace(1, ⌊fraction·T⌋, K+1)`` truncated), one uniform index per stratum, the same K indices for every
    sample of the batch. → (batch, K) long."""
    top = max(1, min(T - 1, int(T * fraction)))
    bounds = torch.linspace(1, top, k + 1).long()  # (K+1,)
    lo, hi = bounds[:-1], bounds[1:]
    u = torch.rand(k, generator=generator)
    idx = (lo + (u * (hi - lo).float()).long()).clamp(max=T - 1)  # (K,)
    return idx.unsqueeze(0).expand(batch, k).clone()


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x_t = (1 − t)·x_0 + t·ε and the flow-matching target u = ε − x_0. x0, eps (n, *S), t (n,) → both (n, *S)."""
    tt = t.reshape(-1, *([1] * (x0.dim() - 1)))
    return (1 - tt) * x0 + tt * eps, eps - x0


def unit_inputs(traj, state: ForwardState, rows: torch.Tensor, cols: torch.Tensor):
    """Units (rows, cols) of a rollout → (t (n,), x_0 (n, *S), x_t (n, *S), u (n, *S), cond of the rows)."""
    t = traj.sigmas[state.idx[rows, cols]]  # (n,)
    x0 = traj.xs[rows, -1]  # (n, *S) the clean samples
    x_t, u = noised(x0, state.noise[rows, cols], t)
    return t, x0, x_t, u, take_cond(traj.cond, rows)


def reference_velocity(ctx, x_t: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor | None:
    """v_ref(x_t, t) of the reference (no grad) when the KL term is on (``loss.beta`` > 0), else None."""
    if ctx.beta <= 0:
        return None
    with torch.no_grad(), ctx.policy.reference():
        return ctx.policy.velocity(x_t, t, cond)


def velocity_kl(v: torch.Tensor, v_ref: torch.Tensor | None) -> torch.Tensor:
    """The KL term's mean((v_θ − v_ref)²) per unit, zeros without a reference. v, v_ref (n, *S) → (n,)."""
    if v_ref is None:
        return torch.zeros(v.shape[0], device=v.device)
    return ((v - v_ref) ** 2).mean(tuple(range(1, v.dim())))


def plan_units(plan: BatchPlan, times: torch.Tensor, *, ode: bool, generator: torch.Generator) -> None:
    """Train K units per sample (columns 0 … K−1 of ``plan.selected``), with the given grid indices (B, K) and
    noise drawn from ``generator``; ``ode``: every sampling step deterministic (the papers' ODE rollouts)."""
    B, T = plan.selected.shape
    K = times.shape[1]
    dev = plan.selected.device
    sel = torch.zeros(B, T, dtype=torch.bool, device=dev)
    sel[:, :K] = True
    plan.selected = sel
    if ode:
        plan.sde_mask = torch.zeros(B, T, dtype=torch.bool, device=dev)
    noise = torch.randn(B, K, *plan.x0.shape[1:], generator=generator)  # CPU stream, then the policy's device
    plan.engine_state = ForwardState(idx=times.to(dev), noise=noise.to(device=plan.x0.device, dtype=torch.float32))


def unit_batches(selected: torch.Tensor, k: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The selected units (i, j), j < K, in chunks → [(rows (n,), cols (n,))]. ``size`` > 0: chunks of at most
    ``size`` units; 0: one chunk per unit index j (the batch's samples, as ``recompute`` takes one chunk per step),
    so peak activation memory does not grow with K."""
    rows, cols = selected[:, :k].T.nonzero(as_tuple=True)[::-1]  # column-major: unit j of every sample together
    if rows.numel() == 0:
        return []
    if size <= 0:
        return [(rows[cols == j], cols[cols == j]) for j in cols.unique().tolist()]
    return list(zip(rows.split(size), cols.split(size)))


# ---------------------------------------------------------------------- the old policy (EMA of θ)
def ema_decay(step: int, rate: float, cap: float) -> float:
    """DiffusionNFT's old-policy schedule: decay = min(rate·step, cap) after ``step`` optimizer updates."""
    return min(rate * step, cap)


class OldPolicy:
    """θ_old: a copy of the trainable parameters, moved towards θ after each update,
    θ_old ← d·θ_old + (1 − d)·θ. ``current`` is True while θ_old equals θ bit for bit (then v_old needs no forward)."""

    def __init__(self):
        self.values: list[torch.Tensor] | None = None
        self.updates = 0
        self.current = True
        self.last_decay = 0.0

    def update(self, params: list[torch.Tensor], rate: float, cap: float) -> None:
        """First call: θ_old = θ. Later calls (one per rollout, i.e. after the previous update): the EMA step."""
        with torch.no_grad():
            if self.values is None:
                self.values = [p.detach().clone() for p in params]
                self.current = True
                return
            self.updates += 1
            d = ema_decay(self.updates, rate, cap)
            self.last_decay = d
            for o, p in zip(self.values, params):
                o.mul_(d).add_(p.detach(), alpha=1 - d)
            self.current = d == 0.0

    def active(self, params: list[torch.Tensor], module=None) -> contextlib.AbstractContextManager:
        """Inside the block the parameters hold θ_old (``ema.swapped``: copied in place, restored after; ``module``
        resharded under FSDP2). No-op while θ_old equals θ."""
        if self.values is None or self.current:
            return contextlib.nullcontext()
        return swapped(params, self.values, module)


@contextlib.contextmanager
def conditional_only(policy):
    """CFG-free forwards: under true classifier-free guidance the block runs the conditional branch alone."""
    if not policy.uses_cfg:
        yield
        return
    scale, policy.guidance_scale = policy.guidance_scale, 1.0
    try:
        yield
    finally:
        policy.guidance_scale = scale


def count_unit_backward(stats, samples: int) -> None:
    """One backward call through ``samples`` network inputs: CFG-free forwards have one input per unit (unlike
    ``base.count_backward``, which doubles under true CFG)."""
    stats.backward_calls += 1
    stats.sample_backwards += samples


def clip_advantages(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """A clipped to [−c, c] and divided by c → [−1, 1]. (n,) → (n,)."""
    return adv.clamp(-clip, clip) / clip
