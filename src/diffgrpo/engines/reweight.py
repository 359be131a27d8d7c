"""``reweight``: LeanGRPO's recompute-free schedule that back-propagates during the rollout.

Estimator: on the first update after a rollout r ≡ 1 and the clip is inactive, so the PPO surrogate's
gradient is ∂L_ik/∂θ = −A_i·r·∂ℓ_ik/∂θ = −A_i·∂ℓ_ik/∂θ: linear in the (not yet known) advantage. During the
rollout each selected step's grad-enabled forward is back-propagated immediately with a provisional
advantage of 1 (which frees its activations) into a per-trajectory buffer

    G_i = Σ_{k selected} ∇_θ ℓ_ik            (per-sample gradients from one batched backward, see _per_sample)
    K_i = Σ_{k selected} ∇_θ KL_ik           (β > 0 only: the KL gradient does not scale with A)

Once rewards and advantages are known, ``backward`` writes Σ_i c_i·(−A_i·G_i + β·K_i) into ``.grad``, where
c_i = w_ik is trajectory i's aggregation weight (constant over its selected steps for every aggregation
mode; trajectories dropped after the fact — invalid reward, zero-std filtering — get c_i = 0, i.e. their
buffer is simply dropped). Per-trajectory buffers make this exact for ANY advantage function: advantage
clipping, global std and leave-one-out baselines need no special case.
Exact relative to ``recompute`` on the first update after a rollout; later inner epochs fall back to
``recompute`` (metric ``fallback_recompute = 1``).
Cost per selected step: 0 extra forwards + 1 backward (≈ 2F; +1 backward with β > 0) instead of 3F.
Memory: one graph in flight at a time (like recompute) plus B·P floats of buffers (2·B·P with β > 0; tiny
with LoRA); reported as metric ``grad_buffer_bytes``.
Floor: the cost model counts a sample-backward as 2 forwards, but each selected step also forms B per-sample
gradients of every trainable weight and adds them into the buffers (B·P floats of memory traffic per step), which
it does not see. A Linear layer's per-sample gradients go into the buffers by one batched GEMM
(``_per_sample.PerSampleGrads._add_linear``); on a full fine-tune of the tiny transformer (P = 283k, B = 64) the
train phase then measured 1.4–1.9× recompute's (ideal 1.5×; 0.6–0.8× with the einsum-then-add it replaces;
docs/engines.md, "The engines' floors"). The buffer traffic grows with P: LoRA keeps it small.
Gradient sync is deferred: the rollout-time forwards/backwards run under ``ctx.no_sync()`` and never touch
``.grad``; the final gradient is averaged over ranks with exactly ONE collective per optimizer step (an
all-reduce under DDP, a reduce-scatter into the shards under FSDP2; see ``distributed.add_mean_grad_``).
Source: LeanGRPO (recompute-free GRPO schedules), "Reweight".
"""
from __future__ import annotations

import contextlib
import time

import torch

from .. import distributed
from ..config import EngineConfig, RunConfig
from ..errors import ConfigError
from ..metering import engine_run
from ..samplers import flow_sde
from ..types import BatchPlan, EngineStats, Rollout, RolloutHooks
from ._graph import recompute_fallback, recompute_pairs
from ._per_sample import PerSampleGrads, per_sample_grads_loop
from .base import (
    EngineContext,
    StatsAccumulator,
    keep_plan,
    kl_step_weights,
    kl_weights,
    plain_sampling,
    take_cond,
    trainable_params,
    unit_sample_weights,
    weighted_kl,
)


class GradBuffers:
    """Per-trajectory gradient buffers filled during one rollout."""

    def __init__(self, batch: int, numel: int, kl: bool, planned: torch.Tensor):
        self.pg = torch.zeros(batch, numel, device=planned.device)  # (B, P) Σ_k ∇ℓ_ik
        self.kl = torch.zeros(batch, numel, device=planned.device) if kl else None  # (B, P) Σ_k ∇KL_ik
        self.planned = planned.clone()  # (B, T) pairs back-propagated during the rollout
        self.backward_calls = 0
        self.sample_backwards = 0
        self.seconds = 0.0
        self.kl_pairs = torch.zeros(planned.shape, device=planned.device)  # (B, T) KL_ik for the metrics
        self.released = False
        self.exit = contextlib.ExitStack()  # recording hooks + no_sync, closed after the last grad step

    @property
    def count(self) -> int:
        return self.pg.shape[0] * (2 if self.kl is not None else 1)

    @property
    def nbytes(self) -> int:
        return self.pg.numel() * self.pg.element_size() * (2 if self.kl is not None else 1)

    def release(self) -> None:
        self.exit.close()
        self.pg = self.kl = None
        self.released = True


