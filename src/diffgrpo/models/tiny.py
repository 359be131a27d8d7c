"""Built-in default model: a class-conditional flow-matching transformer on 16×16 digits.

The network is a real ``diffusers.SD3Transformer2DModel`` at a tiny config (joint text/image attention,
AdaLN timestep conditioning, patchified pixels), conditioned by a small word-level prompt encoder
("a handwritten digit 7"). It is pretrained with the rectified-flow objective
    L = E ||v_θ((1−σ)x₀ + σε, σ, c) − (ε − x₀)||²,  σ ~ logit-normal(0, 1),
on scikit-learn's digits (train split), with the prompt dropped to the null prompt with probability
``cond_dropout`` so classifier-free guidance works. Pretrained weights are cached per architecture/recipe
under the user cache directory and reused. It is served by the diffusers adapter
(:class:`~.diffusers_adapter.DiffusersFlowPolicy`, pipeline ``sd3``), see :func:`build_tiny_policy`.
"""
from __future__ import annotations

import hashlib
import json
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_root
from ..config import ModelConfig, PretrainConfig, RunConfig
from ..console import Steps
from ..data import NUMBER_WORDS, digits_split
from ..distributed import launched_local_rank, resolve_device
from . import words
from .diffusers_adapter import DiffusersFlowPolicy, PolicyOptions
from .pretraining import load_or_train, pretrain_step
from .reference import needs_reference
from .tiny_shapes import ROW as SHAPES_ROW
from .tiny_shapes import ShapesFlowNet, load_or_pretrain_shapes
from .tiny_shapes_video import ROW as SHAPES_VIDEO_ROW
from .tiny_shapes_video import ShapesVideoFlowNet, load_or_pretrain_shapes_video

VOCAB = ["<pad>", "<bos>", "<unk>", "a", "an", "the", "handwritten", "digit", "number", "of", "image", "picture",
         *[str(i) for i in range(10)], *NUMBER_WORDS]
MAX_TOKENS = 8


def tokenize(prompts: list[str]) -> torch.Tensor:
    """Word-level ids (B, MAX_TOKENS) over this model's VOCAB (see ``models.words.tokenize``)."""
    return words.tokenize(prompts, VOCAB, MAX_TOKENS)


def PromptEncoder(dim: int) -> words.WordPromptEncoder:
    """This model's prompt encoder: ``models.words.WordPromptEncoder`` over its VOCAB and MAX_TOKENS."""
    return words.WordPromptEncoder(dim, VOCAB, MAX_TOKENS)


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


def arch_kwargs(mcfg: ModelConfig) -> dict:
    return dict(image_size=mcfg.image_size, patch_size=mcfg.patch_size, num_layers=mcfg.num_layers,
                num_heads=mcfg.num_heads, head_dim=mcfg.head_dim, text_dim=mcfg.text_dim)


def _recipe_key(arch: dict, pcfg: PretrainConfig) -> str:
    blob = json.dumps({"arch": arch, "steps": pcfg.steps, "bs": pcfg.batch_size, "lr": pcfg.lr,
                       "drop": pcfg.cond_dropout, "seed": pcfg.seed, "v": 2}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _training_prompts(y: torch.Tensor, g: torch.Generator, dropout: float) -> list[str]:
    templates = ("a handwritten digit {d}", "digit {d}", "the number {w}", "{d}", "an image of the digit {d}")
    t_idx = torch.randint(len(templates), (len(y),), generator=g)
    drop = torch.rand(len(y), generator=g) < dropout
    return ["" if dr else templates[int(t)].format(d=int(d), w=NUMBER_WORDS[int(d)])
            for d, t, dr in zip(y, t_idx, drop)]


def pretrain(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True) -> TinyFlowNet:
    """Rectified-flow pretraining on the digits train split; returns the trained network (CPU, eval mode)."""
    g = torch.Generator().manual_seed(pcfg.seed)
    torch.manual_seed(pcfg.seed)
    (x_tr, y_tr), _ = digits_split(mcfg.image_size)
    x_tr = x_tr * 2 - 1  # data in [-1, 1]
    net = TinyFlowNet(**arch_kwargs(mcfg))
    opt = torch.optim.AdamW(net.parameters(), lr=pcfg.lr, weight_decay=0.0)
    warm = max(1, pcfg.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine decay to 0
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(i, pcfg.steps) / pcfg.steps)))
    bar = Steps(pcfg.steps, "pretraining built-in model", enabled=progress)  # a bar only on a terminal
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


