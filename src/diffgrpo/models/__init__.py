"""Policy adapters. ``POLICIES`` maps ``model.name`` to a factory ``(RunConfig, progress, log) -> policy``.

A policy adapter provides: ``encode(prompts) -> cond`` (dict of tensors batched on dim 0),
``velocity(x, sigma, cond)`` (CFG inside), ``decode(x) -> images in [0, 1]``, ``trainable_parameters()``,
``reference()`` (context manager: velocity uses the reference weights), ``latent_shape``, ``uses_cfg``,
``device`` and ``counters`` ({"forwards_grad", "forwards_nograd"} sample-forward counts).
"""
from __future__ import annotations

from .tiny import TinyFlowPolicy, build_tiny_policy

POLICIES = {
    "tiny": build_tiny_policy,
}

__all__ = ["POLICIES", "TinyFlowPolicy", "build_tiny_policy"]
