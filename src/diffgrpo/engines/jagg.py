"""``jagg``: Jacobian-aggregated group gradient with cosine-similarity routing.

Estimator. Each selected step's loss depends on θ only through v_k = v_θ(x_k, σ_k), so the exact gradient is
Σ_k J_kᵀ g_k with J_k = ∂v_k/∂θ and the upstream signal g_k = ∂(w_k L_k)/∂v_k, obtained by autograd through
:func:`~diffgrpo.engines.base.step_loss` alone (v_k a leaf; no network backward). The selected steps of every
trajectory are split into windows of W consecutive selected steps a = k_0 < … < k_{W−1} = b (the last window
may be shorter). Inside a window the Jacobians are interpolated in σ,
    J_k ≈ (1 − α_k) J_a + α_k J_b,   α_k = (σ_k − σ_a) / (σ_b − σ_a)
(σ, not the step index: index weights j/(W−1) are wrong on shifted grids), so
    Σ_k J_kᵀ g_k ≈ J_aᵀ G_a + J_bᵀ G_b,   G_a = Σ_k (1 − α_k) g_k,   G_b = Σ_k α_k g_k,
applied with one forward with grad on [x_a; x_b] at [σ_a; σ_b] (conditioning tiled) and one
``out.backward(cat[G_a, G_b])``. Windows of different trajectories share that forward/backward (σ is passed
per sample, so their endpoints need not coincide): by default the j-th windows of all trajectories together.

Current velocities. g_k needs v_k under the current θ. The endpoints take it from the grad forward itself
(its detached output). Interior steps take ``rollout.traj.velocities`` on the first update (epoch 0: θ = θ_old, exact
and free) and a no-grad forward at (x_k, σ_k) after an optimizer step (epoch > 0). With β > 0 the KL term's
∂/∂v is part of g_k and every window step needs a no-grad reference forward (as in ``recompute``).

Exact relative to ``recompute``: windows of 1 or 2 steps are exact for any model (α ∈ {0, 1}); longer windows
are exact when v_θ is affine in (x, σ) and the window's states are collinear with the σ-weights
(x_k = (1 − α_k) x_a + α_k x_b). Otherwise the error is second order in the window's σ-span for smooth J_k
(first order in the SDE's off-chord noise). ``jagg_frac = 0`` routes every step to ``recompute_pairs`` and
reproduces ``recompute`` exactly.

Routing (``jagg_frac``, ``jagg_min_score``). Every (trajectory, window) gets a free linearity score from the
rollout velocities: λ_w = mean over interior k of cos(v_k − v_a, v_b − v_a), the cosine between the velocity
change so far and the change across the window; 1 when v moves along a straight line in the window (the
case where interpolating the Jacobians is the natural model), lower when it turns. Of the n windows with
interior steps, the top ⌈jagg_frac · n⌉ by λ that also score ≥ jagg_min_score use JAGG; the others get exact
per-step backward. Windows of 1–2 steps are exact either way (same cost; JAGG path unless jagg_frac = 0). The cosine ignores where along the chord v_k sits, so the
relative residual ‖v_k − ((1−α_k) v_a + α_k v_b)‖ / ‖v_b − v_a‖ is logged as well (``jagg_residual_*``).

Retained endpoints (``engine.evaluation=retain``, JAGG ∘ LeanGRPO Retain). The windows depend only on the
selected steps, known before sampling, so :meth:`JaggEngine.rollout_hooks` runs the rollout forwards of the
window endpoints (and of one-step windows) with grad and keeps those graphs; the other rollout forwards stay
no-grad. With β > 0 the endpoints' reference forwards run in the rollout too; the interior steps' reference
forwards (no grad) run in ``backward`` as with recompute evaluation, since the sampler only calls back for grad
steps. On the first update (epoch 0, θ = θ_old) ``backward`` runs no forward with grad: the endpoint velocities
come from the retained graphs, the interiors from the rollout, and all windows' signals go back in ONE
backward call (``cat[G_a, G_b]`` over rows of graphs from different rollout steps, i.e.
``torch.autograd.backward([v_a…, v_b…], [G_a…, G_b…])``). Windows routed to the exact path (``jagg_frac`` < 1;
routing needs the rollout's velocities, so it cannot be known when the graphs are chosen) use their retained
endpoint graphs as exact one-step terms of that same backward and recompute only their interior steps with
``recompute_pairs``. Same gradient as recompute evaluation up to float summation order. Epoch > 0 releases the
graphs and runs the recompute evaluation. ``stats.retained_graphs`` counts retained sample graphs (2 per window
of ≥ 2 steps, 1 per one-step window); ``stats.seconds["rollout_extra"]`` is the reference-forward time spent
inside the rollout. Cost per window on the first update: 0 forwards + 2 sample-backwards instead of W of each
(recompute: W forwards + W backwards): ideal train-phase speedup 3W/4 (2.7× for K = 9 steps, W = 4).

Cost per JAGG window of W ≥ 2 steps: 2 sample-forwards with grad + 2 sample-backwards (×2 with CFG) instead of
W of each; + (W − 2) no-grad forwards when epoch > 0; + W no-grad reference forwards when β > 0 (recompute
needs those too). Ideal train-phase speedup ≈ W/2. Peak activation memory: one chunk's forward (≤ 2B samples by default, see :meth:`JaggEngine.chunk_windows`).

Source: "JAGG" (Jacobian-aggregated group gradient), see the design notes, section 4.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from ..config import EngineConfig, RunConfig
from ..errors import ConfigError
from ..metering import chunks, engine_run
from ..types import BatchPlan, EngineStats, Rollout, RolloutHooks
from ._graph import RetainedSteps, recompute_pairs, retain_hooks, usable_store
from ._steps import selected_per_trajectory
from .base import (
    EngineContext,
    StatsAccumulator,
    count_backward,
    keep_plan,
    plain_sampling,
    step_loss,
    take_cond,
    unit_sample_weights,
)

# ----------------------------------------------------------------------------------------------------------
# pure helpers
# ----------------------------------------------------------------------------------------------------------

def sigma_weights(sig: torch.Tensor) -> torch.Tensor:
    """Interpolation weights α_k = (σ_k − σ_a)/(σ_b − σ_a) for a window's σ values (W,) → (W,), in σ's dtype.

    α_a = 0, α_b = 1; a window of one step gets α = 0.
    """
    if sig.numel() < 2:
        return torch.zeros_like(sig)
    return (sig - sig[0]) / (sig[-1] - sig[0])


def composite_signals(g: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g (W, n, *S) upstream signals of n windows, alpha (W,) or (W, n) → (G_a, G_b) each (n, *S).

    G_a = Σ_k (1 − α_k) g_k, G_b = Σ_k α_k g_k.
    """
    a = alpha.to(g.dtype).reshape(alpha.shape[0], -1, *([1] * (g.dim() - 2)))  # (W, 1|n, 1, …)
    return ((1 - a) * g).sum(0), (a * g).sum(0)