def trajectory_factors(loss_weights: torch.Tensor, planned: torch.Tensor) -> torch.Tensor | None:
    """c (B,): each trajectory's aggregation weight over its planned steps, or None if it varies with k.

    loss_weights (B, T) final weights (0 for dropped trajectories); planned (B, T) bool.
    """
    big = torch.where(planned, loss_weights, torch.full_like(loss_weights, -float("inf"))).amax(1)
    small = torch.where(planned, loss_weights, torch.full_like(loss_weights, float("inf"))).amin(1)
    has = planned.any(1)
    if bool(((big - small).abs() > 1e-6 * big.abs().clamp(min=1e-30))[has].any()):
        return None
    return torch.where(has, big, torch.zeros_like(big))


def combine(pg: torch.Tensor, kl: torch.Tensor | None, adv: torch.Tensor, c: torch.Tensor, beta: float,
            kl_gate: torch.Tensor | None = None) -> torch.Tensor:
    """Flat gradient Σ_i c_i·(−A_i·G_i + β·g_i·K_i) (g: the KL term's per-sample weights, 1 when None).
    pg, kl (B, P); adv, c, kl_gate (B,) → (P,)."""
    g = -(c * adv) @ pg
    if kl is not None and beta > 0:
        g = g + beta * ((c if kl_gate is None else c * kl_gate.to(c)) @ kl)
    return g


def pair_kl(ctx: EngineContext, rollout: Rollout, kl_pairs: torch.Tensor) -> torch.Tensor:
    """The (B, T) per-pair KL terms times their weights (:func:`~diffgrpo.engines.base.kl_weights`)."""
    B, T = kl_pairs.shape
    rows = torch.arange(B, device=kl_pairs.device).repeat_interleave(T)
    steps = torch.arange(T, device=kl_pairs.device).repeat(B)
    return weighted_kl(kl_pairs.reshape(-1), kl_weights(ctx, rollout, rows, steps)).reshape(B, T)


def check_reweight_config(cfg: RunConfig) -> None:
    """The first update is formed from r = 1 without the step loss: no normalised ratio."""
    if cfg.loss.ratio_norm:
        raise ConfigError("loss.ratio_norm: engine.name=reweight forms the first update from r = 1 without the step "
                          "loss; use recompute, retain, jagg or single_step with the normalised ratio")


