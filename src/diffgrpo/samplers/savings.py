"""Rollout savings: fewer network forwards for the same trained transitions.

- **Shared prefix** (Flow-GRPO-Fast / TreeGRPO / BranchGRPO): the G samples of a group share their initial noise
  and prompt, so until the group's first stochastic (or grad-carrying) step they follow the *same* deterministic
  ODE path. That prefix of k steps runs once per group: k + G·(T − k) sample-forwards instead of G·T. Exact: every
  recorded tensor equals the unshared computation with the same initial noise (the SDE noise stream is drawn as
  before, whole batch per step).
- **Sliding SDE window** (MixGRPO): SDE kernel and training on a window of ``size`` consecutive steps, ODE
  elsewhere; the window starts at ``start`` and moves ``stride`` steps every ``every`` iterations, rolling back to
  the start past the last trainable step (MixGRPO's "progressive" schedule with ``roll_back``) or staying there.
- **Cheap deterministic tail**: after a sample's last stochastic (or trained) step the ODE only carries it to
  x₀ for the reward. The tail may run on a coarser sub-grid of the remaining σ's with Euler or Heun (second
  order; DPM-Solver-2-like for the straight-line flow) steps. Not exact: the decoded sample and so the reward
  change (the bias is measured against the full tail, see ``benchmarks/rollout_tail_bias.py``); the trained
  transitions are untouched. Tail states that are not computed are recorded as NaN (no engine reads them: they
  are neither stochastic nor trained).

Pure torch; no config objects.
"""
from __future__ import annotations

import torch

TAIL_SOLVERS = ("full", "euler", "heun")


# ---------------------------------------------------------------------- shared prefix
def first_free_steps(T: int, sde_mask: torch.Tensor | None, grad_mask: torch.Tensor | None, *,
                     stochastic_kernel: bool, batch: int, device=None) -> torch.Tensor:
    """(B,) long: each row's first step that is stochastic or carries grad (T when none).

    The final step (into σ = 0) is deterministic for every kernel. Without ``sde_mask`` every step but the last is
    stochastic unless the kernel is ``ode``.
    """
    free = torch.zeros(batch, T, dtype=torch.bool, device=device)
    if stochastic_kernel:
        free[:, :T - 1] = True if sde_mask is None else sde_mask[:, :T - 1].to(device)
    if grad_mask is not None:
        free |= grad_mask.to(device)
    idx = torch.arange(T, device=device).expand(batch, T)
    return torch.where(free, idx, torch.full_like(idx, T)).min(1).values


