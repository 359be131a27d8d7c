"""Policy adapter for diffusers flow-matching transformers (SD3/SD3.5, FLUX.1, FLUX.2, Wan 2.1/2.2, Qwen-Image,
Z-Image; the editing pipelines Qwen-Image-Edit (Plus) and FLUX.1 Kontext through ``models/editing.py``).

One class, :class:`DiffusersFlowPolicy`, wraps a diffusers transformer (and, when built from a pipeline, its
text encoders and VAE) behind the interface the rollout and the engines use (see ``models/__init__.py``).
What differs between families is data, kept in :data:`PIPELINES`:

| family    | transformer class              | timestep | text conditioning               | latents (rollout → model)      | guidance |
|-----------|--------------------------------|----------|---------------------------------|--------------------------------|----------|
| sd3       | SD3Transformer2DModel          | σ·1000   | prompt_embeds + pooled          | (C, H, W) as is                | true CFG |
| flux      | FluxTransformer2DModel         | σ        | prompt_embeds + pooled, txt_ids | (C, H, W) → 2×2-packed tokens, img_ids | distilled guidance embedding (one forward) |
| wan       | WanTransformer3DModel          | σ·1000   | prompt_embeds                   | (C, F, H, W) as is             | true CFG |
| qwenimage | QwenImageTransformer2DModel    | σ        | prompt_embeds + mask            | (C, H, W) → 2×2-packed tokens, img_shapes | true CFG with norm rescale |
| zimage    | ZImageTransformer2DModel       | 1 − σ    | unpadded prompt features (mask) | (C, H, W) → a list of (C, 1, H, W), output −v | true CFG (pipeline g = ours − 1) |
| flux2     | Flux2Transformer2DModel        | σ        | 3 stacked LM layers (Mistral-3) | (4C, H/16, W/16) patchified → h·w tokens, 4-axis ids | distilled guidance embedding |
| flux2_klein | Flux2Transformer2DModel (no guidance embedder) | σ | 3 stacked LM layers (Qwen3) | as flux2 | true CFG |

FLUX.2's layout, text features and decoding live in ``models/flux2.py``.

Wan 2.2 A14B (a pipeline with ``transformer_2`` and ``boundary_ratio``): two experts held as one module
(:class:`WanExperts`), ``transformer`` for timesteps ≥ boundary_ratio·1000 (high noise), ``transformer_2`` below,
exactly the pipeline's switch; each row of a batch goes to its own expert, and the low-noise expert guides with
``guidance_scale_2`` (the pipeline's default: ``guidance_scale``). ``train_experts`` picks the trained experts
(both, high, low; the others stay frozen), each with its own LoRA adapter; FSDP2 shards the blocks of both.
Wan 2.2 TI2V-5B (``expand_timesteps``): one transformer fed the per-token timestep the pipeline feeds it.

The rollout always sees unpacked latents (B, *latent_shape); packing happens inside :meth:`velocity`.
Classifier-free guidance runs the conditional and negative-prompt branches as one batched forward of 2B
samples (counted as 2B sample-forwards). Velocities are returned in float32; the transformer forward may run
under autocast (``mixed_precision``) while all step math stays float32.

Reference policy (KL): with LoRA the base model with the adapter disabled (no second copy of the weights);
without LoRA a frozen copy of the initial transformer, made only when requested (``keep_reference``).
Prompt encodings come from the pipeline's own ``encode_prompt`` and are cached per prompt (an LRU of
``cache_size`` prompts), so each distinct prompt is encoded once. With ``offload_text_encoders`` the text encoders
(T5-XXL, CLIP, Qwen2.5-VL, UMT5: up to ~10 GB in bf16) live on the CPU and visit the accelerator only while a
batch of not-yet-cached prompts is encoded (all of a batch's new prompts in one call), so between encodings the
accelerator holds the transformer alone. Cost: one host↔device copy of the encoders per batch that brings new
prompts (none once every prompt of the set is cached).

fp16 (``mixed_precision="fp16"``): a ``torch.amp.GradScaler`` attached as ``grad_scaler`` multiplies the gradient
that reaches the transformer's output by the loss scale (an identity in the forward). Every engine's loss depends
on the weights only through the velocities, so this scales every engine's backward without touching the engines;
the trainer unscales before clipping and skips the step on inf.
"""
from __future__ import annotations

import contextlib
import copy
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from safetensors.torch import save_file

from ..cache import save_dir_atomic
from ..config import RunConfig
from ..distributed import info as distributed_info
from ..distributed import launched_local_rank, resolve_device
from ..errors import ConfigError
from ..types import DTYPES
from . import editing, flux2
from .latents import flux_image_ids, pack_2x2, unpack_2x2
from .lora import (
    ATTN_TARGETS,
    JOINT_TARGETS,
    adapter_disabled,
    add_lora,
    load_lora_state_dict,
    lora_state_dict,
)
from .reference import frozen_reference, needs_reference

# ------------------------------------------------------------------------------------------- family table


