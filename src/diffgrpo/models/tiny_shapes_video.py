"""Built-in model of the shapes_video task (``train.task=shapes_video``): a prompt-conditioned flow-matching video
transformer on 32 × 32 RGB clips of moving shapes (:mod:`diffgrpo.tasks.shapes_video`), served through Wan's row.

The network is a real ``diffusers.WanTransformer3DModel`` at a tiny config (3-D patches of 1 frame × 8 × 8 pixels,
so 16 tokens per frame, 3-D rotary positions, cross-attention to the prompt, timestep modulation) on pixels in
[−1, 1] in diffusers' video layout (C, F, H, W), under the word-level prompt encoder of the built-in image models
(:mod:`.words`) over this task's grammar ("a red circle moving left and a blue square moving up").

As the shapes model, the transformer predicts the clean clip x̂₀ and the velocity the samplers and engines use is
derived from it, v = (x − x̂₀) / max(σ, SIGMA_FLOOR) (exact for the rectified flow x = (1−σ)x₀ + σε); the policy
calls it through :data:`ROW` (Wan's row with this forward). Pretraining minimises the clean-clip error
    L = E ||x̂₀((1−σ)x₀ + σε, σ, c) − x₀||²,  σ ~ logit-normal(0, 1),
on clips rendered for the **train** prompts only (a category uniformly, then a prompt of it; a pool of ``POOL``
clips, fewer for a short run, rendered once, each also mirrored left ↔ right and played backwards, with the
directions its prompt names changed to match), the prompt dropped to the null prompt with probability
``cond_dropout`` so classifier-free guidance works. Weights are cached like the shapes model's
(``tiny-shapes-video-<recipe hash>`` under the cache root, written atomically).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_root
from ..config import ModelConfig, PretrainConfig
from ..console import Steps
from ..tasks import shapes
from ..tasks import shapes_video as task
from . import words
from .pipelines import wan
from .pipelines.spec import ForwardArgs
from .pretraining import load_or_train, pretrain_step
from .tiny_shapes import _schedule, clean_to_velocity

VOCAB = ["<pad>", "<bos>", "<unk>", "a", "an", "and", "moving", *task.DIRECTIONS, *shapes.COLORS, *shapes.SHAPES]
MAX_TOKENS = 12  # <bos> + the longest prompt (11 words)
CHANNELS = 3
POOL = 2048  # clips rendered once for pretraining (×4 by the mirror and the reversal)
RECIPE_VERSION = 1
MIRROR = {"left": "right", "right": "left"}
REVERSE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def velocity_from_clean(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs
                        ) -> torch.Tensor:
    """h (N, 3, F, S, S), sigma (N,) → velocity (N, 3, F, S, S) from the transformer's clean-clip prediction."""
    return clean_to_velocity(h, wan.forward(tr, h, sigma, cond, args), sigma)


ROW = dataclasses.replace(wan.ROWS[0], forward=velocity_from_clean)  # Wan's row, velocity from x̂₀


def tokenize(prompts: list[str]) -> torch.Tensor:
    """Word-level ids (B, MAX_TOKENS) over this model's VOCAB (see ``models.words.tokenize``)."""
    return words.tokenize(prompts, VOCAB, MAX_TOKENS)


class ShapesVideoFlowNet(nn.Module):
    """Prompt encoder + Wan transformer on RGB clips; ``clean`` predicts x̂₀ (B, 3, F, S, S)."""

    def __init__(self, image_size=32, num_frames=task.NUM_FRAMES, patch_size=8, num_layers=3, num_heads=4,
                 head_dim=32, text_dim=32):
        super().__init__()
        from diffusers import WanTransformer3DModel

        self.image_size, self.num_frames = image_size, num_frames
        self.latent_shape = (CHANNELS, num_frames, image_size, image_size)
        self.text = words.WordPromptEncoder(text_dim, VOCAB, MAX_TOKENS)
        self.transformer = WanTransformer3DModel(
            patch_size=(1, patch_size, patch_size), num_attention_heads=num_heads, attention_head_dim=head_dim,
            in_channels=CHANNELS, out_channels=CHANNELS, text_dim=text_dim, freq_dim=32, ffn_dim=2 * num_heads * head_dim,
            num_layers=num_layers, rope_max_seq_len=32)

    @classmethod
    def from_model(cls, mcfg: ModelConfig) -> ShapesVideoFlowNet:
        """A randomly initialised network of the ``model.*`` architecture."""
        return cls(**arch_kwargs(mcfg))

    def clean(self, x, sigma, prompt_embeds):
        # x (B, 3, F, S, S); sigma (B,) in [0, 1] → x̂₀ (B, 3, F, S, S); Wan takes timesteps in [0, 1000]
        return self.transformer(hidden_states=x, encoder_hidden_states=prompt_embeds, timestep=sigma * 1000.0,
                                return_dict=False)[0]


