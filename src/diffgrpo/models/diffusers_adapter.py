"""Policy adapter for diffusers flow-matching transformers (SD3/SD3.5, FLUX.1, Wan 2.1, Qwen-Image).

One class, :class:`DiffusersFlowPolicy`, wraps a diffusers transformer (and, when built from a pipeline, its
text encoders and VAE) behind the interface the rollout and the engines use (see ``models/__init__.py``).
What differs between families is data, kept in :data:`PIPELINES`:

| family    | transformer class              | timestep | text conditioning               | latents (rollout → model)      | guidance |
|-----------|--------------------------------|----------|---------------------------------|--------------------------------|----------|
| sd3       | SD3Transformer2DModel          | σ·1000   | prompt_embeds + pooled          | (C, H, W) as is                | true CFG |
| flux      | FluxTransformer2DModel         | σ        | prompt_embeds + pooled, txt_ids | (C, H, W) → 2×2-packed tokens, img_ids | distilled guidance embedding (one forward) |
| wan       | WanTransformer3DModel          | σ·1000   | prompt_embeds                   | (C, F, H, W) as is             | true CFG |
| qwenimage | QwenImageTransformer2DModel    | σ        | prompt_embeds + mask            | (C, H, W) → 2×2-packed tokens, img_shapes | true CFG with norm rescale |

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
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import save_dir_atomic
from ..config import RunConfig
from ..distributed import launched_local_rank, resolve_device
from ..errors import ConfigError
from ..types import DTYPES
from .lora import (
    ATTN_TARGETS,
    JOINT_TARGETS,
    adapter_disabled,
    add_lora,
    load_lora_state_dict,
    lora_state_dict,
)
from .reference import frozen_reference

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
}


def detect_family(transformer: nn.Module) -> str:
    """Pipeline key (model.family) from the transformer's class (or one of its bases)."""
    for cls in type(transformer).__mro__:
        for key, fam in PIPELINES.items():
            if cls.__name__ == fam.transformer_class:
                return key
    raise ValueError(f"unsupported transformer class {type(transformer).__name__}; supported: "
                     f"{[f.transformer_class for f in PIPELINES.values()]}")


# ------------------------------------------------------------------------------------------- packing


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, H/2·W/2, 4C), the FLUX / Qwen-Image token layout."""
    B, C, H, W = x.shape
    return x.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_2x2(t: torch.Tensor, C: int, H: int, W: int) -> torch.Tensor:
    """(B, H/2·W/2, 4C) → (B, C, H, W); the inverse of :func:`pack_2x2`."""
    B = t.shape[0]
    return t.view(B, H // 2, W // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def flux_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """FLUX rotary position ids of the packed image tokens: (h·w, 3) with (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


# ------------------------------------------------------------------------------------------- per-family forward


def _forward(fam: PipelineSpec, tr: nn.Module, h: torch.Tensor, sigma: torch.Tensor, cond: dict, *,
             latent_hw: tuple[int, int], guidance: float | None) -> torch.Tensor:
    """One transformer call in the family's native layout. h: model input (packed for flux/qwen); sigma (N,)."""
    t = sigma * fam.timestep_scale
    if fam.name == "sd3":
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], pooled_projections=cond["pooled"],
                  timestep=t, return_dict=False)[0]
    if fam.name == "wan":
        return tr(hidden_states=h, encoder_hidden_states=cond["prompt_embeds"], timestep=t, return_dict=False)[0]
    H, W = latent_hw
    g = None
    if getattr(getattr(tr, "module", tr).config, "guidance_embeds", False):  # tr may be a DDP wrapper
        g = torch.full((h.shape[0],), float(guidance if guidance is not None else 1.0), device=h.device,
                       dtype=torch.float32)
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
        if family == "qwenimage":
            pe, mask = pipe.encode_prompt(prompt=prompts, device=dev, max_sequence_length=max_sequence_length)
            if mask is None:
                mask = torch.ones(pe.shape[:2], dtype=torch.long, device=pe.device)
            return {"prompt_embeds": pe, "prompt_mask": mask}
        raise ValueError(family)

    return encode


# ------------------------------------------------------------------------------------------- VAE decoding


