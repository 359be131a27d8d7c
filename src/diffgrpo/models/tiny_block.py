"""The built-in block-diffusion masked LM (``model.name=tiny_block``): a transformers model whose attention is causal
across blocks of ``block_size`` positions and bidirectional inside one, so the keys and values of a finished block
never change and a cache of them is exact. Layout as released block-diffusion LMs (SDAR, TraDo): ``model.layers``
with ``self_attn.{q,k,v,o}_proj`` and ``mlp.{gate,up,down}_proj``, ``lm_head``; position j scores token j.

Attention: position i (block ⌊i / b⌋) attends to every non-padding key j with ⌊j / b⌋ <= ⌊i / b⌋, and always to
itself. Prompts are left-padded to a multiple of b (:func:`block_prompt_length`), so the completion starts at a
block boundary. Forward arguments: ``input_ids`` (B, n); ``attention_mask`` (B, K) the keys kept (2-D, K = cached +
n) or (B, 1, n, K) bool used as is (4-D); ``position_ids`` (B|1, n); ``past_key_values`` (a transformers ``Cache``
holding the keys/values of positions [0, K − n): each layer calls ``cache.update`` and attends to what it returns).

Pretraining (block diffusion, as SDAR trains): t ~ U(t_min, 1) per sequence, completion tokens masked with
probability t, every noisy block scored with the exact clean prefix as context, in one forward of the two streams
[x_0 ; x_t] (:func:`two_stream_keep`: a noisy position of block k sees the clean keys of blocks < k and the noisy
keys of block k):
    L = E_t [ (1/t) Σ_j 1[j masked] · −log p_θ(y_j | x_0[blocks < k_j], x_t[block k_j]) ] / L
the prompt never masked; the answer slips of :func:`~.hf_masked_lm.pretrain_tiny_mlm` as there. Weights are cached
per task/architecture/recipe under the cache directory.
"""
from __future__ import annotations

import functools
import hashlib
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_root
from ..config import PretrainConfig, RunConfig
from ..distributed import launched_local_rank, resolve_device
from ..tasks import VOCAB, get_task
from .block_cache import block_keep
from .hf_masked_lm import MaskedLMPolicy, cached_pretrained, pretrain_on_task
from .masked_lm_scale import configure_model

TINY_BLOCK_SIZE = 4  # the built-in model's attention block when dllm.block_length is 0
TINY_BLOCK_ARCH = dict(hidden_size=96, num_hidden_layers=3, num_attention_heads=4, intermediate_size=192)


