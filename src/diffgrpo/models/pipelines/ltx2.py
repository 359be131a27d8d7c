"""LTX-2 text-to-audio+video (``LTX2Pipeline``, ``LTX2VideoTransformer3DModel``): one row.

Exact: the transformer call, the text conditioning, the latent layouts and the video decoding are the pipeline's own
(diffusers 0.42), so the library's ODE rollout on the pipeline's σ grid reproduces its sampling of both streams
(tested on a tiny random-weight pipeline). What the pipeline does, and what is done here:

- state: the pipeline denoises a video latent and an audio latent together, one transformer call giving both
  velocities (the streams attend to each other). Both are the policy's state: one flat vector per sample,
  [video tokens (F'·h·w, C) row-major (f, h, w), audio tokens (L, C_a·M)], each in the pipeline's own normalised,
  packed layout (video ``(z − mean)·scaling/std`` per channel, audio ``(z − mean)/std`` per token feature). The
  transformer is trained on both; the per-step Gaussian log-prob is over the whole state. The text encoder, its
  connectors, the VAEs and the vocoder are frozen.
- layout: :func:`layout` (F', h, w, C; the audio's L, C_a, M; the frame rate) rides in ``ForwardArgs.layout``;
  ``latent_shape`` is (F'·h·w·C + L·C_a·M,). L = round(F / fps · sample_rate / hop / 4), the pipeline's, at its
  default frame rate of 24 (``FRAME_RATE``), which also sets the video's rotary positions.
- text: the pipeline's ``encode_prompt`` (every hidden state of the Gemma 3 encoder, left-padded to
  ``max_sequence_length`` = 1024 by default with a mask), then its ``connectors`` → per-stream text embeddings
  and the mask; fixed-length, so a sample does not depend on its batch.
- timestep: σ·1000 (``timestep`` and ``sigma``, as the pipeline passes them), cross-modal timestep on (the
  pipeline's default ``use_cross_timestep``). The pipeline's grid is linspace(1, 1/T, T) with the scheduler's
  shift (dynamic: mu from the video token count, :func:`grid_shift`), equal to the library's ``sampler.shift``.
- guidance: true CFG v_u + s·(v_c − v_u) on both streams with the negative prompt: the pipeline's x0-space
  delta with one scale equals it. The pipeline's defaults add more: a separate audio scale (7), spatio-temporal
  guidance (an extra perturbed forward), modality-isolation guidance (another forward) and a std rescale (0.7);
  these are not reproduced: the pipeline matches the library with ``audio_guidance_scale = guidance_scale``,
  ``stg_scale = audio_stg_scale = 0``, ``modality_scale = audio_modality_scale = 1`` and
  ``guidance_rescale = audio_guidance_rescale = 0``.
- pixels: the video part denormalised, ``vae.decode`` → (B, 3, F, H, W) in [0, 1] (a VAE without timestep
  conditioning, as LTX-2's); the rewards see the video. :func:`decode_audio` gives the waveform (audio VAE,
  vocoder) for inspection.
- LoRA: the pipeline's ``LTX2LoraLoaderMixin`` saves and loads transformer adapters (attention projections of
  both streams and of their cross-attention).

Cost: one transformer call per sample per step for both streams (×2 with CFG).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError
from ..lora import ATTN_TARGETS
from .spec import ForwardArgs, PipelineSpec, to_unit

TIMESTEP_SCALE = 1000.0
FRAME_RATE = 24.0  # the pipeline's default frame_rate (the audio length and the video's rotary positions)
COND_KEYS = ("video_embeds", "audio_embeds", "text_mask")


def layout(pipe, resolution: int, num_frames: int, frame_rate: float = FRAME_RATE) -> dict:
    """The paired state's geometry at a square ``resolution`` and ``num_frames``, as the pipeline derives it."""
    f, ft = pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio
    if resolution % f:
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {f} for LTX-2")
    if (num_frames - 1) % ft:
        raise ConfigError(f"model.num_frames: {num_frames} must be 1 + a multiple of {ft} for LTX-2")
    per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
    mel = pipe.audio_vae.config.mel_bins // pipe.audio_vae_mel_compression_ratio
    return {"frames": (num_frames - 1) // ft + 1, "height": resolution // f, "width": resolution // f,
            "channels": int(pipe.transformer.config.in_channels), "audio_frames": round(num_frames / frame_rate
                                                                                         * per_second),
            "audio_channels": int(pipe.audio_vae.config.latent_channels), "mel_bins": int(mel),
            "fps": float(frame_rate)}


def sizes(lay: Mapping) -> tuple[int, int]:
    """(video numel, audio numel) of one sample's state."""
    return (lay["frames"] * lay["height"] * lay["width"] * lay["channels"],
            lay["audio_frames"] * lay["audio_channels"] * lay["mel_bins"])


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int]:
    """(video numel + audio numel,): the flat paired state."""
    return (sum(sizes(layout(pipe, resolution, num_frames))),)


