"""Qwen-Image (``QwenImagePipeline``, ``QwenImageTransformer2DModel``).

Timestep σ; text conditioning: Qwen2.5-VL prompt embeddings with their mask; latents (C, H, W) packed into 2×2
tokens with ``img_shapes``; true CFG whose guided prediction is rescaled to the conditional one's per-token norm;
the VAE is Wan's (per-channel statistics, one frame).
"""
from __future__ import annotations

import torch
from torch import nn

from ..lora import JOINT_TARGETS
from .spec import ForwardArgs, PipelineSpec, embedded_guidance, grid_latent_shape, normalized_decode


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, L, D), "prompt_mask": (B, L)}."""
    pe, mask = pipe.encode_prompt(prompt=prompts, device=pipe.transformer.device,
                                  max_sequence_length=max_sequence_length)
    if mask is None:
        mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
    return {"prompt_embeds": pe, "prompt_mask": mask}


def forward(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """h (N, H/2·W/2, 4C) packed tokens, sigma (N,) → prediction of the same tokens."""
    H, W = args.latent_hw
    return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"],
              encoder_hidden_states_mask=cond["prompt_mask"], timestep=sigma,
              guidance=embedded_guidance(tr, h, args.guidance), img_shapes=[[(1, H // 2, W // 2)]] * h.shape[0],
              return_dict=False)[0]


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) → pixels (B, 3, fH, fW) in [0, 1] (the video VAE on one frame)."""
    return normalized_decode(vae, z.unsqueeze(2))[:, :, 0]


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, ...]:
    return grid_latent_shape(pipe, "qwenimage", resolution, num_frames, packed=True, video=False)


ROWS = (
    PipelineSpec("qwenimage", "QwenImageTransformer2DModel", "QwenImagePipeline", 1.0, packed=True, video=False,
                 true_cfg=True, cfg_renorm=True, cond_keys=("prompt_embeds", "prompt_mask"),
                 lora_targets=JOINT_TARGETS, max_sequence_length=1024, encode=encode, forward=forward,
                 decode=decode, latent_shape=latent_shape),
)

__all__ = ["ROWS", "decode", "encode", "forward", "latent_shape"]
