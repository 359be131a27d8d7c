"""The GRPO training loop, one iteration top to bottom (``Trainer.step``):

    collect   the family plans, samples, decodes, scores and weights a batch (``Family.collect``; an engine may
              already accumulate the first update's gradient while sampling, e.g. Retain's waves)
    update    ``train.num_inner_epochs`` times: zero ``.grad`` → ``Family.backward`` (its engine / likelihood
              method fills ``.grad``) → non-finite guard → clip → optimizer step → EMA
    log       TRL-style metrics and the engine's counters

The loop knows nothing of pixels or tokens: a *family* (``family.Family``; ``families.FAMILIES``) owns everything
model-specific, and every family is driven the same way. ``Trainer.rollout()`` runs a family's rollout,
``Trainer.backward(rollout)`` fills ``.grad`` (no optimizer step), ``Trainer.step()`` runs one iteration.
``Trainer.train()`` runs the whole job (``job.Job``: run directory, evaluations, checkpoints, outputs); the run
state a checkpoint holds is ``checkpoint.RunState`` (``state`` / ``load_state``).
"""
from __future__ import annotations

import math
import os
import time
from pathlib import Path

import torch

from . import consistency, distributed
from .config import MODEL_FAMILIES, RunConfig
from .console import emit
from .diversity.reference import AdaptiveReference
from .ema import EMA
from .errors import ConfigError, TrainingError
from .families import FAMILIES
from .family import Family, Sync
from .models import POLICIES
from .rewards import with_supplied
from .run import checkpoint, job, rundir
from .run.checkpoint import RunState
from .types import EngineStats, Rollout
from .validation import validate


