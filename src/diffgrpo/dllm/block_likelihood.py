"""Likelihood estimates of block-causal masked LMs (``policy.block_size`` > 0): every block scored with the exact
clean prefix as context.

Any estimator of :mod:`diffgrpo.dllm.likelihood` (masks (B, M, P+L), weights (B, M, L)) is evaluated block by block:
for completion block k = [s, e) and forward m the model reads

    x^(m,k) = [ prompt (with m's prompt mask) ; y[:s] clean ; block k of y with m's mask ]      (length P + e)

and scores block k's tokens (later blocks cannot change them under block-causal attention, so they are left out).
This is the context the sampler had when it decoded block k (the finished blocks' clean tokens), and the
context the block-diffusion objective trains on (SDAR, TraDo); a full forward of the masked sequence would
instead show block k the masks of the earlier blocks. Per estimator, under block-causal attention:

  mean_field    (diffu_grpo, wd1)   the whole block masked given the exact prefix: the block's mean-field term; exact
                                    log-likelihood when the block holds one token (b = 1), not exact for b > 1
  coupled / coupled_released        the complementary pair inside each block given the exact prefix: an unbiased
                                    estimate of the block-wise ELBO term (a bound, not exact)
  random_mask   (UniGRPO)           ELBO-weighted random masks inside each block: as coupled (a bound, not exact)
  SML plug-in   (daca.likelihood)   strata refine the masks as on a masked LM; chain by decode order inside a block
                                    approaches the sampler's own path, exact with K = L as there
  trace         (trace_rl)          the sampler's own states: exact (ℓ equals the recorded step log-probs)
  SPG           (spg)               its block masks already keep earlier blocks clean and later ones masked: with
                                    ``dllm.spg_block_length`` = the model's block its full forward has the exact
                                    prefix; it is evaluated by its own full forward

Cost: one forward per block of the (B·M) rows that score a token in it, of P + e positions.
"""
from __future__ import annotations

import torch

from ..samplers import masked
from .likelihood import apply_masks


def map_blocks(fn, ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor, mask_id: int,
               block_length: int) -> torch.Tensor:
    """Run ``fn`` on every completion block k = [s, e) given its context x^(m, k) (the prompt under m's mask, the
    clean blocks before k, block k under m's mask) and assemble the per-block outputs. ids (B, N), masks (B, M, N),
    weights (B, M, L) → (B, M, L) float32. ``fn(need, x, s, e)``: need (r,) the (B·M) rows scoring a token of block
    k (a non-zero weight), x (r, P + e) their contexts → (r, e - s) float32; rows not needed stay 0."""
    B, M, N = masks.shape
    L = weights.shape[-1]
    P = N - L
    noisy = apply_masks(ids, masks, mask_id)  # (B·M, N)
    ctx = torch.cat([noisy[:, :P], ids[:, P:].repeat_interleave(M, 0)], 1)  # (B·M, N) prompt mask, clean completion
    w = weights.reshape(B * M, L)
    blocks = []
    for s in range(0, L, block_length):
        e = s + block_length
        out = torch.zeros(B * M, e - s, device=ids.device)
        need = torch.nonzero(w[:, s:e].ne(0).any(1)).flatten()  # (r,) rows scoring a token of this block
        if need.numel():
            x = torch.cat([ctx[need, :P + s], noisy[need, P + s:P + e]], 1)  # (r, P + e)
            out = out.index_put((need,), fn(need, x, s, e))  # (r, b)
        blocks.append(out)
    return torch.cat(blocks, 1).view(B, M, L)


def block_forward_log_probs(logits_fn, ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor, mask_id: int,
                            block_length: int, temperature: float = 1.0) -> torch.Tensor:
    """log p(y_j | x^(m, k(j))) for every completion token and forward. ids (B, N), masks (B, M, N), weights
    (B, M, L) (forwards with zero weight on a block are not run; their entries are 0) → (B, M, L) float32.
    Differentiable through ``logits_fn``."""
    M, L = masks.shape[1], weights.shape[-1]
    P = ids.shape[1] - L
    y = ids[:, P:].repeat_interleave(M, 0)  # (B·M, L)

    def block(need, x, s, e):  # (r,), (r, P + e) → (r, b)
        logits = masked.token_logits(logits_fn(x)[:, P + s:].float(), mask_id)  # (r, b, V)
        if temperature > 0 and temperature != 1.0:
            logits = logits / temperature
        return torch.log_softmax(logits, -1).gather(-1, y[need, s:e].unsqueeze(-1)).squeeze(-1)

    return map_blocks(block, ids, masks, weights, mask_id, block_length)


def block_token_log_probs(logits_fn, ids: torch.Tensor, masks: torch.Tensor, weights: torch.Tensor, mask_id: int,
                          block_length: int, temperature: float = 1.0) -> torch.Tensor:
    """Σ_m w_mj · log p(y_j | x^(m, k(j))) → (B, L) float32 (:func:`block_forward_log_probs`)."""
    lp = block_forward_log_probs(logits_fn, ids, masks, weights, mask_id, block_length, temperature)
    return (lp * weights).sum(1)


__all__ = ["block_forward_log_probs", "block_token_log_probs", "map_blocks"]
