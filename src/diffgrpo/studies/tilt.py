"""The diversity the KL-regularised optimum keeps at a given reward: the line a pure reward-against-KL trade moves along.

Estimator: for max_π E_π[r] − β·KL(π‖p₀) the optimum is the base policy tilted by its reward,
    p*_β(x | c) ∝ p₀(x | c) · exp(r(x, c) / β)
(the Gibbs variational principle; DPO, Rafailov et al. 2023, eq. 4), and among all policies with E_π[r] = t it is
the one nearest p₀ in KL. On n base samples per prompt it is estimated by self-normalised weights
w_i = softmax(r_i / β) within each prompt, with one β for every prompt (the KL-regularised objective has one), found
by bisection so that the mean over prompts of Σ w_i r_i equals t. Its per-prompt diversity is the expected L2
distance between two distinct samples drawn by w,
    D_w = Σ_{i≠j} w_i w_j ‖f_i − f_j‖ / (1 − Σ_i w_i²),
which at β = ∞ (uniform w) is the guards' per-prompt diversity (``feature_stats.per_prompt_diversity``) exactly.

Exactness: consistent as n grows; with few effective samples (1 / Σ w² per prompt, reported) the tilted
distribution's estimate is noisy and biased towards the base's best samples. Cost: no forward beyond the n base
samples per prompt and their features.
"""
from __future__ import annotations

import math

import torch

from ..feature_stats import per_prompt_diversity, prompt_groups


def tilt_weights(r: torch.Tensor, inv_beta: float) -> torch.Tensor:
    """r (n,) rewards of one prompt's samples → w (n,) float64 ∝ exp(r / β), summing to 1 (inv_beta = 1 / β ≥ 0)."""
    return torch.softmax(r.double() * inv_beta, dim=0)


def weighted_spread(f: torch.Tensor, w: torch.Tensor) -> float:
    """f (n, D) features, w (n,) weights summing to 1 → the expected L2 distance between two distinct draws by w."""
    f, w = f.double(), w.double()
    d = torch.cdist(f, f)  # (n, n), 0 on the diagonal
    return float(w @ d @ w / (1 - (w * w).sum()))


def tilted_reward(rewards: torch.Tensor, groups: list[torch.Tensor], inv_beta: float) -> float:
    """Mean over prompts of the tilted mean reward Σ w_i r_i. rewards (N,); groups: each prompt's sample indices."""
    return sum(float(tilt_weights(rewards[g], inv_beta) @ rewards[g].double()) for g in groups) / len(groups)


def solve_inv_beta(rewards: torch.Tensor, groups: list[torch.Tensor], target: float, *, tol: float = 1e-7
                   ) -> float | None:
    """1 / β with tilted reward = ``target`` (bisection; the tilted reward rises with 1 / β): 0 when the base
    already reaches it, None when even the best sample of every prompt (β → 0) does not."""
    if tilted_reward(rewards, groups, 0.0) >= target:
        return 0.0
    if sum(float(rewards[g].max()) for g in groups) / len(groups) <= target:
        return None
    lo, hi = 0.0, 1.0
    while tilted_reward(rewards, groups, hi) < target:
        lo, hi = hi, hi * 2
    while hi - lo > tol * max(1.0, hi):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tilted_reward(rewards, groups, mid) < target else (lo, mid)
    return hi


def tilted_point(feats: torch.Tensor, rewards: torch.Tensor, prompts: list[str], target: float) -> dict:
    """The KL-optimal policy at mean reward ``target`` on these base samples: feats (N, D), rewards (N,), prompts (N,)
    → {target, inv_beta, reward, diversity, diversity_ratio (÷ the base's), kl (nats, mean over prompts),
    ess_min, ess_mean}; ``inv_beta`` None (and the rest NaN) when the target is out of the samples' reach."""
    groups = [torch.tensor(idx) for idx in prompt_groups(prompts)]
    base = per_prompt_diversity(feats, prompts)
    inv_beta = solve_inv_beta(rewards, groups, target)
    if inv_beta is None:
        nan = float("nan")
        return dict(target=target, inv_beta=None, reward=nan, diversity=nan, diversity_ratio=nan, kl=nan,
                    ess_min=nan, ess_mean=nan)
    ws = [tilt_weights(rewards[g], inv_beta) for g in groups]
    spread = sum(weighted_spread(feats[g], w) for g, w in zip(groups, ws)) / len(groups)
    ess = [float(1 / (w * w).sum()) for w in ws]
    kl = sum(float((w * torch.log(w.clamp_min(1e-300) * len(w))).sum()) for w in ws) / len(ws)
    return dict(target=target, inv_beta=inv_beta, reward=tilted_reward(rewards, groups, inv_beta), diversity=spread,
                diversity_ratio=spread / base if base > 0 else math.nan, kl=kl, ess_min=min(ess),
                ess_mean=sum(ess) / len(ess))


__all__ = ["solve_inv_beta", "tilt_weights", "tilted_point", "tilted_reward", "weighted_spread"]