def linearity_scores(v: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing scores of n windows from their velocities v (W, n, *S) and weights alpha (W,) or (W, n).

    → (cos (n,), residual (n,)): mean over interior k of cos(v_k − v_a, v_b − v_a), and of
    ‖v_k − ((1−α_k) v_a + α_k v_b)‖ / ‖v_b − v_a‖. Windows with W ≤ 2 score (1, 0).
    """
    W, n = v.shape[0], v.shape[1]
    if W <= 2:
        return torch.ones(n, dtype=v.dtype, device=v.device), torch.zeros(n, dtype=v.dtype, device=v.device)
    f = v.flatten(2).double()  # (W, n, D)
    chord = f[-1] - f[0]  # (n, D)
    inner = f[1:-1] - f[0]  # (W−2, n, D)
    cos = torch.nn.functional.cosine_similarity(inner, chord.unsqueeze(0).expand_as(inner), dim=-1, eps=1e-12)
    a = alpha.double().reshape(W, -1)[1:-1].unsqueeze(-1)  # (W−2, 1|n, 1)
    resid = (inner - a * chord).norm(dim=-1) / chord.norm(dim=-1).clamp(min=1e-12)  # (W−2, n)
    return cos.mean(0).to(v.dtype), resid.mean(0).to(v.dtype)


def split_windows(steps: list[int], window: int) -> list[list[int]]:
    """Consecutive chunks of ``window`` selected steps (the last one may be shorter)."""
    return [steps[j:j + window] for j in range(0, len(steps), window)]


def anchor_mask(selected: torch.Tensor, window: int) -> torch.Tensor:
    """(B, T) bool: the window endpoints (and one-step windows) of every trajectory's selected steps."""
    out = torch.zeros_like(selected)
    sel = selected.cpu()
    for i in range(sel.shape[0]):
        for ws in split_windows(sel[i].nonzero().flatten().tolist(), window):
            out[i, ws[0]] = True
            out[i, ws[-1]] = True
    return out


@dataclass
class Window:
    """One (trajectory, window): trajectory index and its selected steps a = steps[0] … b = steps[-1]."""

    traj: int
    steps: list[int]
    score: float = 1.0
    residual: float = 0.0

    @property
    def anchors(self) -> list[int]:
        """Steps whose Jacobian is evaluated: both endpoints, or the single step."""
        return [self.steps[0]] if len(self.steps) == 1 else [self.steps[0], self.steps[-1]]


# ----------------------------------------------------------------------------------------------------------
# engine
# ----------------------------------------------------------------------------------------------------------

def check_jagg_config(cfg: RunConfig) -> None:
    """A window of W steps must fit in the steps selected per trajectory."""
    e = cfg.engine
    n = selected_per_trajectory(cfg)
    if e.window > n:
        raise ConfigError(f"engine.window: W={e.window} is larger than the {n} steps selected per trajectory "
                          f"(steps.mode={cfg.steps.mode}, sampler.num_steps={cfg.sampler.num_steps}); "
                          f"choose 2 <= W <= {n}")


class JaggEngine:
    """JAGG gradient engine (see the module docstring). Config: ``window``, ``jagg_frac``, ``jagg_min_score``."""

    name = "jagg"
    config_keys = ("window", "jagg_frac", "jagg_min_score", "evaluation")  # the engine.* keys it reads besides name and micro_batch_size
    check_config = staticmethod(check_jagg_config)
    alpha_fn = staticmethod(sigma_weights)  # (W,) σ values → (W,) α

    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.window = int(cfg.window)
        self.jagg_frac = float(cfg.jagg_frac)
        self.jagg_min_score = float(cfg.jagg_min_score)
        self.evaluation = str(cfg.evaluation)
        if self.window < 2:
            raise ValueError(f"engine.window must be >= 2, got {self.window}")
        if self.evaluation not in ("recompute", "retain"):
            raise NotImplementedError(f"jagg: engine.evaluation={self.evaluation!r} is not available; "
                                      "use 'recompute' or 'retain'")

    # -- planning ------------------------------------------------------------------------------------------

    plan = keep_plan
    wave_size = 0
    sampling = plain_sampling
    sample_weights = unit_sample_weights

    def rollout_hooks(self, ctx: EngineContext, plan: BatchPlan,
                      cond: dict[str, torch.Tensor]) -> RolloutHooks | None:
        """``evaluation=retain``: keep the rollout graphs of the window endpoints (from ``plan.selected``) in a
        :class:`RetainedSteps` on ``plan.engine_state``."""
        if self.evaluation != "retain":
            return None
        hooks, plan.engine_state = retain_hooks(ctx, cond, anchor_mask(plan.selected, self.window))
        return hooks

    def windows(self, rollout: Rollout) -> list[Window]:
        """Every trajectory's selected steps split into windows, scored from the rollout velocities."""
        sel = rollout.selected.cpu()
        by_steps: dict[tuple, list[int]] = {}  # trajectories sharing their selected steps are scored together
        for i in range(rollout.batch_size):
            by_steps.setdefault(tuple(sel[i].nonzero().flatten().tolist()), []).append(i)
        found: dict[int, list[Window]] = {}
        for steps, trajs in by_steps.items():
            per_traj = [found.setdefault(i, []) for i in trajs]
            rows = torch.tensor(trajs, device=rollout.traj.velocities.device)
            for ws in split_windows(list(steps), self.window):
                cos = res = None
                if len(ws) > 2:
                    alpha = self.alpha_fn(rollout.traj.sigmas[ws])
                    v = rollout.traj.velocities[rows][:, ws].transpose(0, 1)  # (W, n, *S)
                    cos, res = (t.tolist() for t in linearity_scores(v, alpha))
                for j, (i, lst) in enumerate(zip(trajs, per_traj)):
                    w = Window(i, ws)
                    if cos is not None:
                        w.score, w.residual = cos[j], res[j]
                    lst.append(w)
        return [w for i in sorted(found) for w in found[i]]  # trajectory order, windows in step order

    def route(self, windows: list[Window]) -> list[bool]:
        """True for windows that use JAGG.

        The routing pool is the n windows with interior steps (W ≥ 3): the top ⌈jagg_frac·n⌉ of them by score
        that also reach ``jagg_min_score`` use JAGG. Windows of 1–2 steps are exact on either path and cost the
        same; they take the JAGG path (batched with the others) unless jagg_frac = 0, where everything takes
        the exact path so that the result is ``recompute``'s bit for bit.
        """
        pool = [j for j, w in enumerate(windows) if len(w.steps) > 2]
        n_top = min(len(pool), math.ceil(self.jagg_frac * len(pool) - 1e-9))
        order = sorted(pool, key=lambda j: -windows[j].score)  # stable: ties keep trajectory order
        use = [len(w.steps) <= 2 and self.jagg_frac > 0 for w in windows]
        for j in order[:n_top]:
            use[j] = windows[j].score >= self.jagg_min_score
        return use

    @staticmethod
    def chunk_windows(wins: list[Window], micro_batch_size: int) -> list[list[Window]]:
        """Windows sharing one joint forward/backward.

        ``micro_batch_size`` 0: the j-th windows of all trajectories together (a forward of ≤ 2B samples, as
        many chunks as windows per trajectory); otherwise chunks of max(1, micro_batch_size // 2) windows, so
        a forward holds at most ``micro_batch_size`` samples (or 2 when it is 1).
        """
        if micro_batch_size <= 0:
            groups: dict[int, list[Window]] = {}
            seen: dict[int, int] = {}
            for w in wins:
                j = seen.get(w.traj, 0)
                seen[w.traj] = j + 1
                groups.setdefault(j, []).append(w)
            return [groups[j] for j in sorted(groups)]
        n = max(1, micro_batch_size // 2)
        return [wins[j:j + n] for j in range(0, len(wins), n)]

    # -- velocity evaluation -------------------------------------------------------------------------------

    def endpoint_velocities(self, ctx: EngineContext, rollout: Rollout, traj: torch.Tensor,
                            steps: torch.Tensor) -> torch.Tensor:
        """Current velocities WITH graph at the anchor rows (traj (m,), steps (m,)) → (m, *S).

        One forward on the batch [x_{i,k}] at per-sample σ_k with the rows' conditioning. This is the step an
        ``evaluation="retain"`` variant replaces by graphs kept from the rollout.
        """
        x = rollout.traj.xs[traj, steps]  # (m, *S)
        sig = rollout.traj.sigmas[steps]  # (m,)
        with torch.enable_grad():
            return ctx.policy.velocity(x, sig, take_cond(rollout.traj.cond, traj))

    def interior_velocities(self, ctx: EngineContext, rollout: Rollout, traj: torch.Tensor, steps: torch.Tensor,
                            epoch: int) -> torch.Tensor:
        """Current velocities (no graph) at interior rows → (m, *S): the rollout's on epoch 0, else recomputed."""
        if epoch == 0:
            return rollout.traj.velocities[traj, steps]
        out = []
        with torch.no_grad():
            for part in chunks(torch.arange(len(traj), device=traj.device), ctx.micro_batch_size):
                ti, si = traj[part], steps[part]
                out.append(ctx.policy.velocity(rollout.traj.xs[ti, si], rollout.traj.sigmas[si], take_cond(rollout.traj.cond, ti)))
        return torch.cat(out) if out else rollout.traj.velocities[traj, steps]

    def reference_velocities(self, ctx: EngineContext, rollout: Rollout, traj: torch.Tensor,
                             steps: torch.Tensor, store: RetainedSteps | None = None) -> torch.Tensor | None:
        """No-grad reference velocities at rows (traj, steps) → (m, *S), or None when β = 0.

        With ``store``, rows whose reference forward ran in the rollout are taken from it."""
        if ctx.beta <= 0:
            return None
        if store is not None:
            kept = store.mask[traj, steps]  # (m,)
            if bool(kept.any()):
                v = rollout.traj.velocities.new_empty((len(traj),) + tuple(rollout.traj.velocities.shape[2:]))
                v[kept] = store.gather(traj[kept], steps[kept], reference=True).to(v.dtype)
                if bool((~kept).any()):
                    v[~kept] = self.reference_velocities(ctx, rollout, traj[~kept], steps[~kept]).to(v.dtype)
                return v
        out = []
        with torch.no_grad(), ctx.policy.reference():
            for part in chunks(torch.arange(len(traj), device=traj.device), ctx.micro_batch_size):
                ti, si = traj[part], steps[part]
                out.append(ctx.policy.velocity(rollout.traj.xs[ti, si], rollout.traj.sigmas[si], take_cond(rollout.traj.cond, ti)))
        return torch.cat(out)

    # -- upstream signals ------------------------------------------------------------------------------------

    @staticmethod
    def upstream_signals(ctx: EngineContext, rollout: Rollout, traj: torch.Tensor, steps: torch.Tensor,
                         v: torch.Tensor, v_ref: torch.Tensor | None, acc: StatsAccumulator,
                         fresh: torch.Tensor | None = None) -> torch.Tensor:
        """g = ∂(Σ w L)/∂v at rows (traj (m,), steps (m,)) with current velocities v (m, *S) → (m, *S).

        Autograd through ``step_loss`` only (v is a fresh leaf), one call per distinct step.
        """
        g = torch.zeros_like(v)
        for k in torch.unique(steps).tolist():
            rows = (steps == k).nonzero().flatten()
            leaf = v[rows].detach().requires_grad_(True)
            with torch.enable_grad():
                loss, terms = step_loss(ctx, rollout, traj[rows], k, leaf, None if v_ref is None else v_ref[rows])
                (g_k,) = torch.autograd.grad(loss, leaf)
            g[rows] = g_k.to(g.dtype)
            acc.add(terms, fresh=False if fresh is None else fresh[rows])  # fresh (m,): rows of a grad forward
        return g

    # -- backward --------------------------------------------------------------------------------------------

    def _jagg_chunk(self, ctx: EngineContext, rollout: Rollout, wins: list[Window], epoch: int,
                    stats: EngineStats, acc: StatsAccumulator, final: bool,
                    store: RetainedSteps | None = None) -> None:
        """One joint forward/backward for the windows ``wins`` (with ``store``: no forward, the endpoints'
        retained rollout graphs)."""
        dev = rollout.traj.xs.device
        # anchor rows: endpoints of every window; member rows: every step of every window
        a_traj, a_step = [], []
        m_traj, m_step, m_anchor, m_alpha, m_interior = [], [], [], [], []
        for w in wins:
            alpha = self.alpha_fn(rollout.traj.sigmas[w.steps])  # (W,)
            base = len(a_traj)
            for s in w.anchors:
                a_traj.append(w.traj)
                a_step.append(s)
            last = len(w.steps) - 1
            for j, s in enumerate(w.steps):
                m_traj.append(w.traj)
                m_step.append(s)
                m_anchor.append((base, base + (1 if last > 0 else 0)))
                m_alpha.append(float(alpha[j]) if last > 0 else 0.0)
                m_interior.append(0 < j < last)
        a_traj_t = torch.tensor(a_traj, device=dev)
        a_step_t = torch.tensor(a_step, device=dev)
        m_traj_t = torch.tensor(m_traj, device=dev)
        m_step_t = torch.tensor(m_step, device=dev)
        interior = torch.tensor(m_interior, device=dev)
        # α kept in float64 so that the composite signals are exact sums
        alpha_t = torch.tensor(m_alpha, dtype=torch.float64, device=dev)  # (M,)

        v_ref = self.reference_velocities(ctx, rollout, m_traj_t, m_step_t, store)  # (M, *S) or None
        with contextlib.ExitStack() as es:
            if not final:
                es.enter_context(ctx.no_sync())
            if store is None:
                out = self.endpoint_velocities(ctx, rollout, a_traj_t, a_step_t)  # (A, *S) with graph
            else:  # rows of graphs from different rollout steps: the backward below spans all of them
                out = store.gather(a_traj_t, a_step_t)  # (A, *S)
            # current velocity of every member row: endpoints from the grad forward, interior from the rollout
            # (epoch 0) or a no-grad forward (epoch > 0)
            v_cur = torch.empty((len(m_traj),) + tuple(out.shape[1:]), dtype=out.dtype, device=dev)
            first = torch.tensor([p[0] for p in m_anchor], device=dev)
            second = torch.tensor([p[1] for p in m_anchor], device=dev)
            is_a = ~interior & (alpha_t == 0)
            is_b = ~interior & ~is_a
            v_cur[is_a] = out.detach()[first[is_a]]
            v_cur[is_b] = out.detach()[second[is_b]]
            if bool(interior.any()):
                v_cur[interior] = self.interior_velocities(ctx, rollout, m_traj_t[interior], m_step_t[interior],
                                                           epoch).to(out.dtype)
            g = self.upstream_signals(ctx, rollout, m_traj_t, m_step_t, v_cur, v_ref, acc,
                                      fresh=~interior if store is None else None)  # (M, *S)
            g = g.double()
            shape = (-1,) + (1,) * (g.dim() - 1)
            a = alpha_t.reshape(shape)
            G = torch.zeros((len(a_traj),) + tuple(g.shape[1:]), dtype=g.dtype, device=dev)  # (A, *S)
            G.index_add_(0, first, (1 - a) * g)  # G_a = Σ (1 − α_k) g_k
            G.index_add_(0, second, a * g)  # G_b = Σ α_k g_k (one-step windows: α = 0, nothing added)
            out.backward(G.to(out.dtype))
        count_backward(ctx, stats, len(a_traj))

    def backward(self, ctx: EngineContext, rollout: Rollout, epoch: int = 0) -> EngineStats:
        acc = StatsAccumulator()
        state = rollout.traj.engine_state
        store = usable_store(state if isinstance(state, RetainedSteps) else None, epoch)
        with engine_run(ctx, self.name) as stats:
            wins = self.windows(rollout)
            use = self.route(wins)
            if store is not None and not bool(store.mask[anchor_mask(rollout.selected, self.window)].all()):
                store.release()  # the rollout did not keep every endpoint: recompute evaluation
                store = None
            jagg = [w for w, u in zip(wins, use) if u]
            exact = torch.zeros_like(rollout.selected)
            for w, u in zip(wins, use):
                if not u:
                    if store is None:
                        exact[w.traj, w.steps] = True
                    else:  # retained endpoints as exact one-step terms, interior steps recomputed
                        jagg += [Window(w.traj, [s]) for s in w.anchors]
                        exact[w.traj, w.steps[1:-1]] = True
            if bool(exact.any()):
                recompute_pairs(ctx, rollout, stats, acc, exact, last_backward=not jagg)
            # retained graphs: every window in one chunk, so that one backward call covers all the graphs
            parts = self.chunk_windows(jagg, ctx.micro_batch_size) if store is None else [jagg] if jagg else []
            for j, part in enumerate(parts):
                self._jagg_chunk(ctx, rollout, part, epoch, stats, acc, final=j == len(parts) - 1, store=store)
            if store is not None:
                store.settle(stats)
        stats.metrics.update(acc.metrics())
        if self.evaluation == "retain":
            stats.metrics["fallback_recompute"] = float(store is None)
        scored = [w for w in wins if len(w.steps) > 2]
        routed = [w for w, u in zip(wins, use) if u and len(w.steps) > 2]
        sc = torch.tensor([w.score for w in scored] or [1.0], dtype=torch.float64)
        rs = torch.tensor([w.residual for w in scored] or [0.0], dtype=torch.float64)
        n_steps = max(1, sum(len(w.steps) for w in wins))
        stats.metrics.update({
            "jagg_score_mean": float(sc.mean()), "jagg_score_min": float(sc.min()), "jagg_score_max": float(sc.max()),
            "jagg_residual_mean": float(rs.mean()), "jagg_residual_max": float(rs.max()),
            "jagg_windows": float(len(wins)),
            "jagg_frac_routed": len(routed) / len(scored) if scored else float(self.jagg_frac > 0),
            "jagg_steps_routed": sum(len(w.steps) for w, u in zip(wins, use) if u) / n_steps,
        })
        return stats
