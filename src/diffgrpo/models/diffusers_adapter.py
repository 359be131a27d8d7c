"""Policy adapter for diffusers flow-matching transformers: the architectures of ``models/pipelines/`` (SD3/SD3.5,
FLUX.1, FLUX.2, Wan 2.1/2.2, Qwen-Image, Z-Image, and the editing pipelines Qwen-Image-Edit (Plus), FLUX.1 Kontext).

One class, :class:`DiffusersFlowPolicy`, wraps a diffusers transformer (and, when built from a pipeline, its
text encoders and VAE) behind the interface the rollout and the engines use (see ``models/__init__.py``). What
differs between architectures is their row of :data:`~.pipelines.PIPELINES` (``model.pipeline``): data and the
functions the policy calls (``row.encode``, ``row.forward``, ``row.decode``, ``row.latent_shape``, ``row.check``);
nothing here names one. The policy's settings are one :class:`PolicyOptions`.

The rollout sees unpacked latents (B, *latent_shape); a packed row's 2×2 packing happens inside :meth:`velocity`.
Classifier-free guidance runs the conditional and negative-prompt branches as one batched forward of 2B samples
(counted as 2B sample-forwards). Velocities are float32; the transformer forward may run under autocast
(``mixed_precision``) while all step math stays float32. Two experts (Wan 2.2 A14B, ``pipelines.wan.WanExperts``)
train as one module, each with its own adapter; the low-noise expert guides with ``guidance_scale_2``.

Reference policy (KL): with LoRA the base model with the adapter disabled; without LoRA a frozen copy of the
initial transformer, made only when requested (``keep_reference``). Prompt encodings are cached per prompt (an LRU
of ``cache_size`` prompts). With ``offload_text_encoders`` the text encoders live on the CPU and visit the
accelerator only while a batch of not-yet-cached prompts is encoded (``placement.TextEncoderOffload``).
fp16: a ``torch.amp.GradScaler`` attached as ``grad_scaler`` multiplies the gradient that reaches the
transformer's output by the loss scale, which scales every engine's backward without touching the engines.
"""
from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from ..cache import save_dir_atomic
from ..config import ModelConfig, RunConfig
from ..distributed import info as distributed_info
from ..distributed import launched_local_rank, resolve_device
from .latents import pack_2x2, unpack_2x2
from .lora import adapter_disabled, add_lora, load_lora_state_dict, lora_state_dict
from .pipelines import PIPELINES, ForwardArgs, PipelineSpec
from .pipelines.detect import detect_pipeline, pipeline_of, resolve_row
from .pipelines.editing import keys as source_keys
from .pipelines.load import load_pipeline
from .pipelines.spec import pad_seq
from .pipelines.wan import EXPERTS, WanExperts, expert_weights, experts
from .placement import TEXT_ENCODER_NAMES, ScaleGrad, TextEncoderOffload, weight_dtype
from .reference import frozen_reference, needs_reference

_SEQ_KEYS = ("prompt_embeds", "prompt_mask")


@dataclass(frozen=True)
class PolicyOptions:
    """A policy's settings (``build_diffusers_policy`` takes them from ``model.*``)."""

    guidance_scale: float = 1.0  # true CFG scale, or the embedded guidance value of a guidance-distilled row
    guidance_scale_2: float | None = None  # the low-noise expert's (two experts); None: guidance_scale
    negative_prompt: str = ""
    max_sequence_length: int = 0  # 0: the row's default
    device: str | torch.device = "cpu"
    mixed_precision: str = "no"  # no, bf16, fp16: autocast of the transformer forward
    lora_rank: int = 0  # 0: full fine-tune
    lora_alpha: float = 0.0
    lora_target_modules: str | tuple = ""  # empty: the row's lora_targets
    gradient_checkpointing: bool = False
    keep_reference: bool = False  # full fine-tune: keep a frozen copy of the initial weights (KL reference)
    decode_batch_size: int = 8
    cache_size: int = 512  # prompts whose encodings are kept (LRU)
    offload_text_encoders: bool = False
    train_experts: str = "both"  # two experts: both, high (transformer) or low (transformer_2)

    @classmethod
    def from_model(cls, m: ModelConfig, device: torch.device, keep_reference: bool) -> PolicyOptions:
        """The options of the ``model.*`` section ``m``."""
        return cls(guidance_scale=m.guidance_scale, guidance_scale_2=m.guidance_scale_low or None,
                   negative_prompt=m.negative_prompt, max_sequence_length=m.max_sequence_length, device=device,
                   mixed_precision=m.mixed_precision, lora_rank=m.lora_rank, lora_alpha=m.lora_alpha,
                   lora_target_modules=m.lora_target_modules, gradient_checkpointing=m.gradient_checkpointing,
                   keep_reference=keep_reference, offload_text_encoders=m.offload_text_encoders,
                   train_experts=m.train_experts)


