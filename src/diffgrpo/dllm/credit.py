"""Denoising Progress Scores (DPS): per-token credit weights for dLLM GRPO from the sampler's own records.

DACA-GRPO (Denoising-Aware Credit Assignment) weights each completion token's policy-loss term by how hard
the sampler found it, using only what :func:`diffgrpo.samplers.masked.sample` recorded while decoding, so the
weights cost zero extra forwards. Raw score s_j of completion token j (``daca.dps_score``):

  entropy     H_j = −Σ_v p_v log p_v of the predictive distribution at the step j was committed (nats)
  confidence  1 − c_j, c_j = probability of the committed token at commit
  margin      1 − m_j, m_j = top-1 − top-2 probability at commit (m ∈ [0, 1], so 1 − m ∈ [0, 1])
  settling    (t_j + 1) / S, t_j = global commit step, S = number of sampling steps (late-settling tokens weigh more)
  progress    (r_j + 1) / block_length, r_j = within-block commit rank (0 = committed first in its block)

Weights, per completion i over its valid tokens V_i (up to and including the first <eos>):

  1. floor: s ← max(s, 1e-6 · max_{V_i} s, 1e-12) so every score is positive;
  2. normalise + clip: w = clip(c_i · s, lo, hi) with the scale c_i > 0 chosen (bisection in log c) so that
     mean_{V_i} w = 1 — a mean-one weighting that respects [lo, hi] = [dps_clip_min, dps_clip_max]
     (solvable for positive scores whenever lo ≤ 1 ≤ hi);
  3. mix: u = (1 − λ) + λ · w with λ = ``daca.dps_mix`` (convex, so mean 1 and the bounds still hold;
     λ = 0 gives u ≡ 1, the base method bit for bit);
  4. tokens outside V_i get u = 1 (they carry no loss weight); u is detached and multiplies the per-token
     policy term only (not the KL), see :func:`diffgrpo.dllm.grpo.grpo_token_loss`.

Source: DACA-GRPO (Denoising-Aware Credit Assignment for GRPO on diffusion LMs), "Denoising Progress Scores".
"""
from __future__ import annotations

import math

import torch

DPS_SCORES = ("none", "entropy", "confidence", "margin", "settling", "progress")


def raw_scores(name: str, records: dict, *, steps: int, block_length: int) -> torch.Tensor:
    """The raw score s (B, L) float32 of ``name`` from sampler records (commit_step, confidence, entropy, margin,
    block_rank, each (B, L))."""
    if name == "entropy":
        return records["entropy"].float()
    if name == "confidence":
        return 1.0 - records["confidence"].float()
    if name == "margin":
        return 1.0 - records["margin"].float()
    if name == "settling":
        return (records["commit_step"].float() + 1.0) / steps
    if name == "progress":
        return (records["block_rank"].float() + 1.0) / block_length
    raise ValueError(f"daca.dps_score must be one of {DPS_SCORES[1:]}, got {name!r}")


def normalise_clip(scores: torch.Tensor, valid: torch.Tensor, lo: float = 0.2, hi: float = 5.0,
                   iters: int = 80) -> torch.Tensor:
    """Mean-one clipped weights w = clip(c_i·s, lo, hi), mean over valid tokens of each row = 1.

    scores (B, L) ≥ 0, valid (B, L) bool → (B, L) float32 (1 outside ``valid``; rows without valid tokens all 1).
    c_i is found by bisection on log c (mean_valid clip(c·s) is non-decreasing in c)."""
    if not lo <= 1.0 <= hi:
        raise ValueError(f"DPS clip bounds must satisfy lo <= 1 <= hi, got [{lo}, {hi}]")
    s = scores.double().clamp_min(0)
    vf = valid.double()  # (B, L)
    n = vf.sum(1, keepdim=True).clamp_min(1)  # (B, 1)
    smax = (s * vf).amax(1, keepdim=True)  # (B, 1)
    s = torch.maximum(s, (1e-6 * smax).clamp_min(1e-12))  # positive scores
    mean_s = (s * vf).sum(1, keepdim=True) / n  # (B, 1)
    log_c0 = -torch.log(mean_s)
    a, b = log_c0 - 60.0, log_c0 + 60.0  # mean(clip(c·s)) is lo at a and hi at b (s spans < 26 decades)

    def mean_w(log_c):
        return ((s * log_c.exp()).clamp(lo, hi) * vf).sum(1, keepdim=True) / n

    for _ in range(iters):
        mid = (a + b) / 2
        below = mean_w(mid) < 1.0
        a = torch.where(below, mid, a)
        b = torch.where(below, b, mid)
    w = (s * ((a + b) / 2).exp()).clamp(lo, hi)
    # remove the bisection residue without leaving [lo, hi]: rescale only the unclipped tokens
    free = valid & (w > lo) & (w < hi)
    fixed = ((w * vf) * (~free).double()).sum(1, keepdim=True)
    free_sum = (w * free.double()).sum(1, keepdim=True)
    scale = torch.where(free_sum > 0, (n - fixed) / free_sum.clamp_min(1e-300), torch.ones_like(free_sum))
    w = torch.where(free, (w * scale).clamp(lo, hi), w)
    has = valid.any(1, keepdim=True)
    return torch.where(valid & has, w, torch.ones_like(w)).float()


def mix_uniform(w: torch.Tensor, lam: float) -> torch.Tensor:
    """u = (1 − λ) + λ·w (λ = 0 → exactly 1 everywhere). (B, L) → (B, L)."""
    return (1.0 - lam) + lam * w


def dps_weights(records: dict, valid: torch.Tensor, *, score: str, mix: float, clip_min: float = 0.2,
                clip_max: float = 5.0, steps: int, block_length: int) -> torch.Tensor:
    """Detached DPS token weights (B, L) float32; see the module docstring."""
    s = raw_scores(score, records, steps=steps, block_length=block_length)
    w = normalise_clip(s, valid, clip_min, clip_max)
    return mix_uniform(torch.where(valid, w, torch.ones_like(w)), mix).detach()


def weight_stats(w: torch.Tensor, valid: torch.Tensor, top_frac: float = 0.2) -> dict[str, float]:
    """Logged statistics over valid tokens: dps/mean, dps/std, dps/max, dps/top20_share (share of each
    completion's total weight held by its top ``top_frac`` tokens, averaged over completions)."""
    vals = w[valid]
    if vals.numel() == 0:
        return {"dps/mean": 1.0, "dps/std": 0.0, "dps/max": 1.0, "dps/top20_share": top_frac}
    shares = []
    for i in range(w.shape[0]):
        row = w[i][valid[i]]
        if row.numel():
            k = max(1, math.ceil(top_frac * row.numel()))
            shares.append(float(row.topk(k).values.sum() / row.sum()))
    return {"dps/mean": float(vals.mean()), "dps/std": float(vals.std()) if vals.numel() > 1 else 0.0,
            "dps/max": float(vals.max()), "dps/top20_share": sum(shares) / len(shares)}


__all__ = ["DPS_SCORES", "raw_scores", "normalise_clip", "mix_uniform", "dps_weights", "weight_stats"]
