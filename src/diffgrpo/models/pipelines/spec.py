"""The row type of the pipeline table and the helpers several architectures share.

A :class:`PipelineSpec` is data (classes, timestep convention, latent layout, guidance kind, conditioning keys,
LoRA targets) plus references to its architecture module's functions (``encode``, ``forward``, ``decode``,
``latent_shape``, ``check``). The policy adapter calls only these; an architecture is one module and one row.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError


@dataclass(frozen=True)
class ForwardArgs:
    """What one transformer call needs beside the inputs: the latent grid (H, W) and the rollout's latent shape,
    the guidance value (embedded by guidance-distilled transformers), the pipeline's config (a mapping) and the
    row's ``layout`` (a row whose state is not one latent grid, e.g. LTX-2's paired video and audio)."""

    latent_hw: tuple[int, int]
    latent_shape: tuple[int, ...]
    guidance: float
    pipeline_config: Mapping = field(default_factory=dict)
    layout: Mapping = field(default_factory=dict)


def no_check(name: str, config: Mapping, m: ModelConfig, transformer: nn.Module | None) -> None:
    """The check of an architecture without rules of its own."""


def any_transformer(transformer: nn.Module) -> bool:
    return True


@dataclass(frozen=True)
class PipelineSpec:
    """One architecture of the table. ``encode(pipe, prompts, max_sequence_length) -> cond``;
    ``forward(tr, h, sigma, cond, args: ForwardArgs) -> prediction`` in the transformer's layout (packed tokens
    when ``packed``); ``decode(vae, z) -> pixels in [0, 1]``; ``latent_shape(pipe, resolution, num_frames)``;
    ``check(name, config, model_config, transformer)`` before loading (``config``: model_index.json, transformer
    None) and after (``pipe.config``, the loaded transformer). ``accepts(transformer)`` tells rows sharing a
    transformer class apart. ``edit``: an editing pipeline's encoder of (instruction, sources) pairs,
    ``(pipe, pairs, max_sequence_length, side) -> cond``; None for text-only conditioning. ``layout``:
    ``(pipe, resolution, num_frames) -> mapping`` for a row whose state's geometry ``latent_shape`` does not
    carry; the policy passes it in ``ForwardArgs.layout`` and as ``decode(vae, z, layout)``."""

    name: str
    transformer_class: str
    pipeline_class: str
    timestep_scale: float  # the transformer's timestep is σ·timestep_scale (the experts' switch reads it)
    packed: bool  # 2×2 latent packing into tokens (C·4 channels)
    video: bool  # latents (C, F, H, W)
    true_cfg: bool  # False: distilled guidance embedding, one forward
    cfg_renorm: bool  # rescale the guided prediction to the conditional one's per-token norm (Qwen-Image)
    cond_keys: tuple[str, ...]  # per-sample conditioning tensors the forward takes
    lora_targets: tuple[str, ...]  # default LoRA target modules (FlowGRPO / DanceGRPO choices)
    max_sequence_length: int  # default text length of the pipeline's encode_prompt
    encode: Callable[..., dict]
    forward: Callable[..., torch.Tensor]
    decode: Callable[..., torch.Tensor]
    latent_shape: Callable[..., tuple[int, ...]]
    check: Callable[..., None] = no_check
    accepts: Callable[[nn.Module], bool] = any_transformer
    edit: Callable[..., dict] | None = None
    multi_source: bool = False  # an editing pipeline taking several sources per prompt
    layout: Callable[..., Mapping] | None = None

    def matches(self, transformer: nn.Module) -> bool:
        """Whether ``transformer`` (its class or one of its bases) is this row's."""
        return any(c.__name__ == self.transformer_class for c in type(transformer).__mro__) and \
            self.accepts(transformer)


# ------------------------------------------------------------------------------------------- shared helpers


def pad_seq(t: torch.Tensor, L: int) -> torch.Tensor:
    """Zero-pad a (B, l, ...) sequence tensor to length L on dim 1."""
    if t.shape[1] == L:
        return t
    return F.pad(t, [0, 0] * (t.dim() - 2) + [0, L - t.shape[1]])


def embedded_guidance(tr: nn.Module, h: torch.Tensor, value: float) -> torch.Tensor | None:
    """(N,) float32 guidance values for a transformer with a guidance embedder (``guidance_embeds``), else None.
    ``tr`` may be a data-parallel wrapper (``.module``)."""
    if not getattr(getattr(tr, "module", tr).config, "guidance_embeds", False):
        return None
    return torch.full((h.shape[0],), float(value), device=h.device, dtype=torch.float32)


def grid_latent_shape(pipe, name: str, resolution: int, num_frames: int, *, packed: bool,
                      video: bool) -> tuple[int, ...]:
    """(C, H/f, W/f) for images or (C, F', H/f, W/f) for video, from the pipeline's VAE factors; the side must
    be a multiple of 2f (2×2 patches or packing on the latent grid)."""
    f = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8)
    C = pipe.transformer.config.in_channels // 4 if packed else pipe.transformer.config.in_channels
    if resolution % (2 * f):
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {2 * f} for pipeline {name!r}")
    h = resolution // f
    if not video:
        return (C, h, h)
    ft = getattr(pipe, "vae_scale_factor_temporal", 4)
    if (num_frames - 1) % ft:
        raise ConfigError(f"model.num_frames: {num_frames} must be 1 + a multiple of {ft} for pipeline {name!r}")
    return (C, (num_frames - 1) // ft + 1, h, h)


@torch.no_grad()
def scaled_decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, H, W) → pixels (B, 3, fH, fW) in [0, 1] through a VAE with a scaling (and shift) factor."""
    z = z.to(dtype=vae.dtype)
    scale = getattr(vae.config, "scaling_factor", 1.0) or 1.0
    shift = getattr(vae.config, "shift_factor", None) or 0.0
    return to_unit(vae.decode(z / scale + shift, return_dict=False)[0])


@torch.no_grad()
def normalized_decode(vae, z5: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, F, H, W) → pixels (B, 3, F', fH, fW) in [0, 1] through a VAE with per-channel statistics
    (``latents_mean`` / ``latents_std``: Wan, Qwen-Image)."""
    z5 = z5.to(dtype=vae.dtype)
    c = vae.config
    shape = (1, c.z_dim, 1, 1, 1)
    mean = torch.tensor(c.latents_mean, device=z5.device, dtype=z5.dtype).view(shape)
    std = torch.tensor(c.latents_std, device=z5.device, dtype=z5.dtype).view(shape)
    return to_unit(vae.decode(z5 * std + mean, return_dict=False)[0])


def to_unit(out: torch.Tensor) -> torch.Tensor:
    """A VAE's output in [-1, 1] → float32 in [0, 1]."""
    return (out.float() / 2 + 0.5).clamp(0, 1)


def pipeline_has(config: Mapping, component: str) -> bool:
    """Whether a pipeline's config (``pipe.config`` or its model_index.json) names a non-null ``component``."""
    entry = config.get(component) if isinstance(config, Mapping) else None
    return isinstance(entry, (list, tuple)) and len(entry) > 0 and entry[0] is not None


__all__ = ["ForwardArgs", "PipelineSpec", "any_transformer", "embedded_guidance", "grid_latent_shape",
           "no_check", "normalized_decode", "pad_seq", "pipeline_has", "scaled_decode", "to_unit"]
