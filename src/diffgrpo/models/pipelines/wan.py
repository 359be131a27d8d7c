"""Wan 2.1 / 2.2 (``WanPipeline``, ``WanTransformer3DModel``): text-to-video.

Timestep σ·1000; text conditioning: UMT5 prompt embeddings; latents (C, F, H, W) as is; true CFG; the VAE has
per-channel statistics.

Wan 2.2 A14B (a pipeline with ``transformer_2`` and ``boundary_ratio``): two experts held as one module
(:class:`WanExperts`), ``transformer`` for timesteps ≥ boundary_ratio·1000 (high noise), ``transformer_2`` below,
exactly the pipeline's switch; each row of a batch goes to its own expert, and the low-noise expert guides with
``guidance_scale_2`` (the pipeline's default: ``guidance_scale``). ``train_experts`` picks the trained experts
(both, high, low; the others stay frozen), each with its own LoRA adapter; FSDP2 shards the blocks of both.
Wan 2.2 TI2V-5B (``expand_timesteps`` in the pipeline's config): one transformer fed the per-token timestep the
pipeline feeds it.
"""
from __future__ import annotations

import torch
from torch import nn

from ...config import ModelConfig
from ...errors import ConfigError
from ..lora import ATTN_TARGETS
from .spec import ForwardArgs, PipelineSpec, grid_latent_shape, normalized_decode

TIMESTEP_SCALE = 1000.0
EXPERTS = ("both", "high", "low")  # model.train_experts


class WanExperts(nn.Module):
    """Wan 2.2 A14B's two experts as one module: rows whose timestep is ≥ ``boundary_timestep`` run through
    ``high`` (the pipeline's ``transformer``), the others through ``low`` (``transformer_2``), as the pipeline
    switches. Under data parallelism (``sync`` True) an expert without rows still runs on one row whose output is
    added ×0, so that every rank makes the same collective calls (FSDP2) and every trained weight gets a gradient
    (DDP); one process skips it. ``blocks`` lists both experts' blocks (FSDP2 shards them one by one)."""

    def __init__(self, high: nn.Module, low: nn.Module, boundary_timestep: float):
        super().__init__()
        self.high, self.low = high, low
        self.boundary_timestep = float(boundary_timestep)
        self.sync = False

    @property
    def blocks(self) -> nn.ModuleList:
        return nn.ModuleList([*self.high.blocks, *self.low.blocks])

    @property
    def config(self):
        return self.high.config

    def _adapted(self) -> list[nn.Module]:
        return [m for m in (self.high, self.low) if getattr(m, "peft_config", None)]

    def fuse_lora(self, lora_scale: float = 1.0) -> None:
        """Fold each expert's LoRA adapter into its weights (``diffgrpo export --merge``)."""
        for m in self._adapted():
            m.fuse_lora(lora_scale=lora_scale)

    def unload_lora(self) -> None:
        for m in self._adapted():
            m.unload_lora()

    def expert_rows(self, timestep: torch.Tensor) -> torch.Tensor:
        """(N,) or (N, L) timesteps → (N,) bool: True where the high-noise expert runs."""
        t = timestep if timestep.dim() == 1 else timestep[:, 0]
        return t >= self.boundary_timestep

    def forward(self, hidden_states, encoder_hidden_states, timestep, return_dict=False):
        hi = self.expert_rows(timestep)
        N = hidden_states.shape[0]
        parts, keep = [], hidden_states.new_zeros(())
        for expert, rows in ((self.high, hi.nonzero().flatten()), (self.low, (~hi).nonzero().flatten())):
            if rows.numel() == 0 and not self.sync:
                continue
            take = rows if rows.numel() else torch.zeros(1, dtype=torch.long, device=hidden_states.device)
            o = expert(hidden_states=hidden_states[take], encoder_hidden_states=encoder_hidden_states[take],
                       timestep=timestep[take], return_dict=False)[0]
            if rows.numel():
                parts.append((rows, o))
            else:
                keep = keep + 0 * o.float().sum()
        out = parts[0][1].new_zeros((N, *parts[0][1].shape[1:]))
        for rows, o in parts:
            out = out.index_copy(0, rows, o)
        return (out + keep.to(out.dtype),)


