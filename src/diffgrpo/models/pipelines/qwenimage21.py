"""Qwen-Image 2.1 and its Turbo (``QwenImage21Pipeline``, ``QwenImage21Transformer2DModel``): one row.

Exact: the transformer call, the text conditioning, the latent layout and the decoding are the pipeline's own
(diffusers 0.42), so the library's ODE rollout on the pipeline's σ grid reproduces its sampling (tested on a tiny
random-weight pipeline). What the pipeline does, and what is done here:

- latents: the VAE's 64 channels at 1/16 of the side, (C, H/16, W/16), taken by the transformer unpatched as one
  token per grid cell, (B, h·w, C) row-major, with ``img_shapes`` [(1, h, w)].
- text: a Qwen3-VL encoder's last decoder layer (before its final norm) over the pipeline's chat template, the
  system tokens dropped; (B, L, D) with a mask of the valid positions. The transformer is one block-causal stream
  [text, image] whose image rotary positions start after the text, padding included: a padded prompt is not the
  same prompt. The pipeline pads a batch to its longest prompt, so its sample depends on the other prompts; here
  rows are grouped by their prompt length and each group runs without padding, so a sample equals the pipeline's
  sample of its prompt alone and does not depend on the batch (nor on the update's micro-batches). The pipeline's
  ``max_sequence_length`` does not exist: ``model.max_sequence_length`` is not read.
- timestep: the transformer takes σ. The grid is the pipeline config's ``sample_sigmas`` (a distilled checkpoint's
  few-step grid) or linspace(1, 1/T, T), then, with the scheduler's dynamic shifting, the exponential time shift of
  ``mu = calculate_shift(h·w, scheduler config)``, which equals the library's shift s = e^mu on the uniform grid
  (:func:`grid_shift`). A ``sample_sigmas`` grid that is not uniform cannot be set through ``sampler.num_steps`` /
  ``sampler.shift``: the library samples its own grid, not the checkpoint's.
- guidance: the pipeline samples without guidance by default (``true_cfg_scale`` 1: 2.1 and its Turbo are meant to
  be sampled so); ``model.guidance_scale`` > 1 runs its true CFG neg + s·(pos − neg), no norm rescale, with the
  negative prompt (empty: the pipeline's " ").
- the pipeline's KV cache of the text keys (``use_kv_cache``, valid as ``causal_condition`` modulates text from
  t = 0) is not used: every forward recomputes the text tokens, equal to float tolerance.
- pixels: the VAE decodes 4 channels (RGBA); the rewards see the first three, in [0, 1].

Cost: one transformer call per distinct prompt length of a batch per step (the negative prompt's among them with
CFG). Under data parallelism the ranks' batches may hold different numbers of distinct lengths. DDP makes no
collective in forward and syncs once in backward, so ranks may make different numbers of calls. Under FSDP2 every
block call is a collective (an all-gather in forward, a reduce-scatter in backward): the ranks agree on the union
of their lengths (two small all-reduces per forward) and each runs one call per length of the union, a length it
lacks on one row of zero text whose output is added ×0 (the same calls on every rank; its gradient is exactly 0).
Two ranks of either kind give one process's gradient on the union of their units (tested).
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import torch
from torch import nn

from ...errors import ConfigError
from ..lora import ATTN_TARGETS
from .spec import ForwardArgs, PipelineSpec, normalized_decode

VAE_FACTOR = 16  # pixels per latent cell (the pipeline's vae_scale_factor)


def grid_shift(scheduler_config: Mapping, resolution: int) -> float:
    """The library's ``sampler.shift`` equal to the pipeline's grid at a square ``resolution``: e^mu with the
    pipeline's ``calculate_shift`` of the h·w latent tokens under dynamic shifting, else the scheduler's ``shift``."""
    if not scheduler_config.get("use_dynamic_shifting", False):
        return float(scheduler_config.get("shift", 1.0))
    from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import calculate_shift

    side = resolution // VAE_FACTOR
    mu = calculate_shift(side * side, scheduler_config.get("base_image_seq_len", 256),
                         scheduler_config.get("max_image_seq_len", 4096), scheduler_config.get("base_shift", 0.5),
                         scheduler_config.get("max_shift", 1.15))
    return math.exp(mu)


# ------------------------------------------------------------------------------------------- the row's functions


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, L, D), "prompt_mask": (B, L)}: right-padded,
    the mask 1 on each prompt's valid prefix. ``max_sequence_length`` is not the pipeline's (not read)."""
    pe, mask, _ = pipe.encode_prompt(prompt=list(prompts), device=pipe.transformer.device)
    if mask is None:
        mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
    return {"prompt_embeds": pe, "prompt_mask": mask.long()}