@dataclass(frozen=True)
class PipelineSpec:
    name: str
    transformer_class: str
    pipeline_class: str
    timestep_scale: float  # the transformer's timestep argument is σ·timestep_scale
    packed: bool  # 2×2 latent packing into tokens (C·4 channels)
    video: bool  # latents (C, F, H, W)
    true_cfg: bool  # False: distilled guidance embedding, one forward
    cfg_renorm: bool  # rescale the guided prediction to the conditional one's per-token norm (Qwen-Image)
    cond_keys: tuple[str, ...]  # per-sample conditioning tensors the forward takes
    lora_targets: tuple[str, ...]  # default LoRA target modules (FlowGRPO / DanceGRPO choices)
    max_sequence_length: int  # default text length of the pipeline's encode_prompt


PIPELINES: dict[str, PipelineSpec] = {
    "sd3": PipelineSpec("sd3", "SD3Transformer2DModel", "StableDiffusion3Pipeline", 1000.0, False, False, True, False,
                  ("prompt_embeds", "pooled"), JOINT_TARGETS, 256),
    "flux": PipelineSpec("flux", "FluxTransformer2DModel", "FluxPipeline", 1.0, True, False, False, False,
                   ("prompt_embeds", "pooled"), JOINT_TARGETS, 512),
    "wan": PipelineSpec("wan", "WanTransformer3DModel", "WanPipeline", 1000.0, False, True, True, False,
                  ("prompt_embeds",), ATTN_TARGETS, 512),
    "qwenimage": PipelineSpec("qwenimage", "QwenImageTransformer2DModel", "QwenImagePipeline", 1.0, True, False, True, True,
                        ("prompt_embeds", "prompt_mask"), JOINT_TARGETS, 1024),
    # Z-Image: timestep 1 − σ, output −v, per-sample lists of (C, 1, H, W) latents and unpadded caption features;
    # its pipeline's guidance g (pos + g·(pos − neg), 0 = off) is model.guidance_scale = g + 1 here
    "zimage": PipelineSpec("zimage", "ZImageTransformer2DModel", "ZImagePipeline", 1.0, False, False, True, False,
                     ("prompt_embeds", "prompt_mask"), ATTN_TARGETS, 512),
    # FLUX.2 (models/flux2.py): rollout latents are the patchified (4C, H/16, W/16) grid; [dev] embedded guidance,
    # [klein] true CFG; both transformers are Flux2Transformer2DModel ([dev] has the guidance embedder)
    "flux2": PipelineSpec("flux2", "Flux2Transformer2DModel", "Flux2Pipeline", 1.0, False, False, False, False,
                    ("prompt_embeds",), flux2.LORA_TARGETS, 512),
    "flux2_klein": PipelineSpec("flux2_klein", "Flux2Transformer2DModel", "Flux2KleinPipeline", 1.0, False, False,
                          True, False, ("prompt_embeds",), flux2.LORA_TARGETS, 512),
    # image editing (models/editing.py): the source's VAE latents are appended to the latent tokens
    "qwenimage_edit": PipelineSpec("qwenimage_edit", "QwenImageTransformer2DModel", "QwenImageEditPipeline", 1.0,
                                   True, False, True, True, ("prompt_embeds", "prompt_mask", "image_latents"),
                                   JOINT_TARGETS, 1024),
    "qwenimage_edit_plus": PipelineSpec("qwenimage_edit_plus", "QwenImageTransformer2DModel",
                                        "QwenImageEditPlusPipeline", 1.0, True, False, True, True,
                                        ("prompt_embeds", "prompt_mask", "image_latents"), JOINT_TARGETS, 1024),
    "flux_kontext": PipelineSpec("flux_kontext", "FluxTransformer2DModel", "FluxKontextPipeline", 1.0, True, False,
                                 False, False, ("prompt_embeds", "pooled", "image_latents"), JOINT_TARGETS, 512),
}


def detect_family(transformer: nn.Module) -> str:
    """Pipeline key (model.family) from the transformer's class (or one of its bases)."""
    for cls in type(transformer).__mro__:
        for key, fam in PIPELINES.items():
            if cls.__name__ == fam.transformer_class:
                return flux2.variant(transformer) if key in flux2.FAMILIES else key
    raise ValueError(f"unsupported transformer class {type(transformer).__name__}; supported: "
                     f"{[f.transformer_class for f in PIPELINES.values()]}")


# ------------------------------------------------------------------------------------------- Wan 2.2 experts


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


