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
  coupled      (DiffuCoder paper) M = 2: t ~ U(0.2, 0.8), completion tokens masked with probability t in the
               first forward and the complement in the second, so each token is scored exactly once; w = 1.
  coupled_released (DiffuCoder's released trainer) M = 3: the whole completion masked, plus the pair above;
               w = ½ on the full mask, ½/t and ½/(1−t) on the pair (each token: the mean of a full-mask term and
               its 1/t- or 1/(1−t)-weighted pair term).
  random_mask  (UniGRPO-style)    M = m: ratios t_m ~ U(t_min, 1), tokens masked with probability t_m;
               w_mj = 1[masked] / (t_m · M), the ELBO weighting (E[w_mj] = 1 per token and forward average).
  stratified   (SML; the extension point for a K-forward estimator): K strata, forward k masks stratum k.
  SPG's block-wise masks live with its objective in :mod:`diffgrpo.dllm.spg`.

Stratified Masking Likelihood (DACA-GRPO's SML) as a plug-in on ANY of the estimators above
(:func:`stratify`): the valid completion tokens are split into K strata (:func:`assign_strata`: random
balanced, interleaved, or by decode order) and every base forward m is refined into K forwards; forward (k, m)
masks only the stratum-k part of m's masked completion tokens (``leave_one_out``; ``chain``: strata k..K−1),
keeps m's prompt mask, and scores stratum k with m's weights. Each token is thus scored by exactly one group
k with the same total weight as in the base estimator, but sees the other strata as context. K = 1 is the base
estimator exactly; on the mean field, K strata are the paper's SML (K forwards); K = L with leave_one_out is
the pseudo-likelihood, K = L with chain and a random partition is a one-order sample of the exact
any-order log-likelihood (:func:`any_order_log_likelihood`), and K = L with chain and the ``decode_order``
partition on the mean field is the sampler's own path log-likelihood (every token scored in the context it was
committed in; equal to the sampler's recorded step log-probs when each step commits one token). The default,
K = 2 chain by decode order, scores the half decoded first as the mean field does and the rest given that half:
on the built-in tasks its GRPO gradient tracks the path's far better than leave_one_out with random strata
(benchmarks/results/daca/fidelity_*.md), which trained markedly worse on sudoku and json_schema. Cost K·M
forwards.

:func:`token_log_probs` evaluates any of them with one batched forward of B·M sequences.
"""
from __future__ import annotations

import math

import torch

from ..samplers import masked


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, L) ids → (B, L) bool: the tokens an estimator scores, up to and including the first <eos> (all if there
    is none)."""
    is_eos = completions == eos_id
    before = torch.cumsum(is_eos.long(), 1) - is_eos.long()  # number of eos strictly before j
    return before == 0


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


def coupled_released(B: int, P: int, L: int, *, t_min: float = 0.2, t_max: float = 0.8,
                     generator: torch.Generator | None = None, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """DiffuCoder's released estimator: → masks (B, 3, P+L), weights (B, 3, L).

    Forward 0 masks the whole completion, forwards 1 and 2 are the complementary pair of :func:`coupled`
    (t ~ U(t_min, t_max) per row, m ~ Bernoulli(t) per token). Per token

        ℓ_j = ½ · [ log p(y_j | x^full) + m_j · log p(y_j | x^(1)) / t + (1 − m_j) · log p(y_j | x^(2)) / (1 − t) ]

    (the average of the full-mask term and the 1/t, 1/(1−t)-weighted pair term, as DiffuCoder's trainer combines
    them). Its trainer draws one t per micro-batch; here t is drawn per row (same law per sample)."""
    t = t_min + (t_max - t_min) * torch.rand(B, 1, generator=generator, device=device)  # (B, 1)
    m1 = torch.rand(B, L, generator=generator, device=device) < t  # (B, L)
    comp = torch.stack([torch.ones_like(m1), m1, ~m1], 1)  # (B, 3, L)
    masks = torch.cat([torch.zeros(B, 3, P, dtype=torch.bool, device=device), comp], -1)
    w = torch.stack([torch.ones(B, L, device=device), m1.float() / t, (~m1).float() / (1 - t)], 1) / 2  # (B, 3, L)
    return masks, w


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


SML_PARTITIONS = ("random", "interleaved", "decode_order")
SML_MODES = ("leave_one_out", "chain")


def assign_strata(valid: torch.Tensor, num_strata: int, partition: str = "random", *,
                  order: torch.Tensor | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Stratum of every completion token among the valid ones. valid (B, L) bool → strata (B, L) long,
    −1 where not valid.

    With r_j the rank of valid token j among the row's n valid tokens (by a uniform random key for
    ``random``, by position for ``interleaved``, by decode order for ``decode_order``; ``order`` (B, L) is the
    sampler's commit order of positions):
      random, decode_order  stratum = ⌊r_j·K / n⌋  (balanced contiguous blocks of the ranking; decode_order:
                            stratum 0 = decoded first, so ``chain`` conditions on earlier-decoded strata)
      interleaved           stratum = r_j mod K
    Only ``random`` draws from ``generator``."""
    B, L = valid.shape
    dev = valid.device
    if partition == "random":
        key = torch.rand(B, L, generator=generator, device=dev)
    elif partition == "interleaved":
        key = torch.arange(L, device=dev, dtype=torch.float32).expand(B, L)
    elif partition == "decode_order":
        if order is None:
            raise ValueError("decode_order partition needs the sampler's decode order")
        key = torch.empty(B, L, device=dev)
        key.scatter_(1, order, torch.arange(L, device=dev, dtype=torch.float32).expand(B, L).contiguous())
    else:
        raise ValueError(f"sml partition must be one of {SML_PARTITIONS}, got {partition!r}")
    key = torch.where(valid, key, torch.full_like(key, float("inf")))
    rank = torch.argsort(torch.argsort(key, 1), 1)  # (B, L) rank of each position by key
    n = valid.sum(1, keepdim=True).clamp_min(1)  # (B, 1)
    st = rank % num_strata if partition == "interleaved" else torch.div(rank * num_strata, n, rounding_mode="floor")
    return torch.where(valid, st, torch.full_like(st, -1))


def stratify(masks: torch.Tensor, weights: torch.Tensor, strata: torch.Tensor, num_strata: int, *,
             chain: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Refine base masks into SML groups. masks (B, M, P+L), weights (B, M, L), strata (B, L) long (−1 = not
    stratified: keeps the base mask in every group and is scored in group 0) → (B, K·M, P+L), (B, K·M, L),
    row k·M + m being base forward m restricted to stratum k (``chain``: strata ≥ k). K = 1 returns the base
    tensors' values exactly."""
    B, M, N = masks.shape
    L = weights.shape[-1]
    K = num_strata
    k = torch.arange(K, device=strata.device).view(1, K, 1, 1)  # (1, K, 1, 1)
    s = strata.view(B, 1, 1, L)
    free = s < 0
    scored = (s == k) | (free & (k == 0))  # (B, K, 1, L)
    keep = ((s >= k) if chain else (s == k)) | free  # completion positions that group k may mask
    comp = masks[..., N - L:].unsqueeze(1) & keep  # (B, K, M, L)
    prompt = masks[..., : N - L].unsqueeze(1).expand(B, K, M, N - L)
    out_m = torch.cat([prompt, comp], -1).reshape(B, K * M, N)
    w = weights.unsqueeze(1).expand(B, K, M, L)
    out_w = torch.where(scored, w, torch.zeros_like(w)).reshape(B, K * M, L)
    return out_m, out_w


def any_order_log_likelihood(logits_fn, ids: torch.Tensor, L: int, mask_id: int) -> torch.Tensor:
    """Exact any-order log-likelihood of the last L tokens of each row (prompt visible), by enumeration.

        log p(y | prompt) := E_σ Σ_j log p(y_σj | prompt, y_σ<j),  σ uniform over the L! decoding orders
                           = Σ_{U ⊊ [L]} Σ_{j ∉ U} |U|!(L−|U|−1)!/L! · log p(y_j | prompt, y_U)

    (the probability that a uniform order reveals exactly U before j is |U|!(L−|U|−1)!/L!). One forward per
    subset U of revealed tokens: 2^L forwards per row, so only for tiny L. ids (B, P+L) → (B,),
    differentiable through ``logits_fn``."""
    B, N = ids.shape
    subsets = torch.tensor([[(u >> j) & 1 for j in range(L)] for u in range(2 ** L)], dtype=torch.bool,
                           device=ids.device)  # (2^L, L) True = revealed
    size = subsets.sum(1)  # (2^L,)
    coef = torch.tensor([math.factorial(int(u)) * math.factorial(L - int(u) - 1) / math.factorial(L)
                         if u < L else 0.0 for u in size], device=ids.device)  # (2^L,)
    masks = torch.cat([torch.zeros(2 ** L, N - L, dtype=torch.bool, device=ids.device), ~subsets], -1)
    w = (~subsets).float() * coef.unsqueeze(1)  # (2^L, L): weight of log p(y_j | y_U) for j ∉ U
    S = 2 ** L
    lp = token_log_probs(logits_fn, ids, masks.unsqueeze(0).expand(B, S, N), w.unsqueeze(0).expand(B, S, L),
                         mask_id)  # (B, L)
    return lp.sum(1)


ESTIMATORS = {"mean_field": mean_field, "coupled": coupled, "coupled_released": coupled_released,
              "random_mask": random_mask}


def apply_masks(input_ids: torch.Tensor, masks: torch.Tensor, mask_id: int) -> torch.Tensor:
    """input_ids (B, P+L), masks (B, M, P+L) → masked copies (B·M, P+L) (row b·M + m is forward m of b)."""
    B, M, N = masks.shape
    x = input_ids.unsqueeze(1).expand(B, M, N)
    return torch.where(masks, torch.full_like(x, mask_id), x).reshape(B * M, N)


def forward_log_probs(logits_fn, input_ids: torch.Tensor, masks: torch.Tensor, L: int, mask_id: int,
                      temperature: float = 1.0) -> torch.Tensor:
    """log p(y_j | x^(m)) of every completion token under every forward. → (B, M, L) float32.

    input_ids (B, P+L) the full sequences; masks (B, M, P+L). One forward of B·M rows.
    p = softmax(logits / temperature) over the real tokens (<mask> excluded): the distribution the rollout
    sampled from (temperature ≤ 0 → 1). Differentiable through ``logits_fn``."""
    B, M, N = masks.shape
    logits = masked.token_logits(logits_fn(apply_masks(input_ids, masks, mask_id))[:, N - L:].float(), mask_id)
    if temperature > 0 and temperature != 1.0:
        logits = logits / temperature
    y = input_ids[:, N - L:].unsqueeze(1).expand(B, M, L).reshape(B * M, L, 1)
    return torch.log_softmax(logits, -1).gather(-1, y).squeeze(-1).view(B, M, L)  # (B, M, L)


def token_log_probs(logits_fn, input_ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor,
                    mask_id: int, temperature: float = 1.0) -> torch.Tensor:
    """Σ_m w_mj · log p(y_j | x^(m)) for the completion tokens. → (B, L) float32.

    input_ids (B, P+L) the full sequences; masks (B, M, P+L); weights (B, M, L). One forward of B·M rows
    (:func:`forward_log_probs`). Differentiable through ``logits_fn`` (call under no_grad for old/reference
    values).
    """
    lp = forward_log_probs(logits_fn, input_ids, masks, weights.shape[-1], mask_id, temperature)  # (B, M, L)
    return (lp * weights).sum(1)


__all__ = ["ESTIMATORS", "SML_MODES", "SML_PARTITIONS", "completion_mask", "mean_field", "coupled", "coupled_released",
           "random_mask", "stratified", "assign_strata", "stratify", "any_order_log_likelihood", "apply_masks",
           "forward_log_probs", "token_log_probs"]
