"""Built-in default policy: a class-conditional flow-matching transformer on 16×16 digits.

The network is a real ``diffusers.SD3Transformer2DModel`` at a tiny config (joint text/image attention,
AdaLN timestep conditioning, patchified pixels), conditioned by a small word-level prompt encoder
("a handwritten digit 7"). It is pretrained with the rectified-flow objective
    L = E ||v_θ((1−σ)x₀ + σε, σ, c) − (ε − x₀)||²,  σ ~ logit-normal(0, 1),
on scikit-learn's digits (train split), with the prompt dropped to the null prompt with probability
``cond_dropout`` so classifier-free guidance works. Pretrained weights are cached per architecture/recipe
under the user cache directory and reused.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_lock, cache_root, save_dir_atomic
from ..data import NUMBER_WORDS, digits_split
from .lora import adapter_disabled, add_lora, load_lora_state_dict, lora_state_dict
from .pretraining import pretrain_step
from .reference import frozen_reference

VOCAB = ["<pad>", "<bos>", "<unk>", "a", "an", "the", "handwritten", "digit", "number", "of", "image", "picture",
         *[str(i) for i in range(10)], *NUMBER_WORDS]
MAX_TOKENS = 8


def tokenize(prompts: list[str]) -> torch.Tensor:
    """Word-level ids (B, MAX_TOKENS): <bos> then words; unknown words map to <unk>; padded with <pad>."""
    idx = {w: i for i, w in enumerate(VOCAB)}
    out = torch.zeros(len(prompts), MAX_TOKENS, dtype=torch.long)
    for b, p in enumerate(prompts):
        words = p.lower().replace(",", " ").replace(".", " ").split()[: MAX_TOKENS - 1]
        ids = [idx["<bos>"]] + [idx.get(w, idx["<unk>"]) for w in words]
        out[b, : len(ids)] = torch.tensor(ids)
    return out


class PromptEncoder(nn.Module):
    """Tokens (B, L) → sequence embeddings (B, L, D) and pooled embedding (B, D)."""

    def __init__(self, dim: int):
        super().__init__()
        self.tok = nn.Embedding(len(VOCAB), dim)
        self.pos = nn.Parameter(torch.zeros(MAX_TOKENS, dim))
        self.mix = nn.Sequential(nn.Linear(dim, dim), nn.GELU(), nn.Linear(dim, dim))
        self.pool = nn.Linear(dim, dim)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.tok(tokens) + self.pos  # (B, L, D)
        h = h + self.mix(h)
        m = (tokens != 0).float().unsqueeze(-1)  # (B, L, 1)
        pooled = self.pool((h * m).sum(1) / m.sum(1).clamp(min=1))  # (B, D)
        return h, pooled


class TinyFlowNet(nn.Module):
    """Prompt encoder + SD3 transformer; ``forward`` predicts the velocity v (B, 1, S, S)."""

    def __init__(self, image_size=16, patch_size=2, num_layers=2, num_heads=4, head_dim=16, text_dim=32):
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.image_size = image_size
        self.text = PromptEncoder(text_dim)
        self.transformer = SD3Transformer2DModel(
            sample_size=image_size, patch_size=patch_size, in_channels=1, out_channels=1,
            num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
            joint_attention_dim=text_dim, caption_projection_dim=num_heads * head_dim,
            pooled_projection_dim=text_dim, pos_embed_max_size=image_size // patch_size)

    def forward(self, x, sigma, prompt_embeds, pooled):
        # x (B,1,S,S); sigma (B,) in [0,1]; SD3 takes timesteps in [0, 1000]
        return self.transformer(hidden_states=x, encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
                                timestep=sigma * 1000.0, return_dict=False)[0]


def arch_kwargs(mcfg) -> dict:
    return dict(image_size=mcfg.image_size, patch_size=mcfg.patch_size, num_layers=mcfg.num_layers,
                num_heads=mcfg.num_heads, head_dim=mcfg.head_dim, text_dim=mcfg.text_dim)


def _recipe_key(arch: dict, pcfg) -> str:
    blob = json.dumps({"arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr,
                       "drop": pcfg.cond_dropout, "seed": pcfg.seed, "v": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _training_prompts(y: torch.Tensor, g: torch.Generator, dropout: float) -> list[str]:
    templates = ("a handwritten digit {d}", "digit {d}", "the number {w}", "{d}", "an image of the digit {d}")
    t_idx = torch.randint(len(templates), (len(y),), generator=g)
    drop = torch.rand(len(y), generator=g) < dropout
    return ["" if dr else templates[int(t)].format(d=int(d), w=NUMBER_WORDS[int(d)])
            for d, t, dr in zip(y, t_idx, drop)]


def pretrain(mcfg, pcfg, *, progress: bool = True) -> TinyFlowNet:
    """Rectified-flow pretraining on the digits train split; returns the trained network (CPU, eval mode)."""
    from tqdm.auto import tqdm

    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    (x_tr, y_tr), _ = digits_split(mcfg.image_size)
    x_tr = x_tr * 2 - 1  # data in [-1, 1]
    net = TinyFlowNet(**arch_kwargs(mcfg))
    opt = torch.optim.AdamW(net.parameters(), lr=pcfg.lr, weight_decay=0.0)
    warm = max(1, pcfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay to 0
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, pcfg.steps) / pcfg.steps)))
    bar = tqdm(range(pcfg.steps), desc="pretraining built-in model", disable=not progress, leave=False)
    ema = None
    for _ in bar:
        idx = torch.randint(len(y_tr), (pcfg.batch_size,), generator=g)
        x0, y = x_tr[idx], y_tr[idx]  # (N,1,S,S), (N,)
        # light augmentation: ±1 px shifts keep the small data set from being memorised
        shift = torch.randint(-1, 2, (2,), generator=g)
        x0 = torch.roll(x0, shifts=(int(shift[0]), int(shift[1])), dims=(2, 3))
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(pcfg.batch_size, generator=g))  # logit-normal (SD3)
        s = sigma.view(-1, 1, 1, 1)
        xt = (1 - s) * x0 + s * eps
        emb, pooled = net.text(tokenize(_training_prompts(y, g, pcfg.cond_dropout)))
        loss = F.mse_loss(net(xt, sigma, emb, pooled), eps - x0)
        ema = pretrain_step(loss, net, opt, sched, bar, ema)
    return net.eval()


def load_or_pretrain(mcfg, pcfg, *, progress: bool = True, log=print) -> TinyFlowNet:
    """The cached pretrained network for this architecture and recipe; pretrains (and caches) it if absent."""
    from safetensors.torch import load_file, save_file

    arch = arch_kwargs(mcfg)
    path = cache_root(mcfg.cache_dir) / f"tiny-flow-{_recipe_key(arch, pcfg)}"
    net = TinyFlowNet(**arch)
    with cache_lock(path):  # concurrent runs (or torchrun ranks) pretrain once and share the result
        if not (path / "model.safetensors").is_file():
            log(f"no cached built-in model at {path}; pretraining it ({pcfg.steps} steps, runs once)")
            trained = pretrain(mcfg, pcfg, progress=progress)

            def write(tmp: Path):
                save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp / "model.safetensors"))
                (tmp / "config.json").write_text(json.dumps({"arch": arch, "pretrain": vars(pcfg)}, indent=2))

            save_dir_atomic(path, write)
    net.load_state_dict(load_file(str(path / "model.safetensors")))
    return net.eval()


class TinyFlowPolicy:
    """Policy adapter for :class:`TinyFlowNet` (pixel space, grayscale, data in [−1, 1]).

    Trainable: the transformer (the prompt encoder is frozen, as text encoders are in SD3 post-training), or,
    with ``lora_rank`` > 0, only a peft LoRA adapter on it (default targets: SD3's joint-attention projections;
    see :mod:`.lora`). Reference policy: with LoRA the transformer with the adapter disabled; otherwise a frozen
    copy of the initial transformer, made on construction when ``keep_reference``. ``state_dict`` holds the
    trainable weights (the adapter alone with LoRA).
    ``counters`` counts sample-forwards with and without grad (a CFG call counts two per sample).
    """

    def __init__(self, net: TinyFlowNet, *, guidance_scale: float = 1.0, device="cpu", keep_reference=False,
                 lora_rank: int = 0, lora_alpha: float = 0.0, lora_target_modules: str | tuple | list = ""):
        self.net = net.to(device)
        self.device = torch.device(device)
        self.guidance_scale = float(guidance_scale)
        self.latent_shape = (1, net.image_size, net.image_size)
        for p in self.net.text.parameters():
            p.requires_grad_(False)
        self.lora_rank = int(lora_rank)
        if self.lora_rank > 0:
            add_lora(self.net.transformer, self.lora_rank, lora_alpha, lora_target_modules)
        self.net.transformer.train()
        self._ref = (copy.deepcopy(self.net.transformer).requires_grad_(False)
                     if keep_reference and not self.lora_rank else None)
        self._use_ref = False
        self.counters = {"forwards_grad": 0, "forwards_nograd": 0}
        # data parallel: the wrapper forwards go through (DDP / FSDP2, set by the trainer); None = net.transformer.
        # Weights, state dicts and trainable parameters stay on net.transformer.
        self.forward_module = None

    @property
    def uses_cfg(self) -> bool:
        return self.guidance_scale != 1.0

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.net.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.net.transformer.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """→ {"prompt_embeds": (B, L, D), "pooled": (B, D)} plus the null prompt's when CFG is on."""
        emb, pooled = self.net.text(tokenize(prompts).to(self.device))
        cond = {"prompt_embeds": emb, "pooled": pooled}
        if self.uses_cfg:
            n_emb, n_pooled = self.net.text(tokenize([""]).to(self.device))
            cond["neg_prompt_embeds"] = n_emb.expand_as(emb).contiguous()
            cond["neg_pooled"] = n_pooled.expand_as(pooled).contiguous()
        return cond

    def reference(self):
        """Inside the block ``velocity`` uses the reference weights (LoRA disabled, or the frozen copy)."""
        return adapter_disabled(self.net.transformer) if self.lora_rank else frozen_reference(self)

    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """x (B, 1, S, S), sigma (B,) → guided velocity (B, 1, S, S) float32."""
        tr = self._ref if self._use_ref else (self.forward_module if self.forward_module is not None
                                              else self.net.transformer)
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(x.shape[0])
        emb, pooled = cond["prompt_embeds"], cond["pooled"]
        n = x.shape[0] * (2 if self.uses_cfg else 1)
        self.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += n
        if self.uses_cfg:
            xx = torch.cat([x, x])
            ee = torch.cat([emb, cond["neg_prompt_embeds"]])
            pp = torch.cat([pooled, cond["neg_pooled"]])
            out = tr(hidden_states=xx, encoder_hidden_states=ee, pooled_projections=pp,
                     timestep=torch.cat([sigma, sigma]) * 1000.0, return_dict=False)[0].float()
            v_c, v_u = out.chunk(2)
            return v_u + self.guidance_scale * (v_c - v_u)
        return tr(hidden_states=x, encoder_hidden_states=emb, pooled_projections=pooled,
                  timestep=sigma * 1000.0, return_dict=False)[0].float()

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents (B, 1, S, S) in [−1, 1] → images (B, 1, S, S) in [0, 1]."""
        return ((x.float() + 1) / 2).clamp(0, 1)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights: the LoRA adapter (peft names) or the whole transformer."""
        if self.lora_rank:
            return lora_state_dict(self.net.transformer)
        return {k: v.detach().contiguous() for k, v in self.net.transformer.state_dict().items()}

    def load_state_dict(self, sd):
        if self.lora_rank:
            load_lora_state_dict(self.net.transformer, sd)
        else:
            self.net.transformer.load_state_dict(sd)


def build_tiny_policy(cfg, *, progress=True, log=print, pretrained=True) -> TinyFlowPolicy:
    """Adapter factory used by the trainer: cached pretrained network (or random init) → policy."""
    net = load_or_pretrain(cfg.model, cfg.pretrain, progress=progress, log=log) if pretrained else \
        TinyFlowNet(**arch_kwargs(cfg.model))
    m = cfg.model
    return TinyFlowPolicy(net, guidance_scale=m.guidance_scale, device=m.device, keep_reference=cfg.loss.beta > 0,
                          lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_target_modules=m.lora_target_modules)


__all__ = ["TinyFlowNet", "TinyFlowPolicy", "PromptEncoder", "build_tiny_policy", "load_or_pretrain", "pretrain",
           "tokenize"]