def experts(transformer: nn.Module, transformer_2: nn.Module | None, boundary_ratio: float | None) -> nn.Module:
    """The module a policy trains: ``transformer`` alone, or with ``transformer_2`` the two experts switched at
    ``boundary_ratio``·1000 (the pipeline config's ``boundary_ratio``)."""
    if transformer_2 is None:
        return transformer
    if boundary_ratio is None:
        raise ValueError("a second transformer needs the pipeline's boundary_ratio")
    return WanExperts(transformer, transformer_2, float(boundary_ratio) * TIMESTEP_SCALE)


def expert_weights(sd: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The entries of component ``name`` in a two-expert LoRA state dict, without their prefix."""
    pre = name + "."
    return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}


def check_experts(m: ModelConfig, *, has_two: bool) -> None:
    """model.train_experts / model.guidance_scale_low need a two-expert pipeline (Wan 2.2 A14B's transformer_2)."""
    if has_two:
        return
    if m.train_experts != "both":
        raise ConfigError(f"model.train_experts: value {m.train_experts!r} needs a pipeline with two experts "
                          "(transformer and transformer_2, e.g. Wan 2.2 A14B); this one has one: remove the key")
    if m.guidance_scale_low:
        raise ConfigError("model.guidance_scale_low: applies to the low-noise expert transformer_2 of a two-expert "
                          "pipeline (Wan 2.2 A14B); this one has one transformer: remove the key")


def expanded_timesteps(t: torch.Tensor, latent_shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """Wan 2.2 TI2V's per-token timestep of text-to-video (every token at t, as its pipeline feeds it):
    t (N,), latents (C, F, H, W), patch (p_t, p_h, p_w) → (N, F/p_t · H/p_h · W/p_w)."""
    _, F_, H, W = latent_shape
    L = (F_ // patch[0]) * (H // patch[1]) * (W // patch[2])
    return t[:, None].expand(t.shape[0], L)


# ------------------------------------------------------------------------------------------- the row's functions


def encode(pipe, prompts: list[str], max_sequence_length: int) -> dict[str, torch.Tensor]:
    """The pipeline's ``encode_prompt`` → {"prompt_embeds": (B, L, D)}."""
    pe, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, device=pipe.transformer.device,
                               max_sequence_length=max_sequence_length)
    return {"prompt_embeds": pe}


def forward(tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, args: ForwardArgs) -> torch.Tensor:
    """h (N, C, F, H, W), sigma (N,) → velocity (N, C, F, H, W); per-token timesteps where the pipeline's config
    has ``expand_timesteps`` (TI2V)."""
    t = sigma * TIMESTEP_SCALE
    if args.pipeline_config.get("expand_timesteps", False):
        patch = tuple(getattr(tr, "module", tr).config.patch_size)  # tr may be a data-parallel wrapper
        t = expanded_timesteps(t, args.latent_shape, patch)
    return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], timestep=t, return_dict=False)[0]


def decode(vae, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, C, F, H, W) → pixels (B, 3, F', fH, fW) in [0, 1]."""
    return normalized_decode(vae, z)


def latent_shape(pipe, resolution: int, num_frames: int) -> tuple[int, ...]:
    return grid_latent_shape(pipe, "wan", resolution, num_frames, packed=False, video=True)


ROWS = (
    PipelineSpec("wan", "WanTransformer3DModel", "WanPipeline", TIMESTEP_SCALE, packed=False, video=True,
                 true_cfg=True, cfg_renorm=False, cond_keys=("prompt_embeds",), lora_targets=ATTN_TARGETS,
                 max_sequence_length=512, encode=encode, forward=forward, decode=decode, latent_shape=latent_shape),
)

__all__ = ["EXPERTS", "ROWS", "WanExperts", "check_experts", "decode", "encode", "expanded_timesteps",
           "expert_weights", "experts", "forward", "latent_shape"]
