"""DiverseGRPO (Liu et al., arXiv 2512.21514, CVPR 2026): a distribution-level exploration bonus from clustering a
group's samples, and a regulariser concentrated on the early, high-noise steps.

* **Cluster bonus** (wired: a reward bonus). The samples of a group are clustered in a feature space: two samples
  are linked when their cosine distance is below τ (``diversity.cluster_threshold``) and a cluster is a connected
  component of that graph (single linkage). Sample i in cluster C(i) gets the bonus b_i = λ / |C(i)| (λ =
  ``diversity.cluster_bonus``), added to its reward before the group-relative advantages: a sample in a rare mode
  gains against one in a crowded mode. A group of identical samples (one cluster of n) and a group of mutually
  distant samples (n singletons) each get a constant bonus, so their advantages are unchanged.
* **Early-step weights** (wired: a per-step KL weight, ``diversity.step_weight_power`` = p, any
  ``diversity.method``): the KL term of grid step k is weighted by s_k = σ_k^p / mean_j σ_j^p (:func:`early_step_weights`,
  mean 1 over the T steps), so the regulariser concentrates on the early, high-noise steps; the forward-process
  engines weigh a unit at grid time σ_k alike. Every engine multiplies its per-(sample, step) KL term by it
  (``engines.base.kl_weights``). p = 0: no weight, today's term bit for bit. No extra forward.

Cost: one feature extraction per training sample (the guards' feature space), O(n²·D) per group; no policy forward.

Sources: the paper's abstract (arXiv 2512.21514v1; the stored page gives its opening only, so its section and
equation numbers could not be read here): spectral clustering of the samples of one caption, exploratory rewards
allocated by cluster size, and a structure-aware regulariser with stronger constraints on the early denoising
steps. A third-party summary (papernotes, CVPR 2026) adds: the bonus is inversely proportional to cluster size and
the regulariser a Wasserstein-type constraint on the early steps only, in place of a uniform KL. No released code
was found (repository names "DiverseGRPO", "diverse-grpo"; code and issue search); by that summary only a project
page is public. Where this differs:

* Clustering: threshold single linkage on cosine distance (deterministic, no cluster count, no eigensolver) instead
  of spectral clustering; the paper's affinity and cluster count are not known here.
* Features: the run's guard features instead of the paper's semantic image features.
* Bonus: λ/|C(i)| added to the reward before the group advantages; the paper's exact allocation and scale are not
  known here.
* Regulariser: the run's own KL term reweighted by σ_k^p (mean 1) over every step instead of a Wasserstein-type
  constraint on the early steps only; a large p approaches early-only.
"""
from __future__ import annotations

import torch

from .groups import cosine_distances, group_members
from .part import Part


def threshold_clusters(d: torch.Tensor, threshold: float) -> torch.Tensor:
    """Connected components of the graph linking pairs closer than ``threshold``. d (n, n) distances → labels (n,)
    long, numbered 0, 1, … in order of each cluster's first member."""
    n = d.shape[0]
    labels = torch.full((n,), -1, dtype=torch.long)
    adj = (d < threshold).cpu()
    nxt = 0
    for i in range(n):
        if labels[i] >= 0:
            continue
        frontier = [i]
        labels[i] = nxt
        while frontier:
            j = frontier.pop()
            for k in adj[j].nonzero().flatten().tolist():
                if labels[k] < 0:
                    labels[k] = nxt
                    frontier.append(k)
        nxt += 1
    return labels


def cluster_sizes(feats: torch.Tensor, group_ids: torch.Tensor, threshold: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's cluster size within its group and the number of clusters of each group.
    feats (B, D), group_ids (B,) → (sizes (B,) float32, clusters (G,) long)."""
    sizes = torch.zeros(feats.shape[0], device=feats.device)
    counts = []
    for rows in group_members(group_ids):
        rows = rows.to(feats.device)
        labels = threshold_clusters(cosine_distances(feats[rows]), threshold)  # (n,)
        per = torch.bincount(labels).float()  # (clusters,)
        sizes[rows] = per[labels].to(sizes.device)
        counts.append(len(per))
    return sizes, torch.tensor(counts, dtype=torch.long)


def cluster_bonus(sizes: torch.Tensor, strength: float) -> torch.Tensor:
    """b = λ / |C(i)|. sizes (B,) → (B,)."""
    return strength / sizes.clamp(min=1)


def early_step_weights(sigmas: torch.Tensor, power: float = 1.0) -> torch.Tensor:
    """KL weights of the T steps growing with the noise level, w_k ∝ σ_k^p, mean 1. sigmas (T+1,) → (T,)."""
    w = sigmas[:-1].float().clamp(min=0) ** power
    return w / w.mean().clamp(min=1e-12)


def objective(knobs, feats: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor) -> Part:
    """DiverseGRPO's wired part from the ``diversity`` section: the cluster bonus and its statistics."""
    sizes, clusters = cluster_sizes(feats, group_ids, float(knobs.cluster_threshold))
    bonus = cluster_bonus(sizes, float(knobs.cluster_bonus)).to(rewards.device)
    return Part(bonus=bonus, stats={"diversity/cluster_bonus_mean": float(bonus.mean()) if len(bonus) else 0.0,
                                    "diversity/clusters_per_group": float(clusters.float().mean())
                                    if len(clusters) else 0.0})
