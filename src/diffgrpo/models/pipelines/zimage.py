"""Z-Image (``ZImagePipeline``, ``ZImageTransformer2DModel``).

The transformer takes the timestep 1 − σ, a per-sample list of (C, 1, H, W) latents and each prompt's unpadded
caption features, and predicts −v. Its pipeline's guidance g (pos + g·(pos − neg), 0 = off) is
model.guidance_scale = g + 1 here (true CFG). The VAE is scaled and shifted.
"""
from __future__ import annotations

import torch
from torch import nn

from ..lora import ATTN_TARGETS
from .spec import ForwardArgs, PipelineSpec, grid_latent_shape, pad_seq, scaled_decode


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` (a list of (L_i, D) per prompt) → padded {"prompt_embeds": (B, L, D),
    "prompt_mask": (B, L)}."""
    dev = pipe.transformer.device
    pes, _ = pipe.encode_prompt(prompt=list(prompts), device=dev, do_classifier_free_guidance=False,
                                max_sequence_length=max_sequence_length)
    L = max(e.shape[0] for e in pes)
    mask = torch.stack([torch.arange(L, device=dev) < e.shape[0] for e in pes]).long()
    return {"prompt_embeds": torch.stack([pad_seq(e[None], L)[0] for e in pes]), "prompt_mask": mask}


def forward(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """h (N, C, H, W), sigma (N,) → velocity (N, C, H, W)."""
    mask = cond["prompt_mask"].bool()
    caps = [e[m] for e, m in zip(cond["prompt_embeds"], mask)]  # each (L_i, D): the prompt's own tokens
    out = tr(list(h.unsqueeze(2).unbind(0)), 1.0 - sigma, caps, return_dict=False)[0]  # [(C, 1, H, W)] × N
    return -torch.stack(list(out)).squeeze(2)


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) → pixels (B, 3, fH, fW) in [0, 1]."""
    return scaled_decode(vae, z)


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, ...]:
    return grid_latent_shape(pipe, "zimage", resolution, num_frames, packed=False, video=False)


ROWS = (
    PipelineSpec("zimage", "ZImageTransformer2DModel", "ZImagePipeline", 1.0, packed=False, video=False,
                 true_cfg=True, cfg_renorm=False, cond_keys=("prompt_embeds", "prompt_mask"),
                 lora_targets=ATTN_TARGETS, max_sequence_length=512, encode=encode, forward=forward, decode=decode,
                 latent_shape=latent_shape),
)

__all__ = ["ROWS", "decode", "encode", "forward", "latent_shape"]
