"""Transformers at real sizes from their published config numbers, with random weights (no download).

Each entry of ``MODELS`` names a diffusers transformer class and its constructor arguments per size:

  real   the published model's transformer config (what a GPU run benchmarks)
  small  a scaled-down version with the same structure, for CPU measurements (the memory table)
  toy    the smallest version that exercises the same code paths (CI runs the suite at this size)

Config numbers (the ``transformer/config.json`` of each hub repository):
  sd3   stabilityai/stable-diffusion-3.5-medium: SD3Transformer2DModel, 24 MMDiT-X layers (dual attention in
        layers 0-12), 24 heads × 64, joint_attention_dim 4096, caption_projection_dim 1536, pooled 2048,
        pos_embed_max_size 384, qk_norm rms_norm; 16 latent channels; 2.5B parameters.
  flux  black-forest-labs/FLUX.1-dev: FluxTransformer2DModel, 19 double + 38 single blocks, 24 heads × 128,
        joint_attention_dim 4096, pooled 768, guidance embedding, rope axes (16, 56, 56); 12B parameters.
  wan   Wan-AI/Wan2.1-T2V-1.3B-Diffusers: WanTransformer3DModel, 30 layers, 12 heads × 128, ffn 8960,
        text_dim 4096, freq_dim 256, patch (1, 2, 2); 1.3B parameters.
  flux2_klein  black-forest-labs/FLUX.2-klein-4B: Flux2Transformer2DModel, 5 double + 20 single blocks, 24 heads ×
        128, mlp ratio 3, joint_attention_dim 7680 (3 × Qwen3-4B's 2560), 128 latent channels, rope axes
        (32, 32, 32, 32), theta 2000, no guidance embedder; ~4B parameters. These numbers come from independent
        implementations of the model, not from the hub's config.json (not read here). At its published 1024×1024:
        (128, 64, 64) latents, 4096 image tokens + 512 text tokens. Sampled without CFG (guidance 1), as every cell.

  wan22_a14b  Wan-AI/Wan2.2-T2V-A14B-Diffusers: two WanTransformer3DModel experts (``transformer`` for high noise,
        ``transformer_2`` for low noise, switched at boundary_ratio 0.875 of the timesteps), each 40 layers,
        40 heads × 128 (dim 5120), ffn 13824, text_dim 4096, freq_dim 256, patch (1, 2, 2); 2 × 14B parameters (the
        Wan team's released config: dim 5120, ffn 13824, 40 heads, 40 layers, boundary 0.875). Both experts train
        (LoRA on each); a rollout crosses the boundary, so every cell runs both.

Text encoders and VAEs are not what is benchmarked: the policy gets a stub text encoding (seeded random
embeddings of the shapes the pipeline's ``encode_prompt`` returns: T5/CLIP lengths and widths) and a stub decoder
(the first three latent channels through a sigmoid, the first frame for video) that the JPEG reward can score.
"""
from __future__ import annotations

import zlib

import torch

from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy, PolicyOptions
from diffgrpo.models.pipelines import wan

# per family: class, constructor kwargs per size, latent shape per size (C, H, W) / (C, F, H, W), text tokens,
# text width, pooled width (0: none), and the resolution the latents stand for
MODELS = {
    "sd3": {
        "class": "SD3Transformer2DModel",
        "real": dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                     attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                     caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                     dual_attention_layers=tuple(range(13)), qk_norm="rms_norm"),
        "small": dict(sample_size=16, patch_size=2, in_channels=16, out_channels=16, num_layers=4,
                      attention_head_dim=32, num_attention_heads=4, joint_attention_dim=64,
                      caption_projection_dim=128, pooled_projection_dim=64, pos_embed_max_size=16,
                      dual_attention_layers=(0, 1), qk_norm="rms_norm"),
        "toy": dict(sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
                    attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
                    pooled_projection_dim=16, pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm"),
        "latents": {"real": (16, 64, 64), "small": (16, 16, 16), "toy": (16, 8, 8)},
        "pixels": {"real": "512×512", "small": "128×128", "toy": "64×64"},
        "text": {"real": (333, 4096, 2048), "small": (16, 64, 64), "toy": (8, 16, 16)},  # CLIP 77 + T5 256 tokens
    },
    "flux": {
        "class": "FluxTransformer2DModel",
        "real": dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                     guidance_embeds=True, axes_dims_rope=(16, 56, 56)),
        "toy": dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8, guidance_embeds=True,
                    axes_dims_rope=(2, 2, 4)),
        "latents": {"real": (16, 64, 64), "toy": (16, 8, 8)},
        "pixels": {"real": "512×512", "toy": "64×64"},
        "text": {"real": (512, 4096, 768), "toy": (8, 16, 8)},
    },
    "wan": {
        "class": "WanTransformer3DModel",
        "real": dict(patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        "toy": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                    out_channels=16, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "latents": {"real": (16, 3, 60, 104), "toy": (16, 2, 8, 8)},  # 9 frames at 480×832
        "pixels": {"real": "9 frames × 480×832", "toy": "5 frames × 64×64"},
        "text": {"real": (512, 4096, 0), "toy": (8, 16, 0)},
    },
    "flux2_klein": {
        "class": "Flux2Transformer2DModel",
        "real": dict(patch_size=1, in_channels=128, num_layers=5, num_single_layers=20, attention_head_dim=128,
                     num_attention_heads=24, joint_attention_dim=7680, timestep_guidance_channels=256, mlp_ratio=3.0,
                     axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=False),
        "toy": dict(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                    num_attention_heads=2, joint_attention_dim=16, timestep_guidance_channels=16,
                    axes_dims_rope=(2, 2, 2, 2), guidance_embeds=False),
        "latents": {"real": (128, 64, 64), "toy": (16, 4, 4)},  # patchified VAE latents: 1024 px / 16
        "pixels": {"real": "1024×1024", "toy": "64×64"},
        "text": {"real": (512, 7680, 0), "toy": (8, 16, 0)},
    },
    "wan22_a14b": {
        "class": "WanTransformer3DModel",
        "experts": 2, "boundary_ratio": 0.875, "policy_family": "wan",
        "real": dict(patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16,
                     out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
                     qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024),
        "toy": dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=16,
                    out_channels=16, text_dim=16, freq_dim=16, ffn_dim=32, num_layers=2, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
        "latents": {"real": (16, 3, 60, 104), "toy": (16, 2, 8, 8)},  # 9 frames at 480×832
        "pixels": {"real": "9 frames × 480×832", "toy": "5 frames × 64×64"},
        "text": {"real": (512, 4096, 0), "toy": (8, 16, 0)},
    },
}


