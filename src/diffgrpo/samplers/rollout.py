"""Trajectory sampling with the shared step function: the data every engine trains on.

Runs T steps of ``flow_sde.step`` from the initial noise and records, per step, the state x_k, the (guided)
velocity v_k, the log-prob of the taken transition and the standard-normal noise injected. Network calls
run without grad unless a step appears in ``grad_mask``; then the velocity of those samples is computed with
grad and handed to ``on_grad_step`` (recompute-free engines keep or back-propagate it there), while the
trajectory itself always continues from detached tensors so graphs never chain across steps.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from . import flow_sde, savings

# on_grad_step(k, idx (n,), v_with_graph (n, *S), x_k (n, *S), x_next (n, *S)) -> None
GradStepHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def sample_trajectories(policy, cond: dict[str, torch.Tensor], x0: torch.Tensor, sigmas: torch.Tensor, *,
                        kernel: dict, generator: torch.Generator | None = None,
                        sde_mask: torch.Tensor | None = None,
                        grad_mask: torch.Tensor | None = None,
                        on_grad_step: GradStepHook | None = None,
                        batch_size: int = 0,
                        share_groups: torch.Tensor | None = None,
                        tail_start: torch.Tensor | None = None, tail_solver: str = "full",
                        tail_steps: int = 0, step_noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sample B trajectories. x0 (B, *S) initial noise; sigmas (T+1,).

    ``sde_mask`` (B, T) bool optionally makes step k of trajectory i deterministic (the ODE step x + dt·v,
    log-prob 0, no noise) where False, e.g. Flash-GRPO's ODE-everywhere-but-one-step rollouts.
    ``batch_size`` > 0 runs every step in chunks of that many trajectories (whole rows), bounding the network's
    activations: the step's noise is still drawn once for the whole batch, so the draws do not change, and
    ``on_grad_step`` is called once per chunk with row indices of the whole batch.
    ``share_groups`` (B,) group ids: rollout savings' shared prefix (``savings.shared_prefix_lengths``): a group
    whose rows share x0 and conditioning runs its deterministic prefix once (exact).
    ``tail_start`` (B,) long with ``tail_solver`` ∈ {euler, heun}: from that step on, the row is carried to σ = 0
    by ``tail_steps`` steps of the solver (``savings.solve_tail``; not exact); its skipped states and velocities
    are recorded as NaN. ``tail_solver="full"`` runs every step.
    ``step_noise`` (B, T, *S): the standard-normal step noise to use instead of drawing it from ``generator`` (the
    same values the generator would give when they were drawn from it, step by step, for the whole batch).
    Returns {"xs": (B, T+1, *S), "velocities": (B, T, *S), "log_probs": (B, T), "noise": (B, T, *S),
    "saved_forwards": int (sample-forwards not run thanks to the shared prefix and the tail, before CFG)}.
    """
    B, T = x0.shape[0], sigmas.shape[0] - 1
    dev = x0.device
    xs = torch.empty(B, T + 1, *x0.shape[1:], device=dev)
    vel = torch.empty(B, T, *x0.shape[1:], device=dev)
    lps = torch.zeros(B, T, device=dev)
    noise = torch.zeros(B, T, *x0.shape[1:], device=dev)
    x = x0.float()
    xs[:, 0] = x
    n = batch_size if 0 < batch_size < B else B
    saved = 0
    rows_all = torch.arange(B, device=dev)
    follower = prefix = leader = None
    if share_groups is not None:
        ff = savings.first_free_steps(T, sde_mask, grad_mask, stochastic_kernel=kernel.get("sde_type") != "ode",
                                      batch=B, device=dev)
        prefix, leader = savings.shared_prefix_lengths(share_groups, ff, x0, cond)
        follower = leader != rows_all
        saved += savings.prefix_forwards_saved(prefix, leader)
    tail = None
    if tail_start is not None and tail_solver != "full":
        if tail_solver not in savings.TAIL_SOLVERS:
            raise ValueError(f"tail_solver must be one of {savings.TAIL_SOLVERS}, got {tail_solver!r}")
        tail = tail_start.to(dev).long()
        if grad_mask is not None:
            late = grad_mask.to(dev) & (torch.arange(T, device=dev) >= tail.unsqueeze(1))
            if bool(late.any()):
                raise ValueError("a grad-carrying step lies in the cheap tail; tail_start must follow it")
    for k in range(T):
        inactive = torch.zeros(B, dtype=torch.bool, device=dev)
        if follower is not None:
            inactive |= follower & (prefix > k)
        if tail is not None:
            inactive |= tail <= k
        eps = None if step_noise is None else step_noise[:, k]  # (B, *S) given, or drawn from the generator
        if not bool(inactive.any()):
            x = _run_step(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, n,
                          eps, vel[:, k], lps[:, k], noise[:, k])
        else:
            x = _run_partial(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, n,
                             inactive, vel, lps, noise, eps)
            if follower is not None:
                f = (follower & (prefix > k)).nonzero().flatten()
                if len(f):
                    x[f] = x[leader[f]]
                    vel[f, k] = vel[leader[f], k]
        xs[:, k + 1] = x
    if tail is not None:
        saved += _run_tail(policy, cond, xs, vel, sigmas, tail, tail_solver, tail_steps)
    return {"xs": xs, "velocities": vel, "log_probs": lps, "noise": noise, "saved_forwards": saved}


