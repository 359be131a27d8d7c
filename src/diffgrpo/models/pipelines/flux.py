"""FLUX.1 (``FluxPipeline``, ``FluxTransformer2DModel``): [dev] guidance-distilled, [schnell] without guidance.

Timestep σ; text conditioning: T5 prompt embeddings with zero text ids and the pooled CLIP projection; latents
(C, H, W) packed into 2×2 tokens (H/2·W/2, 4C) with rotary image ids (0, row, col); guidance: the distilled
guidance embedding (one forward, no negative branch).
"""
from __future__ import annotations

import torch
from torch import nn

from ..latents import flux_image_ids
from ..lora import JOINT_TARGETS
from .spec import ForwardArgs, PipelineSpec, embedded_guidance, grid_latent_shape, scaled_decode


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, L, D), "pooled": (B, D')}."""
    pe, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, device=pipe.transformer.device,
                                       max_sequence_length=max_sequence_length)
    return {"prompt_embeds": pe, "pooled": pooled}


def forward(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """h (N, H/2·W/2, 4C) packed tokens, sigma (N,) → prediction of the same tokens."""
    H, W = args.latent_hw
    L = cond["prompt_embeds"].shape[1]
    return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
              timestep=sigma, guidance=embedded_guidance(tr, h, args.guidance),
              img_ids=flux_image_ids(H // 2, W // 2, h.device, h.dtype),
              txt_ids=torch.zeros(L, 3, device=h.device, dtype=h.dtype), return_dict=False)[0]


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) → pixels (B, 3, fH, fW) in [0, 1]."""
    return scaled_decode(vae, z)


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, ...]:
    return grid_latent_shape(pipe, "flux", resolution, num_frames, packed=True, video=False)


ROWS = (
    PipelineSpec("flux", "FluxTransformer2DModel", "FluxPipeline", 1.0, packed=True, video=False, true_cfg=False,
                 cfg_renorm=False, cond_keys=("prompt_embeds", "pooled"), lora_targets=JOINT_TARGETS,
                 max_sequence_length=512, encode=encode, forward=forward, decode=decode, latent_shape=latent_shape),
)

__all__ = ["ROWS", "decode", "encode", "forward", "latent_shape"]
