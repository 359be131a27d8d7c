"""GRPO step loss: PPO-clip surrogate plus β·KL, and the one aggregation that owns all normalisation.

For trajectory i and selected step k, with r = exp(ℓ_θ − ℓ_old):
    L_ik = max(−A_i·r, −A_i·clip(r, 1−ε, 1+ε)) + β·KL_ik
The total loss is Σ_ik w_ik·L_ik with w = :func:`aggregation_weights` (computed once per rollout). Engines
back-propagate partial sums of this in any chunking they like; none of them rescales on its own, so every
engine optimises exactly the same objective.

Trust-region options (:func:`policy_loss`, default off): Flow-DPPO's exact per-step Gaussian KL mask in place of the
clip (``loss.trust_region=kl_mask``) and GRPO-Guard's ratio normalisation (``loss.ratio_norm``).
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


# ---------------------------------------------------------------------- trust-region options of the step loss
TRUST_REGIONS = ("clip", "kl_mask")


def gaussian_step_kl(mean: torch.Tensor, old_mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean"
                     ) -> torch.Tensor:
    """Exact KL(N(μ_old, s²I) ‖ N(μ_θ, s²I)) = reduce((μ_θ − μ_old)²) / (2s²) of two equal-covariance Gaussian step
    policies. mean, old_mean (n, *S), std (n,) → (n,). ``reduce`` is the log-prob's reduction (``mean``: the KL
    divided by the number of elements, matching a mean-reduced log-density; ``sum``: the KL itself)."""
    sq = (mean - old_mean) ** 2
    dims = tuple(range(1, sq.dim()))
    red = sq.mean(dims) if reduce == "mean" else sq.sum(dims)
    return red / (2 * std ** 2)


def kl_mask_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, kl: torch.Tensor,
                 bound: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-DPPO's divergence trust region in place of ratio clipping. All (n,) → (loss, ratio, masked bool).

    L = −A·r unless the step both left the trust region (KL ≥ bound, the exact per-step Gaussian KL to the rollout
    policy) and moves further away in the advantage's direction (r > 1 with A > 0, or r < 1 with A < 0); then its
    loss and gradient are 0. Steps inside the region, and corrective steps outside it, pass unclipped."""
    ratio = torch.exp(log_prob - old_log_prob)
    away = ((ratio > 1) & (advantages > 0)) | ((ratio < 1) & (advantages < 0))
    masked = (kl.detach() >= bound) & away
    loss = torch.where(masked, torch.zeros_like(ratio), -advantages * ratio)
    return loss, ratio, masked


def normalized_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, kl: torch.Tensor, std: torch.Tensor
                         ) -> torch.Tensor:
    """GRPO-Guard's RatioNorm: (ℓ_θ − ℓ_old + KL)·s. All (n,) → (n,).

    For a step sampled from the old Gaussian, ℓ_θ − ℓ_old = ε·(μ_θ − μ_old)/s − |μ_θ − μ_old|²/(2s²) (reduced):
    its mean is −KL (the left shift that keeps positive-advantage ratios out of the clip range) and its spread
    scales as 1/s (inconsistent across steps). Adding the exact KL centres it; multiplying by s makes the spread
    |μ_θ − μ_old| alone, the same scale at every step. r̃ = exp of this replaces r in the clipped surrogate."""
    return (log_prob - old_log_prob + kl) * std


def policy_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor, clip_range: float, *,
                trust_region: str = "clip", ratio_norm: bool = False, kl: torch.Tensor | None = None,
                std: torch.Tensor | None = None, kl_bound: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-step policy term, all options in one place. (n,) inputs → (loss, ratio, clipped-or-masked bool).

    ``trust_region="clip"`` without ``ratio_norm`` is :func:`ppo_clip_loss` unchanged (the default). ``ratio_norm``:
    the clipped surrogate on GRPO-Guard's normalised ratio (needs ``kl`` and ``std``). ``trust_region="kl_mask"``:
    Flow-DPPO's KL mask at ``kl_bound`` (needs ``kl``) in place of clipping."""
    if trust_region not in TRUST_REGIONS:
        raise ValueError(f"trust_region must be one of {TRUST_REGIONS}, got {trust_region!r}")
    if ratio_norm and trust_region != "clip":
        raise ValueError("ratio_norm normalises the ratio the PPO clip acts on; it needs trust_region='clip'")
    if trust_region == "clip" and not ratio_norm:
        return ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range)
    if kl is None:
        raise ValueError(f"trust_region={trust_region!r} / ratio_norm need the per-step KL")
    if trust_region == "kl_mask":
        return kl_mask_loss(log_prob, old_log_prob, advantages, kl, kl_bound)
    if std is None:
        raise ValueError("ratio_norm needs the step std")
    return ppo_clip_loss(old_log_prob + normalized_log_ratio(log_prob, old_log_prob, kl, std), old_log_prob,
                         advantages, clip_range)