def _run_step(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, n: int,
              eps, vel_k, lps_k, noise_k) -> torch.Tensor:
    """Step k of every row of ``x`` (m, *S), in chunks of ``n`` rows; records into vel_k (m, *S), lps_k (m,),
    noise_k (m, *S) → x_{k+1} (m, *S). ``eps`` (m, *S): the step's noise, drawn here when None."""
    m = x.shape[0]
    n = n if 0 < n < m else m
    x_next = None if n == m else torch.empty_like(x)
    for lo in range(0, m, n):
        rows = slice(lo, min(lo + n, m))
        # the whole batch's noise, drawn after the first chunk's forward (where the unchunked loop draws it)
        eps, x_rows = _step_chunk(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask,
                                  on_grad_step, rows, m, eps, vel_k, lps_k, noise_k)
        if n == m:
            x_next = x_rows
        else:
            x_next[rows] = x_rows
    return x_next


def _run_partial(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, n: int,
                 inactive: torch.Tensor, vel, lps, noise, eps: torch.Tensor | None = None) -> torch.Tensor:
    """Step k of the rows not ``inactive`` (B,) bool; inactive rows keep x and get zero records (a shared-prefix
    follower's are filled from its leader by the caller, a tail row's are NaN). The whole batch's noise is drawn
    as in the full step, so the stream does not change → x_{k+1} (B, *S)."""
    act = (~inactive).nonzero().flatten()  # (a,)
    if eps is None:
        eps = torch.randn(x.shape, generator=generator, device=x.device)  # (B, *S) the full step's draw
    x_next = x.clone()
    vel[inactive, k] = float("nan")
    lps[inactive, k] = 0.0
    noise[inactive, k] = 0.0
    if len(act) == 0:
        return x_next
    def sub(t):
        return None if t is None else t[act]
    hook = None
    if on_grad_step is not None:
        def hook(kk, idx, v, xk, xn):
            return on_grad_step(kk, act[idx], v, xk, xn)
    v_k = torch.empty_like(x[act])
    l_k = torch.zeros(len(act), device=x.device)
    z_k = torch.zeros_like(x[act])
    x_next[act] = _run_step(policy, {name: t[act] for name, t in cond.items()}, x[act], sigmas, k, kernel,
                            generator, sub(sde_mask), sub(grad_mask), hook, n, eps[act], v_k, l_k, z_k)
    vel[act, k], lps[act, k], noise[act, k] = v_k, l_k, z_k
    return x_next


def _run_tail(policy, cond, xs, vel, sigmas, tail: torch.Tensor, solver: str, steps: int) -> int:
    """Carry every row from xs[i, tail_i] to σ = 0 with the cheap tail; fills xs[:, T], NaN between → saved
    sample-forwards (T − tail_i per row minus the tail's calls)."""
    T = sigmas.shape[0] - 1
    saved = 0
    for s in tail.unique().tolist():
        if s >= T:
            continue
        r = (tail == s).nonzero().flatten()
        c = {name: t[r] for name, t in cond.items()}
        with torch.no_grad():
            x_end, calls = savings.solve_tail(lambda xx, sig, c=c: policy.velocity(xx, sig, c).float(), xs[r, s],
                                              savings.tail_grid(sigmas, s, steps), solver)
        xs[r, s + 1:T] = float("nan")
        xs[r, T] = x_end
        saved += (T - s) * len(r) - calls
    return saved


def _step_chunk(policy, cond, x_all, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, rows: slice,
                B: int, eps_all, vel_k, lps_k, noise_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k of trajectories ``rows``: forwards, the kernel, the records (into the step's vel_k (B, *S),
    lps_k (B,), noise_k (B, *S)) → (the step's (B, *S) noise, x_{k+1} of the rows)."""
    whole = rows.start == 0 and rows.stop == B
    x = x_all if whole else x_all[rows]
    c = cond if whole else {name: t[rows] for name, t in cond.items()}
    m = x.shape[0]
    sig = sigmas[k].expand(m)
    g_idx = grad_mask[rows, k].nonzero().flatten() if grad_mask is not None else None
    v_graph = None
    if g_idx is not None and len(g_idx) > 0:
        with torch.enable_grad():
            v_graph = policy.velocity(x[g_idx], sig[g_idx], {n: t[g_idx] for n, t in c.items()})
        if len(g_idx) < m:
            rest = torch.ones(m, dtype=torch.bool, device=x.device)
            rest[g_idx] = False
            r_idx = rest.nonzero().flatten()
            with torch.no_grad():
                v_rest = policy.velocity(x[r_idx], sig[r_idx], {n: t[r_idx] for n, t in c.items()})
            v = torch.empty_like(x)
            v[g_idx] = v_graph.detach()
            v[r_idx] = v_rest
        else:
            v = v_graph.detach()
    else:
        with torch.no_grad():
            v = policy.velocity(x, sig, c)
    if eps_all is None:
        eps_all = torch.randn(x_all.shape, generator=generator, device=x_all.device)
    eps = eps_all if whole else eps_all[rows]
    with torch.no_grad():
        out = flow_sde.step(v, sigmas[k], sigmas[k + 1], x, noise=eps, **kernel)
    stoch_b = out.std > 0  # (m,)
    x_next = out.prev_sample.detach()
    if sde_mask is not None:
        stoch_b = stoch_b & sde_mask[rows, k]
        ode = flow_sde.step(v, sigmas[k], sigmas[k + 1], x, sde_type="ode").prev_sample
        x_next = torch.where(stoch_b.reshape(-1, *([1] * (x.dim() - 1))), x_next, ode)
    stochastic = stoch_b.reshape(-1, *([1] * (x.dim() - 1)))
    noise_k[rows] = torch.where(stochastic, eps, torch.zeros_like(eps))
    vel_k[rows] = v
    lps_k[rows] = torch.where(stoch_b, out.log_prob, torch.zeros_like(out.log_prob))
    if v_graph is not None and on_grad_step is not None:
        on_grad_step(k, g_idx + rows.start, v_graph, x[g_idx], x_next[g_idx])
    return eps_all, x_next
