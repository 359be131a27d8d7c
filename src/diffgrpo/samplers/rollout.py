"""Trajectory sampling with the shared step function: the data every engine trains on.

Runs T steps of ``flow_sde.step`` from the initial noise and records, per step, the state x_k, the (guided)
velocity v_k, the log-prob of the taken transition and the standard-normal noise injected. Network calls
run without grad unless a step appears in ``grad_mask``; then the velocity of those samples is computed with
grad and handed to ``on_grad_step`` (recompute-free engines keep or back-propagate it there), while the
trajectory itself always continues from detached tensors so graphs never chain across steps.
"""
from __future__ import annotations

from typing import Callable

import torch

from . import flow_sde

# on_grad_step(k, idx (n,), v_with_graph (n, *S), x_k (n, *S), x_next (n, *S)) -> None
GradStepHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def sample_trajectories(policy, cond: dict[str, torch.Tensor], x0: torch.Tensor, sigmas: torch.Tensor, *,
                        kernel: dict, generator: torch.Generator | None = None,
                        sde_mask: torch.Tensor | None = None,
                        grad_mask: torch.Tensor | None = None,
                        on_grad_step: GradStepHook | None = None,
                        batch_size: int = 0, step_noise: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Sample B trajectories. x0 (B, *S) initial noise; sigmas (T+1,).

    ``sde_mask`` (B, T) bool optionally makes step k of trajectory i deterministic (the ODE step x + dt·v,
    log-prob 0, no noise) where False, e.g. Flash-GRPO's ODE-everywhere-but-one-step rollouts.
    ``batch_size`` > 0 runs every step in chunks of that many trajectories (whole rows), bounding the network's
    activations: the step's noise is still drawn once for the whole batch, so the draws do not change, and
    ``on_grad_step`` is called once per chunk with row indices of the whole batch.
    ``step_noise`` (B, T, *S): the standard-normal step noise to use instead of drawing it from ``generator`` (the
    same values the generator would give when they were drawn from it, step by step, for the whole batch).
    Returns {"xs": (B, T+1, *S), "velocities": (B, T, *S), "log_probs": (B, T), "noise": (B, T, *S)}.
    """
    B, T = x0.shape[0], sigmas.shape[0] - 1
    xs = torch.empty(B, T + 1, *x0.shape[1:], device=x0.device)
    vel = torch.empty(B, T, *x0.shape[1:], device=x0.device)
    lps = torch.zeros(B, T, device=x0.device)
    noise = torch.zeros(B, T, *x0.shape[1:], device=x0.device)
    x = x0.float()
    xs[:, 0] = x
    n = batch_size if 0 < batch_size < B else B
    for k in range(T):
        eps, x_next = (None if step_noise is None else step_noise[:, k]), (None if n == B else torch.empty_like(x))
        for lo in range(0, B, n):
            rows = slice(lo, min(lo + n, B))
            # the whole batch's noise, drawn after the first chunk's forward (where the unchunked loop draws it)
            eps, x_rows = _step_chunk(policy, cond, x, sigmas, k, kernel, generator, sde_mask, grad_mask,
                                      on_grad_step, rows, B, eps, vel, lps, noise)
            if n == B:
                x_next = x_rows
            else:
                x_next[rows] = x_rows
        x = x_next
        xs[:, k + 1] = x
    return {"xs": xs, "velocities": vel, "log_probs": lps, "noise": noise}


def _step_chunk(policy, cond, x_all, sigmas, k, kernel, generator, sde_mask, grad_mask, on_grad_step, rows: slice,
                B: int, eps_all, vel, lps, noise) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k of trajectories ``rows``: forwards, the kernel, the records → (the step's (B, *S) noise,
    x_{k+1} of the rows)."""
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
    noise[rows, k] = torch.where(stochastic, eps, torch.zeros_like(eps))
    vel[rows, k] = v
    lps[rows, k] = torch.where(stoch_b, out.log_prob, torch.zeros_like(out.log_prob))
    if v_graph is not None and on_grad_step is not None:
        on_grad_step(k, g_idx + rows.start, v_graph, x[g_idx], x_next[g_idx])
    return eps_all, x_next
