"""Masked-diffusion sampler (LLaDA): semi-autoregressive block decoding with low-confidence or random remasking.

The completion (``gen_length`` tokens after the prompt) starts fully masked and is decoded block by block
(``block_length`` tokens, left to right). Each block gets ``steps // num_blocks`` steps; the number of tokens
committed per step spreads the block's masked count evenly, earlier steps taking the remainder (LLaDA's
``get_num_transfer_tokens``). At every step the model predicts all positions; for each masked position of
the current block a token is proposed (argmax at temperature 0, else a sample from softmax(logits / T) via
the Gumbel-max trick) and the n positions with the highest score are committed, where the score is

  low_confidence  p(proposed token) under softmax(logits)   (LLaDA's default)
  random          an independent uniform draw               (the original any-order masked diffusion sampler)

The <mask> token itself is never proposed: its logit is removed (:func:`token_logits`), so every committed
position holds a real token and is committed exactly once; the likelihood estimators score under the same
distribution. Committed tokens are never re-masked. Because the logits of every position are computed at every step, the
sampler records per completion token, at zero extra forwards: the step it was committed at, its
confidence (probability of the committed token), the entropy and the top-1 − top-2 probability margin of the
predictive distribution at commit, and its within-block commit rank; plus the decode order.

Pure torch: the model is any callable ``logits_fn(input_ids (B, L)) -> (B, L, V)`` whose position j scores
token j (adapters shift Dream-style logits before returning them).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

REMASKING = ("low_confidence", "random")


@dataclass
class MaskedSample:
    """Result of :func:`sample`. Shapes: B completions, P prompt tokens, L = gen_length."""

    sequences: torch.Tensor  # (B, P+L) long: prompt + decoded completion
    commit_step: torch.Tensor  # (B, L) long: global step index at which each completion token was committed
    confidence: torch.Tensor  # (B, L) float32: p(committed token) under softmax(logits) at commit
    entropy: torch.Tensor  # (B, L) float32: entropy of softmax(logits) at commit (nats)
    margin: torch.Tensor  # (B, L) float32: top-1 − top-2 probability at commit
    block_rank: torch.Tensor  # (B, L) long: commit rank within its block (0 = first committed)
    order: torch.Tensor  # (B, L) long: completion positions in the order they were committed
    step_log_prob: torch.Tensor  # (B, L) float32: log-prob of the committed token under the sampling distribution
    num_steps: int = 0

    @property
    def completions(self) -> torch.Tensor:
        return self.sequences[:, -self.commit_step.shape[1]:]


def num_transfer_tokens(n_masked: int, steps: int) -> list[int]:
    """Tokens committed at each of ``steps`` steps for a block of ``n_masked`` masks (sums to n_masked)."""
    base, rem = divmod(n_masked, steps)
    return [base + (1 if s < rem else 0) for s in range(steps)]


def schedule(gen_length: int, block_length: int, steps: int) -> list[tuple[int, int]]:
    """(block index, tokens to commit) for every global step. Raises ValueError on inconsistent sizes."""
    if gen_length % block_length:
        raise ValueError(f"gen_length {gen_length} must be a multiple of block_length {block_length}")
    n_blocks = gen_length // block_length
    if steps % n_blocks:
        raise ValueError(f"steps {steps} must be a multiple of the number of blocks {n_blocks}")
    per_block = steps // n_blocks
    if per_block > block_length:
        raise ValueError(f"steps per block ({per_block}) exceeds block_length {block_length}")
    return [(b, k) for b in range(n_blocks) for k in num_transfer_tokens(block_length, per_block)]


def token_logits(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """logits (..., V) with the <mask> entry set to −inf (when ``mask_id`` is a column): the distribution over
    real tokens that the sampler draws from and the estimators score under."""
    if 0 <= mask_id < logits.shape[-1]:
        logits = logits.index_fill(-1, torch.tensor([mask_id], device=logits.device), float("-inf"))
    return logits


def predictive_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits (..., V) → (probs (..., V), entropy (...), margin (...)) in float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    p = logp.exp()
    ent = -(p * torch.where(p > 0, logp, torch.zeros_like(logp))).sum(-1)  # 0·log 0 = 0 (the removed <mask>)
    top2 = p.topk(2, dim=-1).values
    return p, ent, top2[..., 0] - top2[..., 1]


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """argmax at T = 0, else a sample of softmax(logits / T) (Gumbel-max, float64). logits (..., V) → (...)."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64)
    g = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (logits.double() / temperature + g).argmax(-1)


@torch.no_grad()
def sample(logits_fn, prompt_ids: torch.Tensor, *, mask_id: int, gen_length: int, block_length: int, steps: int,
           temperature: float = 0.0, remasking: str = "low_confidence",
           generator: torch.Generator | None = None) -> MaskedSample:
    """Decode ``gen_length`` tokens after ``prompt_ids`` (B, P). See the module docstring."""
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    sched = schedule(gen_length, block_length, steps)
    B, P = prompt_ids.shape
    L, dev = gen_length, prompt_ids.device
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=dev)], 1)  # (B, P+L)
    commit_step = torch.full((B, L), -1, dtype=torch.long, device=dev)
    conf = torch.zeros(B, L, device=dev)
    ent = torch.zeros(B, L, device=dev)
    marg = torch.zeros(B, L, device=dev)
    slp = torch.zeros(B, L, device=dev)
    rank = torch.zeros(B, L, dtype=torch.long, device=dev)
    order = torch.zeros(B, L, dtype=torch.long, device=dev)
    n_done = 0
    done_in_block = 0
    prev_block = -1
    pos = torch.arange(L, device=dev)
    rows = torch.arange(B, device=dev).unsqueeze(1)
    for s, (blk, k) in enumerate(sched):
        if blk != prev_block:
            done_in_block, prev_block = 0, blk
        logits = token_logits(logits_fn(x)[:, P:].float(), mask_id)  # (B, L, V)
        p, e, m = predictive_stats(logits)
        x0 = gumbel_argmax(logits, temperature, generator)  # (B, L)
        p0 = p.gather(-1, x0.unsqueeze(-1)).squeeze(-1)  # (B, L)
        if remasking == "low_confidence":
            score = p0.clone()
        else:
            score = torch.rand(B, L, generator=generator, device=dev)
        masked = x[:, P:] == mask_id
        in_block = (pos >= blk * block_length) & (pos < (blk + 1) * block_length)
        score = torch.where(masked & in_block, score, torch.full_like(score, -float("inf")))
        pick = score.topk(k, dim=-1).indices  # (B, k) highest score first
        x[:, P:][rows, pick] = x0[rows, pick]
        commit_step[rows, pick] = s
        conf[rows, pick] = p0[rows, pick]
        ent[rows, pick] = e[rows, pick]
        marg[rows, pick] = m[rows, pick]
        if temperature > 0:
            lq = torch.log_softmax(logits.double() / temperature, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
            slp[rows, pick] = lq[rows, pick].float()
        rank[rows, pick] = done_in_block + torch.arange(k, device=dev)
        order[:, n_done:n_done + k] = pick
        n_done += k
        done_in_block += k
    return MaskedSample(sequences=x, commit_step=commit_step, confidence=conf, entropy=ent, margin=marg,
                        block_rank=rank, order=order, step_log_prob=slp, num_steps=len(sched))


__all__ = ["MaskedSample", "REMASKING", "sample", "schedule", "num_transfer_tokens", "predictive_stats",
           "gumbel_argmax"]
