"""Stable Diffusion 3 / 3.5 (``StableDiffusion3Pipeline``, ``SD3Transformer2DModel``; the built-in tiny model too).

Timestep σ·1000; text conditioning: the joint CLIP + T5 prompt embeddings and the pooled CLIP projection; latents
(C, H, W) as the VAE makes them (scaled and shifted); true CFG.
"""
from __future__ import annotations

import torch
from torch import nn

from ..lora import JOINT_TARGETS
from .spec import ForwardArgs, PipelineSpec, grid_latent_shape, scaled_decode

TIMESTEP_SCALE = 1000.0


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, L, D), "pooled": (B, D')}."""
    pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, prompt_3=prompts,
                                          device=pipe.transformer.device, do_classifier_free_guidance=False,
                                          max_sequence_length=max_sequence_length)
    return {"prompt_embeds": pe, "pooled": pooled}


def forward(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """h (N, C, H, W), sigma (N,) → velocity (N, C, H, W)."""
    return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
              timestep=sigma * TIMESTEP_SCALE, return_dict=False)[0]


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) → pixels (B, 3, fH, fW) in [0, 1]."""
    return scaled_decode(vae, z)


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, ...]:
    return grid_latent_shape(pipe, "sd3", resolution, num_frames, packed=False, video=False)


ROWS = (
    PipelineSpec("sd3", "SD3Transformer2DModel", "StableDiffusion3Pipeline", TIMESTEP_SCALE, packed=False,
                 video=False, true_cfg=True, cfg_renorm=False, cond_keys=("prompt_embeds", "pooled"),
                 lora_targets=JOINT_TARGETS, max_sequence_length=256, encode=encode, forward=forward, decode=decode,
                 latent_shape=latent_shape),
)

__all__ = ["ROWS", "decode", "encode", "forward", "latent_shape"]
