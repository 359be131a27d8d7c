"""The family protocol: what the training loop asks of a kind of generative model.

Three layers, each a protocol declared in one place:
  loop    ``Trainer`` (trainer.py): world, policy, optimizer, EMA, the update, ``step``, checkpoints, ``train``;
          it knows nothing of pixels or tokens.
  family  ``Family`` (here): planning a batch, the rollout, decoding, rewards, the loss weights (through
          ``loss_weights.grpo_loss_weights``, shared by every family), evaluation and its own RNG streams.
          ``flow.family.FlowFamily`` (flow-matching image/video transformers) and ``dllm.family.DLLMFamily``
          (masked diffusion LMs) implement it as equals; ``families.FAMILIES`` is the registry.
  engine  how the gradient of a rollout is formed: a flow ``engines.base.Engine``, or a masked LM's
          likelihood method (``dllm.grpo.TokenGRPO``), called by its family's ``backward``.

A new family is one package implementing :class:`Family` (with its ``rules.py``), one entry in
``families.FAMILIES`` and its model names in ``config.MODEL_FAMILIES``; the loop does not change.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .config import RunConfig
from .distributed import WorldInfo
from .types import EngineStats, Rollout


@dataclass
class Sync:
    """What the loop hands a family once data parallelism is set up (no-ops in one process)."""

    params: list  # the trainable parameters as the optimizer holds them (sharded DTensors under FSDP2)
    no_sync: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)
    all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # Σ over ranks; None in one process


@dataclass
class Samples:
    """What :meth:`Family.sample` drew, for a caller to write as it is: each prompt once per sample (prompt-major,
    ``per_prompt`` in a row), with either the decoded images / first frames (N, C, H, W) or the texts (N,)."""

    prompts: list[str]
    per_prompt: int = 1
    images: torch.Tensor | None = None
    texts: list[str] | None = None
    notes: tuple[str, ...] = ()  # what the caller should tell the user (e.g. a request the family adjusted)


DEFAULT_SAMPLES = 8  # samples per prompt when a caller leaves ``num`` to the family


class Family(Protocol):
    """A kind of generative model trained by the one GRPO loop. Built with ``(cfg, policy, world, log)``."""

    name: str
    policy: Any
    guards: Any  # guards.EvalGuards: eval/guard/* of every evaluation, and the base model's statistics

    @staticmethod
    def check_config(cfg: RunConfig, purpose: str = "train") -> None:
        """Refuse (ConfigError) a combination of keys this family cannot train (its ``rules.py``); run by
        ``validation.validate`` before any model loads, after the per-field and machine checks. ``purpose``
        (``validation.PURPOSES``) says whether the data files are read (``data_sources.reads_data``)."""
        ...

    @staticmethod
    def check_world(cfg: RunConfig, world: WorldInfo) -> None:
        """Refuse (ConfigError) a data-parallel layout this family cannot run; called before the model loads."""
        ...

    def network(self) -> torch.nn.Module:
        """The trained module that data parallelism wraps (DDP) or shards (FSDP2)."""
        ...

    def connect(self, sync: Sync) -> None:
        """Called once after wrapping and building the optimizer."""
        ...

    def rollout(self, prompts: list | None = None, group_ids: torch.Tensor | None = None) -> Rollout:
        """Sample, decode, score and weight one batch (a fresh training batch by default), in one piece."""
        ...

    def collect(self) -> tuple[Rollout, EngineStats | None]:
        """The next training batch as the engine wants it sampled; with the first update's stats when the engine
        already accumulated that gradient into ``.grad`` (zeroed by the caller) during sampling, else None."""
        ...

    def backward(self, rollout: Rollout, epoch: int) -> EngineStats:
        """Accumulate ∇ Σ w·L of ``rollout`` into ``.grad`` (zeroed by the caller); epoch 0 = first update."""
        ...

    def evaluate(self, table=None) -> tuple[dict[str, float], torch.Tensor | None]:
        """Held-out metrics ({"eval/…": value}) and images to save (or None), under the current weights; ``table``
        (a ``media.SampleTable``, on rank 0 only, or None) receives one row per evaluation sample."""
        ...

    def sample(self, prompts: list[str] | None, *, seed: int, num: int | None = None, sde_type: str = "",
               source_images: tuple[str, ...] = ()) -> Samples:
        """``num`` samples of each prompt (``num`` None: the family's default, :data:`DEFAULT_SAMPLES`, or one for a
        text model decoding greedily, whose samples would all be equal; prompts None: the family's own prompts) under the current weights, drawn as an
        evaluation draws them with ``eval.seed=seed`` and ``num`` samples per prompt: the same seed, the same
        samples. ``sde_type``: the sampler (``"ode"``: deterministic; ``""``: the evaluation's); ``source_images``:
        the source image(s) an editing model edits under every prompt. Not counted as training cost."""
        ...

    def rng_state(self) -> dict:
        """Every random stream of the family, for checkpoints."""
        ...

    def set_rng_state(self, state: dict) -> None: ...

    def extra_state(self) -> dict[str, torch.Tensor] | None:
        """Tensors of the family's own that a checkpoint keeps beside the policy's (``family.safetensors``; e.g.
        TraceRL's value network), or None."""
        ...

    def load_extra_state(self, state: dict[str, torch.Tensor] | None) -> None:
        """Restore :meth:`extra_state` from a checkpoint (None: the checkpoint holds none)."""
        ...


__all__ = ["Family", "Samples", "Sync"]
