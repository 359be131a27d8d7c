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
trainer splits the batch, see ``Trainer.step``). Global-std advantages couple every group, so waves are
refused with ``advantage.std_mode=global``.
Source: LeanGRPO (recompute-free GRPO schedules), "Retain".

:func:`retain_hooks` and :meth:`RetainedSteps.gather` let other engines keep and use a chosen subset of the
rollout's graphs (``engine.evaluation=retain`` of ``jagg`` and ``single_step``); :func:`retained_velocity`
gives the rollout velocity of chosen trajectories at step k with its graph.
"""
from __future__ import annotations

import time

import torch

from ..types import EngineStats, Rollout
from .base import EngineContext, StatsAccumulator, engine_run, step_loss, take_cond
from .recompute import recompute_fallback, recompute_pairs

RETAIN_KEY = "retained_graphs"


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
    store = rollout.extras.get(RETAIN_KEY)
    if store is None:
        raise KeyError("this rollout kept no graphs (run it with the retain engine's rollout hooks)")
    return store.velocity(k, idx)


def usable_store(rollout: Rollout, epoch: int) -> RetainedSteps | None:
    """The rollout's retained graphs when they are still exact (epoch 0, not yet released), else None.

    At epoch > 0 θ has moved, so the graphs are stale: they are released here and the caller recomputes."""
    store = rollout.extras.get(RETAIN_KEY)
    if store is None or store.released:
        return None
    if epoch > 0:
        store.release()
        return None
    return store


def make_retain_hook(ctx: EngineContext, plan, sigmas: torch.Tensor, store: RetainedSteps):
    """on_grad_step callback that keeps v with its graph and runs the no-grad reference forward (β > 0)."""
    cond_cache = {}

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


def retain_hooks(ctx: EngineContext, plan, sigmas: torch.Tensor, mask: torch.Tensor):
    """(grad_mask, on_grad_step) keeping the graphs of the (B, T) pairs ``mask`` in a fresh
    :class:`RetainedSteps` stored under ``plan.extras[RETAIN_KEY]`` (the trainer copies plan.extras into
    rollout.extras, same object)."""
    store = RetainedSteps(mask.shape[0], mask.shape[1], mask.device)
    plan.extras[RETAIN_KEY] = store
    return mask, make_retain_hook(ctx, plan, sigmas, store)


class RetainEngine:
    name = "retain"

    def __init__(self, cfg=None):
        self.cfg = cfg
        self.wave_size = int(getattr(cfg, "wave_size", 0) or 0) if cfg is not None else 0

    def rollout_hooks(self, ctx: EngineContext, plan):
        if ctx.sigmas is None:
            raise RuntimeError("retain: EngineContext.sigmas is not set (the Trainer sets it)")
        return retain_hooks(ctx, plan, ctx.sigmas, plan.selected)

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        store = rollout.extras.get(RETAIN_KEY)
        if epoch > 0 or store is None or store.released:
            if store is not None:
                store.release()
            return recompute_fallback(ctx, rollout, self.name)
        mult = 2 if getattr(ctx.policy, "uses_cfg", False) else 1
        with engine_run(ctx, self.name) as stats:
            stats.retained_graphs = store.num_graphs
            missing = rollout.selected & ~store.mask  # pairs the rollout did not retain (exact fallback)
            total = None
            for k, idx, v, v_ref in store.items:
                loss, terms = step_loss(ctx, rollout, idx, k, v, v_ref)
                total = loss if total is None else total + loss
                acc.add(terms)
                stats.sample_backwards += len(idx) * mult
            if bool(missing.any()):
                recompute_pairs(ctx, rollout, stats, acc, missing, last_backward=total is None)
            if total is not None:
                total.backward()
                stats.backward_calls += 1
            store.release()
        stats.seconds["rollout_extra"] = store.seconds
        stats.metrics.update(acc.metrics())
        stats.metrics["fallback_recompute"] = 0.0
        return stats