class ReweightEngine:
    """LeanGRPO-Reweight (see the module docstring). No engine-specific config."""

    name = "reweight"
    config_keys = ()  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(check_reweight_config)

    def __init__(self, cfg: EngineConfig | None = None):
        self.cfg = cfg

    plan = keep_plan
    wave_size = 0
    sampling = plain_sampling
    sample_weights = unit_sample_weights

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan,
                      cond: dict[str, torch.Tensor]) -> RolloutHooks | None:
        """Back-propagate every planned step during sampling into per-trajectory buffers (``plan.engine_state``)."""
        if ctx.sigmas is None:
            raise RuntimeError("reweight: EngineContext.sigmas is not set (the flow family sets it)")
        sigmas = ctx.sigmas
        params = trainable_params(ctx)
        psg = PerSampleGrads(ctx.policy, params)
        if not psg.supported() and distributed.sharded(params):
            # the fallback differentiates w.r.t. the parameters, but FSDP2's graph holds unsharded copies of them:
            # autograd would return no gradient at all, silently
            raise RuntimeError("reweight under dist.mode=fsdp2 needs per-sample gradients of every trainable layer "
                               "(nn.Linear / nn.Conv2d); use dist.mode=ddp or another engine")
        planned = plan.selected
        step_w = kl_step_weights(ctx, sigmas)  # (T,) or None
        buf = GradBuffers(planned.shape[0], psg.numel, ctx.beta > 0, planned)
        plan.engine_state = buf
        last_k = int(planned.any(0).nonzero().max()) if bool(planned.any()) else -1
        # rows of the last planned step still to come (the sampler may hand a step over in chunks of rows)
        last_left = [int(planned[:, last_k].sum()) if last_k >= 0 else 0]
        if psg.supported():
            buf.exit.enter_context(psg.recording())
        buf.exit.enter_context(ctx.no_sync())

        def on_grad_step(k, idx, v, x_k, x_next):
            t0 = time.perf_counter()
            n = len(idx)
            # upstream signals ∂ℓ_i/∂v_i and ∂KL_i/∂v_i through the closed-form step density only
            v_leaf = v.detach().requires_grad_(True)  # (n, *S)
            with torch.enable_grad():
                out = flow_sde.step(v_leaf, sigmas[k], sigmas[k + 1], x_k, prev_sample=x_next, **ctx.kernel)
                g_pg = torch.autograd.grad(out.log_prob.sum(), v_leaf, retain_graph=ctx.beta > 0)[0]
                g_kl = None
                if ctx.beta > 0:
                    with torch.no_grad(), ctx.policy.reference():  # the rollout's encoded conditioning
                        v_ref = ctx.policy.velocity(x_k, sigmas[k].expand(n), take_cond(cond, idx))
                        ref_mean = flow_sde.step(v_ref, sigmas[k], sigmas[k + 1], x_k, prev_sample=x_next,
                                                 **ctx.kernel).mean
                    kl = flow_sde.gaussian_kl(out.mean, ref_mean, out.std, flowgrpo_compat=ctx.kl_flowgrpo_compat,
                                              sigma=sigmas[k], sigma_next=sigmas[k + 1])
                    g_kl = torch.autograd.grad(kl.sum(), v_leaf)[0]
                    if step_w is not None:  # DiverseGRPO's step weight, known before the rewards
                        g_kl = g_kl * step_w[k]
                    buf.kl_pairs[idx, k] = kl.detach()
            # per-trajectory gradients: one batched backward per term, activations freed afterwards
            recs = psg.take() if psg.supported() else None
            for j, (g, dst) in enumerate(((g_pg, buf.pg), (g_kl, buf.kl))):
                if g is None:
                    continue
                keep = g_kl is not None and j == 0
                if recs is not None:
                    psg.grads(recs, v, g, n, retain_graph=keep, into=(dst, idx))  # dst[idx] += per-sample grads
                    buf.backward_calls += 1
                else:
                    dst.index_add_(0, idx, per_sample_grads_loop(params, v, g, retain_graph=keep))
                    buf.backward_calls += n
                buf.sample_backwards += n * ctx.forward_mult
            if k == last_k:
                last_left[0] -= n
                if last_left[0] <= 0:
                    buf.exit.close()
            buf.seconds += time.perf_counter() - t0

        return RolloutHooks(grad_mask=planned, on_grad_step=on_grad_step)

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        buf = rollout.traj.engine_state
        buf = buf if isinstance(buf, GradBuffers) else None
        c = None
        if buf is not None and not buf.released and epoch == 0:
            buf.exit.close()
            c = trajectory_factors(rollout.loss_weights, buf.planned)
        if c is None:
            if buf is not None:
                buf.release()
            return recompute_fallback(ctx, rollout, self.name)
        params = trainable_params(ctx)
        with engine_run(ctx, self.name) as stats:
            stats.grad_buffers = buf.count
            stats.backward_calls += buf.backward_calls
            stats.sample_backwards += buf.sample_backwards
            missing = rollout.selected & ~buf.planned  # pairs not back-propagated during the rollout
            if bool(missing.any()):  # (not through the Trainer, which plans every trained pair)
                # synced: under FSDP2 a no_sync gradient stays in FSDP's own buffers, out of add_mean_grad_'s reach
                recompute_pairs(ctx, rollout, stats, acc, missing, last_backward=True)
            flat = combine(buf.pg, buf.kl, rollout.advantages.float(), c.float(), ctx.beta, rollout.kl_weights)
            n_comm = sum(distributed.COUNTERS.values())
            # the one gradient sync of this optimizer step: one all-reduce (DDP) or reduce-scatter (FSDP2 shards),
            # added to .grad, which may hold an already synced part of it (missing pairs)
            distributed.add_mean_grad_(params, flat)
            stats.allreduce_calls += sum(distributed.COUNTERS.values()) - n_comm
            sel = rollout.selected
            n_pairs = int(sel.sum())
            acc.n += n_pairs
            acc.ratio += float(n_pairs)  # r ≡ 1 on the first update
            acc.kl += float((buf.kl_pairs * rollout.selected).sum())
            # the loss needs no forward either: with r ≡ 1 the clipped surrogate of pair (i, k) is −A_i (+ β·KL_ik)
            per_pair = -rollout.advantages.float()[:, None] + ctx.beta * pair_kl(ctx, rollout, buf.kl_pairs)
            acc.loss += float((rollout.loss_weights * sel * per_pair).sum())
            stats.metrics["grad_buffer_bytes"] = float(buf.nbytes)
            buf.release()
        stats.seconds["rollout_extra"] = buf.seconds
        stats.metrics.update(acc.metrics())
        stats.metrics["fallback_recompute"] = 0.0
        return stats