def cfg_combine(v_c: torch.Tensor, v_u: torch.Tensor, scale: float, renorm: bool) -> torch.Tensor:
    """v_u + s·(v_c − v_u); with ``renorm`` rescaled to ‖v_c‖ along the last (channel) dim (Qwen-Image)."""
    v = v_u + scale * (v_c - v_u)
    if renorm:
        v = v * (v_c.norm(dim=-1, keepdim=True) / v.norm(dim=-1, keepdim=True).clamp(min=1e-12))
    return v


def pipeline_class(name: str) -> type:
    """``diffusers.<name>`` (a pipeline class) for a policy with no loaded pipeline (the built-in models save their
    LoRA through it). Importing a pipeline module imports every processor class it names (SD3's SigLIP image
    processor for IP-adapters), and transformers warns once where torchvision is missing although saving a LoRA
    uses none of them: its warnings are held back for the import only."""
    import diffusers
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return getattr(diffusers, name)
    finally:
        hf_logging.set_verbosity(level)


def _stack_padded(items: list[dict]) -> dict[str, torch.Tensor]:
    """Concatenate per-prompt encodings (each batched (1, ...)) on dim 0, padding sequences to a common length."""
    out = {}
    for k in items[0]:
        ts = [it[k] for it in items]
        if k in _SEQ_KEYS:
            L = max(t.shape[1] for t in ts)
            ts = [pad_seq(t, L) for t in ts]
        out[k] = torch.cat(ts)
    return out


def pipeline_encoder(row: PipelineSpec, pipe, max_sequence_length: int, side: int) -> Callable[[list], dict]:
    """``prompts -> cond`` through the pipeline's own encoder (an editing row: ``[(instruction, sources)] -> cond``
    with the sources resized to ``side`` pixels)."""
    if row.edit is not None:
        return lambda pairs: row.edit(pipe, pairs, max_sequence_length, side)
    return torch.no_grad()(lambda prompts: row.encode(pipe, prompts, max_sequence_length))


def pipeline_decoder(row: PipelineSpec, vae, batch: int,
                     layout: Mapping | None = None) -> Callable[[torch.Tensor], torch.Tensor]:
    """``z (B, *latent_shape) -> pixels in [0, 1]``, ``batch`` latents per VAE call (a row with a ``layout``:
    ``row.decode(vae, z, layout)``)."""
    if row.layout is not None:
        return lambda z: torch.cat([row.decode(vae, c, layout) for c in z.split(batch)])
    return lambda z: torch.cat([row.decode(vae, c) for c in z.split(batch)])


def _cfg_inputs(x: torch.Tensor, sigma: torch.Tensor, cond: dict, keys: tuple[str, ...], cfg: bool):
    """The forward's rows: x (B, ...) and sigma (B,) as is, or doubled (2B) with the conditional then the negative
    conditioning (sequences padded to a common length) under true CFG."""
    c = {k: cond[k] for k in keys}
    if not cfg:
        return x, sigma, c
    for k in keys:
        pos, neg = cond[k], cond["neg_" + k]
        if k in _SEQ_KEYS:
            L = max(pos.shape[1], neg.shape[1])
            pos, neg = pad_seq(pos, L), pad_seq(neg, L)
        c[k] = torch.cat([pos, neg])
    return torch.cat([x, x]), torch.cat([sigma, sigma]), c


# ------------------------------------------------------------------------------------------- the adapter


