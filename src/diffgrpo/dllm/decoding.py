"""Rollout decoding options of masked diffusion LMs (``dllm.decode``, ``dllm.kv_cache``): their cross-key rules and
the sampler arguments they select.

  dllm.decode=schedule   LLaDA's sampler: ``dllm.diffusion_steps`` steps, each committing its share of the block
                         (``dllm.remasking`` chooses which); exact ancestral sampling of the model's factorisation
  dllm.decode=threshold  Fast-dLLM's confidence-aware parallel decoding: per step, every masked token of the
                         current block whose confidence (probability of its proposed token) is at least
                         ``dllm.decode_threshold``, and at least the most confident one; steps vary per block
  dllm.kv_cache          none / prefix / dual (:mod:`diffgrpo.models.kv_cache`: what each reuses, what is exact);
                         ``dllm.cache_refresh`` = k > 0 rebuilds it every k-th step of a block (0: at block starts,
                         as Fast-dLLM)

The likelihood estimators score the completions alone (and the decode order only for ``daca.sml_partition=
decode_order``), so every method trains on rollouts of either decoder unchanged.
"""
from __future__ import annotations

from ..config import DLLMConfig
from ..errors import ConfigError

DECODE_THRESHOLD = DLLMConfig().decode_threshold  # 0.9, Fast-dLLM's


def check_config(d) -> None:
    """Cross-key rules of the decoding keys of the dllm section ``d``. Raises ConfigError (one line)."""
    if d.decode == "threshold":
        if d.remasking != "low_confidence":
            raise ConfigError(f"dllm.remasking: value {d.remasking!r} does not apply with dllm.decode=threshold (it "
                              f"commits by confidence); must be 'low_confidence', or use dllm.decode=schedule")
        if d.diffusion_steps:
            raise ConfigError(f"dllm.diffusion_steps: value {d.diffusion_steps} does not apply with "
                              f"dllm.decode=threshold (steps follow the threshold: 1 to block_length per block); "
                              f"must be 0")
    elif d.decode_threshold != DECODE_THRESHOLD:
        raise ConfigError(f"dllm.decode_threshold: value {d.decode_threshold} applies only with "
                          f"dllm.decode=threshold (dllm.decode is {d.decode!r}); remove it")
    if d.kv_cache == "none" and d.cache_refresh:
        raise ConfigError(f"dllm.cache_refresh: value {d.cache_refresh} applies only with dllm.kv_cache=prefix or "
                          f"dual; remove it")


def sampler_options(d) -> dict:
    """The :func:`diffgrpo.samplers.masked.sample` keyword arguments of the dllm section ``d`` (cache aside)."""
    return {"remasking": d.remasking, "decode": d.decode, "threshold": d.decode_threshold,
            "cache_refresh": d.cache_refresh}


__all__ = ["DECODE_THRESHOLD", "check_config", "sampler_options"]