class Trainer:
    def __init__(self, cfg: RunConfig | None = None, *, policy=None, rewards: dict | None = None, log=emit,
                 purpose: str = "train"):
        """``rewards``: name → reward callable (either convention of ``rewards.calling``); the run trains on
        exactly these, weighted by ``cfg.reward.weights`` where it names them, else 1. ``purpose``: what the
        config is validated for (``validation.PURPOSES``; ``"sample"`` for ``diffgrpo sample``)."""
        cfg = cfg or RunConfig()
        self.cfg = cfg = with_supplied(cfg, rewards) if rewards else cfg
        validate(cfg, purpose)  # also for configs built in Python rather than read by RunConfig.from_overrides
        rundir.absolute_data_paths(cfg)  # the saved config names the files read, wherever the run resumes from
        self.log = log
        if cfg.model.cache_dir:
            os.environ["DIFFGRPO_CACHE"] = cfg.model.cache_dir
        self._join_world()
        family_cls = FAMILIES[MODEL_FAMILIES[cfg.model.name]]
        check_world(cfg, self.world)
        family_cls.check_world(cfg, self.world)
        torch.manual_seed(cfg.seed)
        self.policy = policy if policy is not None else POLICIES[cfg.model.name](
            cfg, progress=cfg.log.progress and self.world.rank == 0, log=self.log)
        self.device = torch.device(self.policy.device)
        self.family: Family = family_cls(cfg, self.policy, self.world, log=lambda *a: self.log(*a))
        self._wrap()
        self._build_optimizer()
        self.iteration = 0
        self.bad_updates = 0  # consecutive skipped updates (non-finite gradient, or nothing to train)
        every = cfg.diversity.gardo_ref_every  # GARDO's adaptive KL reference
        self.adaptive_ref = AdaptiveReference(every) if every > 0 else None

    def _join_world(self) -> None:
        """Process group before the model (sets the CUDA device; rank > 0 is silent) and the run's device.
        dist.mode=auto is ddp when a launcher started several processes (validate refused none there)."""
        cfg = self.cfg
        self.dist_mode = distributed.resolve_mode(cfg.dist.mode, max(distributed.launched_world_size(),
                                                                     distributed.info().world_size))
        self.world = (distributed.init_from_env(cfg.dist.backend or None, cfg.dist.timeout)
                      if self.dist_mode != "none" else distributed.WorldInfo(0, 1, 0))
        if self.world.rank > 0:
            self.log = _silent
        # model.device=auto → this rank's accelerator (or cpu), resolved once: the policy factories and the saved
        # config see the device the run uses
        cfg.model.device = distributed.resolve_device(
            cfg.model.device, self.world.local_rank if self.world.world_size > 1 else None)

    def _wrap(self) -> None:
        """The DDP / FSDP2 wrapper the policy's forwards go through (None in one process); FSDP2 shards in place,
        so the optimizer is built after."""
        cfg = self.cfg
        self.dp_module = None
        if self.world.world_size > 1:
            self.dp_module = (distributed.wrap_fsdp2(  # mixed precision / CPU offload: dist.fsdp_*
                self.family.network(), param_dtype=cfg.dist.fsdp_param_dtype,
                cpu_offload=cfg.dist.fsdp_cpu_offload) if self.dist_mode == "fsdp2"
                else distributed.wrap(self.family.network(), self.dist_mode))
            self.policy.forward_module = self.dp_module

    def _build_optimizer(self) -> None:
        """AdamW, its learning-rate schedule, the gradient sync handed to the family, the EMA and the fp16 scaler."""
        t = self.cfg.train
        self.params = list(self.policy.trainable_parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(t.adam_beta1, t.adam_beta2))
        # stepped once per optimizer update; spans num_iterations × num_inner_epochs updates
        total, warmup = t.num_iterations * t.num_inner_epochs, t.warmup_iterations * t.num_inner_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda u: lr_factor(u, t.lr_schedule, warmup, total))
        sync = Sync(params=self.params)
        if self.dp_module is not None:  # gradient sync only on an engine's last backward; Σ over ranks
            sync.no_sync = lambda: distributed.no_sync(self.dp_module)
            sync.all_reduce = distributed.all_reduce_sum
        self.family.connect(sync)
        self.ema = EMA(self.policy.named_trainable_parameters(), t.ema_decay) if t.ema_decay > 0 else None
        # fp16: a loss scaler; the flow policy scales the gradient at the transformer's output (every engine)
        self.grad_scaler = (torch.amp.GradScaler(self.device.type) if self.cfg.model.mixed_precision == "fp16"
                            else None)
        if self.grad_scaler is not None:
            self.policy.grad_scaler = self.grad_scaler

    # ------------------------------------------------------------------ one iteration
    def rollout(self, prompts: list | None = None, group_ids: torch.Tensor | None = None) -> Rollout:
        """Sample, decode, score and weight one batch (a fresh training batch by default), in one piece."""
        return self.family.rollout(prompts, group_ids)

    def backward(self, rollout: Rollout, epoch: int = 0) -> EngineStats:
        """Zero the grads and let the family's engine fill ``.grad`` for this rollout (no optimizer step)."""
        self.optimizer.zero_grad(set_to_none=True)
        return self.family.backward(rollout, epoch)

    def update(self, rollout: Rollout, first_stats: EngineStats | None = None) -> tuple[EngineStats, dict[str, float]]:
        """``num_inner_epochs`` optimizer updates on one rollout. Returns the merged stats and update metrics.

        ``first_stats``: the first update's gradient is already in ``.grad`` (rollout waves) with these stats.
        An update is skipped when its gradient is not finite, and so is the rollout when no rank has a sample to
        train (every reward non-finite, or every group filtered out); ``train.max_bad_updates`` skipped updates
        in a row stop the run, and so do non-finite weights after an update (TrainingError)."""
        total = EngineStats()
        info = {"grad_norm": 0.0, "skipped_updates": 0, "learning_rate": self.optimizer.param_groups[0]["lr"]}
        trains = self._trains(rollout)
        for epoch in range(self.cfg.train.num_inner_epochs):
            stats = first_stats if (epoch == 0 and first_stats is not None) else self.backward(rollout, epoch)
            total.engine = stats.engine
            if self.grad_scaler is not None and trains:
                self.grad_scaler.unscale_(self.optimizer)  # before the norm and the clip
            norm = self._grad_norm()
            total.merge(stats)
            info["grad_norm"] = norm
            if epoch == 0:
                info.update(consistency.first_update(stats.metrics))  # first_epoch/*, consistency/*
            if trains and not math.isfinite(norm) and self._scaler_overflow(info):
                continue  # fp16 overflow: the scaler lowered the scale; not a bad update
            if not trains or not torch.isfinite(torch.tensor(norm)):
                why = ("no sample could be trained (every reward non-finite, or every group filtered out)"
                       if not trains else "non-finite loss/gradient")
                self._skip(why, info)
                if not trains:
                    break
                continue
            self.bad_updates = 0
            if self.cfg.train.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)  # unscaled already; steps (the gradient is finite)
                self.grad_scaler.update()
                info["loss_scale"] = self.grad_scaler.get_scale()
            else:
                self.optimizer.step()
            self.scheduler.step()
            if not self.weights_finite():
                raise TrainingError(f"stopping: the weights are non-finite after the update of iteration "
                                    f"{self.iteration + 1} (train.lr={self.cfg.train.lr}); the last checkpoint holds "
                                    "the weights before it")
            if self.ema is not None:
                self.ema.update()
        return total, info

    def _scaler_overflow(self, info: dict) -> bool:
        """fp16: a non-finite gradient is an overflow of the loss scale while the scale is still >= 1: the scaler
        halves it, the update is skipped and it does not count as a bad update. Below 1 the gradient is non-finite
        by itself, and the update counts as bad (False)."""
        if self.grad_scaler is None:
            return False
        self.grad_scaler.update()  # found inf in unscale_: scale × backoff
        scale = self.grad_scaler.get_scale()
        info["loss_scale"] = scale
        if scale < 1.0:
            return False
        info["skipped_updates"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.log(f"fp16: gradient overflow at iteration {self.iteration + 1}; update skipped, loss scale now {scale:g}")
        return True

    def _skip(self, why: str, info: dict) -> None:
        """Count a skipped update; ``train.max_bad_updates`` in a row stop the run."""
        self.bad_updates += 1
        info["skipped_updates"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        limit = self.cfg.train.max_bad_updates
        self.log(f"warning: update skipped at iteration {self.iteration + 1}: {why} ({self.bad_updates} in a row, "
                 f"limit train.max_bad_updates={limit})")
        if self.bad_updates >= limit:
            raise TrainingError(f"stopping: {self.bad_updates} consecutive updates were skipped ({why}; "
                                f"train.max_bad_updates={limit})")

    @staticmethod
    def _trains(rollout: Rollout) -> bool:
        """Whether some rank has a finite reward and a unit to train in this rollout (the same on every rank)."""
        return bool(torch.isfinite(rollout.batch_rewards).any()) and rollout.advantage_stats["trained_units"] > 0

    def _grad_norm(self) -> float:
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:  # sharded DTensor grads
            norms = [distributed.to_full(p.grad.detach().norm()) for p in self.params if p.grad is not None]
            return float(torch.stack(norms).norm()) if norms else 0.0
        grads = [p.grad.detach().flatten() for p in self.params if p.grad is not None]
        return float(torch.cat(grads).norm()) if grads else 0.0

    def step(self) -> dict[str, float]:
        """One GRPO iteration: collect a batch, ``num_inner_epochs`` updates, metrics (TRL-style names)."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)  # an engine may accumulate the first update while sampling
        ro, first = self.family.collect()
        stats, info = self.update(ro, first_stats=first)
        self.iteration += 1
        ref = self.adaptive_ref.after_iteration(self.policy, self.iteration) if self.adaptive_ref else {}
        r = ro.batch_rewards[torch.isfinite(ro.batch_rewards)]  # every rank's rewards when data parallel
        return {"iteration": self.iteration, "reward": float(r.mean()) if len(r) else float("nan"),
                "reward_std": float(r.std()) if len(r) > 1 else 0.0,
                **{f"rewards/{n}/{s}": x for n, v in ro.reward_components.items() for s, x in _mean_std(v).items()},
                **({"loss": info["first_epoch/loss"]} if "first_epoch/loss" in info else {}),
                "frac_reward_zero_std": ro.advantage_stats["frac_reward_zero_std"],
                "adv_clip_frac": ro.advantage_stats["adv_clip_frac"],
                **{k: v for k, v in ro.advantage_stats.items() if k.startswith("diversity/")}, **ref,
                "kl": stats.metrics.get("kl", 0.0), "clip_ratio": stats.metrics.get("clip_ratio", 0.0),
                "ratio_mean": stats.metrics.get("ratio_mean", 1.0), **info,
                "forwards_grad": stats.forwards_grad, "forwards_nograd": stats.forwards_nograd,
                "sample_backwards": stats.sample_backwards, "peak_memory_bytes": stats.peak_memory_bytes,
                "time/rollout": ro.timings["rollout"], "time/sample": ro.timings["sample"],
                "time/reward": ro.timings["reward"], "time/train": stats.seconds.get("train", 0.0),
                "time/iteration": time.perf_counter() - t0}

    def eval_weights(self) -> dict:
        """The weights evaluation uses (the EMA's when train.ema_decay > 0), full tensors (a collective under FSDP2)."""
        return distributed.to_full(self.ema.state_dict() if self.ema is not None else self.policy.state_dict())

    def evaluate(self, table=None) -> tuple[dict[str, float], torch.Tensor | None]:
        """Held-out evaluation by the family, with the EMA weights when ``train.ema_decay`` > 0; ``table`` (a
        ``media.SampleTable``, rank 0) receives one row per sample."""
        if self.ema is None:
            return self.family.evaluate(table)
        with self.ema.swapped_in():
            return self.family.evaluate(table)


    def weights_finite(self) -> bool:
        norms = [p.detach().float().norm() for p in self.params]
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:  # sharded DTensors
            norms = [distributed.to_full(n) for n in norms]
        return bool(torch.isfinite(torch.stack(norms)).all()) if norms else True

    # ------------------------------------------------------------------ the run state and the job
    def state(self) -> RunState:
        """Everything needed to continue bit-for-bit: weights, optimizer, EMA, RNG states, counters."""
        return checkpoint.capture(self)

    def load_state(self, state: RunState) -> None:
        checkpoint.restore(self, state)

    def save_checkpoint(self) -> Path:
        return checkpoint.save(self, self.run_dir())

    def run_dir(self) -> Path:
        return rundir.make(self.cfg, self.world)

    def train(self, resume: bool = False) -> dict[str, float]:
        """Run ``train.num_iterations`` iterations with evaluation, logging, checkpoints and outputs in the run
        directory (``job.Job``). ``resume``: continue from the run directory's newest complete checkpoint.
        SIGINT/SIGTERM finish the current iteration, save a checkpoint and return (``summary["interrupted"]``)."""
        return job.Job(self).run(resume)


def check_world(cfg: RunConfig, world) -> None:
    """Every rank must hold the same number of samples (all-gathers) and whole shares of the batch."""
    W, t = world.world_size, cfg.train
    if W == 1:
        return
    if cfg.dist.group_layout == "spread" and t.group_size % W:
        raise ConfigError(f"dist.group_layout=spread: train.group_size={t.group_size} must be a multiple of "
                          f"the world size {W}")
    if cfg.dist.group_layout == "local" and t.prompts_per_batch % W:
        raise ConfigError(f"dist.group_layout=local: train.prompts_per_batch={t.prompts_per_batch} must be a "
                          f"multiple of the world size {W}")


def lr_factor(update: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of ``train.lr`` at optimizer update ``update`` (0-based) of ``total``: a linear warmup over the
    first ``warmup`` updates ((u+1)/warmup), then constant, cosine or linear decay to 0 at ``total``."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(max((update - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p


def _mean_std(v: torch.Tensor) -> dict[str, float]:
    """Mean and standard deviation of the finite entries of a reward component."""
    f = v[torch.isfinite(v)]
    return {"mean": float(f.mean()), "std": float(f.std()) if len(f) > 1 else 0.0}




def _silent(*args, **kwargs) -> None:
    """The log function of ranks > 0."""


__all__ = ["FAMILIES", "Trainer", "TrainingError", "check_world", "lr_factor"]