class DiffusersFlowPolicy:
    """Policy over a diffusers flow-matching transformer; see the module docstring.

    ``transformer``: the pipeline's transformer, or its two experts as one :class:`WanExperts`
    (``pipelines.wan.experts``). ``row``: the table row (or its key; "auto": detected from the transformer).
    ``encoder(prompts) -> cond`` (batched text conditioning) and ``decoder(z) -> images in [0, 1]`` are given
    explicitly, or taken from ``pipeline`` (its ``encode_prompt`` and VAE through the row). ``latent_shape`` is
    (C, H, W) or (C, F, H, W) in the rollout's (unpacked) layout; ``layout``: the geometry of a row with
    ``row.layout`` (``row.layout(pipe, resolution, num_frames)``; LTX-2's flat paired state).
    """

    def __init__(self, transformer: nn.Module, row: PipelineSpec | str = "auto",
                 options: PolicyOptions = PolicyOptions(), *, latent_shape: tuple[int, ...], pipeline=None,
                 encoder: Callable | None = None, decoder: Callable | None = None,
                 text_encoders: list[nn.Module] | None = None, layout: Mapping | None = None):
        self.components, self.trained_components = _components(transformer, options.train_experts)
        self.row = resolve_row(row, self.components["transformer"])
        self.options = options
        self.device = torch.device(options.device)
        self.pipeline = pipeline
        self.pipeline_config: Mapping = getattr(pipeline, "config", None) or {}
        self.transformer = transformer.to(self.device)
        self.latent_shape = tuple(int(s) for s in latent_shape)
        if self.row.layout is not None and not layout:
            raise ValueError(f"pipeline {self.row.name!r} needs its layout (row.layout(pipe, resolution, num_frames))")
        self.layout: Mapping = layout or {}
        self.guidance_scale = float(options.guidance_scale)  # mutable: engines run CFG-free forwards at 1
        self.guidance_scale_2 = None if options.guidance_scale_2 is None else float(options.guidance_scale_2)
        self.negative_prompt = options.negative_prompt
        self.max_sequence_length = options.max_sequence_length or self.row.max_sequence_length
        self._encoder, self._decoder = encoder, decoder
        if encoder is None:
            if pipeline is None:
                raise ValueError("DiffusersFlowPolicy needs a pipeline or an encoder")
            side = self.latent_shape[-1] * getattr(pipeline, "vae_scale_factor", 8)  # an editing row's sources
            self._encoder = pipeline_encoder(self.row, pipeline, self.max_sequence_length, side)
        if decoder is None and getattr(pipeline, "vae", None) is not None:
            self._decoder = pipeline_decoder(self.row, pipeline.vae, options.decode_batch_size, self.layout)
        if text_encoders is None:  # the pipeline's own; an explicit encoder function brings its modules itself
            text_encoders = [getattr(pipeline, n, None) for n in TEXT_ENCODER_NAMES] if pipeline is not None else []
        self.text_encoders = TextEncoderOffload(text_encoders, self.device, options.offload_text_encoders)
        self.grad_scaler = None  # torch.amp.GradScaler under fp16 (set by the trainer): scales the backward
        self._cache: OrderedDict[str, dict[str, torch.Tensor]] = OrderedDict()  # LRU of prompt encodings
        self.cache_size = options.cache_size
        self.amp_dtype = {"no": None, "bf16": torch.bfloat16, "fp16": torch.float16}[options.mixed_precision]
        self.counters = {"forwards_grad": 0, "forwards_nograd": 0}
        self.weight_dtype = weight_dtype(self.transformer)  # what the inputs are cast to (before LoRA's fp32 layers)
        self.lora_rank = int(options.lora_rank)
        self._ref = self._prepare_training(options)
        # what velocity() calls for the policy: the transformer, or a data-parallel wrapper around it
        # (``policy.forward_module = DistributedDataParallel(policy.transformer)``); weights stay on .transformer
        self.forward_module = self.transformer
        self._use_ref = False

    def _prepare_training(self, options: PolicyOptions) -> nn.Module | None:
        """Freeze the transformer, then make the trained part trainable: one LoRA adapter per trained expert, or
        the experts' own weights (with a frozen reference copy when asked). → the frozen copy or None."""
        self.transformer.requires_grad_(False)
        ref = None
        if self.lora_rank > 0:
            for name in self.trained_components:
                add_lora(self.components[name], self.lora_rank, options.lora_alpha, options.lora_target_modules,
                         default_targets=self.row.lora_targets)
        else:
            for name in self.trained_components:
                self.components[name].requires_grad_(True)
            ref = self._frozen_copy() if options.keep_reference else None
        if options.gradient_checkpointing:
            for m in self.components.values():
                m.enable_gradient_checkpointing()
        self.transformer.train()
        return ref

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
        return self.row.true_cfg and (self.guidance_scale != 1.0 or self._scale_2() != 1.0)

    def _scale_2(self) -> float:
        """The low-noise expert's guidance scale (= guidance_scale unless set; 1 while guidance is off)."""
        if self.guidance_scale_2 is None or self.guidance_scale == 1.0:
            return self.guidance_scale
        return self.guidance_scale_2

    def guidance_per_row(self, sigma: torch.Tensor) -> torch.Tensor | float:
        """Guidance scale of each row (B,): the low-noise expert's below the boundary (Wan 2.2 A14B)."""
        if not isinstance(self.transformer, WanExperts) or self._scale_2() == self.guidance_scale:
            return self.guidance_scale
        hi = self.transformer.expert_rows(sigma * self.row.timestep_scale)
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
        prompt's source images (``sources.of_batch``) for an editing row (``row.edit``), which adds
        "image_latents" (B, n, C, h, w) and encodes each (prompt, sources) pair, the negative prompt with each
        row's sources; other rows ignore it."""
        if self.row.edit is not None:
            keys = source_keys(list(prompts), sources, self.row.name)
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
        row = self.row
        tr = self._ref if self._use_ref else self.forward_module
        B = x.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x.device).expand(B)
        cfg = self.uses_cfg
        self.counters["forwards_grad" if torch.is_grad_enabled() else "forwards_nograd"] += B * (2 if cfg else 1)
        x, sigma, c = _cfg_inputs(x, sigma, cond, row.cond_keys, cfg)  # (N, ...), N = B or 2B
        H, W = x.shape[-2:]
        h = (pack_2x2(x) if row.packed else x).to(self.weight_dtype)  # (N, H/2·W/2, 4C) or (N, *latent_shape)
        c = {k: (v.to(self.weight_dtype) if v.is_floating_point() else v) for k, v in c.items()}
        if isinstance(self.transformer, WanExperts):  # data parallel: every expert runs on every rank
            self.transformer.sync = distributed_info().world_size > 1
            if isinstance(self._ref, WanExperts):
                self._ref.sync = self.transformer.sync
        args = ForwardArgs((H, W), self.latent_shape, self.guidance_scale, self.pipeline_config, self.layout)
        with torch.autocast(self.device.type, dtype=self.amp_dtype or torch.float32, enabled=self.amp_dtype is not None):
            out = row.forward(tr, h, sigma, c, args)
        out = out.float()
        if self.grad_scaler is not None and out.requires_grad:  # fp16 loss scaling of every engine's backward
            out = ScaleGrad.apply(out, self.grad_scaler.scale(torch.ones((), device=out.device)))
        if cfg:
            v_c, v_u = out.chunk(2)
            scale = self.guidance_per_row(sigma[:B])
            if torch.is_tensor(scale):
                scale = scale.to(v_c.device).view(B, *([1] * (v_c.dim() - 1)))
            out = cfg_combine(v_c, v_u, scale, row.cfg_renorm)
        return unpack_2x2(out, self.latent_shape[0], H, W) if row.packed else out

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
                            else pipeline_class(self.row.pipeline_class))
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


