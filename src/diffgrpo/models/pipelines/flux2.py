"""FLUX.2 [dev] (``Flux2Pipeline``) and FLUX.2 [klein] (``Flux2KleinPipeline``): two rows of the pipeline table.

Exact: the transformer call, the text conditioning, the latent layout and the decoding are the pipelines' own
(diffusers 0.42), so the library's ODE rollout on the pipeline's σ grid reproduces its sampling (tested to < 1e-5
on tiny random-weight pipelines). What the two pipelines do, and what is done here:

- latents: the VAE's (C, H/8, W/8) latents 2×2-patchified into (4C, H/16, W/16) (128 channels for the published
  VAE) and normalised by the VAE's batch-norm statistics; the pipeline's noise lives in that space and so does the
  rollout here (``latent_shape`` = (transformer in_channels, H/16, W/16)). The transformer takes the (h·w) grid
  cells as tokens, (B, h·w, 4C), with 4-axis rotary position ids (t, row, col, layer) = (0, r, c, 0); the text
  tokens' ids are (0, 0, 0, l). Decoding undoes the batch norm and the patchify before ``vae.decode``.
- text: [dev] a Mistral-Small 24B (``Mistral3ForConditionalGeneration``) and [klein] a Qwen3 causal LM (4B / 8B);
  both pipelines stack the hidden states of three layers ([dev] 10, 20, 30; [klein] 9, 18, 27) into (B, L, 3·D)
  features, padded to ``max_sequence_length`` (the padding is not masked in the transformer: it is part of the
  conditioning).
- timestep: the transformer takes σ (it multiplies by 1000 inside); the pipelines' grid is linspace(1, 1/T, T)
  shifted by an exponential time shift with ``mu = compute_empirical_mu(h·w, T)``, which equals the library's
  shift s = e^mu on the same linspace (``empirical_shift``): the shipped configs set ``sampler.shift`` to it.
- guidance: [dev] is guidance-distilled: one forward with the embedded guidance value (``guidance_embeds``), no
  negative branch. [klein] base runs true CFG: neg + s·(pos − neg) with the empty negative prompt, s =
  ``guidance_scale`` (the library's convention, no offset). The step-distilled [klein] (pipeline config
  ``is_distilled``: 4 steps) ignores guidance: it needs ``model.guidance_scale=1`` (checked at load).

The two variants share ``Flux2Transformer2DModel``; the one with a guidance embedder is [dev], the other [klein].
Cost: a transformer forward per sample per step ([klein] with CFG: two, batched as one call of 2B rows).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError
from .spec import ForwardArgs, PipelineSpec, embedded_guidance

LORA_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
                "to_qkv_mlp_proj")  # double-stream attention (image and text) + the single-stream fused projection


def variant(transformer: nn.Module) -> str:
    """``flux2`` ([dev], guidance-distilled: a guidance embedder) or ``flux2_klein`` (true CFG, none)."""
    return "flux2" if getattr(transformer.config, "guidance_embeds", False) else "flux2_klein"


def is_dev(transformer: nn.Module) -> bool:
    return variant(transformer) == "flux2"


def is_klein(transformer: nn.Module) -> bool:
    return variant(transformer) == "flux2_klein"


def empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """FLUX.2's resolution- and step-dependent time-shift parameter (the pipelines' ``compute_empirical_mu``)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    return float(compute_empirical_mu(image_seq_len=image_seq_len, num_steps=num_steps))


def empirical_shift(resolution: int, num_steps: int, vae_scale_factor: int = 8) -> float:
    """The library's ``sampler.shift`` equal to the pipelines' grid at a square ``resolution`` and ``num_steps``:
    e^mu, since e^mu / (e^mu + 1/σ − 1) = sσ / (1 + (s − 1)σ) with s = e^mu."""
    side = resolution // (2 * vae_scale_factor)
    return math.exp(empirical_mu(side * side, num_steps))


# ------------------------------------------------------------------------------------------- layout


def latent_shape(pipe, resolution: int, num_frames: int = 1) -> tuple[int, int, int]:
    """(4C, H/(2f), W/(2f)): the patchified, batch-normalised latents the pipelines sample in."""
    f = pipe.vae_scale_factor
    if resolution % (2 * f):
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {2 * f} for FLUX.2")
    side = resolution // (2 * f)
    return (int(pipe.transformer.config.in_channels), side, side)


def pack(x: torch.Tensor) -> torch.Tensor:
    """(B, C, h, w) → (B, h·w, C): one token per grid cell, row-major (the pipelines' ``_pack_latents``)."""
    B, C, h, w = x.shape
    return x.reshape(B, C, h * w).permute(0, 2, 1)


