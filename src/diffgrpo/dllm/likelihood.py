"""Per-token log-likelihood estimators for masked diffusion LMs.

A masked diffusion LM has no tractable sequence likelihood; GRPO on it uses an estimate of the per-token
log-prob of the completion y built from M forwards on partially masked copies of the sequence:

    logp_j ≈ Σ_m w_mj · log p_θ(y_j | x^(m)),   x^(m) = the sequence with the positions in mask m replaced by <mask>

An estimator is a pair of tensors drawn ONCE per rollout (so old, reference and current policies are scored
with identical masks; nothing re-seeds a global RNG):

    masks   (B, M, P+L) bool  True where forward m masks the position (prompt positions included)
    weights (B, M, L)   float per-forward scoring weight of each completion token (0 where not masked)

Estimators (each a small pure function taking a ``torch.Generator``):

  mean_field   (d1 / diffu-GRPO)  M = 1: the whole completion masked, each prompt token masked with
               probability p_mask_prompt; w = 1. One forward.
  coupled      (DiffuCoder)       M = 2: t ~ U(0.2, 0.8), completion tokens masked with probability t in the
               first forward and the complement in the second, so each token is scored exactly once; w = 1.
  random_mask  (UniGRPO-style)    M = m: ratios t_m ~ U(t_min, 1), tokens masked with probability t_m;
               w_mj = 1[masked] / (t_m · M), the ELBO weighting (E[w_mj] = 1 per token and forward average).
  stratified   (SML; the extension point for a K-forward estimator): K strata, forward k masks stratum k.

:func:`token_log_probs` evaluates any of them with one batched forward of B·M sequences.
"""
from __future__ import annotations

import torch


def mean_field(B: int, P: int, L: int, *, p_mask_prompt: float = 0.0, generator: torch.Generator | None = None,
               device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """→ masks (B, 1, P+L), weights (B, 1, L)."""
    prompt = torch.rand(B, 1, P, generator=generator, device=device) < p_mask_prompt
    masks = torch.cat([prompt, torch.ones(B, 1, L, dtype=torch.bool, device=device)], -1)
    return masks, torch.ones(B, 1, L, device=device)


def coupled(B: int, P: int, L: int, *, t_min: float = 0.2, t_max: float = 0.8,
            generator: torch.Generator | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Complementary pair: → masks (B, 2, P+L), weights (B, 2, L); every completion token masked exactly once."""
    t = t_min + (t_max - t_min) * torch.rand(B, 1, generator=generator, device=device)  # (B, 1)
    m1 = torch.rand(B, L, generator=generator, device=device) < t  # (B, L)
    comp = torch.stack([m1, ~m1], 1)  # (B, 2, L)
    masks = torch.cat([torch.zeros(B, 2, P, dtype=torch.bool, device=device), comp], -1)
    return masks, comp.float()


def random_mask(B: int, P: int, L: int, *, num_samples: int = 2, t_min: float = 0.05,
                generator: torch.Generator | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """m = num_samples random ratios per completion, ELBO-weighted: → masks (B, m, P+L), weights (B, m, L)."""
    t = t_min + (1 - t_min) * torch.rand(B, num_samples, 1, generator=generator, device=device)  # (B, m, 1)
    comp = torch.rand(B, num_samples, L, generator=generator, device=device) < t  # (B, m, L)
    masks = torch.cat([torch.zeros(B, num_samples, P, dtype=torch.bool, device=device), comp], -1)
    return masks, comp.float() / (t * num_samples)


def stratified(B: int, P: int, L: int, *, strata: torch.Tensor, num_strata: int,
               chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward k masks stratum k (``chain``: strata k..K−1) and scores stratum k.

    strata (B, L) long in [0, K) assigns each completion token a stratum. → masks (B, K, P+L), weights (B, K, L).
    K = 1 is the mean field with p_mask_prompt = 0.
    """
    k = torch.arange(num_strata, device=strata.device).view(1, -1, 1)  # (1, K, 1)
    s = strata.unsqueeze(1)  # (B, 1, L)
    score = s == k  # (B, K, L)
    comp = (s >= k) if chain else score
    masks = torch.cat([torch.zeros(B, num_strata, P, dtype=torch.bool, device=strata.device), comp], -1)
    return masks, score.float()


ESTIMATORS = {"mean_field": mean_field, "coupled": coupled, "random_mask": random_mask}


def apply_masks(input_ids: torch.Tensor, masks: torch.Tensor, mask_id: int) -> torch.Tensor:
    """input_ids (B, P+L), masks (B, M, P+L) → masked copies (B·M, P+L) (row b·M + m is forward m of b)."""
    B, M, N = masks.shape
    x = input_ids.unsqueeze(1).expand(B, M, N)
    return torch.where(masks, torch.full_like(x, mask_id), x).reshape(B * M, N)


def token_log_probs(logits_fn, input_ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor,
                    mask_id: int, temperature: float = 1.0) -> torch.Tensor:
    """Σ_m w_mj · log p(y_j | x^(m)) for the completion tokens. → (B, L) float32.

    input_ids (B, P+L) the full sequences; masks (B, M, P+L); weights (B, M, L). One forward of B·M rows.
    p = softmax(logits / temperature): the distribution the rollout sampled from (temperature ≤ 0 → 1).
    Differentiable through ``logits_fn`` (call under no_grad for old/reference values).
    """
    B, M, N = masks.shape
    L = weights.shape[-1]
    logits = logits_fn(apply_masks(input_ids, masks, mask_id))[:, N - L:].float()  # (B·M, L, V)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    y = input_ids[:, N - L:].unsqueeze(1).expand(B, M, L).reshape(B * M, L, 1)
    lp = torch.log_softmax(logits, -1).gather(-1, y).squeeze(-1).view(B, M, L)  # (B, M, L)
    return (lp * weights).sum(1)


__all__ = ["ESTIMATORS", "mean_field", "coupled", "random_mask", "stratified", "apply_masks", "token_log_probs"]
