"""Masked diffusion LMs at scale: weights at ``dllm.dtype``, activation checkpointing of the blocks (transformers'
switch), a peft LoRA adapter (trains in float32 on a frozen base) and FSDP2 sharding of every transformer block
found below the root (LLaDA's ``transformer.blocks``, Dream's ``layers``), peft's wrapper included."""
from __future__ import annotations

import torch.nn as nn

from ..distributed import fully_shard_each, is_initialized
from ..distributed import transformer_blocks as root_blocks
from ..errors import ConfigError
from ..types import DTYPES

# default LoRA targets, the first candidate set the model has: LLaDA / Dream / Llama-style attention (d1's choice),
# BERT-style attention
LORA_TARGETS = (("q_proj", "k_proj", "v_proj"), ("query", "key", "value"), ("Wqkv",))
BLOCK_NAMES = ("blocks", "layers", "layer", "h")  # LLaDA: transformer.blocks; Dream/Qwen: layers; BERT: encoder.layer


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` is a peft model (a LoRA adapter on a frozen base)."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def default_lora_targets(model: nn.Module) -> list[str]:
    """The first of ``LORA_TARGETS`` whose module names all occur in ``model`` (ValueError if none does)."""
    leaves = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    for names in LORA_TARGETS:
        if set(names) <= leaves:
            return list(names)
    raise ValueError("no default LoRA targets found (looked for " + "; ".join(", ".join(t) for t in LORA_TARGETS)
                     + "); set dllm.lora_target_modules")


def add_lora(model: nn.Module, rank: int, alpha: float = 0.0, targets: str = "") -> nn.Module:
    """Freeze ``model`` and wrap it in a peft LoRA model (rank ``rank``, alpha 0 = rank; ``targets`` comma-separated,
    empty = :func:`default_lora_targets`). The adapter starts at B = 0 (the model is unchanged) and trains in
    float32 whatever the base dtype."""
    from peft import LoraConfig, get_peft_model

    names = [t.strip() for t in targets.split(",") if t.strip()] or default_lora_targets(model)
    model.requires_grad_(False)
    peft_model = get_peft_model(model, LoraConfig(r=int(rank), lora_alpha=float(alpha or rank), lora_dropout=0.0,
                                                  target_modules=names, init_lora_weights=True))
    for n, p in peft_model.named_parameters():  # trainable adapter weights in float32
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)
    return peft_model


def configure_model(model: nn.Module, *, dtype: str = "float32", gradient_checkpointing: bool = False,
                    lora_rank: int = 0, lora_alpha: float = 0.0, lora_targets: str = "") -> nn.Module:
    """The masked LM at ``dtype``, with activation checkpointing and a LoRA adapter when asked (→ the module the
    policy trains: ``model`` or its peft wrapper)."""
    model = model.to(DTYPES[dtype])
    if gradient_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(f"dllm.gradient_checkpointing: {type(model).__name__} does not support gradient "
                              f"checkpointing (transformers' gradient_checkpointing_enable); set it to false")
        # non-reentrant: gradients reach the adapter even though the frozen embeddings' output needs none
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 (the old name is deprecated)
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if lora_rank > 0:
        model = add_lora(model, lora_rank, lora_alpha, lora_targets)
    return model


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a masked LM (the first non-empty ``nn.ModuleList`` named in ``BLOCK_NAMES``, searched
    through the module tree, peft wrappers included): what FSDP2 shards one by one."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and len(mod) and name.rsplit(".", 1)[-1] in BLOCK_NAMES:
            return list(mod)
    return []


def shard_blocks(model: nn.Module, *, param_dtype: str = "float32", cpu_offload: bool = False) -> int:
    """FSDP2: ``fully_shard`` every block :func:`transformer_blocks` finds that the trainer's root wrap
    (``distributed.wrap_fsdp2``, which looks only at the root's own block lists) would not shard itself, with the
    root's policies (``dist.fsdp_param_dtype``: all-gather and compute in that dtype, reduce in float32;
    ``dist.fsdp_cpu_offload``); the trainer then shards the root. → the number of blocks sharded here. No-op at
    world size 1."""
    import torch.distributed as dist

    if not is_initialized() or dist.get_world_size() == 1 or root_blocks(model):
        return 0
    blocks = transformer_blocks(model)
    fully_shard_each(blocks, param_dtype=param_dtype, cpu_offload=cpu_offload)
    return len(blocks)


__all__ = ["BLOCK_NAMES", "LORA_TARGETS", "add_lora", "configure_model", "default_lora_targets", "is_lora",
           "shard_blocks", "transformer_blocks"]
