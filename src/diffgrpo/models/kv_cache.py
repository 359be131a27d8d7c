"""Key/value caches across denoising steps for masked diffusion LMs (Fast-dLLM's prefix and dual caches).

A masked LM attends bidirectionally, so every position's keys/values at layer l ≥ 1 depend on every token, and a
cache reused across denoising steps is an approximation. What each mode reuses while the completion block
[start, end) decodes (prompt length P, sequence N = P + L):

  prefix  the keys/values of positions [0, P + start) (prompt + finished blocks), taken from the full forward at
          the block's first step; later steps compute the query window [P + start, N) (block + the masked suffix)
          against them. Approximation: the prefix's keys/values at layers ≥ 1 do not see the tokens committed in
          the current block since its first step (layer 0's keys/values are functions of token and position
          only, so they are exact).
  dual    as prefix, and also the keys/values of the masked suffix [P + end, N): the query window is the block
          alone. Approximation: additionally, the suffix's keys/values at layers ≥ 1 are stale in the same way.

Exact parts: the block's first step is a full forward; ``dllm.cache_refresh = k > 0`` rebuilds the cache by a
full forward every k-th step of a block (k = 1: every step, no cache at all); a cached step on an unchanged
sequence reproduces the full forward's logits on its window (softmax attention is invariant to the order of
the keys, so cached keys may precede the fresh ones). :meth:`KVCache.check` tests that last property on the
model itself before the cache is used: a model whose forward does not fill a transformers ``Cache`` (its
``cache`` / ``past_key_values`` argument), or ignores ``position_ids`` or the attention mask over cached keys,
is refused in one line.

Logit shift (Dream: position j scores token j + 1): the query window starts one position earlier and the
cached part ends there, so the window's outputs score exactly the block's tokens.

Cost per cached step: the query window's positions through every layer (W = N − P − start for prefix, the block
length (+1 with the shift) for dual), attention against N keys; a full forward computes N positions.
"""
from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..errors import ConfigError

KV_CACHES = ("none", "prefix", "dual")
CACHE_KWARGS = ("cache", "past_key_values")  # transformers >= 5.x names it cache, earlier past_key_values


def cache_layers(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values), each (B, H, N, d), of a transformers ``DynamicCache`` (both layouts)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers if getattr(layer, "keys", None) is not None]
    return list(zip(cache.key_cache, cache.value_cache))


def new_cache():
    """An empty transformers ``DynamicCache`` (transformers is imported on first use, as hf_masked_lm does)."""
    from transformers import DynamicCache

    return DynamicCache()


def filled_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    """A fresh ``DynamicCache`` holding ``kv`` (per layer (B, H, n, d)); the forward appends the window to it."""
    cache = new_cache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@contextlib.contextmanager
def eval_mode(model: nn.Module):
    """Inside the block ``model`` is in eval mode (transformers drops the cache of checkpointed layers in train
    mode; the policy keeps dropout at 0, so the forward is the same)."""
    was = model.training
    if was:
        model.train(False)
    try:
        yield
    finally:
        if was:
            model.train(True)


