"""Built-in model of the shapes task (``train.task=shapes``): a prompt-conditioned flow-matching transformer on
32 × 32 RGB scenes of coloured shapes (:mod:`diffgrpo.tasks.shapes`).

The network is the digits model's class at three channels: a real ``diffusers.SD3Transformer2DModel`` (joint
text/image attention, AdaLN timestep conditioning, patchified pixels in [−1, 1]; ``train.task=shapes`` sets 8-pixel
patches, so 16 image tokens, three blocks and a width of 4 heads × 32) under a word-level prompt encoder
over the task's grammar ("a red circle left of a blue square"): each word a learned embedding plus its position,
so the transformer's joint attention can bind colours to shapes and read counts and relations.

The transformer predicts the clean image x̂₀ and the velocity the samplers and engines use is derived from it,
    v_θ(x, σ, c) = (x − x̂₀(x, σ, c)) / max(σ, SIGMA_FLOOR),
exact for the rectified flow x = (1−σ)x₀ + σε (where ε − x₀ = (x − x₀)/σ). An 8-pixel patch holds 192 values, more
than the width: a transformer predicting v directly must carry every pixel's noise through that bottleneck and
leaves it in the samples, while x̂₀ is a smooth image. The policy calls the transformer through :data:`ROW` (SD3's
row with this forward), so every engine sees velocities as from any SD3 model; an exported transformer predicts
x̂₀ (its model card says so). Pretraining minimises the clean-image error, the rectified-flow loss weighted by σ²,
    L = E ||x̂₀((1−σ)x₀ + σε, σ, c) − x₀||²,  σ ~ logit-normal(0, 1),
on scenes rendered for **every** prompt of the grammar, held-out combinations included, as a text-to-image model
has seen red triangles before anyone fine-tunes it (categories drawn uniformly, then a prompt of the category, then
a layout with one object per cell of a 2 × 2 grid, jittered — ``shapes.layout(grid=True)``; RL may move objects
anywhere, the checker reads any layout; a pool of ``POOL`` scenes, fewer for a short run, rendered once, each also mirrored left ↔ right
with its relation swapped), the prompt dropped to the null prompt with probability ``cond_dropout`` so
classifier-free guidance works. RL trains on the train prompts only: the held-out prompts (colour–shape bindings,
counts and pairs RL never sees) measure whether what RL teaches carries over to prompts it did not train on. Weights are
cached like the digits model's (``tiny-shapes-<recipe hash>`` under the cache root, written atomically).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_root
from ..config import ModelConfig, PretrainConfig
from ..console import Steps
from ..tasks import shapes as task
from . import words
from .pipelines import sd3
from .pipelines.spec import ForwardArgs
from .pretraining import load_or_train, pretrain_step

VOCAB = ["<pad>", "<bos>", "<unk>", "a", "an", "and", "of", "left", "right", "above", "below",
         *task.NUMBERS.values(), *task.COLORS, *task.SHAPES, *(f"{s}s" for s in task.SHAPES)]
MAX_TOKENS = 10  # <bos> + the longest prompt ("a red circle left of a blue square": 8 words)
CHANNELS = 3
POOL = 6144  # scenes rendered once for pretraining (doubled by the mirror)
MIRROR = {"left of": "right of", "right of": "left of"}
RECIPE_VERSION = 3
SIGMA_FLOOR = 0.02  # v = (x − x̂₀) / max(σ, SIGMA_FLOOR): samplers never call the model below their last σ > 0


def clean_to_velocity(h: torch.Tensor, clean: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """v = (x − x̂₀) / max(σ, SIGMA_FLOOR): h, clean (N, C, ...) and sigma (N,) → velocity (N, C, ...)."""
    return (h - clean) / sigma.clamp_min(SIGMA_FLOOR).view(-1, *([1] * (h.dim() - 1))).to(h.dtype)


def velocity_from_clean(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs
                        ) -> torch.Tensor:
    """h (N, 3, S, S), sigma (N,) → velocity (N, 3, S, S) from the transformer's clean-image prediction."""
    return clean_to_velocity(h, sd3.forward(tr, h, sigma, cond, args), sigma)


ROW = dataclasses.replace(sd3.ROWS[0], forward=velocity_from_clean)  # SD3's row, velocity from x̂₀


def tokenize(prompts: list[str]) -> torch.Tensor:
    """Word-level ids (B, MAX_TOKENS) over this model's VOCAB (see ``models.words.tokenize``)."""
    return words.tokenize(prompts, VOCAB, MAX_TOKENS)


def ShapesPromptEncoder(dim: int) -> words.WordPromptEncoder:
    """This model's prompt encoder: ``models.words.WordPromptEncoder`` over its VOCAB and MAX_TOKENS."""
    return words.WordPromptEncoder(dim, VOCAB, MAX_TOKENS)


