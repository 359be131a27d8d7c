"""GARDO (He et al., arXiv 2512.24138): gated and adaptive regularisation with diversity-aware optimisation.

What is here, and how it acts:

* **Diversity-aware amplification** (wired: an advantage map). Each sample's diversity is its cosine distance to
  its nearest other member of the group in a feature space, d_i = min_{j≠i} (1 − cos(f_i, f_j)), normalised within
  the group, d̂_i = d_i / max_g d (0 for a group of identical samples). A sample that is both good and diverse gets
  its advantage amplified, A'_i = A_i·(1 + λ·d̂_i) where A_i > 0; other advantages are unchanged (λ =
  ``diversity.gardo_amplify``). A group of identical samples is left exactly as it was.
* **Gated regularisation** (wired: a per-sample KL weight, ``diversity.gardo_gate`` = q, any ``diversity.method``).
  The KL term β·KL_ik of sample i is kept where its uncertainty u_i is at or above the q-quantile of the batch's
  valid samples and dropped elsewhere: g_i = 1[u_i ≥ Q_q(u)] multiplies every engine's per-(sample, step) KL term
  (:func:`kl_gate_weights`, carried as ``GRPOWeights.kl_weights``; the quantile over every rank's samples, or over
  one wave's when the batch is rolled out in waves). The uncertainty proxy is |A_i|, the magnitude of the sample's
  group-relative advantage (its within-group reward z-score under ``advantage.std_mode=group``): the reward is
  trusted least where a sample stands furthest from its group. q = 0: no weight at all, today's term bit for bit.
  No extra forward.
* **The adaptive reference's clock** (:func:`refresh_due`, ``diversity.gardo_ref_every``).

Cost: one feature extraction per training sample (the guards' feature space: the digit classifier's penultimate
features for the built-in task, CLIP features for real models), O(n²·D) per group of n; no extra network forward
of the policy, no backward.

Sources: the paper's abstract (its section and equation numbers could not be read from this machine: the stored
arXiv page gives its opening only) and the released trainer, tinnerhrhe/GARDO@1cc77fb3
(``flow_grpo/stat_tracking.py:PerPromptStatTracker.update``, ``type='gardo'``;
``scripts/train_sd3_grpo_gardo.py:main`` and ``RiskCompensator``), re-derived in tests/test_diversity_reference.py.
Where this differs from the released code:

* Diversity features: DINOv3 ViT-L/16 (timm ``vit_large_patch16_dinov3``) there; the run's guard features here.
  The distance d_i is the same (nearest other member's 1 − cos; max |Δ| 1e-7 on identical features).
* Normaliser and strength: the release multiplies A_i ≥ 0 by d_i / mean_g(d) (mean over the whole group, so a
  below-average-diversity good sample is damped); here by 1 + λ·d_i / max_g(d), which never damps. The release is
  ``amplify(A, d/mean_g(d) − 1, 1)`` in this module's terms (tested to 9e-8).
* Advantage: the release shapes the mean-centred reward r_i − r̄_g without any std division; here the map acts on
  the run's advantages (``advantage.std_mode``).
* A group of coincident samples: left unchanged here; the release's d/mean_g(d) is 0/0 there.
* Gate's uncertainty: the release ranks the whole gathered batch by the trained reward and by two auxiliary reward
  models (aesthetic, ImageReward; rank 1 = best) and takes u_i = rank_main − mean(rank_aux); it keeps the KL where
  u_i > the (100 − 100·b)-th percentile of the u ≥ 0, b adapted each iteration (start 0.1, ×1.1 or ×0.9 when the mean
  u leaves the range of the last 20, clipped to [0.02, 0.2]). Here no auxiliary reward is assumed: u = |A_i|, q
  fixed (q ↔ 1 − b), and a sample exactly at the threshold is kept (≥ against the release's >).
* Gated KL's scale: the release averages the KL over the gated samples of each micro-batch (its scale does not
  shrink with the share kept); here gated-out samples weigh 0 in the loss's usual aggregation over samples, so the
  KL term shrinks by about the share kept (loss.beta / (1 − q) restores the release's scale).
"""
from __future__ import annotations

import torch

from .groups import group_members, nearest_neighbour_distance
from .part import Part


def normalised_diversity(feats: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """d̂ (B,) in [0, 1]: each sample's nearest-neighbour cosine distance over its group's largest one (0 when the
    group's samples coincide). feats (B, D), group_ids (B,)."""
    d = nearest_neighbour_distance(feats, group_ids)  # (B,)
    out = torch.zeros_like(d)
    for rows in group_members(group_ids):
        rows = rows.to(d.device)
        top = d[rows].max()
        if top > 0:
            out[rows] = d[rows] / top
    return out


def amplify(adv: torch.Tensor, diversity: torch.Tensor, strength: float) -> torch.Tensor:
    """A' = A·(1 + λ·d̂) where A > 0, A elsewhere. adv (B,), diversity d̂ (B,) → (B,)."""
    return torch.where(adv > 0, adv * (1 + strength * diversity.to(adv.device)), adv)


def uncertainty_gate(uncertainty: torch.Tensor, quantile: float, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The samples the gated KL term regularises: uncertainty at or above its ``quantile`` (linear interpolation,
    ``torch.quantile``) over the ``valid`` samples (quantile 0: every sample; invalid ones: never when gating).
    uncertainty (B,), valid (B,) bool → (B,) bool."""
    if quantile <= 0:
        return torch.ones_like(uncertainty, dtype=torch.bool)
    u = uncertainty.float()
    ok = torch.ones_like(u, dtype=torch.bool) if valid is None else valid.to(u.device).bool()
    if not bool(ok.any()):
        return torch.zeros_like(ok)
    return ok & (u >= torch.quantile(u[ok], quantile))


def kl_gate_weights(advantages: torch.Tensor, valid: torch.Tensor, quantile: float) -> torch.Tensor:
    """GARDO's gated regularisation as per-sample KL weights: 1 for the samples whose uncertainty — here the
    magnitude |A_i| of the group-relative advantage, the within-group reward z-score under ``std_mode=group``
    (the reward is least trusted where a sample stands furthest from its group) — is at or above ``quantile`` of
    the batch's valid samples, 0 elsewhere. advantages (B,), valid (B,) bool → (B,) float32."""
    return uncertainty_gate(advantages.detach().abs(), quantile, valid).float()


def refresh_due(iteration: int, every: int) -> bool:
    """Whether the adaptive reference is reset to the online policy after ``iteration`` (1-based) updates."""
    return every > 0 and iteration > 0 and iteration % every == 0


def objective(knobs, feats: torch.Tensor, rewards: torch.Tensor, group_ids: torch.Tensor) -> Part:
    """GARDO's wired part from the ``diversity`` section: the amplification map and its statistics."""
    d = normalised_diversity(feats, group_ids)  # (B,)
    lam = float(knobs.gardo_amplify)

    def adjust(adv: torch.Tensor) -> torch.Tensor:
        return amplify(adv, d, lam)

    return Part(adjust=adjust, stats={"diversity/gardo_diversity_mean": float(d.mean()) if len(d) else 0.0})
