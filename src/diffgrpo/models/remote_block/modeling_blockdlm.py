"""A small block-diffusion LM in the layout of the released SDAR / TraDo checkpoints, loaded as they are:
``AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)`` through ``auto_map`` in ``config.json``.
Standalone (imports torch and transformers only) so that a model directory can ship it as its own code.

Layout: ``model.embed_tokens``; ``model.layers[i]`` with ``input_layernorm``, ``self_attn.{q,k,v,o}_proj`` and the
per-head ``self_attn.{q,k}_norm``, ``post_attention_layernorm``, ``mlp.{gate,up,down}_proj`` (SwiGLU); ``model.norm``;
``lm_head``. RMSNorm, rotary positions (``rope_theta``), grouped-query attention (``num_key_value_heads``).
Position j scores token j.

Attention, as the released code: the caller passes the mask. ``attention_mask`` (B|1, 1, n, K) bool (True: may
attend) or additive float over the K = cached + n keys; None: block-causal over the positions (query i attends to
key j iff ⌊j / block_size⌋ <= ⌊i / block_size⌋), no padding. A 2-D padding mask is refused: this model does not
build its block mask from one. Cache: ``past_key_values`` (a transformers ``Cache``); with ``store_kv=True`` every
layer appends this forward's keys/values (``cache.update``) and attends to all of them, otherwise it attends to the
cached keys/values followed by its own and stores nothing.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from .configuration_blockdlm import BlockDLMConfig

try:
    from transformers.modeling_layers import GradientCheckpointingLayer as _Layer
except ImportError:  # older transformers: no activation checkpointing of the layers
    _Layer = nn.Module


class BlockDLMRMSNorm(nn.Module):
    def __init__(self, size, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x, pos, theta):
    """Rotary positions: x (B, H, n, d), pos (B|1, n) → (B, H, n, d); pairs (i, i + d/2) turn by pos · θ^(−2i/d)."""
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)  # (d/2,)
    ang = pos.float()[:, None, :, None] * freq  # (B|1, 1, n, d/2)
    cos, sin = ang.cos().to(x.dtype), ang.sin().to(x.dtype)
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def cached_layer(cache, i):
    """(keys, values) (B, H_kv, K, d) that ``cache`` holds for layer i, or None (both Cache layouts)."""
    if hasattr(cache, "layers"):
        layer = cache.layers[i] if i < len(cache.layers) else None
        return None if getattr(layer, "keys", None) is None or layer.keys.numel() == 0 else (layer.keys, layer.values)
    return (cache.key_cache[i], cache.value_cache[i]) if i < len(cache.key_cache) else None


def block_causal_mask(n, past, block_size, device):
    """(1, 1, n, past + n) bool: query at position past + i may attend key j iff block(j) <= block(past + i)."""
    q = past + torch.arange(n, device=device)
    k = torch.arange(past + n, device=device)
    return (k[None, :] // block_size <= q[:, None] // block_size)[None, None]


class BlockDLMAttention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.layer_idx, self.theta = layer_idx, c.rope_theta
        self.n_heads, self.n_kv = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = c.hidden_size // c.num_attention_heads
        d = self.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, c.hidden_size, bias=False)
        self.q_norm, self.k_norm = BlockDLMRMSNorm(d, c.rms_norm_eps), BlockDLMRMSNorm(d, c.rms_norm_eps)

    def forward(self, h, pos, mask, cache=None, store_kv=False):
        B, n, _ = h.shape
        q = rotate(self.q_norm(self.q_proj(h).view(B, n, -1, self.head_dim)).transpose(1, 2), pos, self.theta)
        k = rotate(self.k_norm(self.k_proj(h).view(B, n, -1, self.head_dim)).transpose(1, 2), pos, self.theta)
        v = self.v_proj(h).view(B, n, -1, self.head_dim).transpose(1, 2)  # (B, H_kv, n, d)
        if cache is not None and store_kv:
            k, v = cache.update(k, v, self.layer_idx)
        elif cache is not None and cached_layer(cache, self.layer_idx) is not None:
            pk, pv = cached_layer(cache, self.layer_idx)
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)  # (B, H, K, d)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, n, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, -1))


class BlockDLMMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class BlockDLMDecoderLayer(_Layer):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.input_layernorm = BlockDLMRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = BlockDLMRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn, self.mlp = BlockDLMAttention(c, layer_idx), BlockDLMMLP(c)

    def forward(self, x, pos, mask, cache=None, store_kv=False):
        x = x + self.self_attn(self.input_layernorm(x), pos, mask, cache, store_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockDLMPreTrainedModel(PreTrainedModel):
    config_class = BlockDLMConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["BlockDLMDecoderLayer"]

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=self.config.initializer_range)
        elif isinstance(module, BlockDLMRMSNorm):
            nn.init.ones_(module.weight)


class BlockDLMModel(BlockDLMPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([BlockDLMDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = BlockDLMRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, store_kv=False,
                **kw):
        n = input_ids.shape[1]
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        pos = (past + torch.arange(n, device=input_ids.device))[None] if position_ids is None else position_ids
        if attention_mask is None:
            attention_mask = block_causal_mask(n, past, self.config.block_size, input_ids.device)
        elif attention_mask.dim() != 4:
            raise ValueError("BlockDLM takes a 4-D attention mask (batch, 1, queries, keys), as the released "
                             "block-diffusion models do; it does not build its block mask from a padding mask")
        x = self.embed_tokens(input_ids)  # (B, n, D)
        for layer in self.layers:
            x = layer(x, pos, attention_mask, past_key_values, store_kv)
        return BaseModelOutputWithPast(last_hidden_state=self.norm(x), past_key_values=past_key_values)


class BlockDLMForCausalLM(BlockDLMPreTrainedModel):
    """Block-causal masked LM: ``forward(input_ids, attention_mask, position_ids, past_key_values, store_kv)`` →
    ``.logits`` (B, n, V), position j scoring token j."""

    def __init__(self, config):
        super().__init__(config)
        self.model = BlockDLMModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **kw):
        out = self.model(input_ids, attention_mask, position_ids, past_key_values, **kw)
        return CausalLMOutputWithPast(logits=self.lm_head(out.last_hidden_state), past_key_values=past_key_values)