@torch.no_grad()
def vae_decode(vae, family: str, z: torch.Tensor) -> torch.Tensor:
    """Latents (B, *latent_shape) → pixels in [0, 1]: (B, 3, H, W), or (B, 3, F, H, W) for wan."""
    z = z.to(dtype=vae.dtype)
    c = vae.config
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
                 offload_text_encoders: bool = False, text_encoders: list[nn.Module] | None = None):
        fam_key = detect_family(transformer) if family in ("", "auto") else family
        if fam_key not in PIPELINES:
            raise ValueError(f"unknown family {family!r}; choose one of {sorted(PIPELINES)}")
        self.family = PIPELINES[fam_key]
        self.device = torch.device(device)
        self.pipeline = pipeline
        self.transformer = transformer.to(self.device)
        self.latent_shape = tuple(int(s) for s in latent_shape)
        self.guidance_scale = float(guidance_scale)
        self.negative_prompt = negative_prompt
        self.max_sequence_length = max_sequence_length or self.family.max_sequence_length
        if encoder is None:
            if pipeline is None:
                raise ValueError("DiffusersFlowPolicy needs a pipeline or an encoder")
            encoder = pipeline_encoder(pipeline, fam_key, self.max_sequence_length)
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
        if self.lora_rank > 0:
            add_lora(self.transformer, self.lora_rank, lora_alpha, lora_target_modules,
                     default_targets=self.family.lora_targets)
            self._ref = None
        else:
            self.transformer.requires_grad_(True)
            self._ref = copy.deepcopy(self.transformer).requires_grad_(False) if keep_reference else None
        if gradient_checkpointing:
            self.transformer.enable_gradient_checkpointing()
        self.transformer.train()
        # what velocity() calls for the policy: the transformer, or a data-parallel wrapper around it
        # (``policy.forward_module = DistributedDataParallel(policy.transformer)``); weights stay on .transformer
        self.forward_module = self.transformer
        self._use_ref = False

    # ---------------------------------------------------------------- properties
    @property
    def uses_cfg(self) -> bool:
        """True CFG (two branches); FLUX's distilled guidance is one forward."""
        return self.family.true_cfg and self.guidance_scale != 1.0

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
    def encode(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """→ {"prompt_embeds": (B, L, D), ("pooled": (B, D)), ("prompt_mask": (B, L))} plus ``neg_*`` entries
        (the negative prompt's, repeated over the batch) when true CFG is on. Cached per prompt."""
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
        with adapter_disabled(self.transformer) if self.lora_rank > 0 else frozen_reference(self):
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
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            out = _forward(fam, tr, h, sigma, c, latent_hw=(H, W), guidance=self.guidance_scale)
        out = out.float()
        if self.grad_scaler is not None and out.requires_grad:  # fp16 loss scaling of every engine's backward
            out = _ScaleGrad.apply(out, self.grad_scaler.scale(torch.ones((), device=out.device)))
        if cfg:
            v_c, v_u = out.chunk(2)
            out = cfg_combine(v_c, v_u, self.guidance_scale, fam.cfg_renorm)
        return unpack_2x2(out, self.latent_shape[0], H, W) if fam.packed else out

    # ---------------------------------------------------------------- decoding
    def decode(self, x: torch.Tensor) -> torch.Tensor:
        """Latents (B, *latent_shape) → images (B, 3, H, W) in [0, 1] ((B, 3, F, H, W) for video)."""
        if self._decoder is None:
            raise RuntimeError("this policy has no VAE/decoder")
        return self._decoder(x)

    # ---------------------------------------------------------------- weights
    def state_dict(self) -> dict[str, torch.Tensor]:
        """The trainable weights: the LoRA adapter (peft names) or the whole transformer."""
        if self.lora_rank > 0:
            return lora_state_dict(self.transformer)
        return {k: v.detach().contiguous() for k, v in self.transformer.state_dict().items()}

    def load_state_dict(self, sd):
        if self.lora_rank > 0:
            load_lora_state_dict(self.transformer, sd)
        else:
            self.transformer.load_state_dict(sd)

    def export(self, run_dir: str | Path) -> Path:
        """The end-of-run export into ``run_dir``: ``lora/`` (diffusers LoRA format) or ``transformer/``, written
        into a temporary directory renamed into place."""
        target = Path(run_dir) / ("lora" if self.lora_rank > 0 else "transformer")
        return save_dir_atomic(target, self.save_adapter)

    def save_adapter(self, directory: str | Path, weights: dict[str, torch.Tensor] | None = None) -> Path | None:
        """LoRA: save in diffusers format (``<Pipeline>.save_lora_weights``), loadable with the pipeline's
        ``load_lora_weights``. Full fine-tune: ``transformer.save_pretrained``. Returns the directory.
        ``weights``: the adapter's full tensors under peft's names (``state_dict()``, gathered from FSDP2 shards)
        instead of the live module's."""
        import diffusers
        from peft.utils import get_peft_model_state_dict

        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        if self.lora_rank > 0:
            pipe_cls = type(self.pipeline) if self.pipeline is not None else getattr(diffusers, self.family.pipeline_class)
            layers = get_peft_model_state_dict(self.transformer) if weights is None else weights
            pipe_cls.save_lora_weights(
                str(d), transformer_lora_layers={k: v.detach().contiguous().cpu() for k, v in layers.items()},
                transformer_lora_adapter_metadata=self.transformer.peft_config["default"].to_dict())
        else:
            self.transformer.save_pretrained(str(d))
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
    dtype = DTYPES[m.dtype]
    try:
        pipe = DiffusionPipeline.from_pretrained(m.pretrained, dtype=dtype)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.pretrained: cannot load a diffusers pipeline from {m.pretrained!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if getattr(pipe, "transformer", None) is None:
        raise ConfigError(f"model.pretrained: {m.pretrained!r} has no transformer component "
                          f"({type(pipe).__name__} is not a flow-matching transformer pipeline)")
    family = detect_family(pipe.transformer) if m.family == "auto" else m.family
    if getattr(pipe, "transformer_2", None) is not None:
        log("warning: this pipeline has a second (low-noise) transformer; only `transformer` is trained and used")
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
        keep_reference=cfg.loss.beta > 0, offload_text_encoders=m.offload_text_encoders)


__all__ = ["DiffusersFlowPolicy", "PIPELINES", "PipelineSpec", "build_diffusers_policy", "detect_family", "pack_2x2",
           "unpack_2x2", "cfg_combine", "vae_decode", "pipeline_encoder", "TextEncoderOffload"]
