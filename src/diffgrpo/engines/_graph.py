"""What the likelihood engines share about where a trained velocity comes from: a fresh forward with grad at the
stored (x_k, σ_k) (:func:`recompute_pairs`, exact, 1F + 1B per pair) or the graph the rollout's own forward kept
(:class:`RetainedSteps`, filled by :func:`retain_hooks` during sampling, 1B per pair). Engines compose these
velocity sources; no engine module imports another.
"""
from __future__ import annotations

import contextlib
import time

import torch

from ..metering import chunks, engine_run
from ..types import EngineStats, Rollout, RolloutHooks
from .base import (
    EngineContext,
    StatsAccumulator,
    count_backward,
    reference_velocity,
    step_loss,
    take_cond,
)


# ---------------------------------------------------------------------- a fresh forward with grad
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
        acc.add(terms, fresh=True)


def recompute_fallback(ctx: EngineContext, rollout: Rollout, name: str) -> EngineStats:
    """Exact recompute of every selected pair, reported as engine ``name`` with ``fallback_recompute = 1``.

    Used by the recompute-free engines once θ has moved away from the rollout's θ_old (inner epochs > 0)."""
    acc = StatsAccumulator()
    with engine_run(ctx, name) as stats:
        recompute_pairs(ctx, rollout, stats, acc, rollout.selected)
    stats.metrics.update(acc.metrics())
    stats.metrics["fallback_recompute"] = 1.0
    return stats


# ---------------------------------------------------------------------- the rollout's retained graphs
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


def make_retain_hook(ctx: EngineContext, cond: dict[str, torch.Tensor], store: RetainedSteps):
    """on_grad_step callback that keeps v with its graph and runs the no-grad reference forward (β > 0) on the
    rollout's own encoded conditioning ``cond``."""
    sigmas = ctx.sigmas

    def on_grad_step(k, idx, v, x_k, x_next):
        t0 = time.perf_counter()
        v_ref = None
        if ctx.beta > 0:
            with torch.no_grad(), ctx.policy.reference():
                v_ref = ctx.policy.velocity(x_k, sigmas[k].expand(len(idx)), take_cond(cond, idx))
        store.add(k, idx, v, v_ref)
        store.seconds += time.perf_counter() - t0

    return on_grad_step


def retain_hooks(ctx: EngineContext, cond: dict[str, torch.Tensor],
                 mask: torch.Tensor) -> tuple[RolloutHooks, RetainedSteps]:
    """Hooks keeping the graphs of the (B, T) pairs ``mask`` in a fresh :class:`RetainedSteps` (returned too: the
    calling engine puts it in its state on ``plan.engine_state``)."""
    if ctx.sigmas is None:
        raise RuntimeError("EngineContext.sigmas is not set (the flow family sets it)")
    store = RetainedSteps(mask.shape[0], mask.shape[1], mask.device)
    return RolloutHooks(grad_mask=mask, on_grad_step=make_retain_hook(ctx, cond, store)), store
