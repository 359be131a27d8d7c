"""The exact key/value cache of a block-causal masked LM (``policy.block_size`` > 0: :mod:`.tiny_block`, or a
remote-code block model such as SDAR / TraDo).

Under block-causal attention a position's keys and values at every layer depend only on the tokens of its own and
earlier blocks, so once a block is finished (every token committed) its keys and values are final. The cache holds
those of the prompt and the finished blocks; a denoising step of block k forwards the block's b positions alone
against them, and when the block is finished one more forward of its clean tokens appends its keys and values.
Nothing is approximated: the step's logits equal those of a full forward of the sequence up to the block's end
(up to floating-point summation order), which ``tests/test_block_dllm.py::test_block_kv_cache_is_exact`` checks
token for token on whole rollouts.

The model's forward must take ``past_key_values`` (a transformers ``Cache``: each attention layer calls
``cache.update(k, v, layer)`` and attends to what it returns), ``position_ids`` and a 4-D boolean ``attention_mask``
(:func:`block_keep`: block-causal over the cached and new keys, padding of the left-padded prompt excluded), as the
released block-diffusion models (SDAR, TraDo) take it from their caller. A forward that also takes ``store_kv`` (the
released models append to the cache only with ``store_kv=True``) gets ``store_kv=True`` (:func:`takes_store_kv`).
"""
from __future__ import annotations

import inspect

import torch

from .kv_cache import cache_layers, eval_mode, filled_cache, new_cache


def block_keep(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int,
               key_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Block-causal attention: q_pos (B|1, n), k_pos (B|1, K) positions; key_keep (B, K) bool or None →
    (B|1, 1, n, K) bool, True where query i may attend to key j (block(j) <= block(i), not padding, or j is i)."""
    qb, kb = (q_pos // block_size).unsqueeze(-1), (k_pos // block_size).unsqueeze(-2)  # (B, n, 1), (B, 1, K)
    allowed = kb <= qb  # (B, n, K)
    if key_keep is not None:
        allowed = allowed & key_keep.bool().unsqueeze(1)
    return (allowed | (k_pos.unsqueeze(-2) == q_pos.unsqueeze(-1))).unsqueeze(1)


def takes_store_kv(model) -> bool:
    """Whether ``model``'s forward (below a peft wrapper) takes ``store_kv``: by name or through ``**kwargs``."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    params = inspect.signature(base.forward).parameters.values()
    return any(p.name == "store_kv" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


class BlockKVCache:
    """:class:`~diffgrpo.samplers.block.BlockCache` of a block-causal :class:`~.hf_masked_lm.MaskedLMPolicy`.

    State: per-layer (keys, values) (n, H, K, d) of positions [0, K) for the cache's rows ``self.rows`` (global
    batch rows; rows that stopped decoding are dropped when the others extend), and their key mask (n, K)."""

    def __init__(self, policy):
        self.policy = policy
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.keep: torch.Tensor | None = None
        self.rows: torch.Tensor | None = None

    def _forward(self, ids: torch.Tensor, keep: torch.Tensor, start: int, kv) -> tuple[torch.Tensor, list]:
        """ids (n, W) at positions [start, start + W) against ``kv`` → (raw logits (n, W, V) float32, new kv)."""
        pol = self.policy
        pol.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += ids.shape[0]
        cache = filled_cache(kv) if kv else new_cache()
        pos = torch.arange(start, start + ids.shape[1], device=ids.device).unsqueeze(0)  # (1, W)
        mask = block_keep(pos, torch.arange(keep.shape[1], device=ids.device).unsqueeze(0), pol.block_size, keep)
        kw = {"store_kv": True} if pol.store_kv else {}
        net = pol.model if pol.forward_module is None else pol.forward_module
        with eval_mode(pol.model):
            out = net(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, **kw)
        return out.logits.float(), cache_layers(cache)

    def _select(self, rows: torch.Tensor):
        """The cached (kv, keep) of ``rows`` (a subset of ``self.rows``)."""
        if rows.numel() == self.rows.numel():
            return self.kv, self.keep
        lookup = torch.full((int(self.rows.max()) + 1,), -1, dtype=torch.long, device=rows.device)
        lookup[self.rows] = torch.arange(self.rows.numel(), device=rows.device)
        sub = lookup[rows]  # (n,)
        return [(k.index_select(0, sub), v.index_select(0, sub)) for k, v in self.kv], self.keep[sub]

    def _keep(self, ids: torch.Tensor) -> torch.Tensor:
        """The keys of ``ids`` (n, W) that may be attended to: not padding, as the policy's full forward masks."""
        return ids != self.policy.pad_id if self.policy.use_attention_mask else torch.ones_like(ids, dtype=torch.bool)

    def prefill(self, prompt_ids: torch.Tensor) -> None:
        """Cache the prompt (B, P) (its padding excluded from every later attention)."""
        keep = self._keep(prompt_ids)  # (B, P)
        _, self.kv = self._forward(prompt_ids, keep, 0, [])
        self.keep, self.rows = keep, torch.arange(prompt_ids.shape[0], device=prompt_ids.device)

    def block_logits(self, block_ids: torch.Tensor, rows: torch.Tensor, start: int) -> torch.Tensor:
        """A denoising step: the block's tokens (n, b) of ``rows`` at positions [start, start + b) → raw logits
        (n, b, V); the cache is unchanged."""
        kv, keep = self._select(rows)
        full = torch.cat([keep, self._keep(block_ids)], 1)  # (n, K + b)
        return self._forward(block_ids, full, start, kv)[0]

    def extend(self, block_ids: torch.Tensor, rows: torch.Tensor, start: int) -> None:
        """Append the finished block (n, b) of ``rows`` (the rows that go on; the others are dropped)."""
        kv, keep = self._select(rows)
        full = torch.cat([keep, self._keep(block_ids)], 1)  # (n, K + b)
        _, self.kv = self._forward(block_ids, full, start, kv)
        self.keep, self.rows = full, rows


__all__ = ["BlockKVCache", "block_keep", "takes_store_kv"]