def expert_weights(sd: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """The entries of component ``name`` in a two-expert LoRA state dict, without their prefix."""
    pre = name + "."
    return {k[len(pre):]: v for k, v in sd.items() if k.startswith(pre)}


# ------------------------------------------------------------------------------------------- per-family forward


def expanded_timesteps(t: torch.Tensor, latent_shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """Wan 2.2 TI2V's per-token timestep of text-to-video (every token at t, as its pipeline feeds it):
    t (N,), latents (C, F, H, W), patch (p_t, p_h, p_w) → (N, F/p_t · H/p_h · W/p_w)."""
    _, F_, H, W = latent_shape
    L = (F_ // patch[0]) * (H // patch[1]) * (W // patch[2])
    return t[:, None].expand(t.shape[0], L)


def _forward(fam: PipelineSpec, tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, *,
             latent_hw: tuple[int, int], guidance: float | None, expand: tuple | None = None) -> torch.Tensor:
    """One transformer call in the family's native layout. h: model input (packed for flux/qwen); sigma (N,);
    ``expand``: (latent shape, patch) of a Wan 2.2 TI2V transformer (per-token timesteps)."""
    t = sigma * fam.timestep_scale
    if fam.name == "sd3":
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                  timestep=t, return_dict=False)[0]
    if fam.name == "zimage":
        mask = cond["prompt_mask"].bool()
        caps = [e[m] for e, m in zip(cond["prompt_embeds"], mask)]  # each (L_i, D): the prompt's own tokens
        out = tr(list(h.unsqueeze(2).unbind(0)), 1.0 - sigma, caps, return_dict=False)[0]  # [(C, 1, H, W)] × N
        return -torch.stack(list(out)).squeeze(2)
    if fam.name == "wan":
        if expand is not None:
            t = expanded_timesteps(t, *expand)
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], timestep=t, return_dict=False)[0]
    H, W = latent_hw
    g = None
    if getattr(getattr(tr, "module", tr).config, "guidance_embeds", False):  # tr may be a DDP wrapper
        g = torch.full((h.shape[0],), float(guidance if guidance is not None else 1.0), device=h.device,
                       dtype=torch.float32)
    if fam.name in flux2.FAMILIES:
        return flux2.forward(tr, h, sigma, cond["prompt_embeds"], g)
    if editing.is_edit(fam.name):
        return editing.edit_forward(fam.name, tr, h, t, cond, latent_hw=latent_hw, guidance=g)
    if fam.name == "flux":
        L = cond["prompt_embeds"].shape[1]
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                  timestep=t, guidance=g, img_ids=flux_image_ids(H // 2, W // 2, h.device, h.dtype),
                  txt_ids=torch.zeros(L, 3, device=h.device, dtype=h.dtype), return_dict=False)[0]
    if fam.name == "qwenimage":
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"],
                  encoder_hidden_states_mask=cond["prompt_mask"], timestep=t, guidance=g,
                  img_shapes=[[(1, H // 2, W // 2)]] * h.shape[0], return_dict=False)[0]
    raise ValueError(fam.name)


def cfg_combine(v_c: torch.Tensor, v_u: torch.Tensor, scale: float, renorm: bool) -> torch.Tensor:
    """v_u + s·(v_c − v_u); with ``renorm`` rescaled to ‖v_c‖ along the last (channel) dim (Qwen-Image)."""
    v = v_u + scale * (v_c - v_u)
    if renorm:
        v = v * (v_c.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True).clamp(min=1e-12))
    return v


def _pad_seq(t: torch.Tensor, L: int) -> torch.Tensor:
    """Zero-pad a (B, l, ...) sequence tensor to length L on dim 1."""
    if t.shape[1] == L:
        return t
    pad = [0, 0] * (t.dim() - 2) + [0, L - t.shape[1]]
    return F.pad(t, pad)


_SEQ_KEYS = ("prompt_embeds", "prompt_mask")


def _stack_padded(items: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate per-prompt encodings (each batched (1, ...)) on dim 0, padding sequences to a common length."""
    out = {}
    for k in items[0]:
        ts = [it[k] for it in items]
        if k in _SEQ_KEYS:
            L = max(t.shape[1] for t in ts)
            ts = [_pad_seq(t, L) for t in ts]
        out[k] = torch.cat(ts)
    return out


# ------------------------------------------------------------------------------------------- text encoding


def pipeline_encoder(pipe, family: str, max_sequence_length: int) -> Callable[[list[str]], dict]:
    """``prompts -> {"prompt_embeds": (B, L, D), ...}`` through the pipeline's own ``encode_prompt``."""
    dev = pipe.transformer.device

    @torch.no_grad()
    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        if family == "sd3":
            pe, _, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, prompt_3=prompts, device=dev,
                                                  do_classifier_free_guidance=False,
                                                  max_sequence_length=max_sequence_length)
            return {"prompt_embeds": pe, "pooled": pooled}
        if family == "flux":
            pe, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=prompts, device=dev,
                                               max_sequence_length=max_sequence_length)
            return {"prompt_embeds": pe, "pooled": pooled}
        if family == "wan":
            pe, _ = pipe.encode_prompt(prompt=prompts, do_classifier_free_guidance=False, device=dev,
                                       max_sequence_length=max_sequence_length)
            return {"prompt_embeds": pe}
        if family == "zimage":  # a list of (L_i, D) per prompt → padded (B, L, D) + mask
            pes, _ = pipe.encode_prompt(prompt=list(prompts), device=dev, do_classifier_free_guidance=False,
                                        max_sequence_length=max_sequence_length)
            L = max(e.shape[0] for e in pes)
            mask = torch.stack([torch.arange(L, device=dev) < e.shape[0] for e in pes]).long()
            return {"prompt_embeds": torch.stack([_pad_seq(e[None], L)[0] for e in pes]), "prompt_mask": mask}
        if family == "qwenimage":
            pe, mask = pipe.encode_prompt(prompt=prompts, device=dev, max_sequence_length=max_sequence_length)
            if mask is None:
                mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
            return {"prompt_embeds": pe, "prompt_mask": mask}
        if family in flux2.FAMILIES:
            return flux2.encode(pipe, prompts, max_sequence_length)
        raise ValueError(family)

    return encode


# ------------------------------------------------------------------------------------------- VAE decoding


@torch.no_grad()
def vae_decode(vae, family: str, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, *latent_shape) → pixels in [0, 1]: (B, 3, H, W), or (B, 3, F, H, W) for wan."""
    if family in flux2.FAMILIES:
        return flux2.decode(vae, z)
    z = z.to(dtype=vae.dtype)
    c = vae.config
    family = editing.base_family(family)  # an editing family decodes as its text-to-image family
    if family in ("wan", "qwenimage"):  # per-channel normalisation
        shape = (1, c.z_dim, 1, 1, 1)
        mean = torch.tensor(c.latents_mean, device=z.device, dtype=z.dtype).view(shape)
        std = torch.tensor(c.latents_std, device=z.device, dtype=z.dtype).view(shape)
        z5 = z.unsqueeze(2) if family == "qwenimage" else z  # (B, C, 1, H, W) for the image family
        out = vae.decode(z5 * std + mean, return_dict=False)[0]
        if family == "qwenimage":
            out = out[:, :, 0]
    else:
        scale = getattr(c, "scaling_factor", 1.0) or 1.0
        shift = getattr(c, "shift_factor", None) or 0.0
        out = vae.decode(z / scale + shift, return_dict=False)[0]
    return (out.float() / 2 + 0.5).clamp(0, 1)


# ------------------------------------------------------------------------------------------- memory helpers


class TextEncoderOffload:
    """Where the text encoders live. ``offload`` True: on ``home`` (the CPU) except inside :meth:`active`, which
    moves them to the compute ``device`` for one encoding and back. ``location`` is "home" or "device"; ``moves``
    records every change of it as (location, bytes moved), also where both are the CPU (so the logic is testable
    without an accelerator). ``offload`` False: they stay on ``device``."""

    def __init__(self, modules: list[nn.Module], device: torch.device, offload: bool, home: str = "cpu"):
        self.modules = [m for m in modules if m is not None]
        self.device, self.offload, self.home = torch.device(device), bool(offload), torch.device(home)
        self.moves: list[tuple[str, int]] = []
        self.location = ""
        self._move("home" if self.offload else "device")

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.modules for p in m.parameters())

    def _move(self, where: str) -> None:
        if where == self.location:
            return
        for m in self.modules:
            m.to(self.home if where == "home" else self.device)
        if self.location:  # the initial placement is not a move
            self.moves.append((where, self.nbytes()))
        self.location = where

    @contextlib.contextmanager
    def active(self):
        """The encoders on the compute device inside the block; back on ``home`` after it when offloading."""
        self._move("device")
        try:
            yield
        finally:
            if self.offload:
                self._move("home")


class _ScaleGrad(torch.autograd.Function):
    """Identity in the forward; multiplies the incoming gradient by ``scale`` (a 0-d tensor) in the backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g * scale.to(g.dtype), None


TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")


def weight_dtype(module: nn.Module) -> torch.dtype:
    """The dtype holding most of ``module``'s floating-point weights: the one its inputs must have. Not the first
    parameter's: diffusers keeps some small modules in float32 in a bf16 model (Wan's ``scale_shift_table``, its
    time embedder and norms: ``_keep_in_fp32_modules``)."""
    count: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get) if count else torch.float32


