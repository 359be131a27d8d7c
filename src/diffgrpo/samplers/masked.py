"""Masked-diffusion sampler (LLaDA): semi-autoregressive block decoding with low-confidence or random remasking, or
confidence-threshold parallel decoding, optionally with a key/value cache.

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

Decoders (``decode``): "schedule" is the above; "threshold" (Fast-dLLM's confidence-aware parallel decoding)
commits at each step every masked token of the current block whose confidence p(proposed token) is at least
``threshold``, and at least the most confident one, so a block takes 1 to block_length steps (``steps`` unused).
Rows move to the next block together; a row whose block is done waits and is not forwarded. Every committed token
is scored, as with the schedule, under the logits of the step that committed it, so the records keep their meaning
(``commit_step`` is the global step; ``num_steps`` the steps run). ``cache`` (a :class:`DecodeCache`, e.g.
:class:`diffgrpo.models.kv_cache.KVCache`) replaces the full forward on every step of a block but its first (and
every ``cache_refresh``-th) by a forward of the cache's query window: an approximation described in that module.
The random draws are made for all (B, L) positions every step whatever is computed, so the default decoder's
stream is unchanged and every setting consumes the generator alike. Cost counters: ``forwards`` (rows × model
calls) and ``query_tokens`` (rows × positions computed).

Pure torch: the model is any callable ``logits_fn(input_ids (B, L)) -> (B, L, V)`` whose position j scores
token j (adapters shift Dream-style logits before returning them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
    num_steps: int = 0  # global steps run (decode=threshold: as many as the slowest row of each block needed)
    forwards: int = 0  # sequence-forwards spent (rows × model calls, cached calls included)
    query_tokens: int = 0  # positions computed (rows × query length): a full forward counts P + L

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


def gumbel_argmax(logits: torch.Tensor, temperature: float, generator: torch.Generator | None,
                  noise: torch.Tensor | None = None) -> torch.Tensor:
    """argmax at T = 0, else a sample of softmax(logits / T) (Gumbel-max, float64). logits (..., V) → (...).
    ``noise``: the uniform draws (..., V) float64 to use instead of drawing them from ``generator``."""
    if temperature <= 0:
        return logits.argmax(-1)
    u = torch.rand(logits.shape, generator=generator, device=logits.device, dtype=torch.float64) if noise is None \
        else noise
    g = -torch.log(-torch.log(u.clamp_min(1e-300)))
    return (logits.double() / temperature + g).argmax(-1)


DECODERS = ("schedule", "threshold")


class DecodeCache(Protocol):
    """What :func:`sample` needs from a key/value cache (:class:`diffgrpo.models.kv_cache.KVCache`).

    ``begin`` runs the full forward on ``x[rows]`` (n, N), keeps the keys/values of the positions the cache
    reuses while the completion block [start, end) decodes, and returns the completion logits (n, L, V);
    ``step`` runs the query window only, against the kept keys/values, for ``rows`` (a subset of the rows
    ``begin`` saw) and returns (logits (n, W, V) of completion positions [w0, w0 + W), w0)."""

    def begin(self, x: torch.Tensor, rows: torch.Tensor, start: int, end: int) -> torch.Tensor: ...

    def step(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int]: ...

    def query_length(self) -> int: ...


@torch.no_grad()
def sample(logits_fn, prompt_ids: torch.Tensor, *, mask_id: int, gen_length: int, block_length: int, steps: int,
           temperature: float = 0.0, remasking: str = "low_confidence", generator: torch.Generator | None = None,
           decode: str = "schedule", threshold: float = 0.9, cache: DecodeCache | None = None,
           cache_refresh: int = 0) -> MaskedSample:
    """Decode ``gen_length`` tokens after ``prompt_ids`` (B, P). See the module docstring.

    ``decode``: "schedule" (``steps`` steps, LLaDA's per-step counts, ``remasking`` picks) or "threshold"
    (every masked block token with confidence >= ``threshold``, at least the most confident one, per step;
    ``steps`` unused). ``cache``: a :class:`DecodeCache` used on every step of a block but its first (and every
    ``cache_refresh``-th when > 0, where the cache is rebuilt by a full forward)."""
    _check_options(remasking, decode, threshold)
    B, P = prompt_ids.shape
    L, dev = gen_length, prompt_ids.device
    per_block, counts = _block_plan(decode, gen_length, block_length, steps)
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=dev)], 1)  # (B, P+L)
    rec = _Records(B, L, dev)
    pos = torch.arange(L, device=dev)
    all_rows = torch.arange(B, device=dev)
    s = 0
    for blk in range(L // block_length):
        start, end = blk * block_length, (blk + 1) * block_length
        in_block = (pos >= start) & (pos < end)  # (L,)
        rec.block_done.zero_()
        for i in range(per_block):
            masked = (x[:, P:] == mask_id) & in_block  # (B, L)
            rows = all_rows if counts is not None else all_rows[masked.any(1)]
            if rows.numel() == 0:
                break
            refresh = i == 0 or (cache_refresh > 0 and i % cache_refresh == 0)
            raw, w0 = _window_logits(logits_fn, cache, x, rows, P, refresh, start, end, rec)
            _decode_step(raw, x, P, rows, masked, w0, s, rec, mask_id=mask_id, temperature=temperature,
                         remasking=remasking, decode=decode, threshold=threshold, generator=generator,
                         count=None if counts is None else counts[blk][i])
            s += 1
    return MaskedSample(sequences=x, commit_step=rec.commit_step, confidence=rec.conf, entropy=rec.ent,
                        margin=rec.marg, block_rank=rec.rank, order=rec.order, step_log_prob=rec.slp, num_steps=s,
                        forwards=rec.forwards, query_tokens=rec.query_tokens)


def _check_options(remasking: str, decode: str, threshold: float) -> None:
    """ValueError on an unknown remasking or decoder, or a threshold outside (0, 1] for the threshold decoder."""
    if remasking not in REMASKING:
        raise ValueError(f"remasking must be one of {REMASKING}, got {remasking!r}")
    if decode not in DECODERS:
        raise ValueError(f"decode must be one of {DECODERS}, got {decode!r}")
    if decode == "threshold" and not 0 < threshold <= 1:
        raise ValueError(f"threshold must be in (0, 1], got {threshold}")


def _block_plan(decode: str, gen_length: int, block_length: int, steps: int) -> tuple[int, list[list[int]] | None]:
    """(steps per block at most, tokens to commit per block and step or None when the threshold decides).
    Raises ValueError on inconsistent sizes."""
    if decode == "schedule":
        sched = schedule(gen_length, block_length, steps)
        n_blocks = gen_length // block_length
        return len(sched) // n_blocks, [[k for blk, k in sched if blk == b] for b in range(n_blocks)]
    if gen_length % block_length:
        raise ValueError(f"gen_length {gen_length} must be a multiple of block_length {block_length}")
    return block_length, None  # at most: at least one token per step


def _window_logits(logits_fn, cache: DecodeCache | None, x: torch.Tensor, rows: torch.Tensor, P: int,
                   refresh: bool, start: int, end: int, rec: _Records) -> tuple[torch.Tensor, int]:
    """Raw logits (n, W, V) of completion positions [w0, w0 + W) for ``rows`` (n,), and w0: a full forward
    without a cache, else the cache rebuilt (``refresh``) or its query window; the cost counted in ``rec``."""
    N = x.shape[1]  # P + L
    if cache is None:
        raw, w0 = logits_fn(x if rows.numel() == x.shape[0] else x[rows])[:, P:], 0
        query = N
    elif refresh:
        raw, w0 = cache.begin(x, rows, start, end), 0
        query = N
    else:
        raw, w0 = cache.step(x, rows)
        query = cache.query_length()
    rec.forwards += rows.numel()
    rec.query_tokens += rows.numel() * query
    return raw, w0


def _decode_step(raw: torch.Tensor, x: torch.Tensor, P: int, rows: torch.Tensor, masked: torch.Tensor, w0: int,
                 step: int, rec: _Records, *, mask_id: int, temperature: float, remasking: str, decode: str,
                 threshold: float, generator: torch.Generator | None, count: int | None) -> None:
    """One decoding step from the window's raw logits (n, W, V): propose a token per position, score the masked
    candidates and commit ``count`` of them per row (None: those at or above ``threshold``, at least one)."""
    B, L = masked.shape
    dev = x.device
    logits = token_logits(raw.float(), mask_id)  # (n, W, V), <mask> removed
    W = logits.shape[1]
    # the random draws are made for all (B, L) positions every step whatever is computed, so every
    # decoder and cache setting consumes the generator alike
    u = None
    if temperature > 0:
        u = torch.rand((B, L, logits.shape[-1]), generator=generator, device=dev, dtype=torch.float64)
        u = u[rows, w0:w0 + W]
    u_rank = torch.rand(B, L, generator=generator, device=dev) if remasking == "random" else None
    p, e, m = predictive_stats(logits)  # (n, W, V), (n, W), (n, W)
    x0 = gumbel_argmax(logits, temperature, None, noise=u)  # (n, W)
    p0 = p.gather(-1, x0.unsqueeze(-1)).squeeze(-1)  # (n, W)
    score = u_rank[rows, w0:w0 + W] if remasking == "random" and decode == "schedule" else p0.clone()
    cand = masked[rows, w0:w0 + W]  # (n, W)
    score = torch.where(cand, score, torch.full_like(score, -float("inf")))
    if count is not None:
        k = torch.full((rows.numel(),), count, dtype=torch.long, device=dev)
    else:  # every candidate at or above the threshold, at least one
        k = (cand & (p0 >= threshold)).sum(1).clamp_min(1)
    kmax = int(k.max())
    pick = score.topk(kmax, dim=-1).indices  # (n, kmax) highest score first
    valid = torch.arange(kmax, device=dev) < k.unsqueeze(1)  # (n, kmax)
    slp = None
    if temperature > 0:
        slp = torch.log_softmax(logits.double() / temperature, -1).gather(-1, x0.unsqueeze(-1)).squeeze(-1)
    rec.commit(x, P, rows, pick, valid, w0, step, x0=x0, p0=p0, ent=e, marg=m, slp=slp)


class _Records:
    """The sampler's per-token records (B, L) and its cost counters, filled as tokens are committed."""

    def __init__(self, B: int, L: int, dev):
        self.commit_step = torch.full((B, L), -1, dtype=torch.long, device=dev)
        self.conf = torch.zeros(B, L, device=dev)
        self.ent = torch.zeros(B, L, device=dev)
        self.marg = torch.zeros(B, L, device=dev)
        self.slp = torch.zeros(B, L, device=dev)
        self.rank = torch.zeros(B, L, dtype=torch.long, device=dev)
        self.order = torch.zeros(B, L, dtype=torch.long, device=dev)
        self.n_done = torch.zeros(B, dtype=torch.long, device=dev)  # tokens committed so far per row
        self.block_done = torch.zeros(B, dtype=torch.long, device=dev)  # ... in the current block
        self.L = L
        self.forwards = 0  # sequence-forwards (rows × model calls)
        self.query_tokens = 0  # positions computed (rows × query length)

    def commit(self, x, P, rows, pick, valid, w0, step, *, x0, p0, ent, marg, slp) -> None:
        """Commit, for each row r of ``rows`` (n,), window positions ``pick[r, valid[r]]`` (n, kmax) in that order."""
        n, kmax = pick.shape
        j = torch.arange(kmax, device=pick.device).expand(n, kmax)
        r_loc = torch.arange(n, device=pick.device).unsqueeze(1).expand(n, kmax)[valid]  # (c,) local row
        r = rows[r_loc]  # (c,) global row
        w = pick[valid]  # (c,) window position
        c = w + w0  # (c,) completion position
        x[r, P + c] = x0[r_loc, w]
        self.commit_step[r, c] = step
        self.conf[r, c] = p0[r_loc, w]
        self.ent[r, c] = ent[r_loc, w]
        self.marg[r, c] = marg[r_loc, w]
        if slp is not None:
            self.slp[r, c] = slp[r_loc, w].float()
        jj = j[valid]
        self.rank[r, c] = self.block_done[r] + jj
        self.order[r, self.n_done[r] + jj] = c
        k = valid.sum(1)  # (n,)
        self.n_done[rows] += k
        self.block_done[rows] += k


__all__ = [
    "DECODERS",
    "REMASKING",
    "DecodeCache",
    "MaskedSample",
    "gumbel_argmax",
    "num_transfer_tokens",
    "predictive_stats",
    "sample",
    "schedule",
]