def block_prompt_length(prompt_length: int, block_size: int) -> int:
    """The prompt length rounded up to a multiple of ``block_size`` (the completion starts at a block boundary)."""
    return -(-prompt_length // block_size) * block_size


def two_stream_keep(P: int, L: int, block_size: int, key_keep: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over [x_0 (P+L) ; x_t completion (L)]: clean queries block-causal over clean keys; a noisy query of
    block k sees the clean keys of blocks < k and the noisy keys of block k. key_keep (B, P+L) → (B|1, 1, N+L, N+L)."""
    N = P + L
    pos = torch.cat([torch.arange(N), P + torch.arange(L)])  # (N+L,)
    blk = pos // block_size
    noisy = torch.arange(N + L) >= N
    qb, kb = blk.unsqueeze(1), blk.unsqueeze(0)  # (N+L, 1), (1, N+L)
    qn, kn = noisy.unsqueeze(1), noisy.unsqueeze(0)
    clean_q = ~qn & ~kn & (kb <= qb)
    noisy_q = qn & ((~kn & (kb < qb)) | (kn & (kb == qb)))
    keep = (clean_q | noisy_q).unsqueeze(0)  # (1, N+L, N+L)
    if key_keep is not None:
        kk = torch.cat([key_keep.bool(), torch.ones(key_keep.shape[0], L, dtype=torch.bool, device=key_keep.device)], 1)
        keep = (keep.to(kk.device) & kk.unsqueeze(1)) | torch.eye(N + L, dtype=torch.bool, device=kk.device)
    return keep.unsqueeze(1)


class BlockAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.hidden_size
        self.n_heads = c.num_attention_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d)

    def forward(self, h, keep, cache, layer: int):
        B, n, D = h.shape
        heads = lambda t: t.view(B, n, self.n_heads, D // self.n_heads).transpose(1, 2)  # noqa: E731 (B, H, n, d)
        q, k, v = heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h))
        if cache is not None:
            k, v = cache.update(k, v, layer)  # (B, H, K, d): the cached keys then these
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)  # (B, H, n, d)
        return self.o_proj(out.transpose(1, 2).reshape(B, n, D))


class BlockMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class BlockLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(c.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(c.hidden_size)
        self.self_attn, self.mlp = BlockAttention(c), BlockMLP(c)

    def forward(self, x, keep=None, cache=None, layer: int = 0):
        x = x + self.self_attn(self.input_layernorm(x), keep, cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class BlockBase(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_positions = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.layers = nn.ModuleList([BlockLayer(c) for _ in range(c.num_hidden_layers)])
        self.norm = nn.LayerNorm(c.hidden_size)


def block_lm_forward(m: BlockBase, lm_head: nn.Linear, block_size: int, input_ids, attention_mask=None,
                     position_ids=None, past_key_values=None) -> torch.Tensor:
    """The model's forward (module docstring's arguments) → logits (B, n, V)."""
    dev, n = input_ids.device, input_ids.shape[1]
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    pos = (past + torch.arange(n, device=dev))[None] if position_ids is None else position_ids  # (B|1, n)
    keep = attention_mask
    if keep is None or keep.dim() == 2:
        k_pos = torch.cat([torch.arange(past, device=dev).expand(pos.shape[0], past), pos], 1)  # (B|1, K)
        keep = block_keep(pos, k_pos, block_size, keep)
    x = m.embed_tokens(input_ids) + m.embed_positions(pos)  # (B, n, D)
    for i, layer in enumerate(m.layers):
        x = layer(x, keep.bool(), past_key_values, i)
    return lm_head(m.norm(x))


@functools.cache
def block_lm_classes() -> tuple[type, type]:
    """(BlockLMConfig, TinyBlockLM): the transformers classes of the built-in block model (transformers is imported
    on first use, as :mod:`.hf_masked_lm` does), registered with ``AutoConfig`` / ``AutoModelForCausalLM`` so that an
    exported directory reloads with ``AutoModelForCausalLM.from_pretrained`` after this call."""
    from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import CausalLMOutput

    class BlockLMConfig(PretrainedConfig):
        model_type = "diffgrpo_block_lm"

        def __init__(self, vocab_size=32, hidden_size=96, num_hidden_layers=3, num_attention_heads=4,
                     intermediate_size=192, max_position_embeddings=64, block_size=TINY_BLOCK_SIZE, **kw):
            self.vocab_size, self.hidden_size, self.num_hidden_layers = vocab_size, hidden_size, num_hidden_layers
            self.num_attention_heads, self.intermediate_size = num_attention_heads, intermediate_size
            self.max_position_embeddings, self.block_size = max_position_embeddings, block_size
            super().__init__(**kw)

    class TinyBlockLM(PreTrainedModel):
        """Block-causal masked LM: ``forward(input_ids, attention_mask, position_ids, past_key_values) → .logits``."""

        config_class = BlockLMConfig
        base_model_prefix = "model"

        def __init__(self, config):
            super().__init__(config)
            self.model = BlockBase(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.LayerNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)

        def get_input_embeddings(self):
            return self.model.embed_tokens

        def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **kw):
            return CausalLMOutput(logits=block_lm_forward(self.model, self.lm_head, self.config.block_size,
                                                          input_ids, attention_mask, position_ids, past_key_values))

    # exported directories reload through the Auto classes once this module has built the classes
    AutoConfig.register(BlockLMConfig.model_type, BlockLMConfig, exist_ok=True)
    AutoModelForCausalLM.register(BlockLMConfig, TinyBlockLM, exist_ok=True)
    return BlockLMConfig, TinyBlockLM


def tiny_block_lm(vocab_size: int, *, max_positions: int, block_size: int = TINY_BLOCK_SIZE, **arch) -> nn.Module:
    """The built-in block model (:func:`block_lm_classes`) at a tiny size (no dropout)."""
    a = {**TINY_BLOCK_ARCH, **arch}
    config_cls, model_cls = block_lm_classes()
    return model_cls(config_cls(vocab_size=vocab_size, max_position_embeddings=max_positions,
                                     block_size=block_size, pad_token_id=VOCAB.pad_id, **a))


def block_diffusion_loss(net: nn.Module, prompt_ids: torch.Tensor, completion_ids: torch.Tensor, mask_id: int,
                         pad_id: int, generator: torch.Generator | None = None, t_min: float = 1e-3) -> torch.Tensor:
    """The module docstring's L. prompt_ids (B, P) (P a multiple of the block), completion_ids (B, L) → scalar."""
    B, L = completion_ids.shape
    P = prompt_ids.shape[1]
    t = t_min + (1 - t_min) * torch.rand(B, 1, generator=generator)  # (B, 1)
    m = torch.rand(B, L, generator=generator) < t  # (B, L)
    x0 = torch.cat([prompt_ids, completion_ids], 1)  # (B, N)
    xt = torch.where(m, torch.full_like(completion_ids, mask_id), completion_ids)  # (B, L)
    pos = torch.cat([torch.arange(P + L), P + torch.arange(L)]).unsqueeze(0)  # (1, N+L)
    keep = two_stream_keep(P, L, net.config.block_size, x0 != pad_id)
    logits = net(input_ids=torch.cat([x0, xt], 1), attention_mask=keep, position_ids=pos).logits[:, -L:]
    ce = F.cross_entropy(logits.reshape(B * L, -1), completion_ids.reshape(-1), reduction="none").view(B, L)
    return (ce * m / t).sum() / (B * L)


def _recipe_key(task: str, arch: dict, pcfg: PretrainConfig) -> str:
    recipe = {"task": task, "arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr,
              "seed": pcfg.seed, "kind": "block", "noise": pcfg.answer_noise, "v": 1}
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def pretrain_tiny_block(task, pcfg: PretrainConfig, *, block_size: int, progress: bool = True,
                        arch: dict | None = None) -> nn.Module:
    """Block-diffusion pretraining on the task's train split (answer slips as the tiny masked LM's). → eval mode."""
    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    P = block_prompt_length(task.prompt_length, block_size)
    net = tiny_block_lm(len(VOCAB), max_positions=P + task.gen_length, block_size=block_size, **(arch or {}))
    return pretrain_on_task(net, task, pcfg, P, g, f"pretraining tiny block dLLM ({task.name})", progress,
                            lambda prompts, target: block_diffusion_loss(net, prompts, target, VOCAB.mask_id,
                                                                         VOCAB.pad_id, generator=g))


def load_or_pretrain_block(task, pcfg: PretrainConfig, *, block_size: int = TINY_BLOCK_SIZE, cache_dir: str = "",
                           progress: bool = True, log=print, arch: dict | None = None) -> nn.Module:
    """The cached pretrained tiny block model for this task, block and recipe; pretrains (and caches) it if absent,
    under the entry's lock (concurrent runs and ranks pretrain once)."""
    a = {**TINY_BLOCK_ARCH, **(arch or {}), "block_size": block_size}
    path = cache_root(cache_dir) / f"tiny-block-{task.name}-{_recipe_key(task.name, a, pcfg)}"
    P = block_prompt_length(task.prompt_length, block_size)
    net = tiny_block_lm(len(VOCAB), max_positions=P + task.gen_length, **a)
    return cached_pretrained(net, path, lambda: pretrain_tiny_block(task, pcfg, block_size=block_size,
                                                                    progress=progress, arch=arch),
                             {"task": task.name, "arch": a, "pretrain": vars(pcfg)},
                             f"no cached tiny block dLLM at {path}; pretraining it ({pcfg.steps} steps, runs once)", log)


def build_tiny_block_policy(cfg: RunConfig, *, progress=True, log=print, pretrained=True) -> MaskedLMPolicy:
    """Factory for ``model.name=tiny_block``: the cached pretrained block model for ``dllm.task`` at the block
    ``dllm.block_length`` (0: :data:`TINY_BLOCK_SIZE`); the policy's ``block_size`` marks it block-causal."""
    task = get_task(cfg.dllm.task)
    b = cfg.dllm.block_length or TINY_BLOCK_SIZE
    if pretrained:
        net = load_or_pretrain_block(task, cfg.pretrain, block_size=b, cache_dir=cfg.model.cache_dir,
                                     progress=progress, log=log)
    else:
        net = tiny_block_lm(len(VOCAB), max_positions=block_prompt_length(task.prompt_length, b) + task.gen_length,
                            block_size=b)
    d = cfg.dllm
    net = configure_model(net, dtype=d.dtype, gradient_checkpointing=d.gradient_checkpointing, lora_rank=d.lora_rank,
                          lora_alpha=d.lora_alpha, lora_targets=d.lora_target_modules)
    device = resolve_device(cfg.model.device, launched_local_rank())
    return MaskedLMPolicy(net, vocab=VOCAB, device=device, keep_reference=cfg.loss.beta > 0, block_size=b)


__all__ = ["TINY_BLOCK_SIZE", "block_diffusion_loss", "block_keep", "block_lm_classes", "block_lm_forward",
           "block_prompt_length", "build_tiny_block_policy", "load_or_pretrain_block", "pretrain_tiny_block",
           "tiny_block_lm", "two_stream_keep"]