# ------------------------------------------------------------------------------------------- the adapter


class DiffusersFlowPolicy:
    """Policy over a diffusers flow-matching transformer; see the module docstring.

    ``encoder(prompts) -> cond`` (batched text conditioning) and ``decoder(z) -> images in [0, 1]`` are given
    explicitly, or taken from ``pipeline`` (its ``encode_prompt`` and VAE). ``latent_shape`` is (C, H, W)
    or (C, F, H, W) in the rollout's (unpacked) layout.
    """

    def __init__(self, transformer: nn.Module, *, latent_shape: tuple[int, ...], family: str = "auto",
                 pipeline=None, encoder: Callable | None = None, decoder: Callable | None = None,
                 guidance_scale: float = 1.0, negative_prompt: str = "", max_sequence_length: int = 0,
                 device="cpu", mixed_precision: str = "no", lora_rank: int = 0, lora_alpha: float = 0.0,
                 lora_target_modules: str | tuple | list = "", gradient_checkpointing: bool = False,
                 keep_reference: bool = False, decode_batch_size: int = 8, cache_size: int = 512,
                 offload_text_encoders: bool = False, text_encoders: list[nn.Module] | None = None,
                 transformer_2: nn.Module | None = None, boundary_ratio: float | None = None,
                 guidance_scale_2: float | None = None, train_experts: str = "both", expand_timesteps: bool = False):
        fam_key = detect_family(transformer) if family in ("", "auto") else family
        if fam_key not in PIPELINES:
            raise ValueError(f"unknown family {family!r}; choose one of {sorted(PIPELINES)}")
        self.family = PIPELINES[fam_key]
        self.device = torch.device(device)
        self.pipeline = pipeline
        # the experts by pipeline component name, and those that train (Wan 2.2 A14B: two; else the transformer)
        if transformer_2 is not None:
            if boundary_ratio is None:
                raise ValueError("a second transformer needs the pipeline's boundary_ratio")
            if train_experts not in EXPERTS:
                raise ValueError(f"train_experts must be one of {EXPERTS}, got {train_experts!r}")
            self.components = {"transformer": transformer, "transformer_2": transformer_2}
            self.trained_components = {"both": ("transformer", "transformer_2"), "high": ("transformer",),
                                       "low": ("transformer_2",)}[train_experts]
            transformer = WanExperts(transformer, transformer_2, float(boundary_ratio) * 1000.0)
        else:
            self.components = {"transformer": transformer}
            self.trained_components = ("transformer",)
        self.transformer = transformer.to(self.device)
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.guidance_scale = float(guidance_scale)
        self.guidance_scale_2 = None if guidance_scale_2 is None else float(guidance_scale_2)  # low-noise expert
        self.expand_timesteps = bool(expand_timesteps)
        self.negative_prompt = negative_prompt
        self.max_sequence_length = max_sequence_length or self.family.max_sequence_length
        if encoder is None:
            if pipeline is None:
                raise ValueError("DiffusersFlowPolicy needs a pipeline or an encoder")
            encoder = (editing.edit_encoder(pipeline, fam_key, self.max_sequence_length,
                                            self.latent_shape[-1] * pipeline.vae_scale_factor)
                       if editing.is_edit(fam_key) else pipeline_encoder(pipeline, fam_key, self.max_sequence_length))
        if decoder is None and pipeline is not None and getattr(pipeline, "vae", None) is not None:
            vae = pipeline.vae

            def decoder(z):
                return torch.cat([vae_decode(vae, fam_key, c) for c in z.split(decode_batch_size)])
        self._encoder, self._decoder = encoder, decoder
        if text_encoders is None:  # the pipeline's own; an explicit encoder function brings its modules itself
            text_encoders = [getattr(pipeline, n, None) for n in TEXT_ENCODER_NAMES] if pipeline is not None else []
        self.text_encoders = TextEncoderOffload(text_encoders, self.device, offload_text_encoders)
        self.grad_scaler = None  # torch.amp.GradScaler under fp16 (set by the trainer): scales the backward
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # LRU of prompt encodings
        self.cache_size = cache_size
        self.amp_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[mixed_precision]
        self.counters = {"forwards_grad": 0, "forwards_nograd": 0}

        self.weight_dtype = weight_dtype(self.transformer)  # what the inputs are cast to (before LoRA's fp32 layers)
        self.lora_rank = int(lora_rank)
        self.transformer.requires_grad_(False)
        if self.lora_rank > 0:
            for name in self.trained_components:  # one adapter per trained expert
                add_lora(self.components[name], self.lora_rank, lora_alpha, lora_target_modules,
                         default_targets=self.family.lora_targets)
            self._ref = None
        else:
            for name in self.trained_components:
                self.components[name].requires_grad_(True)
            self._ref = self._frozen_copy() if keep_reference else None
        if gradient_checkpointing:
            for m in self.components.values():
                m.enable_gradient_checkpointing()
        self.transformer.train()
        # what velocity() calls for the policy: the transformer, or a data-parallel wrapper around it
        # (``policy.forward_module = DistributedDataParallel(policy.transformer)``); weights stay on .transformer
        self.forward_module = self.transformer
        self._use_ref = False

    def ensure_reference(self) -> None:
        """Keep a frozen copy of the current weights as the reference if there is none (full fine-tune; with LoRA the
        reference is the base model already). For a caller that builds one policy for several engines."""
        if self.lora_rank == 0 and self._ref is None:
            self._ref = self._frozen_copy()

    def _frozen_copy(self) -> nn.Module:
        """The reference of a full fine-tune: a frozen copy of the trained experts (a frozen expert is shared)."""
        if not isinstance(self.transformer, WanExperts):
            return copy.deepcopy(self.transformer).requires_grad_(False)
        tr = self.transformer
        high = copy.deepcopy(tr.high).requires_grad_(False) if "transformer" in self.trained_components else tr.high
        low = copy.deepcopy(tr.low).requires_grad_(False) if "transformer_2" in self.trained_components else tr.low
        return WanExperts(high, low, tr.boundary_timestep)

    # ---------------------------------------------------------------- properties
    @property
    def uses_cfg(self) -> bool:
        """True CFG (two branches); FLUX's distilled guidance is one forward."""
        return self.family.true_cfg and (self.guidance_scale != 1.0 or self._scale_2() != 1.0)

    def _scale_2(self) -> float:
        """The low-noise expert's guidance scale (= guidance_scale unless set; 1 while guidance is off)."""
        if self.guidance_scale_2 is None or self.guidance_scale == 1.0:
            return self.guidance_scale
        return self.guidance_scale_2

    def guidance_per_row(self, sigma: torch.Tensor) -> torch.Tensor | float:
        """Guidance scale of each row (B,): the low-noise expert's below the boundary (Wan 2.2 A14B)."""
        if not isinstance(self.transformer, WanExperts) or self._scale_2() == self.guidance_scale:
            return self.guidance_scale
        hi = self.transformer.expert_rows(sigma * self.family.timestep_scale)
        return torch.where(hi, self.guidance_scale, self._scale_2()).to(torch.float32)

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.transformer.parameters() if p.requires_grad]

    def named_trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.transformer.named_parameters() if p.requires_grad}

    # ---------------------------------------------------------------- conditioning
    def _encode_cached(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        missing = list(dict.fromkeys(p for p in prompts if p not in self._cache))
        fresh = {}
        if missing:
            with self.text_encoders.active():  # on the accelerator only for this call when offloading
                enc = self._encoder(missing)
            fresh = {p: {k: v[i:i + 1].detach().to(self.device) for k, v in enc.items()} for i, p in enumerate(missing)}
        items = [fresh[p] if p in fresh else self._cache[p] for p in prompts]
        for p in dict.fromkeys(prompts):  # refresh recency; evict the least recently used beyond cache_size
            self._cache[p] = fresh.get(p) or self._cache[p]
            self._cache.move_to_end(p)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return _stack_padded(items)

    @torch.no_grad()
    def encode(self, prompts: list[str], sources: list[tuple[str, ...]] | None = None) -> dict[str, torch.Tensor]:
        """→ {"prompt_embeds": (B, L, D), ("pooled": (B, D)), ("prompt_mask": (B, L))} plus ``neg_*`` entries
        (the negative prompt's, repeated over the batch) when true CFG is on. Cached per prompt. ``sources``: each
        prompt's source images (``sources.of_batch``) for an editing family (models/editing.py), which adds
        "image_latents" (B, n, C, h, w) and encodes each (prompt, sources) pair, the negative prompt with each
        row's sources; other families ignore it."""
        if editing.is_edit(self.family.name):
            keys = editing.keys(list(prompts), sources, self.family.name)
            cond = self._encode_cached(keys)
            if self.uses_cfg:
                neg = self._encode_cached([(self.negative_prompt, s) for _, s in keys])
                cond.update({"neg_" + k: v for k, v in neg.items()})
            return cond
        cond = self._encode_cached(list(prompts))
        if self.uses_cfg:
            neg = self._encode_cached([self.negative_prompt])
            for k, v in neg.items():
                cond["neg_" + k] = v.expand(len(prompts), *v.shape[1:]).contiguous()
        return cond

    # ---------------------------------------------------------------- reference policy
    @contextlib.contextmanager
    def reference(self):
        """Inside the block ``velocity`` uses the reference weights (LoRA disabled, or the frozen copy)."""
        with contextlib.ExitStack() as stack:
            if self.lora_rank > 0:
                for name in self.trained_components:
                    stack.enter_context(adapter_disabled(self.components[name]))
            else:
                stack.enter_context(frozen_reference(self))
            yield

    # ---------------------------------------------------------------- the velocity field
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        """x (B, *latent_shape), sigma (B,) in [0, 1] → guided velocity (B, *latent_shape) float32."""
        fam = self.family
        tr = self._ref if self._use_ref else self.forward_module
        B = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(B)
        cfg = self.uses_cfg
        self.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += B * (2 if cfg else 1)
        c = {k: cond[k] for k in fam.cond_keys}
        if cfg:
            x = torch.cat([x, x])
            sigma = torch.cat([sigma, sigma])
            for k in fam.cond_keys:
                pos, neg = cond[k], cond["neg_" + k]
                if k in _SEQ_KEYS:
                    L = max(pos.shape[1], neg.shape[1])
                    pos, neg = _pad_seq(pos, L), _pad_seq(neg, L)
                c[k] = torch.cat([pos, neg])
        H, W = x.shape[-2:]
        wdtype = self.weight_dtype
        h = pack_2x2(x) if fam.packed else x  # (N, H/2·W/2, 4C) or (N, *latent_shape)
        h = h.to(wdtype)
        c = {k: (v.to(wdtype) if v.is_floating_point() else v) for k, v in c.items()}
        if isinstance(self.transformer, WanExperts):  # data parallel: every expert runs on every rank
            self.transformer.sync = distributed_info().world_size > 1
            if isinstance(self._ref, WanExperts):
                self._ref.sync = self.transformer.sync
        expand = (self.latent_shape, tuple(self.components["transformer"].config.patch_size)) \
            if self.expand_timesteps else None
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            out = _forward(fam, tr, h, sigma, c, latent_hw=(H, W), guidance=self.guidance_scale, expand=expand)
        out = out.float()
        if self.grad_scaler is not None and out.requires_grad:  # fp16 loss scaling of every engine's backward
            out = _ScaleGrad.apply(out, self.grad_scaler.scale(torch.ones((), device=out.device)))
        if cfg:
            v_c, v_u = out.chunk(2)
            scale = self.guidance_per_row(sigma[:B])
            if torch.is_tensor(scale):
                scale = scale.to(v_c.device).view(B, *([1] * (v_c.dim() - 1)))
            out = cfg_combine(v_c, v_u, scale, fam.cfg_renorm)
        return unpack_2x2(out, self.latent_shape[0], H, W) if fam.packed else out

    # ---------------------------------------------------------------- decoding
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents (B, *latent_shape) → images (B, 3, H, W) in [0, 1] ((B, 3, F, H, W) for video)."""
        if self._decoder is None:
            raise RuntimeError("this policy has no VAE/decoder")
        return self._decoder(x)

    # ---------------------------------------------------------------- weights
    def _two_experts(self) -> bool:
        return isinstance(self.transformer, WanExperts)

    def state_dict(self, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The trainable weights: the LoRA adapter (peft names; with two experts prefixed by the component name,
        ``transformer.`` / ``transformer_2.``) or the whole transformer (two experts: ``high.`` / ``low.``).
        ``full``: take them from the transformer's full state dict gathered from FSDP2 shards
        (``distributed.full_model_state``) instead of the live (sharded) module."""
        if self.lora_rank > 0:
            if not self._two_experts():
                return lora_state_dict(self.transformer, full)
            attr = {"transformer": "high", "transformer_2": "low"}  # WanExperts' submodule of each component
            return {f"{name}.{k}": v for name in self.trained_components
                    for k, v in lora_state_dict(self.components[name],
                                                None if full is None else expert_weights(full, attr[name])).items()}
        sd = self.transformer.state_dict() if full is None else full
        return {k: v.detach().contiguous() for k, v in sd.items()}

    def load_state_dict(self, sd):
        if self.lora_rank > 0 and self._two_experts():
            for name in self.trained_components:
                load_lora_state_dict(self.components[name], expert_weights(sd, name))
        elif self.lora_rank > 0:
            load_lora_state_dict(self.transformer, sd)
        else:
            self.transformer.load_state_dict(sd)

    def export(self, run_dir: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path:
        """The end-of-run export into ``run_dir``: ``lora/`` (diffusers LoRA format) or ``transformer/``, written
        into a temporary directory renamed into place. ``weights``: the trainable weights as full tensors
        (``state_dict(full)``, an FSDP2 run's gathered state) instead of the live module's."""
        target = Path(run_dir) / ("lora" if self.lora_rank > 0 else "transformer")
        return save_dir_atomic(target, lambda d: self.save_adapter(d, weights))

    def save_adapter(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path | None:
        """LoRA: save in diffusers format (``<Pipeline>.save_lora_weights``), loadable with the pipeline's
        ``load_lora_weights``. Full fine-tune: ``transformer.save_pretrained``. Returns the directory. Wan 2.2
        A14B: each trained expert's files, ``transformer``'s in the directory, ``transformer_2``'s in its
        ``transformer_2/`` folder (``load_lora_weights(..., load_into_transformer_2=True)`` /
        ``WanTransformer3DModel.from_pretrained``).
        ``weights``: the trainable weights' full tensors (``state_dict(full)``: the adapter under peft's names, or
        the whole transformer), gathered from FSDP2 shards, instead of the live module's; a full fine-tune is then
        written as ``save_pretrained`` writes it (``config.json`` + ``diffusion_pytorch_model.safetensors``)."""
        import diffusers
        from peft.utils import get_peft_model_state_dict

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        two = self._two_experts()
        attr = {"transformer": "high", "transformer_2": "low"}
        for name in self.trained_components:  # transformer_2's files (Wan 2.2 A14B) in a transformer_2/ folder
            sub = d if name == "transformer" else d / name
            sub.mkdir(parents=True, exist_ok=True)
            module = self.components[name]
            if self.lora_rank > 0:
                pipe_cls = (type(self.pipeline) if self.pipeline is not None
                            else getattr(diffusers, self.family.pipeline_class))
                if weights is None:
                    layers = get_peft_model_state_dict(module)
                else:
                    layers = expert_weights(weights, name) if two else weights
                pipe_cls.save_lora_weights(
                    str(sub), transformer_lora_layers={k: v.detach().contiguous().cpu() for k, v in layers.items()},
                    transformer_lora_adapter_metadata=module.peft_config["default"].to_dict())
            elif weights is not None:  # the live module is sharded: its config, and the gathered weights
                part = expert_weights(weights, attr[name]) if two else weights
                module.save_config(str(sub))
                save_file({k: v.detach().contiguous().cpu() for k, v in part.items()},
                          str(sub / "diffusion_pytorch_model.safetensors"), metadata={"format": "pt"})
            else:
                module.save_pretrained(str(sub))
        return d

    def save_checkpoint_files(self, directory: str | Path, trainable: dict[str, torch.Tensor]) -> None:
        """LoRA: the checkpoint also carries the adapter in diffusers format (``<directory>/lora/``), from
        ``trainable`` (this policy's ``state_dict()`` as full tensors). A full fine-tune adds nothing (its weights
        are ``trainable.safetensors`` already)."""
        if self.lora_rank > 0:
            self.save_adapter(Path(directory) / "lora", weights=trainable)


# ------------------------------------------------------------------------------------------- factory


def _is_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


def latent_shape_for(pipe, family: str, resolution: int, num_frames: int) -> tuple[int, ...]:
    """(C, H/f, W/f) for images or (C, F', H/f, W/f) for video, from the pipeline's VAE factors."""
    if family in flux2.FAMILIES:
        return flux2.latent_shape(pipe, resolution)
    tr = pipe.transformer
    fam = PIPELINES[family]
    f = getattr(pipe, "vae_scale_factor_spatial", None) or getattr(pipe, "vae_scale_factor", 8)
    C = tr.config.in_channels // 4 if fam.packed else tr.config.in_channels
    h = resolution // f
    mult = 2 * f  # 2×2 patches / packing on the latent grid for every supported family
    if resolution % mult:
        raise ConfigError(f"model.resolution: {resolution} must be a multiple of {mult} for family {family!r}")
    if fam.video:
        ft = getattr(pipe, "vae_scale_factor_temporal", 4)
        if (num_frames - 1) % ft:
            raise ConfigError(f"model.num_frames: {num_frames} must be 1 + a multiple of {ft} for family {family!r}")
        return (C, (num_frames - 1) // ft + 1, h, h)
    return (C, h, h)


def _index_has(index: Path, component: str) -> bool:
    """Whether a pipeline's model_index.json names a (non-null) ``component``."""
    try:
        entry = json.loads(index.read_text(encoding="utf-8")).get(component)
    except (OSError, ValueError):
        return False
    return isinstance(entry, list) and entry[0] is not None


def check_experts(m, *, has_two: bool) -> None:
    """model.train_experts / model.guidance_scale_low need a two-expert pipeline (Wan 2.2 A14B's transformer_2)."""
    if has_two:
        return
    if m.train_experts != "both":
        raise ConfigError(f"model.train_experts: value {m.train_experts!r} needs a pipeline with two experts "
                          "(transformer and transformer_2, e.g. Wan 2.2 A14B); this one has one: remove the key")
    if m.guidance_scale_low:
        raise ConfigError("model.guidance_scale_low: applies to the low-noise expert transformer_2 of a two-expert "
                          "pipeline (Wan 2.2 A14B); this one has one transformer: remove the key")


def build_diffusers_policy(cfg: RunConfig, *, progress: bool = True, log=print) -> DiffusersFlowPolicy:
    """``model.name=diffusers``: load the pipeline at ``model.pretrained`` with ``from_pretrained`` and wrap it."""
    from diffusers import DiffusionPipeline

    m = cfg.model
    if not m.pretrained:
        raise ConfigError("model.pretrained: required for model.name=diffusers (a local pipeline directory or hub id)")
    if _is_local(m.pretrained):
        p = Path(m.pretrained).expanduser()
        if not (p / "model_index.json").is_file():
            raise ConfigError(f"model.pretrained: {str(p)!r} is not a diffusers pipeline directory "
                              "(no model_index.json)")
        check_experts(m, has_two=_index_has(p / "model_index.json", "transformer_2"))  # before loading anything
        flux2.check_local(p / "model_index.json", m.guidance_scale)
    dtype = DTYPES[m.dtype]
    try:
        pipe = DiffusionPipeline.from_pretrained(m.pretrained, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.pretrained: cannot load a diffusers pipeline from {m.pretrained!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if getattr(pipe, "transformer", None) is None:
        raise ConfigError(f"model.pretrained: {m.pretrained!r} has no transformer component "
                          f"({type(pipe).__name__} is not a flow-matching transformer pipeline)")
    family = editing.family_of_pipeline(pipe, detect_family(pipe.transformer)) if m.family == "auto" else m.family
    transformer_2 = getattr(pipe, "transformer_2", None)
    pipe_cfg = getattr(pipe, "config", {})
    check_experts(m, has_two=transformer_2 is not None)
    if family in flux2.FAMILIES:
        flux2.check_loaded(pipe, family, m.guidance_scale)
    pipe.set_progress_bar_config(disable=True)
    device = resolve_device(m.device, launched_local_rank())  # the Trainer passes it resolved already
    for name in TEXT_ENCODER_NAMES + ("vae",):  # text encoders offloaded: placed by the policy (CPU)
        mod = getattr(pipe, name, None)
        if mod is not None:
            mod.requires_grad_(False).eval()
            if name == "vae" or not m.offload_text_encoders:
                mod.to(device)
    shape = latent_shape_for(pipe, family, m.resolution, m.num_frames)
    log(f"loaded {type(pipe).__name__} from {m.pretrained} (family {family}, latents {shape}, "
        f"{'LoRA rank ' + str(m.lora_rank) if m.lora_rank else 'full fine-tune'})")
    return DiffusersFlowPolicy(
        pipe.transformer, latent_shape=shape, family=family, pipeline=pipe, guidance_scale=m.guidance_scale,
        negative_prompt=m.negative_prompt, max_sequence_length=m.max_sequence_length, device=device,
        mixed_precision=m.mixed_precision, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
        lora_target_modules=m.lora_target_modules, gradient_checkpointing=m.gradient_checkpointing,
        keep_reference=needs_reference(cfg), offload_text_encoders=m.offload_text_encoders,
        transformer_2=transformer_2, boundary_ratio=pipe_cfg.get("boundary_ratio"),
        guidance_scale_2=m.guidance_scale_low or None, train_experts=m.train_experts,
        expand_timesteps=bool(pipe_cfg.get("expand_timesteps", False)))


__all__ = ["DiffusersFlowPolicy", "EXPERTS", "PIPELINES", "PipelineSpec", "WanExperts", "build_diffusers_policy",
           "detect_family", "pack_2x2",
           "unpack_2x2", "cfg_combine", "vae_decode", "pipeline_encoder", "TextEncoderOffload"]
