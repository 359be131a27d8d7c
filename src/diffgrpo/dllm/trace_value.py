"""TraceRL's value model, the math (``dllm.trace_value``): returns and GAE advantages over a trajectory's decoding
steps, and the clipped value regression.

A trajectory of S distinct decoding steps (those committing a trained token, in order; rank i = 0 … S−1) has token
values V_j (the value network at token j in the state its step saw, :mod:`.trace_critic`), step values
V*_i = mean_{j ∈ step i} V_j, and one reward: the sequence's (group-normalised) reward r on every token of its last
step (r_j = r there, 0 elsewhere; r*_i the step mean of r_j). With γ the discount and λ the GAE weight:

    R*_i = r*_i + γ R*_{i+1}                δ*_i = r*_i − V*_i + γ V*_{i+1}        A*_i = δ*_i + γλ A*_{i+1}
    R_j  = r_j + γ R*_{i+1}                 A_j  = r_j − V_j + γ V*_{i+1} + γλ A*_{i+1}      (j in step i)

(terms past the last step are 0). With γ = λ = 1: R_j = r and A_j = r − V_j; with λ = 0: A_j = r_j − V_j + γ V*_{i+1}.
The value network regresses R_j with PPO's clipped value loss, per token

    ½ · max((V − R)², (V_old + clip(V − V_old, −ε, ε) − R)²)

with V_old the values at the rollout. Exact: these are the stated recursions, no estimate; cost O(B·(L + S)).

Differences from the released code (Gen-Verse/dLLM-RL, ``train/train_sdar_value.py``
``compute_returns_and_advantages_from_fragments`` and its value ``forward_process``): the same recursions and token
map (``tests/test_trace_value.py`` checks them against a re-derivation on identical tensors), vectorised over the
batch; the released trains only on groups whose accuracy lies in [0.2, 0.8] (its reward script's filter), here
every group the trainer keeps; it divides the value loss by (rows · L) as its policy loss, here the token mean.
"""
from __future__ import annotations

import torch


def step_ranks(commit_step: torch.Tensor, trained: torch.Tensor) -> tuple[torch.Tensor, int]:
    """commit_step (B, L) long (−1: never committed), trained (B, L) bool → (rank (B, L) long: the rank of each
    trained token's step among the row's distinct trained steps, −1 elsewhere; S_max: columns of a per-step table)."""
    on = trained & (commit_step >= 0)  # (B, L)
    B = commit_step.shape[0]
    S = max(1, int(commit_step.max()) + 1)
    cs = commit_step.clamp_min(0)
    present = torch.zeros(B, S, device=cs.device).scatter_add_(1, cs, on.float()) > 0  # (B, S) a trained step
    rank = (present.long().cumsum(1) - 1).gather(1, cs)  # (B, L)
    return torch.where(on, rank, torch.full_like(rank, -1)), S


def per_step_mean(x: torch.Tensor, rank: torch.Tensor, S: int) -> torch.Tensor:
    """Mean of x (B, L) over the tokens of each step rank (−1: left out) → (B, S + 1), 0 for empty ranks (the
    extra column is the 0 past the last step)."""
    on = (rank >= 0).to(x.dtype)
    idx = rank.clamp_min(0)
    tot = torch.zeros(x.shape[0], S + 1, dtype=x.dtype, device=x.device).scatter_add_(1, idx, x * on)
    cnt = torch.zeros_like(tot).scatter_add_(1, idx, on)
    return tot / cnt.clamp_min(1)


def returns_and_advantages(commit_step: torch.Tensor, trained: torch.Tensor, values: torch.Tensor,
                           reward: torch.Tensor, gamma: float = 1.0, lam: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's R_j and A_j. commit_step (B, L) long, trained (B, L) bool, values (B, L) V_j, reward (B,)
    → (returns (B, L), advantages (B, L)), 0 on tokens not trained."""
    rank, S = step_ranks(commit_step, trained)
    on = rank >= 0  # (B, L)
    last = rank.max(1, keepdim=True).values  # (B, 1) the last trained step
    r_tok = torch.where(on & (rank == last), reward.to(values.dtype).unsqueeze(1), torch.zeros_like(values))
    r_s, v_s = per_step_mean(r_tok, rank, S), per_step_mean(values, rank, S)  # (B, S + 1)
    R_s, A_s = torch.zeros_like(r_s), torch.zeros_like(r_s)
    for i in range(S - 1, -1, -1):  # backward over step ranks; column S stays 0
        R_s[:, i] = r_s[:, i] + gamma * R_s[:, i + 1]
        A_s[:, i] = r_s[:, i] - v_s[:, i] + gamma * v_s[:, i + 1] + gamma * lam * A_s[:, i + 1]
    nxt = (rank + 1).clamp_min(0)  # (B, L) the next step's column
    R = r_tok + gamma * R_s.gather(1, nxt)
    A = r_tok - values + gamma * v_s.gather(1, nxt) + gamma * lam * A_s.gather(1, nxt)
    zero = torch.zeros_like(values)
    return torch.where(on, R, zero), torch.where(on, A, zero)


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float) -> torch.Tensor:
    """Per-token ½·max((V − R)², (V_old + clip(V − V_old, ±ε) − R)²); all (n, L) → (n, L)."""
    v_clip = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns) ** 2, (v_clip - returns) ** 2)


__all__ = ["clipped_value_loss", "per_step_mean", "returns_and_advantages", "step_ranks"]