def build_transformer(family: str, size: str, device: str, dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    """The family's transformer at ``size`` with random weights, created directly on ``device`` (a 12B model is
    not initialised on the CPU first) and cast to ``dtype``."""
    import diffusers

    spec = MODELS[family]
    cls = getattr(diffusers, spec["class"])
    if spec.get("experts", 1) > 1:  # Wan 2.2 A14B: [high-noise expert, low-noise expert], seeded apart
        return torch.nn.ModuleList([_build_one(cls, spec[size], device, dtype, seed + i)
                                    for i in range(spec["experts"])])
    return _build_one(cls, spec[size], device, dtype, seed)


def _build_one(cls, kwargs: dict, device: str, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.device(device):
        tr = cls(**kwargs)
    keep = tuple(getattr(cls, "_keep_in_fp32_modules", None) or ())  # as from_pretrained(torch_dtype=...) keeps them
    for name, t in [*tr.named_parameters(), *tr.named_buffers()]:
        if t.is_floating_point() and not any(k in name.split(".") for k in keep):
            t.data = t.data.to(dtype)
    return tr.requires_grad_(False)


def stub_encoder(family: str, size: str, device: str, dtype: torch.dtype):
    """``prompts -> cond``: seeded random embeddings per prompt with the pipeline's shapes (no text encoder)."""
    L, D, P = MODELS[family]["text"][size]

    def encode(prompts: list[str]) -> dict[str, torch.Tensor]:
        embeds, pooled = [], []
        for p in prompts:
            g = torch.Generator().manual_seed(zlib.crc32(p.encode()))
            embeds.append(torch.randn(1, L, D, generator=g))
            if P:
                pooled.append(torch.randn(1, P, generator=g))
        out = {"prompt_embeds": torch.cat(embeds)}
        if P:
            out["pooled"] = torch.cat(pooled)
        return {k: v.to(device=device, dtype=dtype) for k, v in out.items()}

    return encode


def stub_decoder(z: torch.Tensor) -> torch.Tensor:
    """Latents → (B, 3, H', W') in [0, 1]: the first three channels (the first frame of a video), upsampled
    (nearest) to at least 64 pixels a side so that the JPEG reward tells samples apart at toy sizes too."""
    if z.dim() == 5:
        z = z[:, :, 0]
    img = torch.sigmoid(z[:, :3].float())
    f = max(1, -(-64 // min(img.shape[-2:])))
    return img.repeat_interleave(f, -2).repeat_interleave(f, -1) if f > 1 else img


def build_policy(transformer: torch.nn.Module, family: str, size: str, device: str, *, lora_rank: int = 0,
                 gradient_checkpointing: bool = False) -> DiffusersFlowPolicy:
    """A policy over ``transformer`` (shared between cells: build the full fine-tune cells before the LoRA ones,
    since LoRA adds adapter layers to it)."""
    spec = MODELS[family]
    experts = list(transformer) if isinstance(transformer, torch.nn.ModuleList) else [transformer]
    for tr in experts:
        if "default" in (getattr(tr, "peft_config", None) or {}):  # a previous cell's adapter: a fresh one
            tr.delete_adapters("default")
        if gradient_checkpointing:
            tr.enable_gradient_checkpointing()
        else:
            tr.disable_gradient_checkpointing()
    dtype = next(experts[0].parameters()).dtype
    transformer = wan.experts(experts[0], experts[1] if len(experts) > 1 else None, spec.get("boundary_ratio"))
    options = PolicyOptions(device=device, lora_rank=lora_rank, lora_alpha=float(lora_rank),
                            gradient_checkpointing=gradient_checkpointing, guidance_scale=1.0)
    return DiffusersFlowPolicy(transformer, spec.get("policy_family", family), options,
                               latent_shape=spec["latents"][size], encoder=stub_encoder(family, size, device, dtype),
                               decoder=stub_decoder)


def parameter_count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