def shared_prefix_lengths(group_ids: torch.Tensor, first_free: torch.Tensor, x0: torch.Tensor,
                          cond: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, the steps its group computes once, and the row that computes them.

    group_ids (B,); first_free (B,) from :func:`first_free_steps`; x0 (B, *S); cond {name: (B, …)}.
    A group shares min over its rows of ``first_free`` steps when every row has the leader's x0 and conditioning
    (else 0). → (prefix (B,) long, leader (B,) long index of the group's first row).
    """
    B = group_ids.shape[0]
    dev = first_free.device
    g = group_ids.to(dev)
    prefix = torch.zeros(B, dtype=torch.long, device=dev)
    leader = torch.arange(B, device=dev)
    for gid in g.unique().tolist():
        rows = (g == gid).nonzero().flatten()
        lead = int(rows[0])
        leader[rows] = lead
        same = bool((x0[rows] == x0[lead]).all()) and all(
            bool((t[rows.to(t.device)] == t[lead]).all()) for t in cond.values())
        if same and len(rows) > 1:
            prefix[rows] = first_free[rows].min()
    return prefix, leader


def prefix_forwards_saved(prefix: torch.Tensor, leader: torch.Tensor) -> int:
    """Sample-forwards a shared prefix saves: Σ over groups of (G − 1)·k = G·T − (k + G·(T − k))."""
    followers = leader != torch.arange(len(leader), device=leader.device)
    return int(prefix[followers].sum())


# ---------------------------------------------------------------------- sliding SDE window (MixGRPO)
def sliding_window_start(iteration: int, *, start: int, size: int, k_max: int, every: int, stride: int,
                         roll_back: bool = True) -> int:
    """First step of the window at ``iteration`` (0-based): ``start`` + stride·⌊iteration / every⌋; once the window
    would pass the ``k_max`` trainable steps it rolls back to ``start`` (or holds at the last position, k_max − size),
    as MixGRPO's progressive schedule does."""
    size = min(size, k_max)
    last = k_max - size
    start = min(start, last)
    if every <= 0:
        return start
    j = iteration // every  # shifts so far
    if not roll_back:
        return min(start + stride * j, last)
    positions = (last - start) // stride + 1  # start, start + stride, … ≤ last, then back to start
    return start + stride * (j % positions)


def window_selection(batch: int, T: int, start: int, size: int, device=None) -> torch.Tensor:
    """(B, T) bool: steps start … start+size−1 (clipped to the trainable steps 0 … T−2)."""
    sel = torch.zeros(batch, T, dtype=torch.bool, device=device)
    sel[:, start:min(start + size, T - 1)] = True
    return sel


# ---------------------------------------------------------------------- cheap deterministic tail
def tail_starts(T: int, sde_mask: torch.Tensor | None, keep: torch.Tensor | None, *, stochastic_kernel: bool,
                batch: int, device=None) -> torch.Tensor:
    """(B,) long: the first step after each row's last stochastic or kept (trained) step (0 when none)."""
    busy = torch.zeros(batch, T, dtype=torch.bool, device=device)
    if stochastic_kernel:
        busy[:, :T - 1] = True if sde_mask is None else sde_mask[:, :T - 1].to(device)
    if keep is not None:
        busy |= keep.to(device)
    idx = torch.arange(1, T + 1, device=device).expand(batch, T)
    return torch.where(busy, idx, torch.zeros_like(idx)).max(1).values


def tail_grid(sigmas: torch.Tensor, start: int, steps: int) -> torch.Tensor:
    """σ sub-grid from sigmas[start] to sigmas[-1] = 0 with ``steps`` intervals, taken on the original grid points
    (evenly spaced in index); all remaining points when ``steps`` ≥ their count. sigmas (T+1,) → (n+1,)."""
    T = sigmas.shape[0] - 1
    remaining = T - start
    if remaining <= 0:
        return sigmas[T:]
    n = min(steps, remaining)
    idx = torch.linspace(start, T, n + 1).round().long()
    return sigmas[idx.to(sigmas.device)]


def solve_tail(velocity, x: torch.Tensor, sub: torch.Tensor, solver: str) -> tuple[torch.Tensor, int]:
    """Carry x (n, *S) along the σ sub-grid ``sub`` (m+1,) to sub[-1] with ``solver`` ∈ {euler, heun}.

    ``velocity(x, sigma (n,)) -> v (n, *S)``. Heun: x' = x + dt·(v(x, σ) + v(x̃, σ'))/2 with the Euler predictor
    x̃ (the step into σ' = 0 stays Euler, as in diffusers' Heun scheduler). → (x at sub[-1], forward calls × n).
    """
    n = x.shape[0]
    calls = 0
    for j in range(sub.shape[0] - 1):
        s, s_next = sub[j], sub[j + 1]
        dt = s_next - s
        v = velocity(x, s.expand(n))
        calls += 1
        x_pred = x + dt * v
        if solver == "heun" and float(s_next) > 0:
            v2 = velocity(x_pred, s_next.expand(n))
            calls += 1
            x = x + dt * (v + v2) / 2
        elif solver in ("euler", "heun"):
            x = x_pred
        else:
            raise ValueError(f"tail solver must be one of {TAIL_SOLVERS[1:]}, got {solver!r}")
    return x, calls * n


__all__ = ["TAIL_SOLVERS", "first_free_steps", "shared_prefix_lengths", "prefix_forwards_saved",
           "sliding_window_start", "window_selection", "tail_starts", "tail_grid", "solve_tail"]