def unpack(t: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """(B, h·w, C) → (B, C, h, w); the inverse of :func:`pack`."""
    B, _, C = t.shape
    return t.permute(0, 2, 1).reshape(B, C, h, w)


def image_ids(h: int, w: int, device) -> torch.Tensor:
    """(h·w, 4) rotary ids (t, row, col, layer) = (0, r, c, 0), row-major (the pipelines' ``_prepare_latent_ids``)."""
    r, c = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    z = torch.zeros(h * w, dtype=torch.long)
    return torch.stack([z, r.reshape(-1), c.reshape(-1), z], dim=1).to(device)


def text_ids(L: int, device) -> torch.Tensor:
    """(L, 4) rotary ids (0, 0, 0, l) of the text tokens (the pipelines' ``_prepare_text_ids``)."""
    z = torch.zeros(L, dtype=torch.long)
    return torch.stack([z, z, z, torch.arange(L)], dim=1).to(device)


def forward(tr: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """One transformer call: x (N, C, h, w), sigma (N,), cond["prompt_embeds"] (N, L, D) → velocity (N, C, h, w);
    [dev] embeds the guidance value."""
    _, _, h, w = x.shape
    prompt_embeds = cond["prompt_embeds"]
    out = tr(hidden_states=pack(x), encoder_hidden_states=prompt_embeds, timestep=sigma,
             guidance=embedded_guidance(tr, x, args.guidance), img_ids=image_ids(h, w, x.device),
             txt_ids=text_ids(prompt_embeds.shape[1], x.device), return_dict=False)[0]  # (N, h·w, C)
    return unpack(out, h, w)


# ------------------------------------------------------------------------------------------- text and pixels


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's own ``encode_prompt`` (its default hidden-state layers): {"prompt_embeds": (B, L, 3·D)}."""
    pe, _ = pipe.encode_prompt(prompt=list(prompts), device=pipe.transformer.device,
                               max_sequence_length=max_sequence_length)
    return {"prompt_embeds": pe}


@torch.no_grad()
def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, 4C, h, w) → pixels (B, 3, 2f·h, 2f·w) in [0, 1]: undo the batch norm and the 2×2 patchify."""
    z = z.to(vae.dtype)
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z)
    z = z * std + mean
    B, C4, h, w = z.shape
    z = z.reshape(B, C4 // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(B, C4 // 4, 2 * h, 2 * w)
    out = vae.decode(z, return_dict=False)[0]
    return (out.float() / 2 + 0.5).clamp(0, 1)


def check(name: str, config: Mapping, m: ModelConfig, transformer: nn.Module | None) -> None:
    """Before loading (``config``: model_index.json) and after (``pipe.config``, the loaded ``transformer``):
    :func:`check_guidance`; after loading, the row ``name`` (an explicit ``model.pipeline``) must be the variant the
    transformer is (an explicit ``flux2`` on a [klein] transformer would drop its CFG)."""
    if transformer is not None and variant(transformer) != name:
        found = variant(transformer)
        raise ConfigError(f"model.pipeline: value {name!r} does not match the loaded FLUX.2 transformer, which is "
                          f"{found!r} ({'a' if found == 'flux2' else 'no'} guidance embedder); set {found!r} or auto")
    check_guidance(config, m.guidance_scale)


def check_guidance(config: Mapping, guidance_scale: float) -> None:
    """A step-distilled [klein] pipeline (config ``is_distilled``) ignores guidance: model.guidance_scale must be 1.
    ``config``: the pipeline's config (``pipe.config``) or its ``model_index.json`` as a dict."""
    if config.get("is_distilled", False) and guidance_scale != 1.0:
        raise ConfigError(f"model.guidance_scale: value {guidance_scale} on a step-distilled FLUX.2 [klein] "
                          "(is_distilled): it samples without guidance; set 1.0")


def _row(name: str, pipeline_class: str, true_cfg: bool, accepts) -> PipelineSpec:
    return PipelineSpec(name, "Flux2Transformer2DModel", pipeline_class, 1.0, packed=False, video=False,
                        true_cfg=true_cfg, cfg_renorm=False, cond_keys=("prompt_embeds",), lora_targets=LORA_TARGETS,
                        max_sequence_length=512, encode=encode, forward=forward, decode=decode,
                        latent_shape=latent_shape, check=check, accepts=accepts)


# rollout latents are the patchified (4C, H/16, W/16) grid; [dev] embedded guidance, [klein] true CFG; both
# transformers are Flux2Transformer2DModel ([dev] has the guidance embedder)
ROWS = (_row("flux2", "Flux2Pipeline", False, is_dev), _row("flux2_klein", "Flux2KleinPipeline", True, is_klein))

__all__ = ["LORA_TARGETS", "ROWS", "check", "check_guidance", "decode", "empirical_mu", "empirical_shift", "encode",
           "forward", "image_ids", "latent_shape", "pack", "text_ids", "unpack", "variant"]
