"""Dataclasses that cross the seams: sampler output, rollout record, engine counters.

Shape notation used across the package:
  B  trajectories in the rollout (prompts × group size)
  T  sampling steps (step k maps x_k at σ_k to x_{k+1} at σ_{k+1}; σ_0 = 1, σ_T = 0)
  *S the latent shape of one sample, e.g. (C, H, W)
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch


class StepOut(NamedTuple):
    """Result of one transition ``x_k -> x_{k+1}``.

    prev_sample (B, *S) the next state x_{k+1} (given or sampled);
    log_prob    (B,)    log N(prev_sample; mean, std²) reduced over non-batch elements (0 where std == 0);
    mean        (B, *S) the Gaussian mean μ;
    std         (B,)    the Gaussian std s (per sample, same for every element).
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


@dataclass
class Rollout:
    """Everything a gradient engine needs from the sampling phase.

    Tensors live on the policy's device; float32.
    """

    prompts: list[str]  # length B
    group_ids: torch.Tensor  # (B,) long: trajectories with the same id share a prompt
    cond: dict[str, torch.Tensor]  # conditioning, every tensor batched on dim 0 (B, ...)
    sigmas: torch.Tensor  # (T+1,) decreasing grid, sigmas[0] = 1, sigmas[T] = 0
    xs: torch.Tensor  # (B, T+1, *S) states x_0 (noise) .. x_T (sample)
    velocities: torch.Tensor  # (B, T, *S) (guided) velocities used at each step
    log_probs: torch.Tensor  # (B, T) rollout log-probs of the taken transitions (0 where std == 0)
    noise: torch.Tensor  # (B, T, *S) standard-normal noise injected at each step (0 for deterministic steps)
    selected: torch.Tensor  # (B, T) bool: steps that receive gradients
    rewards: torch.Tensor | None = None  # (B,) combined reward (NaN where excluded)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,)
    valid: torch.Tensor | None = None  # (B,) bool: reward usable in statistics
    advantages: torch.Tensor | None = None  # (B,) float
    loss_weights: torch.Tensor | None = None  # (B, T) aggregation weights from losses.aggregation_weights
    images: torch.Tensor | None = None  # (B, C, H, W) decoded samples in [0, 1]
    metadata: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    extras: dict[str, Any] = field(default_factory=dict)  # engine-owned state (retained graphs, buffers, …)

    @property
    def batch_size(self) -> int:
        return self.xs.shape[0]

    @property
    def num_steps(self) -> int:
        return self.xs.shape[1] - 1


@dataclass
class EngineStats:
    """Counters reported by every gradient engine for one ``backward`` call.

    "sample-" counters count individual samples pushed through the network (a CFG forward of one sample
    counts 2, as the network sees two inputs), so that engines that batch differently compare fairly.
    """

    engine: str = ""
    forwards_grad: int = 0  # sample-forwards with autograd recording
    forwards_nograd: int = 0  # sample-forwards without grad (reference policy, refreshed velocities)
    backward_calls: int = 0  # torch.autograd.backward invocations
    sample_backwards: int = 0  # samples whose activations were back-propagated through the network
    retained_graphs: int = 0  # graphs kept alive from the rollout
    grad_buffers: int = 0  # per-trajectory gradient buffers held at once
    allreduce_calls: int = 0  # gradient all-reduces / reduce-scatters issued
    peak_memory_bytes: int = 0  # CUDA peak allocated, or peak live saved-activation bytes on CPU
    seconds: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    metrics: dict[str, float] = field(default_factory=dict)  # clip_ratio, kl, ratio_mean, …

    def merge(self, other: "EngineStats") -> "EngineStats":
        """Add counters of ``other`` into ``self`` (peak memory takes the max)."""
        for f in dataclasses.fields(self):
            if f.name in ("engine", "seconds", "metrics"):
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, max(a, b) if f.name == "peak_memory_bytes" else a + b)
        for k, v in other.seconds.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.metrics.update(other.metrics)
        return self

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
