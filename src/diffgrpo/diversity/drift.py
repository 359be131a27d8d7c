"""DRIFT (Liu et al., arXiv 2601.12401): a reward-concentrated subset of each group and potential-based shaping of
intra-group diversity.

* **Reward-concentrated subset** (wired: a training subset). Of each group of n samples with finite rewards, the
  m = max(2, round(ρ·n)) whose rewards lie closest to the group's median (for an even count the midpoint of the
  middle pair) are kept (ρ = ``diversity.drift_subset``; ties in the order of the samples); the others — the
  reward outliers at either end — leave the group statistics and the loss. ρ = 1 keeps every sample.
* **Diversity shaping** (wired: a reward bonus). The group's potential is its mean pairwise cosine distance
  Φ(G) = mean_{i≠j} d_ij in a feature space; sample i's shaping term is its marginal contribution to it,
  s_i = λ·(Φ(G) − Φ(G∖{i})) (λ = ``diversity.drift_shaping``), added to its reward. A sample that makes the group
  more diverse gains, a near-duplicate loses. Closed forms: a group of identical samples, or of mutually equidistant
  ones, gets s ≡ 0.

Cost: one feature extraction per training sample (the guards' feature space), O(n²·D) per group; no policy forward.

Sources: the paper's abstract (arXiv 2601.12401v1; the stored page gives its opening only, so its section and
equation numbers could not be read here): a reward-concentrated subset that filters out reward outliers, stochastic
prompt variations, and potential-based shaping of intra-group diversity. A third-party summary (arxivlens) names
the prompt variations as annealed noise on the prompt embeddings. No released code was found (repository names
with "DRIFT" and the authors'; code search). Where this differs:

* Subset: nearest the group's median, m = max(2, round(ρ·n)); the paper's selection rule is not known here.
* Potential: the mean pairwise cosine distance in the run's guard features; the paper's diversity measure and
  features are not known here. The shaping is the leave-one-out difference Φ(G) − Φ(G∖{i}) (a potential
  difference with γ = 1), added to the reward before the group advantages.
* Prompt variations: left out (they change the sampler's conditioning, not the objective).
"""
from __future__ import annotations

import torch

from .groups import cosine_distances, group_members, mean_pairwise_distance
from .part import Part


def concentrated_subset(rewards: torch.Tensor, group_ids: torch.Tensor, fraction: float) -> torch.Tensor:
    """Per group, the m = max(2, round(fraction·n)) finite rewards nearest the group's median (n: finite ones; the
    midpoint of the middle pair for even n).
    rewards (B,), group_ids (B,) → (B,) bool (non-finite rewards: False)."""
    r = rewards.detach().float()
    keep = torch.zeros(len(r), dtype=torch.bool, device=r.device)
    for rows in group_members(group_ids):
        rows = rows.to(r.device)
        rows = rows[torch.isfinite(r[rows])]
        n = len(rows)
        m = min(n, max(2, round(fraction * n)))
        if n == 0:
            continue
        gap = (r[rows] - torch.quantile(r[rows], 0.5)).abs()  # the midpoint median (torch.median: the lower one)
        order = torch.sort(gap, stable=True).indices[:m]
        keep[rows[order]] = True
    return keep


def marginal_diversity(d: torch.Tensor) -> torch.Tensor:
    """Φ(G) − Φ(G∖{i}) for each member i. d (n, n) distances → (n,) (zeros for n < 3: a pair has no subgroup)."""
    n = d.shape[0]
    if n < 3:
        return torch.zeros(n, device=d.device)
    total = d.sum()
    # Φ(G∖{i}) = (Σ d − 2·Σ_j d_ij) / ((n−1)(n−2))
    without = (total - 2 * d.sum(1)) / ((n - 1) * (n - 2))
    return mean_pairwise_distance(d) - without


def diversity_shaping(feats: torch.Tensor, group_ids: torch.Tensor, strength: float) -> torch.Tensor:
    """s = λ·(Φ(G) − Φ(G∖{i})) for every sample. feats (B, D), group_ids (B,) → (B,)."""
    out = torch.zeros(feats.shape[0], device=feats.device)
    for rows in group_members(group_ids):
        rows = rows.to(feats.device)
        out[rows] = strength * marginal_diversity(cosine_distances(feats[rows]))
    return out


def objective(knobs, feats: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor) -> Part:
    """DRIFT's wired part from the ``diversity`` section: the subset, the shaping bonus and their statistics."""
    subset = concentrated_subset(rewards, group_ids, float(knobs.drift_subset))
    shaping = diversity_shaping(feats, group_ids, float(knobs.drift_shaping)).to(rewards.device)
    return Part(bonus=shaping, subset=subset,
                stats={"diversity/drift_shaping_mean": float(shaping.abs().mean()) if len(shaping) else 0.0,
                       "diversity/drift_subset_frac": float(subset.float().mean()) if len(subset) else 0.0})