def _components(transformer: nn.Module, train_experts: str) -> tuple[dict[str, nn.Module], tuple[str, ...]]:
    """The experts by pipeline component name, and those that train (two experts: ``train_experts``)."""
    if not isinstance(transformer, WanExperts):
        return {"transformer": transformer}, ("transformer",)
    if train_experts not in EXPERTS:
        raise ValueError(f"train_experts must be one of {EXPERTS}, got {train_experts!r}")
    trained = {"both": ("transformer", "transformer_2"), "high": ("transformer",), "low": ("transformer_2",)}
    return {"transformer": transformer.high, "transformer_2": transformer.low}, trained[train_experts]


def build_diffusers_policy(cfg: RunConfig, *, progress: bool = True, log=print) -> DiffusersFlowPolicy:
    """``model.name=diffusers``: load the pipeline at ``model.pretrained`` with ``from_pretrained`` and wrap it."""
    m = cfg.model
    pipe, name = load_pipeline(m)
    row = PIPELINES[name]
    device = resolve_device(m.device, launched_local_rank())  # the Trainer passes it resolved already
    for part in TEXT_ENCODER_NAMES + ("vae",):  # text encoders offloaded: placed by the policy (CPU)
        mod = getattr(pipe, part, None)
        if mod is not None:
            mod.requires_grad_(False).eval()
            if part == "vae" or not m.offload_text_encoders:
                mod.to(device)
    shape = row.latent_shape(pipe, m.resolution, m.num_frames)
    log(f"loaded {type(pipe).__name__} from {m.pretrained} (pipeline {name}, latents {shape}, "
        f"{'LoRA rank ' + str(m.lora_rank) if m.lora_rank else 'full fine-tune'})")
    transformer = experts(pipe.transformer, getattr(pipe, "transformer_2", None),
                          getattr(pipe, "config", {}).get("boundary_ratio"))
    layout = row.layout(pipe, m.resolution, m.num_frames) if row.layout is not None else None
    return DiffusersFlowPolicy(transformer, row, PolicyOptions.from_model(m, device, needs_reference(cfg)),
                               latent_shape=shape, pipeline=pipe, layout=layout)


__all__ = ["DiffusersFlowPolicy", "PolicyOptions", "build_diffusers_policy", "cfg_combine", "detect_pipeline",
           "pack_2x2", "pipeline_decoder", "pipeline_encoder", "pipeline_of", "resolve_row", "unpack_2x2"]
