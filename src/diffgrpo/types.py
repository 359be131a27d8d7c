"""Dataclasses that cross the seams: sampler output, trajectory payloads, the rollout, plans, engine counters.

Shape notation used across the package:
  B  trajectories in the rollout (prompts × group size)
  T  sampling steps (step k maps x_k at σ_k to x_{k+1} at σ_{k+1}; σ_0 = 1, σ_T = 0)
  *S the latent shape of one sample, e.g. (C, H, W)
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

# config dtype names (model.dtype, dllm.dtype, dist.fsdp_param_dtype, reward.options.*.dtype) → torch dtypes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
class FlowTrajectory:
    """What a flow-matching rollout recorded: the data every gradient engine trains on.

    Tensors live on the policy's device; float32.
    """

    cond: dict[str, torch.Tensor]  # conditioning, every tensor batched on dim 0 (B, ...)
    sigmas: torch.Tensor  # (T+1,) decreasing grid, sigmas[0] = 1, sigmas[T] = 0
    xs: torch.Tensor  # (B, T+1, *S) states x_0 (noise) .. x_T (sample)
    velocities: torch.Tensor  # (B, T, *S) (guided) velocities used at each step
    log_probs: torch.Tensor  # (B, T) rollout log-probs of the taken transitions (0 where std == 0)
    noise: torch.Tensor  # (B, T, *S) standard-normal noise injected at each step (0 for deterministic steps)
    images: torch.Tensor | None = None  # (B, C, H, W) decoded samples in [0, 1] ((B, C, F, H, W) for video)
    engine_state: Any = None  # the engine's own typed state from planning / sampling (see engines/base.py)

    @property
    def num_steps(self) -> int:
        return self.xs.shape[1] - 1


@dataclass
class TokenTrajectory:
    """What a masked diffusion LM rollout recorded (L completion tokens after P prompt tokens)."""

    sequences: torch.Tensor  # (B, P+L) long: prompt + final completion ids
    prompt_length: int  # P
    log_probs: torch.Tensor  # (B, L) old per-token log-prob estimates under the rollout's masks
    masks: torch.Tensor  # (B, M, P+L) bool: the estimator's masks (one forward each), drawn once per rollout
    mask_weights: torch.Tensor  # (B, M, P+L) float: the estimator's per-forward, per-token weights
    records: dict[str, torch.Tensor]  # sampler records (commit_step, confidence, entropy, margin, …), each (B, L)
    examples: list = field(default_factory=list)  # the task instances (prompt + reference answer) per row
    completions: list[str] = field(default_factory=list)  # decoded completions (B,)
    ref_log_probs: torch.Tensor | None = None  # (B, L) reference estimates (β > 0)
    strata: torch.Tensor | None = None  # (B, L) long SML stratum per token (−1 outside the completion), or None
    groups: int = 1  # forward groups: the masks split into `groups` consecutive slices (SML strata K)
    token_weights: torch.Tensor | None = None  # (B, L) per-token policy-loss weights (DPS), or None
    token_weight_stats: dict[str, float] = field(default_factory=dict)  # their statistics for the log

    @property
    def completion_ids(self) -> torch.Tensor:
        """(B, L) long."""
        return self.sequences[:, self.prompt_length:]


@dataclass
class Rollout:
    """A scored batch: the family's trajectory payload plus what GRPO adds (rewards, advantages, loss weights).

    ``selected`` / ``trained`` / ``loss_weights`` are (B, N) over the payload's trainable units: N = T steps for
    a :class:`FlowTrajectory`, N = L completion tokens for a :class:`TokenTrajectory`.
    """

    prompts: list[str]  # length B
    group_ids: torch.Tensor  # (B,) long: trajectories with the same id share a prompt
    traj: FlowTrajectory | TokenTrajectory
    selected: torch.Tensor  # (B, N) bool: units the engine runs (planned; filtered unless another rank trains)
    trained: torch.Tensor | None = None  # (B, N) bool: units whose loss counts (selected and kept)
    rewards: torch.Tensor | None = None  # (B,) combined reward (NaN where excluded)
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> (B,)
    valid: torch.Tensor | None = None  # (B,) bool: reward usable in statistics
    advantages: torch.Tensor | None = None  # (B,) float
    loss_weights: torch.Tensor | None = None  # (B, N) aggregation weights (see loss_weights.grpo_loss_weights)
    kl_weights: torch.Tensor | None = None  # (B,) per-sample weight of the KL term (None: every sample 1)
    batch_rewards: torch.Tensor | None = None  # (W·B,) every rank's rewards (= rewards in one process)
    advantage_stats: dict[str, float] = field(default_factory=dict)  # frac_reward_zero_std, adv_clip_frac, …
    metadata: list[dict[str, Any]] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return len(self.prompts)


@dataclass
class BatchPlan:
    """The decisions a flow family makes before sampling a batch (engines may amend them in ``Engine.plan``)."""

    prompts: list[str]
    group_ids: torch.Tensor  # (B,) long
    selected: torch.Tensor  # (B, T) bool: steps that will be trained
    x0: torch.Tensor  # (B, *S) initial noise
    metadata: list[dict[str, Any]] = field(default_factory=list)  # per-sample metadata the rewards receive
    sde_mask: torch.Tensor | None = None  # (B, T) bool: False makes that step a deterministic ODE step
    engine_state: Any = None  # the engine's own typed state (e.g. the step chosen per group)
    wave: tuple | None = None  # (whole batch's selected (B_all, T), this wave's rows (B,)) for rollout waves


@dataclass
class RolloutHooks:
    """What an engine asks of the sampler: grad-enabled forwards at ``grad_mask`` handed to ``on_grad_step``."""

    grad_mask: torch.Tensor  # (B, T) bool
    on_grad_step: Callable  # (k, idx (n,), v with graph (n, *S), x_k (n, *S), x_next (n, *S)) -> None


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

    def merge(self, other: EngineStats) -> EngineStats:
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
