"""wd1 — weighted policy optimisation for diffusion LMs (xiaohangt/wd1): a weighted likelihood, no ratio.

Objective. With A = r − mean(group) (no std) and, within each group g, the softmax weights

    w⁺_i = exp(A_i) / Σ_{k∈g} exp(A_k),   w⁻_i = exp(−A_i) / Σ_{k∈g} exp(−A_k),   c_i = w⁺_i − w⁻_i

the loss raises the likelihood of completions in proportion to w⁺ and lowers it in proportion to w⁻:

    L = −Σ_i c_i · Σ_j ℓ_ij           (per token: −c_i·ℓ_ij, :func:`wd1_token_loss`)

with ℓ the d1 mean-field estimate (every completion token masked, prompt tokens masked with probability
``dllm.p_mask_prompt``) under masks drawn once per rollout. Only the current policy's likelihood is approximated
(no ratio to an old policy, hence no clip); a k3 KL to the reference is added per token when loss.beta > 0 (wd1's
released "NP" runs use none). A group whose rewards are all equal has c ≡ 0 and contributes no gradient.

Normalisation: the released trainer sums token log-probs per sequence and sums c-weighted sequences over a group
(one group per device micro-batch, averaged over accumulation steps); here the per-token terms go through the
shared aggregation (``loss.aggregation``, token mean by default): the released loss is ours times the completion
tokens per group, T/G (T completion tokens in the batch, G groups; group_size × the mean completion length, e.g.
6 × 8.17 = 49.0), a per-batch scale that Adam largely absorbs (tests/test_user_defects.py measures it).

Exactness: the gradient of the weighted likelihood under the mean-field estimate; exact in the estimate, biased as
the mean field is relative to the model's likelihood (benchmarks/results/dllm_study/bias.md).

Cost per update: M forwards with grad and M sample-backwards per completion (M = 1 on the mean field, K with SML);
no ℓ_old forwards; ℓ_ref M no-grad forwards when β > 0.

DACA plug-ins: both apply. DPS token weights multiply −c_i·ℓ_ij; SML refines the mean-field forward into K strata
(every token still scored once, so the loss splits per group as for the GRPO methods).
"""
from __future__ import annotations

import torch


def wd1_coefficients(advantages: torch.Tensor, group_ids: torch.Tensor, valid: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """c_i = softmax_g(A)_i − softmax_g(−A)_i over the valid rows of each group. advantages (B,), group_ids (B,),
    valid (B,) bool or None → (B,) float32 (0 on invalid rows)."""
    a = advantages.float()
    ok = torch.ones_like(a, dtype=torch.bool) if valid is None else valid.to(a.device)
    a = torch.where(ok, a, torch.zeros_like(a))
    gid = group_ids.to(a.device)
    out = torch.zeros_like(a)
    for g in torch.unique(gid):
        rows = (gid == g) & ok  # (B,)
        if rows.any():
            ag = a[rows]
            out[rows] = torch.softmax(ag, 0) - torch.softmax(-ag, 0)
    return out


def wd1_token_loss(log_prob: torch.Tensor, coef: torch.Tensor, token_weights=None) -> torch.Tensor:
    """Per-token loss −c_i·ℓ_ij (·u_ij, DPS). log_prob (n, L), coef (n,) → (n, L)."""
    loss = -coef.unsqueeze(1) * log_prob
    return loss if token_weights is None else loss * token_weights.detach()


__all__ = ["wd1_coefficients", "wd1_token_loss"]
