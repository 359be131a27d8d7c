"""SPG — Sandwiched Policy Gradient for masked diffusion LMs (facebookresearch/SPG).

Objective. A ratio-free policy gradient on sequence log-likelihood bounds, with A = r − mean(group) (no std):

    L = −(1 / Σ_i n_i) · Σ_i A_i · ℓ̂_i,   ℓ̂_i = ELBO_i if A_i > 0, else NEG_i

so the update pushes up a LOWER bound of log π(y_i) for rewarded completions and pushes down an UPPER bound for
the others (pushing down a lower bound, as d1 and an ELBO-only method do, can lower the bound without lowering the
likelihood). n_i = valid completion tokens (up to and including the first <eos>); Σ n_i is the token-mean
normaliser of :func:`diffgrpo.losses.aggregation_weights`, so the loss is Σ_ij w_ij·(−A_i·ℓ_ij) with per-token
terms ℓ_ij that sum to the sequence bound.

Normalisation against the released trainer: it normalises per device micro-batch, one group g of completions,
L_released = mean_g (1/T_g) · Σ_{i∈g} A_i·ℓ̂_i (T_g: group g's completion tokens), where the loss here divides the
whole batch by T = Σ_g T_g. Both agree when every group has T/G tokens; otherwise group g's terms here weigh
G·T_g/T times what they weigh there (groups of long completions count more here, short ones more there; measured
in tests/test_user_defects.py). ``loss.aggregation=sample_mean`` is neither: it normalises each sequence by n_i.

Masks (:func:`block_masks`, SPG's ``block_random``): each of M forwards picks one completion block k (a random
permutation of the blocks, reduced modulo the row's number of valid blocks; blocks are reused when M exceeds
them), keeps the blocks before k visible, masks c tokens of block k's valid part (c uniform on
{max(⌊m·t_min⌋, 1), …, min(⌊m·t_max⌋, m)}, m = valid tokens of the block) and masks everything after it, including
the positions after the first <eos>; prompt tokens are masked with probability ``p_mask_prompt`` (SPG masks any
visible token at that rate; here only prompt tokens). t_m = c_m / n with c_m the masked valid tokens of forward m.

Bounds per sequence, from the per-forward token log-probs lp_mj = log p(y_j | x^(m)):

    ELBO  = (1/M) Σ_m (n / c_m) Σ_{j masked in m} lp_mj                           (:func:`elbo_weights`)
    EUBO  = (n / |S|) · Σ_{j ∈ S} (1/β) · log [ (1/M) Σ_m 1[j masked in m] · exp(β·lp_mj) / t_m ]
            S = tokens masked in at least one forward                              (:func:`eubo_terms`)
    NEG   = EUBO (``negative=eubo``), ω·EUBO + (1 − ω)·ELBO (``mix``, SPG's default ω = 0.5), or ELBO (``elbo``)

Exactness. With one block, t_min = 0, t_max = 1, c is uniform on {1, …, n} and E[ELBO] is exactly the any-order
log-likelihood (:func:`diffgrpo.dllm.likelihood.any_order_log_likelihood`: Σ_c E_{|U| = n−c revealed, j masked}
log p(y_j | y_U)); the population EUBO (M → ∞) is ≥ it by Jensen for every β > 0. With finite M the log of an
M-term mean is biased low, so the estimated EUBO is not an upper bound sample by sample (measured in
benchmarks/results/dllm_study/bias.md). Gradients are on-policy only in the first inner epoch (no ratio, no clip).

Cost per update: M forwards with grad and M sample-backwards per completion (M = ``dllm.spg_num_t``, SPG uses 2);
no ℓ_old forwards (nothing uses a ratio), ℓ_ref none (SPG has no KL term).

DACA plug-ins: DPS token weights multiply the per-token terms −A_i·ℓ_ij (meaningful: the bound of a sequence is a
sum of per-token terms). SML is refused for SPG: the EUBO is a per-token log-mean-exp over SPG's own masking
distribution and its bound argument needs that distribution; stratifying each forward changes which conditionals
enter the average and which tokens are masked together.
"""
from __future__ import annotations

import torch

NEGATIVE_MODES = ("mix", "eubo", "elbo")