def load_or_pretrain(mcfg: ModelConfig, pcfg: PretrainConfig, *, progress: bool = True, log=print) -> TinyFlowNet:
    """The cached pretrained network for this architecture and recipe; pretrains (and caches) it if absent."""
    arch = arch_kwargs(mcfg)
    path = cache_root(mcfg.cache_dir) / f"tiny-flow-{_recipe_key(arch, pcfg)}"
    return load_or_train(path, TinyFlowNet(**arch), lambda: pretrain(mcfg, pcfg, progress=progress),
                         {"arch": arch, "pretrain": vars(pcfg)}, what="built-in model", steps=pcfg.steps, log=log)


def decode_pixels(x: torch.Tensor) -> torch.Tensor:
    """Latents (B, 1, S, S) in [−1, 1] → images (B, 1, S, S) in [0, 1] (the model works in pixel space)."""
    return ((x.float() + 1) / 2).clamp(0, 1)


def build_tiny_policy(cfg: RunConfig, *, progress=True, log=print, pretrained=True) -> DiffusersFlowPolicy:
    """Adapter factory used by the trainer: cached pretrained network (or random init) → policy.

    The policy is a :class:`DiffusersFlowPolicy` (pipeline ``sd3``) over ``net.transformer``, with the frozen
    prompt encoder (``net.text.encode``) as its text encoder, the null prompt as the CFG negative prompt and
    :func:`decode_pixels` as its decoder. Trainable: the transformer, or with ``lora_rank`` > 0 only a peft
    LoRA adapter on it (default targets: SD3's joint-attention projections).
    """
    m = cfg.model
    cls, load, row = BUILT_IN_NETS[cfg.train.task]
    fresh = getattr(cls, "from_model", None) or (lambda mc: cls(**arch_kwargs(mc)))
    net = load(m, cfg.pretrain, progress=progress, log=log) if pretrained else fresh(m)
    device = resolve_device(m.device, launched_local_rank())  # the Trainer passes it resolved already
    text = net.text.to(device).eval().requires_grad_(False)  # frozen, as text encoders are in SD3 post-training
    options = PolicyOptions(guidance_scale=m.guidance_scale, negative_prompt="", device=device,
                            lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_target_modules=m.lora_target_modules,
                            keep_reference=needs_reference(cfg), mixed_precision=m.mixed_precision,
                            gradient_checkpointing=m.gradient_checkpointing)
    channels = net.transformer.config.in_channels  # 1 (digits) or 3 (shapes); a video net: (3, F, S, S)
    shape = getattr(net, "latent_shape", (channels, net.image_size, net.image_size))
    return DiffusersFlowPolicy(net.transformer, row, options, latent_shape=shape, encoder=text.encode,
                               decoder=decode_pixels)


# train.task → (network class, cached loader, pipeline row) of the built-in image model
BUILT_IN_NETS = {"digits": (TinyFlowNet, load_or_pretrain, "sd3"),
                 "shapes": (ShapesFlowNet, load_or_pretrain_shapes, SHAPES_ROW),
                 "shapes_video": (ShapesVideoFlowNet, load_or_pretrain_shapes_video, SHAPES_VIDEO_ROW)}

__all__ = ["BUILT_IN_NETS", "TinyFlowNet", "PromptEncoder", "build_tiny_policy", "decode_pixels", "load_or_pretrain", "pretrain",
           "tokenize"]