def _call(tr: nn.Module, tokens: torch.Tensor, sigma: torch.Tensor, text: torch.Tensor, hw: tuple[int, int]):
    """One transformer call on rows sharing an unpadded text length: tokens (n, h·w, C), text (n, l, D) →
    (n, h·w, C), the image's part of the joint output. ``img_mask`` marks one slot per 2×2 group of image tokens
    after the text (the pipeline's)."""
    n, length = text.shape[:2]
    img_mask = torch.cat([torch.zeros(n, length, dtype=torch.bool, device=text.device),
                          torch.ones(n, hw[0] * hw[1] // 4, dtype=torch.bool, device=text.device)], dim=1)
    return tr(hidden_states=tokens, timestep=sigma, encoder_hidden_states=text, encoder_hidden_states_mask=None,
              img_shapes=[[(1, *hw)]] * n, img_mask=img_mask, return_dict=False)[0][:, -tokens.shape[1]:]


def call_lengths(tr: nn.Module, lengths: torch.Tensor) -> list[int]:
    """The prompt lengths to run a call for, ascending: those of ``lengths`` (N,), and with ``tr`` sharded by FSDP2
    those of every rank (a collective: all ranks call it together, as they call every FSDP2 forward)."""
    from torch.distributed.fsdp import FSDPModule

    mine = lengths.unique()  # sorted
    if not isinstance(tr, FSDPModule):
        return mine.tolist()
    import torch.distributed as dist

    top = mine.max().reshape(1).long()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    present = torch.zeros(int(top) + 1, dtype=torch.long, device=lengths.device)  # (top + 1,) 1 where a rank has it
    present[mine.long()] = 1
    dist.all_reduce(present, op=dist.ReduceOp.MAX)
    return present.nonzero().flatten().tolist()


def forward(tr: nn.Module, x: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """x (N, C, h, w), sigma (N,) → velocity (N, C, h, w): one call per distinct prompt length, without padding
    (under FSDP2 per length of any rank; a length without rows here runs on one zero-text row, added ×0)."""
    N, C, h, w = x.shape
    tokens = x.reshape(N, C, h * w).transpose(1, 2)  # (N, h·w, C), row-major cells (the pipeline's _pack_latents)
    lengths = cond["prompt_mask"].sum(dim=1)  # (N,) valid text tokens of each row (a prefix)
    text = cond["prompt_embeds"]  # (N, L, D)
    out, keep = None, tokens.new_zeros(())
    for length in call_lengths(tr, lengths):
        rows = (lengths == length).nonzero().flatten()
        if rows.numel() == 0:  # another rank's length: the same collectives, no contribution
            o = _call(tr, tokens[:1], sigma[:1], text.new_zeros(1, length, text.shape[2]), (h, w))
            keep = keep + 0 * o.sum()
            continue
        o = _call(tr, tokens[rows], sigma[rows], text[rows, :length], (h, w))
        out = o.new_zeros((N, *o.shape[1:])) if out is None else out
        out = out.index_copy(0, rows, o)
    return (out + keep.to(out.dtype)).transpose(1, 2).reshape(N, C, h, w)


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, h, w) → RGB pixels (B, 3, 16h, 16w) in [0, 1] (the VAE's RGBA, alpha dropped)."""
    return normalized_decode(vae, z.unsqueeze(2))[:, :3, 0]


def latent_shape(pipe, resolution: int, num_frames: int = 1) -> tuple[int, int, int]:
    """(C, H/16, W/16); the side a multiple of 32 (the pipeline's), so h·w is a whole number of 2×2 slots."""
    if resolution % (2 * VAE_FACTOR):
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {2 * VAE_FACTOR} for Qwen-Image 2.1")
    side = resolution // VAE_FACTOR
    return (int(pipe.transformer.config.in_channels), side, side)


ROWS = (
    PipelineSpec("qwenimage21", "QwenImage21Transformer2DModel", "QwenImage21Pipeline", 1.0, packed=False,
                 video=False, true_cfg=True, cfg_renorm=False, cond_keys=("prompt_embeds", "prompt_mask"),
                 lora_targets=ATTN_TARGETS, max_sequence_length=1024, encode=encode, forward=forward, decode=decode,
                 latent_shape=latent_shape),
)

__all__ = ["ROWS", "VAE_FACTOR", "call_lengths", "decode", "encode", "forward", "grid_shift", "latent_shape"]
