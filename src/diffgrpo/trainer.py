"""The GRPO training loop, top to bottom:

    prompts → rollout (sampler + policy) → decode → rewards → advantages → engine (.grad) → clip → optimizer

``Trainer.rollout()`` runs everything up to the advantages, ``Trainer.backward(rollout)`` fills ``.grad``
with the configured engine (no optimizer step), ``Trainer.step()`` runs one iteration (a rollout and
``train.num_inner_epochs`` updates), ``Trainer.train()`` runs the whole job with logging and outputs.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import distributed
from .distributed import rank_rows
from .advantages import group_advantages
from .config import ConfigError, RunConfig, validate
from .data import digit_prompt, prompt_digit
from .engines import build_engine, select_steps
from .engines.base import EngineContext
from .losses import aggregation_weights
from .models import POLICIES
from .rewards import compute_rewards
from .samplers import flow_sde
from .samplers.rollout import sample_trajectories
from .types import EngineStats, Rollout


@dataclass
class BatchPlan:
    """The decisions made before sampling a batch (see :meth:`Trainer.plan_batch`)."""

    prompts: list[str]
    group_ids: torch.Tensor  # (B,) long
    selected: torch.Tensor  # (B, T) bool: steps that will be trained
    x0: torch.Tensor  # (B, *S) initial noise
    sde_mask: torch.Tensor | None = None  # (B, T) bool: False makes that step a deterministic ODE step
    extras: dict = field(default_factory=dict)  # engine-owned (e.g. the step chosen per group)
    wave: tuple | None = None  # (whole batch's selected (B_all, T), this wave's rows (B,)) for rollout waves


class Trainer:
    def __init__(self, cfg: RunConfig | None = None, *, policy=None, log=print):
        self.cfg = cfg = cfg or RunConfig()
        validate(cfg)  # also for configs built in Python rather than read by RunConfig.from_overrides
        self.log = log
        if cfg.model.cache_dir:
            os.environ["DIFFGRPO_CACHE"] = cfg.model.cache_dir
        # data parallel (torchrun): process group before the model (sets the CUDA device); rank > 0 is silent
        self.world = (distributed.init_from_env(cfg.dist.backend or None) if cfg.dist.mode != "none"
                      else distributed.WorldInfo(0, 1, 0))
        self._spread = self.world.world_size > 1 and cfg.dist.group_layout == "spread"
        if self.world.rank > 0:
            self.log = log = _silent
        self._check_world()
        torch.manual_seed(cfg.seed)
        self.policy = policy if policy is not None else POLICIES[cfg.model.name](
            cfg, progress=cfg.log.progress and self.world.rank == 0, log=log)
        self.device = torch.device(getattr(self.policy, "device", "cpu"))
        self.engine = build_engine(cfg.engine)
        self.dp_module = None  # the DDP / FSDP2 wrapper velocity() goes through (None in one process)
        if self.world.world_size > 1:
            net = self.policy.transformer if hasattr(self.policy, "transformer") else self.policy.model
            self.dp_module = distributed.wrap(net, cfg.dist.mode)  # FSDP2 shards in place: build the optimizer after
            self.policy.forward_module = self.dp_module
            if hasattr(self.engine, "all_reduce"):  # e.g. single_step's global rectification normaliser
                self.engine.all_reduce = distributed.all_reduce_sum
        self.params = list(self.policy.trainable_parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                           betas=(cfg.train.adam_beta1, cfg.train.adam_beta2))
        self.kernel = dict(sde_type=cfg.sampler.sde_type, noise_level=cfg.sampler.noise_level,
                           reduce=cfg.sampler.logprob_reduce, cps_flowgrpo_compat=cfg.sampler.cps_flowgrpo_compat)
        self.ctx = EngineContext(policy=self.policy, kernel=self.kernel, clip_range=cfg.loss.clip_range,
                                 beta=cfg.loss.beta, kl_flowgrpo_compat=cfg.loss.kl_flowgrpo_compat,
                                 micro_batch_size=cfg.engine.micro_batch_size, params=self.params)
        if self.dp_module is not None:  # gradient sync only on an engine's last backward
            self.ctx.no_sync = lambda: distributed.no_sync(self.dp_module)
        self.sigmas = flow_sde.sigma_grid(cfg.sampler.num_steps, cfg.sampler.shift, device=self.device)
        self.ctx.sigmas = self.sigmas
        # one generator per stream so that e.g. changing the eval schedule never changes training samples.
        # Noise differs across ranks; prompts and steps too, except in the spread layout where every rank plans
        # the same whole batch and keeps its share of each group (rank 0 keeps the one-process seeds).
        rank = self.world.rank
        plan_seed = (lambda s: s) if self._spread else (lambda s: distributed.seed_for(s, rank))
        self.gen_prompts = torch.Generator().manual_seed(plan_seed(cfg.seed))
        self.gen_noise = torch.Generator(device=self.device).manual_seed(distributed.seed_for(cfg.seed + 1, rank))
        self.gen_steps = torch.Generator().manual_seed(plan_seed(cfg.seed + 2))
        self.gen_group_noise = torch.Generator(device=self.device).manual_seed(cfg.seed + 3)  # spread + shared x0
        self.iteration = 0
        self.bad_updates = 0  # consecutive skipped (non-finite) updates
        self.ema = None
        if cfg.train.ema_decay > 0:
            from .ema import EMA

            named = (self.policy.named_trainable_parameters() if hasattr(self.policy, "named_trainable_parameters")
                     else {str(i): p for i, p in enumerate(self.params)})
            self.ema = EMA(named, cfg.train.ema_decay)
        self._stop_signal = None
        from .dllm.grpo import family_for  # masked diffusion LMs: rollout/backward/evaluate live in dllm/grpo.py

        self.family = family_for(self)

    def _check_world(self) -> None:
        """Every rank must hold the same number of samples (all-gathers) and whole shares of the batch."""
        W, t = self.world.world_size, self.cfg.train
        if W == 1:
            return
        if self._spread and t.group_size % W:
            raise ConfigError(f"dist.group_layout=spread: train.group_size={t.group_size} must be a multiple of "
                              f"the world size {W}")
        if not self._spread and t.prompts_per_batch % W:
            raise ConfigError(f"dist.group_layout=local: train.prompts_per_batch={t.prompts_per_batch} must be a "
                              f"multiple of the world size {W}")
        from .dllm.grpo import DLLM_MODELS

        if self.cfg.dist.mode == "fsdp2" and self.cfg.model.name in DLLM_MODELS:
            raise ConfigError(f"dist.mode=fsdp2 is implemented for flow-matching image models; masked diffusion LMs "
                              f"(model.name={self.cfg.model.name}) train data parallel with dist.mode=ddp")
        s = self.cfg.steps
        if self.cfg.dist.mode == "fsdp2" and (s.mode == "random" or (s.mode == "window" and s.window_start < 0)):
            # FSDP2 all-gathers weights in every forward and backward, so every rank must run the same sequence of
            # network calls. That sequence follows each rank's selected steps (a step's rows split into a grad and
            # a no-grad forward, a backward per step with selected rows); steps drawn per trajectory differ across
            # ranks, and the mismatched collectives crash or hang.
            raise ConfigError(f"dist.mode=fsdp2 needs the same trained steps on every trajectory; steps.mode="
                              f"{s.mode}{' with window_start=-1' if s.mode == 'window' else ''} draws them per "
                              "trajectory (use all, first_fraction or window with window_start >= 0, or dist.mode=ddp)")
        e = self.cfg.engine
        if self.cfg.dist.mode == "fsdp2" and e.name == "jagg" and (0 < e.jagg_frac < 1 or e.jagg_min_score > -1):
            # routing by window score sends different steps of each rank to the exact path, so the ranks' network
            # calls differ; all-JAGG (jagg_frac=1, jagg_min_score=-1) or all-exact (jagg_frac=0) keep them equal
            raise ConfigError(f"dist.mode=fsdp2 with engine.name=jagg needs the same network calls on every rank; "
                              f"engine.jagg_frac={e.jagg_frac} / engine.jagg_min_score={e.jagg_min_score} route "
                              "windows by their score, which differs across ranks (use jagg_frac=1 with "
                              "jagg_min_score=-1, jagg_frac=0, or dist.mode=ddp)")

    # ------------------------------------------------------------------ rollout phase
    def sample_prompts(self) -> tuple[list[str], torch.Tensor]:
        """``prompts_per_batch`` prompts, each repeated ``group_size`` times. → (prompts (B,), group_ids (B,))."""
        t = self.cfg.train
        n = t.prompts_per_batch if self._spread else t.prompts_per_batch // self.world.world_size  # local: P/W
        if t.prompts_file:  # text prompts, drawn uniformly from the file
            lines = read_prompts(t.prompts_file)
            pick = torch.randint(len(lines), (n,), generator=self.gen_prompts)
            prompts = [lines[int(i)] for i in pick for _ in range(t.group_size)]
            return prompts, torch.arange(n).repeat_interleave(t.group_size)
        digits = torch.tensor(t.digits)
        pick = digits[torch.randint(len(digits), (n,), generator=self.gen_prompts)]
        prompts = [digit_prompt(int(d)) for d in pick for _ in range(t.group_size)]
        group_ids = torch.arange(n).repeat_interleave(t.group_size)
        return prompts, group_ids

    def initial_noise(self, group_ids: torch.Tensor) -> torch.Tensor:
        """x_0 (B, *S); one draw per group when ``sampler.share_noise_in_group``."""
        shape = self.policy.latent_shape
        if self.cfg.sampler.share_noise_in_group:  # spread: a group's ranks must draw the same x_0
            n = int(group_ids.max()) + 1
            gen = self.gen_group_noise if self._spread else self.gen_noise
            z = torch.randn(n, *shape, generator=gen, device=self.device)
            return z[group_ids.to(self.device)]
        return torch.randn(len(group_ids), *shape, generator=self.gen_noise, device=self.device)

    def plan_batch(self, prompts: list[str] | None = None, group_ids: torch.Tensor | None = None) -> BatchPlan:
        """Decide everything about the next batch before sampling: prompts, groups, initial noise, trained
        steps. An engine may amend the plan (``engine.plan(trainer, plan)``), e.g. to pick one step per group."""
        cfg = self.cfg
        if prompts is None:
            prompts, group_ids = self.sample_prompts()
        elif group_ids is None:
            group_ids = torch.arange(len(prompts)) // cfg.train.group_size
        B, T = len(prompts), cfg.sampler.num_steps
        selected = select_steps(cfg.steps.mode, T, B, fraction=cfg.steps.fraction, window_start=cfg.steps.window_start,
                                window_size=cfg.steps.window_size, generator=self.gen_steps).to(self.device)
        if self._spread:  # the same whole batch on every rank; keep this rank's share of every group
            rows = rank_rows(group_ids, self.world.rank, self.world.world_size)
            prompts, group_ids = [prompts[i] for i in rows.tolist()], group_ids[rows]
            selected = selected[rows.to(self.device)]
        plan = BatchPlan(prompts=list(prompts), group_ids=group_ids, selected=selected,
                         x0=self.initial_noise(group_ids))
        if hasattr(self.engine, "plan"):
            self.engine.plan(self, plan)
        return plan

    def rollout(self, prompts: list[str] | None = None, group_ids: torch.Tensor | None = None, *,
                plan: BatchPlan | None = None) -> Rollout:
        """Sample, decode, score and compute advantages. Prompts default to a fresh training batch.

        Engines that work during sampling expose ``rollout_hooks(ctx, plan) -> (grad_mask, on_grad_step)``.
        """
        cfg = self.cfg
        if self.family is not None:
            return self.family.rollout(self, prompts, group_ids)
        plan = plan or self.plan_batch(prompts, group_ids)
        prompts, group_ids = plan.prompts, plan.group_ids
        timings = {}
        t0 = time.perf_counter()
        grad_mask, hook = (None, None)
        if hasattr(self.engine, "rollout_hooks"):
            # FSDP2 leaves the root's parameters unsharded from a forward (e.g. evaluation) until the next backward;
            # hooks map the modules' registered parameters to the optimizer's (sharded) ones, so reshard first
            distributed.reshard(self.dp_module)
            grad_mask, hook = self.engine.rollout_hooks(self.ctx, plan)
        cond = self.policy.encode(prompts)
        traj = sample_trajectories(self.policy, cond, plan.x0, self.sigmas, kernel=self.kernel,
                                   generator=self.gen_noise, sde_mask=plan.sde_mask, grad_mask=grad_mask,
                                   on_grad_step=hook)
        timings["sample"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        images = self.policy.decode(traj["xs"][:, -1])
        metadata = [{"digit": prompt_digit(p)} for p in prompts]
        rewards, comps = compute_rewards(cfg.reward.weights, images, prompts, metadata, log=self.log)
        timings["reward"] = time.perf_counter() - t1
        ro = Rollout(prompts=prompts, group_ids=group_ids.to(self.device), cond=cond, sigmas=self.sigmas,
                     xs=traj["xs"], velocities=traj["velocities"], log_probs=traj["log_probs"], noise=traj["noise"],
                     selected=plan.selected, rewards=rewards, reward_components=comps, images=images,
                     metadata=metadata, timings=timings, extras=dict(plan.extras))
        self.finish_rollout(ro, wave=plan.wave)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    def finish_rollout(self, ro: Rollout, wave: tuple | None = None) -> None:
        """Advantages, the trained mask and the aggregation weights, from the rewards.

        In a rollout wave (``wave`` = (whole batch's selected, rows)) the aggregation weights are normalised
        over the WHOLE batch's planned steps, so that waves sum to the one-wave objective. (Samples dropped in
        other waves, e.g. for an invalid reward, cannot renormalise this wave; they count as planned.)"""
        a = self.cfg.advantage
        W, rank, B = self.world.world_size, self.world.rank, len(ro.rewards)
        valid = torch.isfinite(ro.rewards)
        rewards, gids = ro.rewards, ro.group_ids.cpu()
        if W > 1:  # statistics over every rank's samples (rank r's rows are r·B … r·B+B−1 of the gathered batch)
            rewards, gids = distributed.gather_groups(ro.rewards, gids, spread=self._spread)
            ro.extras["batch_rewards"] = rewards
        adv, stats = group_advantages(rewards, gids, valid=torch.isfinite(rewards), std_mode=a.std_mode,
                                      baseline=a.baseline, clip=a.clip, eps=a.eps)
        adv = adv[rank * B:(rank + 1) * B] if W > 1 else adv
        keep = valid.clone()
        if a.filter_zero_std:
            keep &= adv != 0
        if int((~valid).sum()):
            self.log(f"warning: {int((~valid).sum())} sample(s) had a non-finite reward and are excluded "
                     "from the statistics and the loss")
        ro.valid = valid.to(self.device)
        ro.advantages = adv.to(self.device)
        planned = ro.selected
        ro.selected = planned & keep.to(self.device).unsqueeze(1)
        sample_weights = self.engine.sample_weights(self.ctx, ro) if hasattr(self.engine, "sample_weights") else None
        if wave is None and W == 1:
            ro.loss_weights = aggregation_weights(ro.selected, self.cfg.loss.aggregation, sample_weights)
        else:
            full_sel, rows = wave if wave is not None else (ro.selected, torch.arange(B, device=ro.selected.device))
            full_sel = full_sel.clone()
            full_sel[rows] = ro.selected
            full_sw = None
            if sample_weights is not None:
                full_sw = torch.ones(full_sel.shape[0], device=sample_weights.device)
                full_sw[rows] = sample_weights
            if W > 1:  # the normaliser counts every rank's selected pairs
                rows = rows + rank * full_sel.shape[0]
                full_sel = distributed.all_gather(full_sel.to(torch.uint8)).bool()
                full_sw = None if full_sw is None else distributed.all_gather(full_sw.float())
            # DDP and FSDP2 AVERAGE gradients over ranks: × W makes the average the one-process sum
            ro.loss_weights = aggregation_weights(full_sel, self.cfg.loss.aggregation, full_sw)[rows] * W
            if W > 1 and bool(full_sel.any()):
                # Some rank trains, so every rank must run its planned network calls: the gradient collectives
                # (DDP's synced backward, FSDP2's all-gathers and reduce-scatters) pair up across ranks, and a rank
                # whose samples were all filtered out (zero-std groups, non-finite rewards) would otherwise skip
                # them and leave the others waiting. Its filtered pairs stay selected with loss weight 0 (their
                # advantage is 0 too), which adds nothing to the gradient. If no rank trains, all skip together.
                ro.selected = planned
        ro.extras["advantage_stats"] = stats

    # ------------------------------------------------------------------ update phase
    def backward(self, rollout: Rollout, epoch: int = 0) -> EngineStats:
        """Zero the grads and let the engine fill ``.grad`` for this rollout (no optimizer step)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.family is not None:
            return self.family.backward(self, rollout, epoch)
        return self.engine.backward(self.ctx, rollout, epoch)

    def split_waves(self, plan: BatchPlan, groups_per_wave: int) -> list[BatchPlan]:
        """Sub-plans of ``groups_per_wave`` complete groups each (in batch order); [plan] if one wave suffices."""
        groups = list(dict.fromkeys(plan.group_ids.tolist()))  # in order of first appearance
        if groups_per_wave <= 0 or groups_per_wave >= len(groups):
            return [plan]
        waves = []
        for j in range(0, len(groups), groups_per_wave):
            take = torch.isin(plan.group_ids, torch.tensor(groups[j:j + groups_per_wave]))
            rows = take.nonzero().flatten()
            dev_rows = rows.to(plan.selected.device)
            waves.append(BatchPlan(prompts=[plan.prompts[i] for i in rows.tolist()], group_ids=plan.group_ids[rows],
                                   selected=plan.selected[dev_rows], x0=plan.x0[rows.to(plan.x0.device)],
                                   sde_mask=None if plan.sde_mask is None else plan.sde_mask[dev_rows],
                                   extras=dict(plan.extras), wave=(plan.selected, dev_rows)))
        return waves

    def rollout_in_waves(self, groups_per_wave: int) -> tuple[Rollout, EngineStats]:
        """Roll out the next batch in waves of complete groups, each wave's first-update gradient accumulated
        into ``.grad`` (zeroed once, before the first wave) before the next wave starts, so only one wave's
        engine state (e.g. retained graphs) is alive at a time. Returns the merged rollout and stats."""
        plan = self.plan_batch()
        self.optimizer.zero_grad(set_to_none=True)
        total = EngineStats(engine=self.engine.name)
        ros = []
        for sub in self.split_waves(plan, groups_per_wave):
            ro = self.rollout(plan=sub)
            total.merge(self.engine.backward(self.ctx, ro, 0))
            ros.append(ro)
        total.metrics["waves"] = float(len(ros))
        return (ros[0] if len(ros) == 1 else self._merge_rollouts(ros)), total

    def _merge_rollouts(self, ros: list[Rollout]) -> Rollout:
        """Concatenate wave rollouts along the batch (for metrics and later inner epochs)."""
        cat = lambda name: torch.cat([getattr(r, name) for r in ros])  # noqa: E731
        a = self.cfg.advantage
        ro = Rollout(prompts=sum((r.prompts for r in ros), []), group_ids=cat("group_ids"),
                     cond={k: torch.cat([r.cond[k] for r in ros]) for k in ros[0].cond}, sigmas=ros[0].sigmas,
                     xs=cat("xs"), velocities=cat("velocities"), log_probs=cat("log_probs"), noise=cat("noise"),
                     selected=cat("selected"), rewards=cat("rewards"),
                     reward_components={k: torch.cat([r.reward_components[k] for r in ros])
                                        for k in ros[0].reward_components},
                     valid=cat("valid"), advantages=cat("advantages"), loss_weights=cat("loss_weights"),
                     images=cat("images"), metadata=sum((r.metadata for r in ros), []),
                     timings={k: sum(r.timings.get(k, 0.0) for r in ros) for k in ros[0].timings})
        _, ro.extras["advantage_stats"] = group_advantages(ro.rewards, ro.group_ids.cpu(), valid=ro.valid.cpu(),
                                                           std_mode=a.std_mode, baseline=a.baseline, clip=a.clip,
                                                           eps=a.eps)
        return ro

    def update(self, rollout: Rollout, first_stats: EngineStats | None = None) -> tuple[EngineStats, dict[str, float]]:
        """``num_inner_epochs`` optimizer updates on one rollout. Returns the merged stats and update metrics.

        ``first_stats``: the first update's gradient is already in ``.grad`` (rollout waves) with these stats."""
        total = EngineStats(engine=self.engine.name)
        info = {"grad_norm": 0.0, "skipped_updates": 0}
        for epoch in range(self.cfg.train.num_inner_epochs):
            stats = first_stats if (epoch == 0 and first_stats is not None) else self.backward(rollout, epoch)
            norm = self._grad_norm()
            if not torch.isfinite(torch.tensor(norm)):
                self.bad_updates += 1
                info["skipped_updates"] += 1
                self.optimizer.zero_grad(set_to_none=True)
                self.log(f"warning: non-finite loss/gradient at iteration {self.iteration + 1}; update skipped "
                         f"({self.bad_updates} in a row, limit train.max_bad_updates={self.cfg.train.max_bad_updates})")
                if self.bad_updates >= self.cfg.train.max_bad_updates:
                    raise TrainingError(f"stopping: {self.bad_updates} consecutive updates had a non-finite loss or "
                                        f"gradient (train.max_bad_updates={self.cfg.train.max_bad_updates})")
            else:
                self.bad_updates = 0
                if self.cfg.train.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
                self.optimizer.step()
                if self.ema is not None:
                    self.ema.update()
            info["grad_norm"] = norm
            total.merge(stats)
            if epoch == 0:
                info.update({f"first_epoch/{k}": v for k, v in stats.metrics.items()})
        return total, info

    def _grad_norm(self) -> float:
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:  # sharded DTensor grads
            norms = [distributed.to_full(p.grad.detach().norm()) for p in self.params if p.grad is not None]
            return float(torch.stack(norms).norm()) if norms else 0.0
        grads = [p.grad.detach().flatten() for p in self.params if p.grad is not None]
        return float(torch.cat(grads).norm()) if grads else 0.0

    def step(self) -> dict[str, float]:
        """One GRPO iteration: rollout, updates, metrics (TRL-style names)."""
        t0 = time.perf_counter()
        wave_size = getattr(self.engine, "wave_size", 0)
        if wave_size and self.family is None:
            ro, first = self.rollout_in_waves(wave_size)
            stats, info = self.update(ro, first_stats=first)
        else:
            ro = self.rollout()
            stats, info = self.update(ro)
        self.iteration += 1
        r = ro.extras.get("batch_rewards", ro.rewards)  # every rank's rewards when data parallel
        r = r[torch.isfinite(r)]
        row = {"iteration": self.iteration, "reward": float(r.mean()) if len(r) else float("nan"),
               "reward_std": float(r.std()) if len(r) > 1 else 0.0,
               **{f"rewards/{n}/mean": float(v[torch.isfinite(v)].mean()) for n, v in ro.reward_components.items()},
               "frac_reward_zero_std": ro.extras["advantage_stats"]["frac_reward_zero_std"],
               "adv_clip_frac": ro.extras["advantage_stats"]["adv_clip_frac"],
               "kl": stats.metrics.get("kl", 0.0), "clip_ratio": stats.metrics.get("clip_ratio", 0.0),
               "ratio_mean": stats.metrics.get("ratio_mean", 1.0), **info,
               "forwards_grad": stats.forwards_grad, "forwards_nograd": stats.forwards_nograd,
               "sample_backwards": stats.sample_backwards, "peak_memory_bytes": stats.peak_memory_bytes,
               "time/rollout": ro.timings["rollout"], "time/sample": ro.timings["sample"],
               "time/reward": ro.timings["reward"], "time/train": stats.seconds.get("train", 0.0),
               "time/iteration": time.perf_counter() - t0}
        return row

    # ------------------------------------------------------------------ evaluation
    def eval_prompts(self) -> tuple[list[str], list[int]]:
        e = self.cfg.eval
        base = read_prompts(e.prompts_file) if e.prompts_file else [digit_prompt(d) for d in range(10)]
        prompts = [p for p in base for _ in range(e.seeds_per_prompt)]
        seeds = [e.seed + j for _ in base for j in range(e.seeds_per_prompt)]
        return prompts, seeds

    def evaluate(self) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out evaluation on fixed prompts and seeds, with the EMA weights when ``train.ema_decay`` > 0."""
        if self.ema is None:
            return self._evaluate()
        with self.ema.swapped_in():
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out evaluation: fixed prompts and seeds, ``eval.sde_type`` sampling (ODE by default)."""
        if self.family is not None:
            return self.family.evaluate(self)
        prompts, seeds = self.eval_prompts()
        x0 = torch.stack([torch.randn(*self.policy.latent_shape, generator=torch.Generator().manual_seed(s))
                          for s in seeds]).to(self.device)
        kernel = dict(self.kernel, sde_type=self.cfg.eval.sde_type)
        g = torch.Generator(device=self.device).manual_seed(self.cfg.eval.seed)
        saved = dict(self.policy.counters)
        traj = sample_trajectories(self.policy, self.policy.encode(prompts), x0, self.sigmas, kernel=kernel, generator=g)
        self.policy.counters.update(saved)  # evaluation is not training cost
        images = self.policy.decode(traj["xs"][:, -1])
        rewards, comps = compute_rewards(self.cfg.reward.weights, images, prompts,
                                         [{"digit": prompt_digit(p)} for p in prompts])
        row = {"eval/reward": float(rewards[torch.isfinite(rewards)].mean())}
        for n, v in comps.items():
            row[f"eval/rewards/{n}/mean"] = float(v[torch.isfinite(v)].mean())
        return row, images

    # ------------------------------------------------------------------ the whole job
    def run_dir(self) -> Path:
        if not self.cfg.log.output_dir:  # rank 0's timestamp for every rank
            self.cfg.log.output_dir = distributed.all_gather_object(
                str(Path("runs") / time.strftime("%Y%m%d-%H%M%S")))[0]
        p = Path(self.cfg.log.output_dir)
        if self.world.rank == 0:
            p.mkdir(parents=True, exist_ok=True)
        return p

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """Everything needed to continue bit-for-bit: weights, optimizer, EMA, RNG states, counters."""
        rng = {"prompts": self.gen_prompts.get_state(), "noise": self.gen_noise.get_state(),
               "steps": self.gen_steps.get_state(), "torch": torch.get_rng_state(),
               "group_noise": self.gen_group_noise.get_state()}
        if self.family is not None:  # e.g. the dLLM sampler's and mask estimator's streams
            rng["family"] = self.family.rng_state()
        if self.world.world_size > 1:  # a collective: every rank's streams, restored per rank on resume
            rng["per_rank"] = distributed.all_gather_object(rng)
        return distributed.to_full({  # FSDP2 shards → full tensors (a collective; identity otherwise)
            "trainable": {k: v for k, v in self.policy.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "rng": rng,
            "extra": {"bad_updates": self.bad_updates},
        })

    def load_state(self, ck: dict) -> None:
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:
            raise TrainingError("resuming a dist.mode=fsdp2 run is not supported (checkpoints hold full tensors); "
                                "resume it with dist.mode=ddp or in one process")
        self.policy.load_state_dict(ck["trainable"])
        self.optimizer.load_state_dict(ck["optimizer"])
        if self.ema is not None:
            if ck.get("ema") is None:
                raise TrainingError("checkpoint has no EMA state but train.ema_decay > 0")
            self.ema.load_state_dict(ck["ema"])
        rng = ck["rng"]
        if len(rng.get("per_rank", [])) == self.world.world_size:
            rng = rng["per_rank"][self.world.rank]
        if "group_noise" in rng:
            self.gen_group_noise.set_state(rng["group_noise"])
        self.gen_prompts.set_state(rng["prompts"])
        self.gen_noise.set_state(rng["noise"])
        self.gen_steps.set_state(rng["steps"])
        if self.family is not None and "family" in rng:
            self.family.set_rng_state(rng["family"])
        elif self.family is not None:
            self.log("warning: the checkpoint holds no dLLM sampling streams (written by an older version); "
                     "sampling continues from fresh streams, so the run does not replay the uninterrupted one")
        torch.set_rng_state(rng["torch"])
        self.iteration = int(ck["iteration"])
        self.bad_updates = int(ck.get("extra", {}).get("bad_updates", 0))

    def save_checkpoint(self) -> Path:
        from .checkpoint import save_checkpoint

        st = self.state()  # on every rank (collectives); rank 0 writes
        if self.world.rank > 0:
            return self.run_dir()
        return save_checkpoint(self.run_dir(), self.iteration, trainable=st["trainable"], optimizer=st["optimizer"],
                               rng=st["rng"], config=self.cfg.to_dict(), ema=st["ema"], extra=st["extra"],
                               keep_last=self.cfg.train.keep_checkpoints)

    def _resume(self, out: Path) -> bool:
        """Load the newest complete checkpoint of ``out`` and drop metric rows written after it."""
        from .checkpoint import latest_complete, load_checkpoint
        from .runlog import read_metrics

        ckpt = latest_complete(out, log=self.log)
        if ckpt is None:
            self.log(f"no complete checkpoint in {out}; starting from the beginning")
            return False
        self.load_state(load_checkpoint(ckpt))
        rows = [r for r in read_metrics(out / "metrics.jsonl") if r.get("iteration", 0) <= self.iteration]
        if self.world.rank == 0:
            tmp = out / ".metrics.jsonl.tmp"
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            os.replace(tmp, out / "metrics.jsonl")
        self.log(f"resumed from {ckpt} (iteration {self.iteration})")
        return True

    def _on_signal(self, signum, frame):
        if self._stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        self.log(f"received signal {signum}: finishing the current iteration, then saving a checkpoint")

    # ------------------------------------------------------------------ the whole job
    def train(self, resume: bool = False) -> dict[str, float]:
        """Run ``train.num_iterations`` iterations with evaluation, logging, checkpoints and outputs in the run
        directory. ``resume``: continue from the run directory's newest complete checkpoint.
        SIGINT/SIGTERM finish the current iteration, save a checkpoint and return (``summary["interrupted"]``)."""
        import signal
        import threading

        from tqdm.auto import tqdm

        from .runlog import MetricsWriter, plot_curves, read_metrics, save_grid

        cfg = self.cfg
        out = self.run_dir()
        resumed = self._resume(out) if resume else False
        lead = self.world.rank == 0  # only rank 0 writes files; every rank trains and evaluates
        if not resumed:
            if distributed.all_gather_object((out / "metrics.jsonl").exists())[0]:
                raise TrainingError(f"log.output_dir: {str(out)!r} already holds a run; resume it with "
                                    "--resume or choose another directory")
            if lead:
                (out / "config.yaml").write_text(cfg.to_yaml())
        writer = (MetricsWriter(out, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, config=cfg.to_dict())
                  if lead else _NullWriter())
        self.log(f"run directory: {out}")

        def do_eval(tag: str) -> dict:
            row, images = self.evaluate()
            row["iteration"] = self.iteration
            writer.write(row)
            if lead and cfg.log.save_images and tag and images is not None:
                save_grid(images, out / f"samples_{tag}.png", nrow=cfg.eval.seeds_per_prompt * 2)
            return row

        rows = read_metrics(out / "metrics.jsonl") if resumed else []
        evals = [r for r in rows if "eval/reward" in r]
        first = evals[0] if evals else do_eval("start")
        last_eval = evals[-1] if evals else first
        self.log(f"eval at start: {_fmt(first)}")
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._on_signal)
        self._stop_signal = None
        bar = tqdm(total=cfg.train.num_iterations, initial=self.iteration, desc="GRPO",
                   disable=not (cfg.log.progress and lead))
        try:
            while self.iteration < cfg.train.num_iterations:
                row = self.step()
                writer.write(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.3f}", it_s=f"{row['time/iteration']:.1f}s")
                if cfg.eval.every and self.iteration % cfg.eval.every == 0 and self.iteration < cfg.train.num_iterations:
                    last_eval = do_eval("")
                if (cfg.train.save_every and self.iteration % cfg.train.save_every == 0) or self._stop_signal:
                    self.save_checkpoint()
                if self._stop_signal is not None:
                    self.log(f"stopped by signal {self._stop_signal} after iteration {self.iteration}; "
                             f"continue with: diffgrpo train --resume {out}")
                    return {"start": first, "end": last_eval, "interrupted": True}
        finally:
            bar.close()
            writer.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
        if cfg.train.num_iterations:
            last_eval = do_eval("end")
        self.log(f"eval at end:   {_fmt(last_eval)}")
        from safetensors.torch import save_file

        weights = distributed.to_full(self.policy.state_dict())  # a collective under FSDP2
        ema_weights = self.ema.state_dict() if self.ema is not None else None
        if not lead:
            return {"start": first, "end": last_eval}
        save_file(weights, str(out / "weights.safetensors"))
        if self.ema is not None:
            save_file(ema_weights, str(out / "weights_ema.safetensors"))
        if hasattr(self.policy, "save_adapter"):  # diffusers policies: LoRA in diffusers format (load_lora_weights)
            self.policy.save_adapter(out / "lora" if getattr(self.policy, "lora_rank", 0) else out / "transformer")
        if cfg.log.save_images:
            rows = read_metrics(out / "metrics.jsonl")
            keys = ("reward",) + tuple(k for k in last_eval if k.startswith("eval/rewards/"))
            plot_curves(rows, out / "reward_curve.png", keys, title="reward (train) and held-out eval")
        summary = {"start": first, "end": last_eval}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


class TrainingError(RuntimeError):
    """The run cannot continue (repeated non-finite updates, inconsistent checkpoint, occupied run directory)."""


def read_prompts(path: str) -> list[str]:
    """Non-empty, stripped lines of a prompt file."""
    return [line.strip() for line in Path(path).expanduser().read_text().splitlines() if line.strip()]


def _fmt(row: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k.startswith("eval/"))


class _NullWriter:
    """The metrics writer of ranks > 0."""

    def write(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def _silent(*args, **kwargs) -> None:
    """The log function of ranks > 0."""