def split(x: torch.Tensor, lay: Mapping) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, n) → video tokens (N, F'·h·w, C), audio tokens (N, L, C_a·M) (views)."""
    nv, _ = sizes(lay)
    N = x.shape[0]
    return (x[:, :nv].reshape(N, -1, lay["channels"]),
            x[:, nv:].reshape(N, lay["audio_frames"], lay["audio_channels"] * lay["mel_bins"]))


def grid_shift(scheduler_config: Mapping, lay: Mapping) -> float:
    """The library's ``sampler.shift`` equal to the pipeline's grid: e^mu of the pipeline's ``calculate_shift`` of
    the video token count under dynamic shifting, else the scheduler's ``shift``."""
    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift

    mu = calculate_shift(lay["frames"] * lay["height"] * lay["width"],
                         scheduler_config.get("base_image_seq_len", 1024), scheduler_config.get("max_image_seq_len", 4096),
                         scheduler_config.get("base_shift", 0.95), scheduler_config.get("max_shift", 2.05))
    return math.exp(mu)


# ------------------------------------------------------------------------------------------- the row's functions


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """``encode_prompt`` then the connectors → {"video_embeds": (B, L, D), "audio_embeds": (B, L, D_a),
    "text_mask": (B, L)}. The connectors follow the text encoder's device."""
    pe, mask, _, _ = pipe.encode_prompt(prompt=list(prompts), do_classifier_free_guidance=False,
                                        max_sequence_length=max_sequence_length, device=pipe.text_encoder.device)
    pipe.connectors.to(pe.device)
    side = getattr(pipe.tokenizer, "padding_side", "left")
    video, audio, m = pipe.connectors(pe, mask, padding_side=side)
    return {"video_embeds": video, "audio_embeds": audio, "text_mask": m}


def forward(tr: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """x (N, n), sigma (N,) → velocity (N, n): both streams through one call, as the pipeline calls it."""
    lay = args.layout
    video, audio = split(x, lay)
    base = getattr(tr, "module", tr)  # tr may be a data-parallel wrapper
    N, F_, h, w, L = x.shape[0], lay["frames"], lay["height"], lay["width"], lay["audio_frames"]
    video_coords = base.rope.prepare_video_coords(N, F_, h, w, x.device, fps=lay["fps"])
    audio_coords = base.audio_rope.prepare_audio_coords(N, L, x.device)
    t = sigma * TIMESTEP_SCALE
    v, a = tr(hidden_states=video, audio_hidden_states=audio, encoder_hidden_states=cond["video_embeds"],
              audio_encoder_hidden_states=cond["audio_embeds"], timestep=t, sigma=t,
              encoder_attention_mask=cond["text_mask"], audio_encoder_attention_mask=cond["text_mask"],
              num_frames=F_, height=h, width=w, fps=lay["fps"], audio_num_frames=L, video_coords=video_coords,
              audio_coords=audio_coords, use_cross_timestep=True, return_dict=False)
    return torch.cat([v.reshape(N, -1), a.reshape(N, -1)], dim=1)


def video_latents(vae, z: torch.Tensor, lay: Mapping) -> torch.Tensor:
    """The state's video part → the VAE's latents (B, C, F', h, w), denormalised as the pipeline does."""
    v, _ = split(z, lay)
    B, C = z.shape[0], lay["channels"]
    v5 = v.reshape(B, lay["frames"], lay["height"], lay["width"], C).permute(0, 4, 1, 2, 3)
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(v5)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(v5)
    return v5 * std / vae.config.scaling_factor + mean


def audio_latents(audio_vae, z: torch.Tensor, lay: Mapping) -> torch.Tensor:
    """The state's audio part → the audio VAE's latents (B, C_a, L, M), denormalised as the pipeline does."""
    _, a = split(z, lay)
    a = a * audio_vae.latents_std.to(a) + audio_vae.latents_mean.to(a)
    return a.unflatten(2, (lay["audio_channels"], lay["mel_bins"])).transpose(1, 2)


@torch.no_grad()
def decode(vae, z: torch.Tensor, lay: Mapping) -> torch.Tensor:
    """State (B, n) → video pixels (B, 3, F, H, W) in [0, 1]."""
    return to_unit(vae.decode(video_latents(vae, z.float(), lay).to(vae.dtype), None, return_dict=False)[0])


@torch.no_grad()
def decode_audio(pipe, z: torch.Tensor, lay: Mapping) -> torch.Tensor:
    """State (B, n) → the vocoder's waveform (B, channels, samples), as the pipeline makes it."""
    mel = pipe.audio_vae.decode(audio_latents(pipe.audio_vae, z.float(), lay).to(pipe.audio_vae.dtype),
                                return_dict=False)[0]
    return pipe.vocoder(mel)


def check(name: str, config: Mapping, m: ModelConfig, transformer: nn.Module | None) -> None:
    """After loading: the layouts this row packs (unit video and audio patches, the pipeline's packing)."""
    c = getattr(transformer, "config", None)
    if c is not None and (c.patch_size, c.patch_size_t, c.audio_patch_size, c.audio_patch_size_t) != (1, 1, 1, 1):
        raise ConfigError(f"model.pretrained: pipeline {name!r} supports unit transformer patches; this one has "
                          f"{(c.patch_size, c.patch_size_t, c.audio_patch_size, c.audio_patch_size_t)}")


ROWS = (
    PipelineSpec("ltx2", "LTX2VideoTransformer3DModel", "LTX2Pipeline", TIMESTEP_SCALE, packed=False, video=True,
                 true_cfg=True, cfg_renorm=False, cond_keys=COND_KEYS, lora_targets=ATTN_TARGETS,
                 max_sequence_length=1024, encode=encode, forward=forward, decode=decode, latent_shape=latent_shape,
                 check=check, layout=layout),
)

__all__ = ["COND_KEYS", "FRAME_RATE", "ROWS", "audio_latents", "check", "decode", "decode_audio", "encode", "forward",
           "grid_shift", "latent_shape", "layout", "sizes", "split", "video_latents"]
