"""Tiny LLaDA-style and Dream-style masked LMs as local remote-code model directories (their own ``modeling_*.py``
and ``configuration_*.py`` behind ``auto_map``, loadable only with ``trust_remote_code=True``), with a character
tokenizer that carries a chat template. Built by the tests, nothing downloaded.

LLaDA style: ``AutoModel`` → ``TinyLLaDAModelLM`` (``model.transformer.blocks``, q_proj/k_proj/v_proj/attn_out,
ff_proj/up_proj/ff_out), bidirectional, position j scores token j, mask token id configurable (the tokenizer has
none, as LLaDA's 126336 is not a tokenizer mask token). Dream style: ``AutoModel`` → ``TinyDreamModel``
(``model.layers`` with self_attn.{q,k,v,o}_proj and mlp.{gate,up,down}_proj), bidirectional, logits shifted as
Dream's: position j scores token j+1.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIALS = ["<pad>", "<|eot|>", "<|mask|>", "<|user|>", "<|assistant|>", "<|system|>", "<unk>"]
CHARS = list("0123456789+-=?# abcdefghijklmnopqrstuvwxyz.,\n")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|eot|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")

_CONFIG = '''
from transformers import PretrainedConfig


class {cls}(PretrainedConfig):
    model_type = "{mtype}"

    def __init__(self, vocab_size=64, d_model=32, n_layers=2, n_heads=2, mlp_hidden=64, max_positions=128,
                 mask_token_id=2, **kw):
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.mlp_hidden, self.max_positions, self.mask_token_id = mlp_hidden, max_positions, mask_token_id
        super().__init__(**kw)
'''

_COMMON = '''
import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput


def attend(q, k, v, n_heads, keep):
    """Bidirectional multi-head attention; keep (B, N) bool marks the keys that may be attended to."""
    B, N, D = q.shape
    split = lambda t: t.view(B, N, n_heads, D // n_heads).transpose(1, 2)  # noqa: E731
    mask = None if keep is None else keep[:, None, None, :]
    out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
    return out.transpose(1, 2).reshape(B, N, D)


class TinyPreTrained(PreTrainedModel):
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.2)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
'''

_LLADA = _COMMON + '''
from .configuration_tinyllada import TinyLLaDAConfig


class LLaDABlock(GradientCheckpointingLayer):
    def __init__(self, c):
        super().__init__()
        d = c.d_model
        self.n_heads = c.n_heads
        self.attn_norm, self.ff_norm = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q_proj, self.k_proj = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.attn_out = nn.Linear(d, d, bias=False)
        self.ff_proj, self.up_proj = nn.Linear(d, c.mlp_hidden, bias=False), nn.Linear(d, c.mlp_hidden, bias=False)
        self.ff_out = nn.Linear(c.mlp_hidden, d, bias=False)

    def forward(self, x, keep=None):
        h = self.attn_norm(x)
        x = x + self.attn_out(attend(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.n_heads, keep))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDATransformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(c.vocab_size, c.d_model), nn.Embedding(c.max_positions, c.d_model)
        self.blocks = nn.ModuleList([LLaDABlock(c) for _ in range(c.n_layers)])
        self.ln_f = nn.LayerNorm(c.d_model)
        self.ff_out = nn.Linear(c.d_model, c.vocab_size, bias=False)


class LLaDAModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = LLaDATransformer(c)


class TinyLLaDAModelLM(TinyPreTrained):
    config_class = TinyLLaDAConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = LLaDAModel(config)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.transformer.wte

    def forward(self, input_ids, attention_mask=None, **kw):
        t = self.model.transformer
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = t.wte(input_ids) + t.wpe(pos)[None]
        keep = None if attention_mask is None else attention_mask.bool()
        for block in t.blocks:
            x = block(x, keep)
        return CausalLMOutput(logits=t.ff_out(t.ln_f(x)))  # position j scores token j (no shift)
'''

_DREAM = _COMMON + '''
from .configuration_tinydream import TinyDreamConfig


class DreamAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d = c.d_model
        self.n_heads = c.n_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, h, keep):
        return self.o_proj(attend(self.q_proj(h), self.k_proj(h), self.v_proj(h), self.n_heads, keep))


class DreamMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.mlp_hidden, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.mlp_hidden, bias=False)
        self.down_proj = nn.Linear(c.mlp_hidden, c.d_model, bias=False)

    def forward(self, h):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class DreamLayer(GradientCheckpointingLayer):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.LayerNorm(c.d_model), nn.LayerNorm(c.d_model)
        self.self_attn, self.mlp = DreamAttention(c), DreamMLP(c)

    def forward(self, x, keep=None):
        x = x + self.self_attn(self.input_layernorm(x), keep)
        return x + self.mlp(self.post_attention_layernorm(x))


class DreamBase(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.embed_positions = nn.Embedding(c.max_positions, c.d_model)
        self.layers = nn.ModuleList([DreamLayer(c) for _ in range(c.n_layers)])
        self.norm = nn.LayerNorm(c.d_model)


class TinyDreamModel(TinyPreTrained):
    config_class = TinyDreamConfig
    base_model_prefix = "model"

    def __init__(self, config):
        super().__init__(config)
        self.model = DreamBase(config)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def forward(self, input_ids, attention_mask=None, **kw):
        m = self.model
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = m.embed_tokens(input_ids) + m.embed_positions(pos)[None]
        keep = None if attention_mask is None else attention_mask.bool()
        for layer in m.layers:
            x = layer(x, keep)
        return CausalLMOutput(logits=self.lm_head(m.norm(x)))  # Dream: position j scores token j+1
'''

# Dream style that takes a key/value cache as transformers models do: ``past_key_values`` (a ``Cache``: each
# attention calls ``cache.update(k, v, layer)`` and attends to what it returns) and ``position_ids``
_DREAM_CACHE = _DREAM.replace("tinydream", "tinydreamcache").replace("TinyDreamConfig", "TinyDreamCacheConfig") + '''


def attend_keys(q, k, v, n_heads, keep):
    """q (B, H, n, d) against k, v (B, H, K, d); keep (B, K) bool."""
    mask = None if keep is None else keep[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)


class TinyDreamCacheModel(TinyDreamModel):
    config_class = TinyDreamCacheConfig

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, **kw):
        m = self.model
        B, n = input_ids.shape
        pos = torch.arange(n, device=input_ids.device)[None] if position_ids is None else position_ids
        x = m.embed_tokens(input_ids) + m.embed_positions(pos)
        keep = None if attention_mask is None else attention_mask.bool()
        for i, layer in enumerate(m.layers):
            a = layer.self_attn
            h = layer.input_layernorm(x)
            heads = lambda t: t.view(B, n, a.n_heads, -1).transpose(1, 2)  # noqa: E731
            q, k, v = heads(a.q_proj(h)), heads(a.k_proj(h)), heads(a.v_proj(h))
            if past_key_values is not None:
                k, v = past_key_values.update(k, v, i)
            x = x + a.o_proj(attend_keys(q, k, v, a.n_heads, keep))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return CausalLMOutput(logits=self.lm_head(m.norm(x)))  # Dream: position j scores token j+1
'''

KINDS = {"llada": ("tinyllada", "TinyLLaDAConfig", "TinyLLaDAModelLM", _LLADA),
         "dream": ("tinydream", "TinyDreamConfig", "TinyDreamModel", _DREAM),
         "dream_cache": ("tinydreamcache", "TinyDreamCacheConfig", "TinyDreamCacheModel", _DREAM_CACHE)}


def char_tokenizer(mask_token: bool):
    """A character-level fast tokenizer with the chat template (``mask_token``: whether it names <|mask|>)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(SPECIALS + CHARS)}
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(SPECIALS)
    kw = {"mask_token": "<|mask|>"} if mask_token else {}
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|eot|>", unk_token="<unk>", **kw)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_remote_model(directory: Path, kind: str = "llada", seed: int = 0, n_layers: int = 2, **size) -> Path:
    """Write a tiny ``kind`` model directory (weights, tokenizer, its own code behind ``auto_map``) → its path.
    ``size``: config overrides (d_model, n_heads, mlp_hidden, max_positions)."""
    import importlib.util
    import sys

    import torch

    stem, cfg_cls, model_cls, modeling = KINDS[kind]
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"configuration_{stem}.py").write_text(_CONFIG.format(cls=cfg_cls, mtype=kind.replace("_", "")))
    (d / f"modeling_{stem}.py").write_text(modeling)
    tok = char_tokenizer(mask_token=kind.startswith("dream"))
    # build the weights with the directory's own code (imported as a package from a private name)
    pkg = f"_diffgrpo_test_{stem}_{abs(hash(str(d)))}"
    (d / "__init__.py").write_text("")
    spec = importlib.util.spec_from_file_location(pkg, d / "__init__.py", submodule_search_locations=[str(d)])
    mod = importlib.util.module_from_spec(spec)
    sys.modules[pkg] = mod
    spec.loader.exec_module(mod)
    conf = importlib.import_module(f"{pkg}.configuration_{stem}")
    modl = importlib.import_module(f"{pkg}.modeling_{stem}")
    cfg = getattr(conf, cfg_cls)(vocab_size=len(tok), n_layers=n_layers, pad_token_id=tok.pad_token_id,
                                 mask_token_id=tok.convert_tokens_to_ids("<|mask|>"), eos_token_id=tok.eos_token_id,
                                 **size)
    cfg.auto_map = {"AutoConfig": f"configuration_{stem}.{cfg_cls}", "AutoModel": f"modeling_{stem}.{model_cls}"}
    torch.manual_seed(seed)
    model = getattr(modl, model_cls)(cfg).eval()
    model.save_pretrained(str(d))
    tok.save_pretrained(str(d))
    (d / "__init__.py").unlink()
    data = json.loads((d / "config.json").read_text())
    assert data["auto_map"]["AutoModel"].startswith("modeling_"), data
    return d


__all__ = ["build_remote_model", "char_tokenizer", "CHAT_TEMPLATE", "SPECIALS", "CHARS"]
