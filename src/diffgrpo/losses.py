"""GRPO step loss: PPO-clip surrogate plus β·KL, and the one aggregation that owns all normalisation.

For trajectory i and selected step k, with r = exp(ℓ_θ − ℓ_old):
    L_ik = max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·KL_ik
The total loss is Σ_ik w_ik·L_ik with w = :func:`aggregation_weights` (computed once per rollout). Engines
back-propagate partial sums of this in any chunking they like; none of them rescales on its own, so every
engine optimises exactly the same objective.
"""
from __future__ import annotations

import torch

AGGREGATIONS = ("mean", "sample_mean", "sum")


def ppo_clip_loss(
    log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-element clipped surrogate. All inputs (N,) → (loss (N,), ratio (N,), clipped (N,) bool).

    ``clipped`` marks elements whose ratio lies outside [1−ε, 1+ε] (FlowGRPO's ``clipfrac``).
    """
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    loss = torch.maximum(unclipped, clipped_loss)
    clipped = (ratio - 1.0).abs() > clip_range
    return loss, ratio, clipped


def aggregation_weights(
    selected: torch.Tensor, mode: str = "mean", sample_weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Weights w (B, T) so that the total loss is Σ w_ik·L_ik over the selected (i, k).

    selected (B, T) bool; sample_weights (B,) optional per-trajectory multipliers (e.g. Flash-GRPO's
    rectification), applied after normalisation.
      "mean"         every selected (i, k) weighs 1/N (FlowGRPO / DanceGRPO: mean over batch and steps)
      "sample_mean"  mean over each trajectory's steps, then over trajectories with ≥ 1 selected step
      "sum"          weight 1
    """
    sel = selected.float()
    if mode == "mean":
        w = sel / sel.sum().clamp(min=1)
    elif mode == "sample_mean":
        per = sel.sum(1, keepdim=True)  # (B, 1)
        n_traj = (per > 0).float().sum().clamp(min=1)
        w = sel / per.clamp(min=1) / n_traj
    elif mode == "sum":
        w = sel
    else:
        raise ValueError(f"loss aggregation must be one of {AGGREGATIONS}, got {mode!r}")
    if sample_weights is not None:
        w = w * sample_weights.reshape(-1, 1).float()
    return w


def aggregate(per_step_loss: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ w·L over matching shapes (any), the only place losses are combined."""
    return (per_step_loss * weights).sum()
