"""HunyuanVideo 1.5 text-to-video (``HunyuanVideo15Pipeline``, ``HunyuanVideo15Transformer3DModel``): one row.

Exact: the transformer call, the text conditioning, the latent layout and the decoding are the pipeline's own
(diffusers 0.42), so the library's ODE rollout on the pipeline's σ grid reproduces its sampling (tested on a tiny
random-weight pipeline). What the pipeline does, and what is done here:

- latents: (C, F', H/16, W/16), C the VAE's ``latent_channels`` (32 published), F' = (F − 1)/4 + 1. The
  transformer takes [latents, conditioning latents, mask] on channels (2C + 1): for text-to-video both are zeros,
  and its image embeddings are zeros (729 tokens), which the transformer reads as text-to-video.
- text: two encoders as the pipeline defines them: a Qwen2.5-VL text model (the hidden states three from the
  last, over the pipeline's system template, its first 108 tokens cropped, padded to 1000 with a mask) and a ByT5
  encoder of the prompt's quoted glyph texts (256 tokens with a mask; zeros when the prompt quotes nothing). Both
  are padded to a fixed length, so a sample does not depend on its batch; ``model.max_sequence_length`` is not
  read (the lengths are the pipeline's).
- timestep: σ·1000; the grid is linspace(1, 0, T + 1)[:−1] shifted by the scheduler's static ``shift``: the
  library's ``sampler.shift`` equal to the scheduler config's ``shift`` reproduces it.
- guidance: the pipeline's guider (``ClassifierFreeGuidance``) runs uncond + s·(cond − uncond) on every step with
  the empty negative prompt; ``model.guidance_scale`` is s (the guider's ``guidance_scale``, which this row does not
  read: set it equal). A guider with ``guidance_rescale``, ``use_original_formulation`` or a start/stop window is
  not reproduced.
- LoRA: the pipeline has no LoRA loader in diffusers 0.42 (no ``save_lora_weights`` / ``load_lora_weights``), so a
  LoRA run could neither checkpoint nor export in diffusers' format: ``check`` refuses ``model.lora_rank`` > 0
  while that holds; a full fine-tune exports ``transformer/`` for ``from_pretrained``.
- pixels: ``vae.decode(z / scaling_factor)`` → (B, 3, F, H, W) in [0, 1], a sample at a time (the VAE's attention
  mask fails on a batch of several in diffusers 0.42).

Cost: one transformer call per sample per step (×2 with CFG).
"""
from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError
from ..lora import JOINT_TARGETS
from .spec import ForwardArgs, PipelineSpec, scaled_decode

TIMESTEP_SCALE = 1000.0
SEMANTIC_TOKENS = 729  # the pipeline's vision_num_semantic_tokens (zero image embeddings for text-to-video)
COND_KEYS = ("prompt_embeds", "prompt_mask", "glyph_embeds", "glyph_mask")


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, 1000, D), "prompt_mask": (B, 1000),
    "glyph_embeds": (B, 256, D₂), "glyph_mask": (B, 256)} (masks float, as the pipeline passes them)."""
    pe, pm, ge, gm = pipe.encode_prompt(prompt=list(prompts), device=pipe.transformer.device,
                                        dtype=pipe.transformer.dtype, batch_size=len(prompts))
    return {"prompt_embeds": pe, "prompt_mask": pm, "glyph_embeds": ge, "glyph_mask": gm}


def forward(tr: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """x (N, C, F, h, w), sigma (N,) → velocity (N, C, F, h, w): the text-to-video input [x, 0, 0] (2C + 1 channels)
    and zero image embeddings, as the pipeline calls the transformer."""
    N, _, F_, h, w = x.shape
    inp = torch.cat([x, torch.zeros_like(x), x.new_zeros(N, 1, F_, h, w)], dim=1)  # (N, 2C + 1, F, h, w)
    image_dim = getattr(tr, "module", tr).config.image_embed_dim  # tr may be a data-parallel wrapper
    image_embeds = x.new_zeros(N, SEMANTIC_TOKENS, image_dim)
    return tr(hidden_states=inp, image_embeds=image_embeds, timestep=sigma * TIMESTEP_SCALE,
              encoder_hidden_states=cond["prompt_embeds"], encoder_attention_mask=cond["prompt_mask"],
              encoder_hidden_states_2=cond["glyph_embeds"], encoder_attention_mask_2=cond["glyph_mask"],
              return_dict=False)[0]


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, F', h, w) → pixels (B, 3, F, 16h, 16w) in [0, 1], one sample per VAE call (the VAE's causal
    attention mask of diffusers 0.42 does not broadcast over a batch of several)."""
    return torch.cat([scaled_decode(vae, z[i:i + 1]) for i in range(z.shape[0])])


def has_lora_io(pipeline_class: str = "HunyuanVideo15Pipeline") -> bool:
    """Whether the installed diffusers gives the pipeline a LoRA loader (``save_lora_weights`` /
    ``load_lora_weights``), which a LoRA run's checkpoints and export use."""
    import diffusers

    cls = getattr(diffusers, pipeline_class, None)
    return hasattr(cls, "save_lora_weights") and hasattr(cls, "load_lora_weights")


def check(name: str, config: Mapping, m: ModelConfig, transformer: nn.Module | None) -> None:
    """Before loading and after: a LoRA run needs the pipeline's LoRA loader (diffusers 0.42 has none for
    ``HunyuanVideo15Pipeline``), refused here rather than at the first checkpoint."""
    if m.lora_rank > 0 and not has_lora_io():
        raise ConfigError(f"model.lora_rank: value {m.lora_rank} needs a LoRA loader on HunyuanVideo15Pipeline "
                          "(save_lora_weights / load_lora_weights), which the installed diffusers lacks; set 0 "
                          "(a full fine-tune)")


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, int, int, int]:
    """(C, (F − 1)/4 + 1, H/16, W/16) from the VAE's channels and compression ratios."""
    f, ft = pipe.vae_scale_factor_spatial, pipe.vae_scale_factor_temporal
    if resolution % f:
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {f} for HunyuanVideo 1.5")
    if (num_frames - 1) % ft:
        raise ConfigError(f"model.num_frames: {num_frames} must be 1 + a multiple of {ft} for HunyuanVideo 1.5")
    return (int(pipe.vae.config.latent_channels), (num_frames - 1) // ft + 1, resolution // f, resolution // f)


ROWS = (
    PipelineSpec("hunyuanvideo15", "HunyuanVideo15Transformer3DModel", "HunyuanVideo15Pipeline", TIMESTEP_SCALE,
                 packed=False, video=True, true_cfg=True, cfg_renorm=False, cond_keys=COND_KEYS,
                 lora_targets=JOINT_TARGETS, max_sequence_length=1000, encode=encode, forward=forward, decode=decode,
                 latent_shape=latent_shape, check=check),
)

__all__ = ["COND_KEYS", "ROWS", "SEMANTIC_TOKENS", "check", "decode", "encode", "forward", "has_lora_io",
           "latent_shape"]