class KVCache:
    """The :class:`~diffgrpo.samplers.masked.DecodeCache` of a :class:`~diffgrpo.models.hf_masked_lm.MaskedLMPolicy`
    for prompts of ``prompt_length`` and completions of ``gen_length`` tokens; ``mode`` prefix or dual."""

    def __init__(self, policy, mode: str, *, prompt_length: int, gen_length: int, check: bool = True):
        if mode not in KV_CACHES[1:]:
            raise ValueError(f"mode must be one of {KV_CACHES[1:]}, got {mode!r}")
        self.policy, self.mode = policy, mode
        self.P, self.L = prompt_length, gen_length
        self.shift = 1 if policy.logits_shift else 0
        self.kwarg = CACHE_KWARGS[0]
        self.kv = None  # per layer (keys, values) of the cached positions, rows self.rows
        self.rows = None
        self.window = (0, 0)  # model positions [q0, q1) of the query window
        if check:
            self.check()

    # ------------------------------------------------------------------ forwards
    def _net(self) -> nn.Module:
        p = self.policy
        return p.model if p.forward_module is None else p.forward_module

    def _forward(self, ids: torch.Tensor, keep: torch.Tensor | None, **kw) -> torch.Tensor:
        """ids (n, W) → raw logits (n, W, V) float32; ``keep`` (n, K) the attention mask over all keys."""
        pol = self.policy
        pol.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += ids.shape[0]
        if keep is not None:
            kw["attention_mask"] = keep.long()
        with eval_mode(self.policy.model):
            return self._net()(input_ids=ids, **kw).logits.float()

    def _keep(self, x: torch.Tensor) -> torch.Tensor | None:
        return (x != self.policy.pad_id) if self.policy.use_attention_mask else None  # (n, N) bool

    def _cached_positions(self) -> torch.Tensor:
        q0, q1 = self.window
        N = self.P + self.L
        return torch.cat([torch.arange(q0), torch.arange(q1, N)])

    def begin(self, x: torch.Tensor, rows: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Full forward on x[rows] (n, N); keeps the keys/values the block [start, end) reuses.
        → completion logits (n, L, V), position j scoring completion token j."""
        N = self.P + self.L
        q0 = self.P + start - self.shift
        q1 = self.P + end if self.mode == "dual" else N
        self.window, self.rows = (q0, q1), rows
        ids = x[rows]
        cache = new_cache()
        out = self._forward(ids, self._keep(ids), **{self.kwarg: cache})  # (n, N, V)
        idx = self._cached_positions().to(x.device)
        self.kv = [(k.index_select(2, idx), v.index_select(2, idx)) for k, v in cache_layers(cache)]
        if self.shift:
            out = torch.cat([out[:, :1], out[:, :-1]], 1)
        return out[:, self.P:]

    def step(self, x: torch.Tensor, rows: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The query window of x[rows] against the kept keys/values (``rows`` ⊆ the rows of :meth:`begin`).
        → (logits (n, W, V) of completion positions [w0, w0 + W), w0)."""
        q0, q1 = self.window
        kv = self.kv
        if rows.numel() != self.rows.numel():
            lookup = torch.full((int(self.rows.max()) + 1,), -1, dtype=torch.long, device=rows.device)
            lookup[self.rows] = torch.arange(self.rows.numel(), device=rows.device)
            sub = lookup[rows]  # (n,) rows of the cache
            kv = [(k.index_select(0, sub), v.index_select(0, sub)) for k, v in kv]
        ids = x[rows]
        keep = self._keep(ids)
        if keep is not None:
            keep = torch.cat([keep[:, self._cached_positions().to(x.device)], keep[:, q0:q1]], 1)  # key order
        pos = torch.arange(q0, q1, device=x.device).unsqueeze(0)  # (1, W)
        out = self._forward(ids[:, q0:q1], keep, position_ids=pos, **{self.kwarg: filled_cache(kv)})  # (n, W, V)
        w0 = q0 + self.shift - self.P
        return out[:, :q1 - self.P - w0], w0

    def query_length(self) -> int:
        return self.window[1] - self.window[0]

    # ------------------------------------------------------------------ the model's own check
    @torch.no_grad()
    def check(self) -> None:
        """Refuse (ConfigError, one line) a model whose cached forward does not reproduce its full forward on an
        unchanged sequence (2 rows, one with left padding; 3 forwards per kwarg tried, not counted as cost)."""
        pol = self.policy
        saved = dict(pol.counters)
        name = type(getattr(pol.model, "base_model", pol.model)).__name__
        N = self.P + self.L
        dev = pol.device
        g = torch.Generator().manual_seed(0)
        x = torch.randint(0, len(pol.vocab), (2, N), generator=g).to(dev)
        x[:, self.P + self.L // 2:] = pol.mask_id
        if self.P > 1:
            x[0, 0] = pol.pad_id
        start = (self.L // 2) if self.L > 1 else 0
        end = self.L
        rows = torch.arange(2, device=dev)
        ref = self._full(x)
        try:
            for kwarg in CACHE_KWARGS:
                self.kwarg = kwarg
                try:
                    self.begin(x, rows, start, end)
                except TypeError:
                    continue
                if self.kv and self.kv[0][0].shape[2] == N - self.query_length():
                    break
            else:
                raise ConfigError(f"dllm.kv_cache: value {self.mode!r} needs a model whose forward fills a "
                                  f"transformers key/value cache (argument cache or past_key_values); {name} does not; "
                                  f"use dllm.kv_cache=none")
            got, w0 = self.step(x, rows)
        finally:
            pol.counters.update(saved)
        want = ref[:, w0:w0 + got.shape[1]]
        err = float((got - want).abs().max())
        fp32 = next(pol.model.parameters()).dtype == torch.float32
        tol = (1e-3 if fp32 else 5e-2) * (1.0 + float(want.abs().max()))
        if not err <= tol:
            raise ConfigError(f"dllm.kv_cache: value {self.mode!r}: the cached forward of {name} does not reproduce "
                              f"its full forward (max |Δlogit| {err:.3g} > {tol:.3g}; it must honour position_ids "
                              f"and an attention mask over cached keys); use dllm.kv_cache=none"
                              + (" or prefix" if self.mode == "dual" else ""))

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        """Completion logits (n, L, V) of the plain full forward (the policy's own)."""
        return self.policy.logits(x)[:, self.P:]


__all__ = ["KV_CACHES", "KVCache", "cache_layers", "eval_mode", "filled_cache"]