def arch_kwargs(mcfg: ModelConfig) -> dict:
    return dict(image_size=mcfg.image_size, num_frames=mcfg.num_frames, patch_size=mcfg.patch_size,
                num_layers=mcfg.num_layers, num_heads=mcfg.num_heads, head_dim=mcfg.head_dim, text_dim=mcfg.text_dim)


def _recipe_key(arch: dict, pcfg: PretrainConfig) -> str:
    blob = json.dumps({"arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr, "pool": POOL,
                       "drop": pcfg.cond_dropout, "seed": pcfg.seed, "v": RECIPE_VERSION}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _renamed(meta: dict, change: dict) -> str:
    return task.describe({"include": [{**r, "motion": change.get(r["motion"], r["motion"])} for r in meta["include"]]})


def clip_pool(n: int, image_size: int, num_frames: int, seed: int) -> tuple[torch.Tensor, list[str]]:
    """``n`` clips of the train prompts, their mirrors, reversals and both → (clips (4n, 3, F, S, S) in [−1, 1],
    prompts (4n,))."""
    rng = np.random.default_rng(seed)
    by_tag: dict[str, list[dict]] = {}
    for r in task.prompts("train"):
        by_tag.setdefault(r["tag"], []).append(r)
    tags = sorted(by_tag)
    metas = [by_tag[t][rng.integers(len(by_tag[t]))] for t in (tags[i] for i in rng.integers(len(tags), size=n))]
    x = torch.stack([task.render(m, rng, image_size, num_frames) for m in metas])  # (n, 3, F, S, S)
    both = {"up": "down", "down": "up"}  # mirrored then played backwards
    clips = torch.cat([x, x.flip(-1), x.flip(2), x.flip(-1).flip(2)]) * 2 - 1  # (4n, 3, F, S, S)
    texts = [m["prompt"] for m in metas] + [_renamed(m, MIRROR) for m in metas] + \
        [_renamed(m, REVERSE) for m in metas] + [_renamed(m, both) for m in metas]
    return clips, texts


def pretrain(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True, log=print) -> ShapesVideoFlowNet:
    """Rectified-flow pretraining on rendered train-prompt clips; returns the trained network (CPU, eval mode)."""
    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    x_all, prompts = clip_pool(min(POOL, pcfg.steps * pcfg.batch_size), mcfg.image_size, mcfg.num_frames, pcfg.seed)
    tokens, null = tokenize(prompts), tokenize([""])  # (4n, L), (1, L)
    net = ShapesVideoFlowNet(**arch_kwargs(mcfg))
    opt = torch.optim.AdamW(net.parameters(), lr=pcfg.lr, weight_decay=0.0)
    sched = _schedule(opt, pcfg.steps)
    bar = Steps(pcfg.steps, "pretraining shapes_video model", enabled=progress, log=log)
    ema = None
    for _ in bar:
        idx = torch.randint(len(prompts), (pcfg.batch_size,), generator=g)
        x0 = x_all[idx]  # (N, 3, F, S, S)
        drop = torch.rand(pcfg.batch_size, generator=g) < pcfg.cond_dropout
        tok = torch.where(drop[:, None], null, tokens[idx])  # (N, L)
        eps = torch.randn(x0.shape, generator=g)
        sigma = torch.sigmoid(torch.randn(pcfg.batch_size, generator=g))  # logit-normal (SD3)
        s = sigma.view(-1, 1, 1, 1, 1)
        emb, _ = net.text(tok)
        loss = F.mse_loss(net.clean((1 - s) * x0 + s * eps, sigma, emb), x0)  # clean-clip error
        ema = pretrain_step(loss, net, opt, sched, bar, ema)
    return net.eval()


def load_or_pretrain_shapes_video(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True,
                                  log=print) -> ShapesVideoFlowNet:
    """The cached pretrained network for this architecture and recipe; pretrains (and caches) it if absent."""
    arch = arch_kwargs(mcfg)
    path = cache_root(mcfg.cache_dir) / f"tiny-shapes-video-{_recipe_key(arch, pcfg)}"
    meta = {"arch": arch, "pretrain": vars(pcfg), "pool": POOL, "version": RECIPE_VERSION}
    return load_or_train(path, ShapesVideoFlowNet(**arch), lambda: pretrain(mcfg, pcfg, progress=progress, log=log),
                         meta, what="shapes_video model", steps=pcfg.steps, log=log)


__all__ = ["ROW", "ShapesVideoFlowNet", "arch_kwargs", "clip_pool", "load_or_pretrain_shapes_video", "pretrain",
           "tokenize", "velocity_from_clean"]
