"""Regional compilation of flow transformers (``model.compile``): each repeated transformer block is compiled
once with ``torch.compile``, as diffusers recommends (``ModelMixin.compile_repeated_blocks``), in place.

Which blocks: the classes the model names in ``_repeated_blocks`` (diffusers' own list: FLUX, Wan, Qwen-Image),
else every block of the model's block lists (``distributed.transformer_blocks``: SD3's ``transformer_blocks``,
whose ``_repeated_blocks`` is empty). Compiling in place (``nn.Module.compile``) covers every caller of the
transformer: sampling, every engine's forward and backward (the backward is compiled by AOTAutograd), the
reference copy for the KL term, and data-parallel wrappers around the transformer.

Shapes: ``dynamic=False``: one graph per distinct input shape (sampling batch, CFG's doubled batch, each
micro-batch size); a run's shapes repeat every iteration, so everything compiles in the first iteration and
nothing after it (tests/test_regional_compile.py counts it). Dynamo's recompile limit is raised to
``RECOMPILE_LIMIT`` so that a handful of shapes × block variants (SD3's last block differs) never falls back
to eager silently.

Exactness: compiled kernels reorder floating-point reductions, so outputs and gradients agree with eager to
rounding, not bit for bit (``aot_eager`` traces without code generation: equal to ~1e-6; inductor: ~1e-5 relative
in float32).
"""
from __future__ import annotations

import torch
from torch import nn

from ..distributed import transformer_blocks
from ..errors import ConfigError

COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
RECOMPILE_LIMIT = 64


def repeated_blocks(transformer: nn.Module) -> list[nn.Module]:
    """The blocks to compile: modules whose class is in ``transformer._repeated_blocks``, else the block lists."""
    names = set(getattr(transformer, "_repeated_blocks", None) or ())
    found = [m for m in transformer.modules() if type(m).__name__ in names]
    return found or transformer_blocks(transformer)


def compile_blocks(transformer: nn.Module, backend: str = "inductor") -> int:
    """Compile every repeated block of ``transformer`` in place (static shapes) → the number of blocks."""
    if backend not in COMPILE_BACKENDS:
        raise ValueError(f"backend must be one of {COMPILE_BACKENDS}, got {backend!r}")
    blocks = repeated_blocks(transformer)
    if not blocks:
        raise ConfigError(f"model.compile: {type(transformer).__name__} has no repeated transformer blocks to compile "
                          f"(no _repeated_blocks, no transformer_blocks list); set model.compile=false")
    cfg = torch._dynamo.config
    cfg.cache_size_limit = max(cfg.cache_size_limit, RECOMPILE_LIMIT)
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


def compile_policy(policy, backend: str = "inductor") -> int:
    """Regional compilation of a flow policy's transformer and of its frozen reference copy, if it keeps one."""
    n = compile_blocks(policy.transformer, backend)
    if getattr(policy, "_ref", None) is not None:
        compile_blocks(policy._ref, backend)
    return n


def check_config(m, dist_mode: str) -> None:
    """Cross-key rules of ``model.compile`` / ``model.compile_backend`` (the model section ``m``)."""
    if not m.compile and m.compile_backend != COMPILE_BACKENDS[0]:
        raise ConfigError(f"model.compile_backend: value {m.compile_backend!r} applies only with model.compile=true; "
                          f"remove it")
    if m.compile and dist_mode == "fsdp2":
        raise ConfigError("model.compile: value True is not supported with dist.mode=fsdp2 (blocks would be compiled "
                          "before they are sharded); use dist.mode=ddp or model.compile=false")


__all__ = ["COMPILE_BACKENDS", "RECOMPILE_LIMIT", "check_config", "compile_blocks", "compile_policy",
           "repeated_blocks"]
