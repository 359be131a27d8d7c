"""Within-group geometry of sample features, shared by the diversity objectives: cosine distances of a group's
samples and their per-group reductions. Pure torch; every group is whole on the calling rank."""
from __future__ import annotations

import torch

ROUND_OFF = 1e-5  # cosine distances below this are float32 round-off of equal directions


def unit_rows(feats: torch.Tensor) -> torch.Tensor:
    """feats (B, D) → (B, D) float32 rows of unit length (a zero row stays zero)."""
    f = feats.detach().float()
    return f / f.norm(dim=1, keepdim=True).clamp(min=1e-12)


def cosine_distances(feats: torch.Tensor) -> torch.Tensor:
    """feats (n, D) → (n, n) pairwise cosine distances 1 − cos, clamped to [0, 2], zero diagonal; a distance below
    ``ROUND_OFF`` (float32 round-off of 1 − cos for equal directions) is 0, so identical samples are at distance 0."""
    u = unit_rows(feats)
    d = (1 - u @ u.T).clamp(0, 2)
    d = torch.where(d < ROUND_OFF, torch.zeros_like(d), d)
    return d.fill_diagonal_(0)


def group_members(group_ids: torch.Tensor) -> list[torch.Tensor]:
    """group_ids (B,) → the row indices (n_g,) of each group, in order of first appearance."""
    ids = group_ids.detach().cpu()
    return [(ids == g).nonzero().flatten() for g in dict.fromkeys(ids.tolist())]


def nearest_neighbour_distance(feats: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each sample's cosine distance to its nearest other member of its group (0 for a group of one).
    feats (B, D), group_ids (B,) → (B,) float32."""
    out = torch.zeros(feats.shape[0], device=feats.device)
    for rows in group_members(group_ids):
        rows = rows.to(feats.device)
        if len(rows) < 2:
            continue
        d = cosine_distances(feats[rows])  # (n, n)
        d = d + torch.diag(torch.full((len(rows),), float("inf"), device=d.device))
        out[rows] = d.min(1).values
    return out


def mean_pairwise_distance(d: torch.Tensor) -> torch.Tensor:
    """The mean cosine distance over the distinct pairs of a group, d (n, n) → () (0 for n < 2)."""
    n = d.shape[0]
    if n < 2:
        return torch.zeros((), device=d.device)
    return d.sum() / (n * (n - 1))
