"""Group-relative advantages (GRPO) and their statistics.

A_i = (r_i − b_i) / (s_i + eps), clipped to ±clip, where for trajectory i in group g:
  baseline  "mean":          b_i = mean of the valid rewards of g
            "leave_one_out": b_i = mean of the other valid rewards of g (RLOO)
  scale     "group": s_i = std of g; "global": s_i = std of every valid reward in the batch; "none": s_i = 1 − eps
  std       "unbiased": the n−1 estimate (torch.std; TRL, FlowGRPO's GRPO code); "population": the n estimate
            (numpy's np.std, the per-prompt stat trackers of FlowGRPO / DiffusionNFT / AWM): advantages larger by
            √(n/(n−1)) (4 samples: ×1.155; 16: ×1.033)
Trajectories whose reward is not usable (``valid`` False: NaN or a failed reward call) get A = 0 and are kept
out of every statistic. Pure torch; no config objects.
"""
from __future__ import annotations

import torch

STD_MODES = ("group", "global", "none")
BASELINES = ("mean", "leave_one_out")
STD_ESTIMATES = ("unbiased", "population")


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    std_mode: str = "group",
    baseline: str = "mean",
    clip: float = 5.0,
    eps: float = 1e-4,
    std: str = "unbiased",
) -> tuple[torch.Tensor, dict[str, float]]:
    """rewards (B,), group_ids (B,) long, valid (B,) bool → advantages (B,) float32 and statistics.

    Statistics: ``frac_reward_zero_std`` (share of groups whose valid rewards are all equal),
    ``adv_clip_frac`` (share of valid trajectories whose advantage hit ±clip), ``num_invalid``.
    """
    if std_mode not in STD_MODES:
        raise ValueError(f"advantage std_mode must be one of {STD_MODES}, got {std_mode!r}")
    if baseline not in BASELINES:
        raise ValueError(f"advantage baseline must be one of {BASELINES}, got {baseline!r}")
    if std not in STD_ESTIMATES:
        raise ValueError(f"advantage std must be one of {STD_ESTIMATES}, got {std!r}")
    ddof = 1 if std == "unbiased" else 0
    r = rewards.detach().float()
    if valid is None:
        valid = torch.isfinite(r)
    valid = valid & torch.isfinite(r)
    r0 = torch.where(valid, r, torch.zeros_like(r))
    w = valid.float()
    groups, inv = torch.unique(group_ids, return_inverse=True)  # inv (B,) in [0, G)
    n_g = torch.zeros(len(groups), device=r.device).index_add_(0, inv, w)  # (G,)
    sum_g = torch.zeros(len(groups), device=r.device).index_add_(0, inv, r0)
    mean_g = sum_g / n_g.clamp(min=1)
    sq_g = torch.zeros(len(groups), device=r.device).index_add_(0, inv, w * (r0 - mean_g[inv]) ** 2)
    # std per group: the n−1 (unbiased, torch.std) or n (population, np.std) estimate
    std_g = torch.sqrt(sq_g / (n_g - ddof).clamp(min=1))
    if baseline == "mean":
        b = mean_g[inv]
    else:
        n_other = (n_g[inv] - 1).clamp(min=1)
        b = (sum_g[inv] - r0) / n_other
    if std_mode == "group":
        scale = std_g[inv]
    elif std_mode == "global":
        scale = r[valid].std(correction=ddof) if int(valid.sum()) > 1 else torch.zeros((), device=r.device)
        scale = scale.expand_as(r)
    else:
        scale = torch.full_like(r, 1 - eps)
    adv = (r0 - b) / (scale + eps)
    clipped = adv.abs() >= clip
    adv = adv.clamp(-clip, clip)
    adv = torch.where(valid & (n_g[inv] > 1), adv, torch.zeros_like(adv))
    zero_std = ((std_g == 0) | (n_g < 2)).float()
    stats = {
        "frac_reward_zero_std": float(zero_std.mean()),
        "adv_clip_frac": float((clipped & valid).float().sum() / w.sum().clamp(min=1)),
        "num_invalid": int((~valid).sum()),
    }
    return adv, stats


def per_reward_advantages(
    components: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    valid: torch.Tensor | None = None,
    std_mode: str = "group",
    baseline: str = "mean",
    clip: float = 5.0,
    eps: float = 1e-4,
    std: str = "unbiased",
) -> tuple[torch.Tensor, dict[str, float]]:
    """GDPO-style decoupled normalisation of a weighted sum of K rewards: each component is normalised within its
    group on its own (``group_advantages`` without clipping), the normalised advantages are summed with the reward
    weights, and the sum is divided by its standard deviation over the batch's valid samples (so its scale does not
    grow with K), then clipped. A component with a much larger spread then no longer drowns the others, and a group
    whose components move in opposite directions keeps both signals.

    components (K, B), weights (K,), group_ids (B,), valid (B,) bool → advantages (B,) float32 and the statistics of
    :func:`group_advantages` (``frac_reward_zero_std``: groups whose weighted total is constant)."""
    r = components.detach().float()
    if valid is None:
        valid = torch.isfinite(r).all(0)
    valid = valid & torch.isfinite(r).all(0)
    total = (weights.float()[:, None] * torch.where(valid, r, torch.zeros_like(r))).sum(0)  # (B,)
    _, stats = group_advantages(torch.where(valid, total, torch.full_like(total, float("nan"))), group_ids,
                                valid=valid, std_mode=std_mode, baseline=baseline, clip=clip, eps=eps, std=std)
    per = torch.stack([group_advantages(r[k], group_ids, valid=valid, std_mode=std_mode, baseline=baseline,
                                        clip=float("inf"), eps=eps, std=std)[0] for k in range(r.shape[0])])  # (K, B)
    adv = (weights.float()[:, None] * per).sum(0)  # (B,), 0 where invalid
    scale = adv[valid].std(correction=int(std == "unbiased")) if int(valid.sum()) > 1 else torch.ones((), device=adv.device)
    adv = adv / (scale + eps)
    clipped = adv.abs() >= clip
    stats["adv_clip_frac"] = float((clipped & valid).float().sum() / valid.float().sum().clamp(min=1))
    return adv.clamp(-clip, clip), stats

