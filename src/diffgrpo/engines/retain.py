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
engine's ``collect`` splits the batch). Global-std advantages couple every group, so waves are
refused with ``advantage.std_mode=global``.
Source: LeanGRPO (recompute-free GRPO schedules), "Retain".

:func:`retain_hooks` and :meth:`RetainedSteps.gather` let other engines keep and use a chosen subset of the
rollout's graphs (``engine.evaluation=retain`` of ``jagg`` and ``single_step``); :func:`retained_velocity`
gives the rollout velocity of chosen trajectories at step k with its graph.
"""
from __future__ import annotations

import time

import torch

from ..types import BatchPlan, EngineStats, FlowTrajectory, Rollout, RolloutHooks
from .base import (EngineContext, StatsAccumulator, count_backward, engine_run, keep_plan, step_loss, take_cond,
                   unit_sample_weights)
from .recompute import recompute_fallback, recompute_pairs


class RetainedSteps:
    """Graphs kept from one rollout: per step k a list of (idx (n,), v (n, *S) with graph, v_ref or None)."""

    def __init__(self, batch: int, num_steps: int, device):
        self.items: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self.mask = torch.zeros(batch, num_steps, dtype=torch.bool, device=device)  # (B, T) retained pairs
        self.seconds = 0.0
        self.released = False
        self._where: dict[tuple[int, int], tuple[int, int]] = {}  # (trajectory, step) -> (item, row)

    def add(self, k: int, idx: torch.Tensor, v: torch.Tensor, v_ref: torch.Tensor | None) -> None:
        self.items.append((k, idx, v, v_ref))
        self.mask[idx, k] = True
        for row, i in enumerate(idx.tolist()):
            self._where[(i, k)] = (len(self.items) - 1, row)

    @property
    def num_graphs(self) -> int:
        return len(self.items)

    def gather(self, traj: torch.Tensor, steps: torch.Tensor, *, reference: bool = False) -> torch.Tensor | None:
        """Rows (traj (m,), steps (m,)) → (m, *S): the retained velocities WITH their graphs (rows of different
        rollout steps in one tensor), or with ``reference`` the no-grad reference velocities (None when the
        rollout ran none, β = 0). KeyError if a pair was not retained."""
        if self.released:
            raise KeyError("retained graphs were already released")
        groups: dict[int, tuple[list[int], list[int]]] = {}  # item -> (output positions, rows of the item)
        for p, (i, k) in enumerate(zip(traj.tolist(), steps.tolist())):
            loc = self._where.get((i, k))
            if loc is None:
                raise KeyError(f"step {k} of trajectory {i} was not retained")
            pos, rows = groups.setdefault(loc[0], ([], []))
            pos.append(p)
            rows.append(loc[1])
        parts, order = [], []
        for item, (pos, rows) in groups.items():
            t = self.items[item][3 if reference else 2]
            if t is None:
                return None
            parts.append(t.index_select(0, torch.tensor(rows, device=t.device)))  # (n_item, *S)
            order += pos
        cat = torch.cat(parts)  # (m, *S) grouped by item
        inv = torch.empty(len(order), dtype=torch.long, device=cat.device)
        inv[torch.tensor(order, device=cat.device)] = torch.arange(len(order), device=cat.device)
        return cat[inv]

    def velocity(self, k: int, idx: torch.Tensor) -> torch.Tensor:
        """v (len(idx), *S) with graph for trajectories ``idx`` at step k; KeyError if any is not retained."""
        return self.gather(idx, torch.full_like(idx, k))

    def settle(self, stats: EngineStats) -> None:
        """Report the retained per-sample graphs and the rollout-time training seconds, then release them."""
        stats.retained_graphs = int(self.mask.sum())
        stats.seconds["rollout_extra"] = self.seconds
        self.release()

    def release(self) -> None:
        self.items = []
        self._where = {}
        self.released = True


def retained_velocity(rollout: Rollout, k: int, idx: torch.Tensor) -> torch.Tensor:
    """Rollout velocity of trajectories ``idx`` (n,) at step k with its graph → (n, *S). Needs ``retain`` hooks."""
    store = rollout.traj.engine_state
    if not isinstance(store, RetainedSteps):
        raise KeyError("this rollout kept no graphs (run it with the retain engine's rollout hooks)")
    return store.velocity(k, idx)


def usable_store(store: RetainedSteps | None, epoch: int) -> RetainedSteps | None:
    """``store`` when its graphs are still exact (epoch 0, not yet released), else None.

    At epoch > 0 θ has moved, so the graphs are stale: they are released here and the caller recomputes."""
    if store is None or store.released:
        return None
    if epoch > 0:
        store.release()
        return None
    return store


def make_retain_hook(ctx: EngineContext, plan: BatchPlan, store: RetainedSteps):
    """on_grad_step callback that keeps v with its graph and runs the no-grad reference forward (β > 0)."""
    cond_cache = {}
    sigmas = ctx.sigmas

    def on_grad_step(k, idx, v, x_k, x_next):
        t0 = time.perf_counter()
        v_ref = None
        if ctx.beta > 0:
            if "cond" not in cond_cache:
                cond_cache["cond"] = ctx.policy.encode(plan.prompts)
            with torch.no_grad(), ctx.policy.reference():
                v_ref = ctx.policy.velocity(x_k, sigmas[k].expand(len(idx)), take_cond(cond_cache["cond"], idx))
        store.add(k, idx, v, v_ref)
        store.seconds += time.perf_counter() - t0

    return on_grad_step


def retain_hooks(ctx: EngineContext, plan: BatchPlan, mask: torch.Tensor) -> tuple[RolloutHooks, RetainedSteps]:
    """Hooks keeping the graphs of the (B, T) pairs ``mask`` in a fresh :class:`RetainedSteps` (returned too: the
    calling engine puts it in its state on ``plan.engine_state``)."""
    if ctx.sigmas is None:
        raise RuntimeError("EngineContext.sigmas is not set (the flow family sets it)")
    store = RetainedSteps(mask.shape[0], mask.shape[1], mask.device)
    return RolloutHooks(grad_mask=mask, on_grad_step=make_retain_hook(ctx, plan, store)), store


# ---------------------------------------------------------------------- rollout waves
def split_waves(plan: BatchPlan, groups_per_wave: int) -> list[BatchPlan]:
    """Sub-plans of ``groups_per_wave`` complete groups each (in batch order); [plan] if one wave suffices.
    Each sub-plan carries ``wave`` = (the whole batch's selected (B_all, T), its rows (B,)) for the loss weights."""
    groups = list(dict.fromkeys(plan.group_ids.tolist()))  # in order of first appearance
    if groups_per_wave <= 0 or groups_per_wave >= len(groups):
        return [plan]
    waves = []
    for j in range(0, len(groups), groups_per_wave):
        take = torch.isin(plan.group_ids, torch.tensor(groups[j:j + groups_per_wave]))
        rows = take.nonzero().flatten()
        dev_rows = rows.to(plan.selected.device)
        waves.append(BatchPlan(prompts=[plan.prompts[i] for i in rows.tolist()], group_ids=plan.group_ids[rows],
                               selected=plan.selected[dev_rows], x0=plan.x0[rows.to(plan.x0.device)],
                               metadata=[plan.metadata[i] for i in rows.tolist()] if plan.metadata else [],
                               sde_mask=None if plan.sde_mask is None else plan.sde_mask[dev_rows],
                               engine_state=plan.engine_state, wave=(plan.selected, dev_rows)))
    return waves


def merge_rollouts(ros: list[Rollout]) -> Rollout:
    """Concatenate wave rollouts along the batch (for metrics and later inner epochs, which recompute).

    Advantage statistics are the waves' averaged by their number of groups (clip fraction by valid samples)."""
    if len(ros) == 1:
        return ros[0]
    cat = lambda get: torch.cat([get(r) for r in ros])  # noqa: E731
    t0 = ros[0].traj
    traj = FlowTrajectory(cond={k: cat(lambda r: r.traj.cond[k]) for k in t0.cond}, sigmas=t0.sigmas,
                          xs=cat(lambda r: r.traj.xs), velocities=cat(lambda r: r.traj.velocities),
                          log_probs=cat(lambda r: r.traj.log_probs), noise=cat(lambda r: r.traj.noise),
                          images=None if t0.images is None else cat(lambda r: r.traj.images))
    n_groups = [float(len(r.group_ids.unique())) for r in ros]
    n_valid = [float(r.valid.sum()) for r in ros]
    stats = {"frac_reward_zero_std": sum(n * r.advantage_stats["frac_reward_zero_std"] for n, r in zip(n_groups, ros))
             / max(sum(n_groups), 1.0),
             "adv_clip_frac": sum(n * r.advantage_stats["adv_clip_frac"] for n, r in zip(n_valid, ros))
             / max(sum(n_valid), 1.0),
             "num_invalid": sum(int(r.advantage_stats["num_invalid"]) for r in ros),
             "trained_units": sum(r.advantage_stats["trained_units"] for r in ros)}
    return Rollout(prompts=sum((r.prompts for r in ros), []), group_ids=cat(lambda r: r.group_ids), traj=traj,
                   selected=cat(lambda r: r.selected), trained=cat(lambda r: r.trained),
                   rewards=cat(lambda r: r.rewards),
                   reward_components={k: cat(lambda r: r.reward_components[k]) for k in ros[0].reward_components},
                   valid=cat(lambda r: r.valid), advantages=cat(lambda r: r.advantages),
                   loss_weights=cat(lambda r: r.loss_weights), batch_rewards=cat(lambda r: r.batch_rewards),
                   advantage_stats=stats, metadata=sum((r.metadata for r in ros), []),
                   timings={k: sum(r.timings.get(k, 0.0) for r in ros) for k in ros[0].timings})


# ---------------------------------------------------------------------- the engine
class RetainEngine:
    """LeanGRPO-Retain (see the module docstring). Config: ``engine.wave_size``."""

    name = "retain"

    def __init__(self, cfg):
        self.cfg = cfg
        self.wave_size = int(cfg.wave_size)

    plan = keep_plan
    sample_weights = unit_sample_weights

    def collect(self, ctx: EngineContext, plan: BatchPlan, rollout) -> tuple[Rollout, EngineStats | None]:
        """Roll out the batch in waves of ``wave_size`` complete groups, each wave's first-update gradient
        accumulated into ``.grad`` (the caller zeroed it) before the next wave starts, so only one wave's retained
        graphs are alive at a time. → (merged rollout, merged stats of the first update)."""
        if not self.wave_size:
            return rollout(plan), None
        total = EngineStats(engine=self.name)
        ros = []
        for sub in split_waves(plan, self.wave_size):
            ro = rollout(sub)
            total.merge(self.backward(ctx, ro, 0))
            ros.append(ro)
        total.metrics["waves"] = float(len(ros))
        return merge_rollouts(ros), total

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan) -> RolloutHooks | None:
        hooks, plan.engine_state = retain_hooks(ctx, plan, plan.selected)
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
