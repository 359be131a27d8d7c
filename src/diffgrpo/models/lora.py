"""LoRA adapters (peft) on diffusers transformers, for the diffusers policy adapter (built-in tiny model included).

:func:`add_lora` freezes the transformer and adds one peft adapter (``transformer.add_adapter``); only its
``lora_A`` / ``lora_B`` weights train, kept in float32. The KL reference policy is the same transformer with
the adapter disabled (:func:`adapter_disabled`), so no second copy of the weights is made. The trainable state
(checkpoints, ``weights.safetensors``) is the adapter alone, under peft's names (:func:`lora_state_dict`).

peft's default init (``init_lora_weights=True``) sets B = 0: the adapted model starts equal to the base model,
and the first gradient w.r.t. A is zero (only B moves on the first update).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

# default targets: the attention projections (FlowGRPO / DanceGRPO choices)
ATTN_TARGETS = ("to_q", "to_k", "to_v", "to_out.0")
JOINT_TARGETS = ATTN_TARGETS + ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")  # + the text stream (MMDiT)


def parse_targets(targets: str | tuple | list, default: tuple[str, ...]) -> list[str]:
    """``"to_q, to_k"`` or a sequence → module names; empty → ``default``."""
    if isinstance(targets, str):
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return list(targets or default)


def add_lora(transformer: nn.Module, rank: int, alpha: float = 0.0, targets: str | tuple | list = "", *,
             default_targets: tuple[str, ...] = JOINT_TARGETS) -> None:
    """Freeze ``transformer`` and add a rank-``rank`` LoRA adapter (alpha 0 = rank) on ``targets``."""
    from peft import LoraConfig

    transformer.requires_grad_(False)
    transformer.add_adapter(LoraConfig(r=int(rank), lora_alpha=float(alpha or rank), init_lora_weights=True,
                                       target_modules=parse_targets(targets, default_targets)))
    for n, p in transformer.named_parameters():  # trainable adapter weights in float32
        if "lora_" in n:
            p.data = p.data.float()
            p.requires_grad_(True)


@contextlib.contextmanager
def adapter_disabled(transformer: nn.Module):
    """Inside the block the transformer computes the base model (the reference policy).

    peft also clears the adapter weights' ``requires_grad`` while disabled and restores it on exit, so no
    backward may run inside the block (graphs built outside it are unaffected once it has exited)."""
    transformer.disable_adapters()
    try:
        yield
    finally:
        transformer.enable_adapters()


def lora_state_dict(transformer: nn.Module, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter weights under peft's names (no adapter name), detached and contiguous; from ``full`` (the
    transformer's state dict gathered from FSDP2 shards, ``distributed.full_model_state``) when given."""
    from peft.utils import get_peft_model_state_dict

    layers = get_peft_model_state_dict(transformer, state_dict=full)
    return {k: v.detach().contiguous() for k, v in layers.items()}


def load_lora_state_dict(transformer: nn.Module, sd: dict[str, torch.Tensor]) -> None:
    """Load :func:`lora_state_dict`'s output; a key the adapter lacks, or an adapter weight ``sd`` lacks, raises."""
    from peft.utils import set_peft_model_state_dict

    res = set_peft_model_state_dict(transformer, sd)
    if getattr(res, "unexpected_keys", None):
        raise KeyError(f"unexpected LoRA keys: {res.unexpected_keys[:5]}")
    missing = [k for k in getattr(res, "missing_keys", None) or [] if "lora_" in k]
    if missing:
        raise KeyError(f"LoRA weights missing from the state dict: {missing[:5]}")


__all__ = ["ATTN_TARGETS", "JOINT_TARGETS", "add_lora", "adapter_disabled", "lora_state_dict",
           "load_lora_state_dict", "parse_targets"]
