"""Block rollouts of block-causal masked LMs (SDAR, TraDo, the built-in ``tiny_block``): exact, cached, of dynamic
length.

The completion (``gen_length`` tokens after a prompt of a multiple of the block size) is decoded one block of
``block_length`` tokens at a time, left to right. Inside a block the configured decoder of
:mod:`diffgrpo.samplers.masked` runs unchanged (``decode=schedule``: ``steps // num_blocks`` steps of LLaDA's
per-step counts, ``remasking`` picks; ``decode=threshold``: every masked token at or above ``threshold``, at least
one per step), with the same records (commit step, confidence, entropy, margin, rank, order, step log-prob) and
the same random draws per step. A step's logits of block k come from

  cache=None   a forward of the sequence up to the block's end, x[:, :P + end] (later blocks cannot change them
               under block-causal attention)
  cache        a :class:`BlockCache` (:class:`diffgrpo.models.block_cache.BlockKVCache`): the block's b positions
               against the exact keys/values of the prompt and the finished blocks; one prefill forward of the
               prompt, and one forward of each finished block's clean tokens to append it

so the two rollouts are equal token for token (up to floating-point summation order in the logits).

Dynamic length (``eos_id``): after each block, a row whose completion holds ``eos_id`` stops; its later blocks are
filled with ``eos_id`` without forwards (records: commit step −1, order: the filled positions last, in position
order). Cost counters ``forwards`` (rows × model calls) and ``query_tokens`` (rows × positions computed).
"""
from __future__ import annotations

from typing import Protocol

import torch

from .masked import MaskedSample, _block_plan, _check_options, _decode_step, _Records


class BlockCache(Protocol):
    """What :func:`sample_blocks` needs from an exact cache of finished blocks."""

    def prefill(self, prompt_ids: torch.Tensor) -> None: ...

    def block_logits(self, block_ids: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor: ...

    def extend(self, block_ids: torch.Tensor, rows: torch.Tensor, start: int) -> None: ...


@torch.no_grad()
def sample_blocks(logits_fn, prompt_ids: torch.Tensor, *, mask_id: int, gen_length: int, block_length: int,
                  steps: int, temperature: float = 0.0, remasking: str = "low_confidence",
                  generator: torch.Generator | None = None, decode: str = "schedule", threshold: float = 0.9,
                  cache: BlockCache | None = None, eos_id: int | None = None) -> MaskedSample:
    """Decode ``gen_length`` tokens after ``prompt_ids`` (B, P) block by block. See the module docstring."""
    _check_options(remasking, decode, threshold)
    B, P = prompt_ids.shape
    L, dev = gen_length, prompt_ids.device
    per_block, counts = _block_plan(decode, gen_length, block_length, steps)
    x = torch.cat([prompt_ids, torch.full((B, L), mask_id, dtype=torch.long, device=dev)], 1)  # (B, P+L)
    rec = _Records(B, L, dev)
    pos = torch.arange(L, device=dev)
    all_rows = torch.arange(B, device=dev)
    alive = torch.ones(B, dtype=torch.bool, device=dev)
    if cache is not None:
        cache.prefill(prompt_ids)
        rec.forwards, rec.query_tokens = B, B * P
    s = 0
    n_blocks = L // block_length
    for blk in range(n_blocks):
        start, end = blk * block_length, (blk + 1) * block_length
        in_block = (pos >= start) & (pos < end)  # (L,)
        rec.block_done.zero_()
        for i in range(per_block):
            masked = (x[:, P:] == mask_id) & in_block & alive.unsqueeze(1)  # (B, L)
            rows = all_rows[alive] if counts is not None else all_rows[masked.any(1)]
            if rows.numel() == 0:
                break
            if cache is None:
                raw = logits_fn(x[rows, :P + end])[:, P + start:]  # (n, b, V)
                rec.query_tokens += rows.numel() * (P + end)
            else:
                raw = cache.block_logits(x[rows, P + start:P + end], rows, P + start)  # (n, b, V)
                rec.query_tokens += rows.numel() * block_length
            rec.forwards += rows.numel()
            _decode_step(raw, x, P, rows, masked, start, s, rec, mask_id=mask_id, temperature=temperature,
                         remasking=remasking, decode=decode, threshold=threshold, generator=generator,
                         count=None if counts is None else counts[blk][i])
            s += 1
        if eos_id is not None:
            alive &= ~(x[:, P + start:P + end] == eos_id).any(1)
        if blk + 1 == n_blocks or not bool(alive.any()):
            break
        if cache is not None:
            rows = all_rows[alive]
            cache.extend(x[rows, P + start:P + end], rows, P + start)
            rec.forwards += rows.numel()
            rec.query_tokens += rows.numel() * block_length
    _fill_stopped(x, P, rec, mask_id, eos_id)
    return MaskedSample(sequences=x, commit_step=rec.commit_step, confidence=rec.conf, entropy=rec.ent,
                        margin=rec.marg, block_rank=rec.rank, order=rec.order, step_log_prob=rec.slp, num_steps=s,
                        forwards=rec.forwards, query_tokens=rec.query_tokens)


def _fill_stopped(x: torch.Tensor, P: int, rec: _Records, mask_id: int, eos_id: int | None) -> None:
    """Rows that stopped early: their undecoded positions hold ``eos_id`` and come last in ``order``."""
    comp = x[:, P:]  # (B, L) view
    undecoded = comp == mask_id
    if eos_id is None or not bool(undecoded.any()):
        return
    comp[undecoded] = eos_id
    for r in torch.nonzero(undecoded.any(1)).flatten().tolist():
        rest = torch.nonzero(undecoded[r]).flatten()  # (m,) in position order
        n = int(rec.n_done[r])
        rec.order[r, n:n + rest.numel()] = rest


__all__ = ["BlockCache", "sample_blocks"]