def block_masks(valid: torch.Tensor, P: int, *, block_length: int, num_t: int = 2, t_min: float = 0.0,
                t_max: float = 1.0, p_mask_prompt: float = 0.0,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """SPG's block-wise random masks. valid (B, L) bool (a prefix of each row) → masks (B, M, P+L) bool."""
    B, L = valid.shape
    dev = valid.device
    M, bl = num_t, block_length
    if L % bl:
        raise ValueError(f"SPG block length {bl} must divide the completion length {L}")
    nb = L // bl
    n = valid.sum(1).clamp_min(1)  # (B,)
    cb = torch.div(n - 1, bl, rounding_mode="floor") + 1  # (B,) blocks holding valid tokens
    perm = torch.argsort(torch.rand(B, nb, generator=generator, device=dev), 1)  # (B, nb) random block order
    m_idx = torch.arange(M, device=dev) % nb  # (M,)
    k = perm[:, m_idx] % cb.unsqueeze(1)  # (B, M) chosen block per forward
    start = k * bl  # (B, M)
    ml = torch.minimum(torch.full_like(start, bl), n.unsqueeze(1) - start)  # (B, M) valid tokens of the block
    lo = torch.clamp(torch.floor(ml * t_min).long(), min=1)
    hi = torch.minimum(torch.floor(ml * t_max).long(), ml)
    hi = torch.maximum(hi, lo)
    c = lo + torch.floor(torch.rand(B, M, generator=generator, device=dev) * (hi - lo + 1)).long()  # (B, M)
    c = torch.minimum(c, hi)
    pos = torch.arange(L, device=dev).view(1, 1, L)  # (1, 1, L)
    s, e = start.unsqueeze(-1), (start + ml).unsqueeze(-1)  # (B, M, 1)
    in_block = (pos >= s) & (pos < e)  # (B, M, L)
    key = torch.where(in_block, torch.rand(B, M, L, generator=generator, device=dev), torch.full((B, M, L), 2.0,
                                                                                             device=dev))
    rank = torch.argsort(torch.argsort(key, -1), -1)  # (B, M, L) rank of each block position by its key
    comp = (in_block & (rank < c.unsqueeze(-1))) | (pos >= e)  # (B, M, L): chosen in block k, all after it
    prompt = torch.rand(B, M, P, generator=generator, device=dev) < p_mask_prompt  # (B, M, P)
    return torch.cat([prompt, comp], -1)


def elbo_weights(masks: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-forward token weights of the ELBO. masks (B, M, P+L), valid (B, L) → (B, M, L):
    w_mj = 1[j valid and masked in m] · n / (c_m · M), so Σ_mj w_mj·lp_mj is the ELBO above."""
    L = valid.shape[1]
    M = masks.shape[1]
    scored = masks[..., -L:] & valid.unsqueeze(1)  # (B, M, L)
    c = scored.sum(-1, keepdim=True).clamp_min(1).float()  # (B, M, 1)
    n = valid.sum(1).view(-1, 1, 1).float()  # (B, 1, 1)
    return scored.float() * n / (c * M)


def eubo_terms(lp: torch.Tensor, masks: torch.Tensor, valid: torch.Tensor, beta: float) -> torch.Tensor:
    """Per-token terms of the EUBO (summing over tokens gives the sequence EUBO above).

    lp (B, M, L) per-forward log-probs, masks (B, M, P+L), valid (B, L) → (B, L) float32 (0 outside S)."""
    _, M, L = lp.shape
    scored = masks[..., -L:] & valid.unsqueeze(1)  # (B, M, L)
    n = valid.sum(1, keepdim=True).float()  # (B, 1)
    t = scored.sum(-1).float().clamp_min(1) / n.clamp_min(1)  # (B, M) empirical mask ratio
    a = beta * lp - torch.log(t).unsqueeze(-1)  # (B, M, L): log(p^β / t)
    a = torch.where(scored, a, torch.full_like(a, float("-inf")))
    in_s = scored.any(1)  # (B, L)
    log_g = torch.logsumexp(a, 1) - torch.log(torch.tensor(float(M), device=lp.device))  # (B, L)
    log_g = torch.where(in_s, log_g, torch.zeros_like(log_g))
    size = in_s.sum(1, keepdim=True).clamp_min(1).float()  # (B, 1)
    return log_g / beta * (n / size) * in_s.float()


def sandwich(lp: torch.Tensor, masks: torch.Tensor, valid: torch.Tensor, advantages: torch.Tensor, *,
             negative: str = "mix", beta: float = 1.5, mix_weight: float = 0.5) -> torch.Tensor:
    """Per-token bound terms ℓ (B, L): the ELBO's for A > 0, the ``negative`` bound's for A ≤ 0.
    lp (B, M, L), masks (B, M, P+L), valid (B, L), advantages (B,)."""
    lower = (lp * elbo_weights(masks, valid)).sum(1)  # (B, L)
    if negative == "elbo":
        upper = lower
    elif negative in ("eubo", "mix"):
        upper = eubo_terms(lp, masks, valid, beta)
        if negative == "mix":
            upper = mix_weight * upper + (1 - mix_weight) * lower
    else:
        raise ValueError(f"dllm.spg_negative must be one of {NEGATIVE_MODES}, got {negative!r}")
    return torch.where((advantages > 0).unsqueeze(1), lower, upper)


def spg_token_loss(bound: torch.Tensor, advantages: torch.Tensor, token_weights=None) -> torch.Tensor:
    """Per-token policy-gradient loss −A_i·ℓ_ij (·u_ij, DPS). bound (n, L), advantages (n,) → (n, L)."""
    loss = -advantages.unsqueeze(1) * bound
    return loss if token_weights is None else loss * token_weights.detach()


__all__ = ["NEGATIVE_MODES", "block_masks", "elbo_weights", "eubo_terms", "sandwich", "spg_token_loss"]