class ShapesFlowNet(nn.Module):
    """Prompt encoder + SD3 transformer on RGB pixels; ``forward`` predicts the velocity v (B, 3, S, S)."""

    def __init__(self, image_size=32, patch_size=4, num_layers=2, num_heads=4, head_dim=16, text_dim=32):
        super().__init__()
        from diffusers import SD3Transformer2DModel

        self.image_size = image_size
        self.text = ShapesPromptEncoder(text_dim)
        self.transformer = SD3Transformer2DModel(
            sample_size=image_size, patch_size=patch_size, in_channels=CHANNELS, out_channels=CHANNELS,
            num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
            joint_attention_dim=text_dim, caption_projection_dim=num_heads * head_dim,
            pooled_projection_dim=text_dim, pos_embed_max_size=image_size // patch_size)

    def clean(self, x, sigma, prompt_embeds, pooled):
        # x (B,3,S,S); sigma (B,) in [0,1] → x̂₀ (B,3,S,S); SD3 takes timesteps in [0, 1000]
        return self.transformer(hidden_states=x, encoder_hidden_states=prompt_embeds, pooled_projections=pooled,
                                timestep=sigma * 1000.0, return_dict=False)[0]

    def forward(self, x, sigma, prompt_embeds, pooled):
        """The velocity (B, 3, S, S), as the policy computes it through :data:`ROW`."""
        return velocity_from_clean(self.transformer, x, sigma, {"prompt_embeds": prompt_embeds, "pooled": pooled},
                                   ForwardArgs((self.image_size,) * 2, (CHANNELS, self.image_size, self.image_size), 1.0))


def arch_kwargs(mcfg: ModelConfig) -> dict:
    return dict(image_size=mcfg.image_size, patch_size=mcfg.patch_size, num_layers=mcfg.num_layers,
                num_heads=mcfg.num_heads, head_dim=mcfg.head_dim, text_dim=mcfg.text_dim)


def _recipe_key(arch: dict, pcfg: PretrainConfig) -> str:
    blob = json.dumps({"arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr, "pool": POOL,
                       "drop": pcfg.cond_dropout, "seed": pcfg.seed, "v": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def mirror(meta: dict) -> dict:
    """A record's left ↔ right mirror image: its relation swapped (upright triangles stay upright)."""
    include = [{**r, "position": [MIRROR.get(r["position"][0], r["position"][0]), r["position"][1]]}
               if "position" in r else r for r in meta["include"]]
    return {**meta, "include": include, "prompt": task.describe({**meta, "include": include})}


def scene_pool(n: int, image_size: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """``n`` scenes of the grammar's prompts and their mirrors → (images (2n, 3, S, S) in [−1, 1], prompts (2n,)):
    a category uniformly, a prompt of it uniformly, a random 2 × 2 grid layout."""
    rng = np.random.default_rng(seed)
    by_tag: dict[str, list[dict]] = {}
    for r in task.all_prompts():
        by_tag.setdefault(r["tag"], []).append(r)
    tags = sorted(by_tag)
    metas = [by_tag[t][rng.integers(len(by_tag[t]))] for t in (tags[i] for i in rng.integers(len(tags), size=n))]
    x = torch.stack([task.render(m, rng, image_size, grid=True) for m in metas])  # (n, 3, S, S)
    images = torch.cat([x, x.flip(-1)]) * 2 - 1  # (2n, 3, S, S)
    return images, [m["prompt"] for m in metas] + [mirror(m)["prompt"] for m in metas]


def _schedule(opt, steps: int):
    warm = max(1, steps // 20)  # linear warm-up, cosine decay to 0
    return torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, steps) / steps)))


def pretrain(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True, log=print) -> ShapesFlowNet:
    """Rectified-flow pretraining on rendered scenes of every prompt; returns the trained network (CPU, eval mode)."""
    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    x_all, prompts = scene_pool(min(POOL, pcfg.steps * pcfg.batch_size), mcfg.image_size, pcfg.seed)
    tokens = tokenize(prompts)  # (2n, L)
    null = tokenize([""])  # (1, L)
    net = ShapesFlowNet(**arch_kwargs(mcfg))
    opt = torch.optim.AdamW(net.parameters(), lr=pcfg.lr, weight_decay=0.0)
    sched = _schedule(opt, pcfg.steps)
    bar = Steps(pcfg.steps, "pretraining shapes model", enabled=progress, log=log)  # a bar only on a terminal
    ema = None
    for _ in bar:
        idx = torch.randint(len(prompts), (pcfg.batch_size,), generator=g)
        x0 = x_all[idx]  # (N, 3, S, S)
        drop = torch.rand(pcfg.batch_size, generator=g) < pcfg.cond_dropout
        tok = torch.where(drop[:, None], null, tokens[idx])  # (N, L)
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(pcfg.batch_size, generator=g))  # logit-normal (SD3)
        s = sigma.view(-1, 1, 1, 1)
        emb, pooled = net.text(tok)
        loss = F.mse_loss(net.clean((1 - s) * x0 + s * eps, sigma, emb, pooled), x0)  # clean-image error
        ema = pretrain_step(loss, net, opt, sched, bar, ema)
    return net.eval()


def load_or_pretrain_shapes(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True,
                            log=print) -> ShapesFlowNet:
    """The cached pretrained shapes network for this architecture and recipe; pretrains (and caches) it if absent."""
    arch = arch_kwargs(mcfg)
    path = cache_root(mcfg.cache_dir) / f"tiny-shapes-{_recipe_key(arch, pcfg)}"
    meta = {"arch": arch, "pretrain": vars(pcfg), "pool": POOL, "version": RECIPE_VERSION}
    return load_or_train(path, ShapesFlowNet(**arch), lambda: pretrain(mcfg, pcfg, progress=progress, log=log), meta,
                         what="shapes model", steps=pcfg.steps, log=log)


__all__ = ["ROW", "SIGMA_FLOOR", "clean_to_velocity", "ShapesFlowNet", "ShapesPromptEncoder", "load_or_pretrain_shapes", "mirror", "pretrain", "scene_pool",
           "tokenize", "velocity_from_clean"]
