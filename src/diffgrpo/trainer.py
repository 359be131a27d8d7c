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

from .advantages import group_advantages
from .config import RunConfig
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


class Trainer:
    def __init__(self, cfg: RunConfig | None = None, *, policy=None, log=print):
        self.cfg = cfg = cfg or RunConfig()
        self.log = log
        if cfg.model.cache_dir:
            os.environ["DIFFGRPO_CACHE"] = cfg.model.cache_dir
        torch.manual_seed(cfg.seed)
        self.policy = policy if policy is not None else POLICIES[cfg.model.name](
            cfg, progress=cfg.log.progress, log=log)
        self.device = torch.device(getattr(self.policy, "device", "cpu"))
        self.engine = build_engine(cfg.engine)
        self.params = list(self.policy.trainable_parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay,
                                           betas=(cfg.train.adam_beta1, cfg.train.adam_beta2))
        self.kernel = dict(sde_type=cfg.sampler.sde_type, noise_level=cfg.sampler.noise_level,
                           reduce=cfg.sampler.logprob_reduce, cps_flowgrpo_compat=cfg.sampler.cps_flowgrpo_compat)
        self.ctx = EngineContext(policy=self.policy, kernel=self.kernel, clip_range=cfg.loss.clip_range,
                                 beta=cfg.loss.beta, kl_flowgrpo_compat=cfg.loss.kl_flowgrpo_compat,
                                 micro_batch_size=cfg.engine.micro_batch_size)
        self.sigmas = flow_sde.sigma_grid(cfg.sampler.num_steps, cfg.sampler.shift, device=self.device)
        # one generator per stream so that e.g. changing the eval schedule never changes training samples
        self.gen_prompts = torch.Generator().manual_seed(cfg.seed)
        self.gen_noise = torch.Generator(device=self.device).manual_seed(cfg.seed + 1)
        self.gen_steps = torch.Generator().manual_seed(cfg.seed + 2)
        self.iteration = 0

    # ------------------------------------------------------------------ rollout phase
    def sample_prompts(self) -> tuple[list[str], torch.Tensor]:
        """``prompts_per_batch`` prompts, each repeated ``group_size`` times. → (prompts (B,), group_ids (B,))."""
        t = self.cfg.train
        digits = torch.tensor(t.digits)
        pick = digits[torch.randint(len(digits), (t.prompts_per_batch,), generator=self.gen_prompts)]
        prompts = [digit_prompt(int(d)) for d in pick for _ in range(t.group_size)]
        group_ids = torch.arange(t.prompts_per_batch).repeat_interleave(t.group_size)
        return prompts, group_ids

    def initial_noise(self, group_ids: torch.Tensor) -> torch.Tensor:
        """x_0 (B, *S); one draw per group when ``sampler.share_noise_in_group``."""
        shape = self.policy.latent_shape
        if self.cfg.sampler.share_noise_in_group:
            n = int(group_ids.max()) + 1
            z = torch.randn(n, *shape, generator=self.gen_noise, device=self.device)
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
        plan = plan or self.plan_batch(prompts, group_ids)
        prompts, group_ids = plan.prompts, plan.group_ids
        timings = {}
        t0 = time.perf_counter()
        grad_mask, hook = (None, None)
        if hasattr(self.engine, "rollout_hooks"):
            grad_mask, hook = self.engine.rollout_hooks(self.ctx, plan)
        cond = self.policy.encode(prompts)
        traj = sample_trajectories(self.policy, cond, plan.x0, self.sigmas, kernel=self.kernel,
                                   generator=self.gen_noise, sde_mask=plan.sde_mask, grad_mask=grad_mask,
                                   on_grad_step=hook)
        timings["sample"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        images = self.policy.decode(traj["xs"][:, -1])
        metadata = [{"digit": prompt_digit(p)} for p in prompts]
        rewards, comps = compute_rewards(cfg.reward.weights, images, prompts, metadata)
        timings["reward"] = time.perf_counter() - t1
        ro = Rollout(prompts=prompts, group_ids=group_ids.to(self.device), cond=cond, sigmas=self.sigmas,
                     xs=traj["xs"], velocities=traj["velocities"], log_probs=traj["log_probs"], noise=traj["noise"],
                     selected=plan.selected, rewards=rewards, reward_components=comps, images=images,
                     metadata=metadata, timings=timings, extras=dict(plan.extras))
        self.finish_rollout(ro)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    def finish_rollout(self, ro: Rollout) -> None:
        """Advantages, the trained mask and the aggregation weights, from the rewards."""
        a = self.cfg.advantage
        valid = torch.isfinite(ro.rewards)
        adv, stats = group_advantages(ro.rewards, ro.group_ids.cpu(), valid=valid, std_mode=a.std_mode,
                                      baseline=a.baseline, clip=a.clip, eps=a.eps)
        keep = valid.clone()
        if a.filter_zero_std:
            keep &= adv != 0
        if int((~valid).sum()):
            self.log(f"warning: {int((~valid).sum())} sample(s) had a non-finite reward and are excluded "
                     "from the statistics and the loss")
        ro.valid = valid.to(self.device)
        ro.advantages = adv.to(self.device)
        ro.selected = ro.selected & keep.to(self.device).unsqueeze(1)
        sample_weights = self.engine.sample_weights(self.ctx, ro) if hasattr(self.engine, "sample_weights") else None
        ro.loss_weights = aggregation_weights(ro.selected, self.cfg.loss.aggregation, sample_weights)
        ro.extras["advantage_stats"] = stats

    # ------------------------------------------------------------------ update phase
    def backward(self, rollout: Rollout, epoch: int = 0) -> EngineStats:
        """Zero the grads and let the engine fill ``.grad`` for this rollout (no optimizer step)."""
        self.optimizer.zero_grad(set_to_none=True)
        return self.engine.backward(self.ctx, rollout, epoch)

    def update(self, rollout: Rollout) -> tuple[EngineStats, dict[str, float]]:
        """``num_inner_epochs`` optimizer updates on one rollout. Returns the merged stats and update metrics."""
        total = EngineStats(engine=self.engine.name)
        info = {"grad_norm": 0.0, "skipped_updates": 0}
        for epoch in range(self.cfg.train.num_inner_epochs):
            stats = self.backward(rollout, epoch)
            norm = self._grad_norm()
            if not torch.isfinite(torch.tensor(norm)):
                self.log(f"warning: non-finite gradient at iteration {self.iteration}; update skipped")
                info["skipped_updates"] += 1
                self.optimizer.zero_grad(set_to_none=True)
            else:
                if self.cfg.train.max_grad_norm > 0:
                    torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
                self.optimizer.step()
            info["grad_norm"] = norm
            total.merge(stats)
            if epoch == 0:
                info.update({f"first_epoch/{k}": v for k, v in stats.metrics.items()})
        return total, info

    def _grad_norm(self) -> float:
        grads = [p.grad.detach().flatten() for p in self.params if p.grad is not None]
        return float(torch.cat(grads).norm()) if grads else 0.0

    def step(self) -> dict[str, float]:
        """One GRPO iteration: rollout, updates, metrics (TRL-style names)."""
        t0 = time.perf_counter()
        ro = self.rollout()
        stats, info = self.update(ro)
        self.iteration += 1
        r = ro.rewards[ro.valid.cpu()]
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
        prompts = [digit_prompt(d) for d in range(10) for _ in range(e.seeds_per_prompt)]
        seeds = [e.seed + j for _ in range(10) for j in range(e.seeds_per_prompt)]
        return prompts, seeds

    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out evaluation: fixed prompts and seeds, ``eval.sde_type`` sampling (ODE by default)."""
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
        if not self.cfg.log.output_dir:
            self.cfg.log.output_dir = str(Path("runs") / time.strftime("%Y%m%d-%H%M%S"))
        p = Path(self.cfg.log.output_dir)
        p.mkdir(parents=True, exist_ok=True)
        return p

    def train(self) -> dict[str, float]:
        """Run ``train.num_iterations`` iterations with evaluation, logging and outputs in the run directory."""
        from tqdm.auto import tqdm

        from .runlog import MetricsWriter, plot_curves, read_metrics, save_grid

        cfg = self.cfg
        out = self.run_dir()
        (out / "config.yaml").write_text(cfg.to_yaml())
        writer = MetricsWriter(out, tensorboard=cfg.log.tensorboard)
        self.log(f"run directory: {out}")

        def do_eval(tag: str) -> dict:
            row, images = self.evaluate()
            row["iteration"] = self.iteration
            writer.write(row)
            if cfg.log.save_images and tag:
                save_grid(images, out / f"samples_{tag}.png", nrow=cfg.eval.seeds_per_prompt * 2)
            return row

        first = do_eval("start")
        self.log(f"eval at start: {_fmt(first)}")
        bar = tqdm(range(cfg.train.num_iterations), desc="GRPO", disable=not cfg.log.progress)
        last_eval = first
        for _ in bar:
            row = self.step()
            writer.write(row)
            bar.set_postfix(reward=f"{row['reward']:.3f}", it_s=f"{row['time/iteration']:.1f}s")
            if cfg.eval.every and self.iteration % cfg.eval.every == 0 and self.iteration < cfg.train.num_iterations:
                last_eval = do_eval("")
        if cfg.train.num_iterations:
            last_eval = do_eval("end")
        self.log(f"eval at end:   {_fmt(last_eval)}")
        writer.close()
        from safetensors.torch import save_file

        save_file(self.policy.state_dict(), str(out / "weights.safetensors"))
        if cfg.log.save_images:
            rows = read_metrics(out / "metrics.jsonl")
            keys = ("reward",) + tuple(k for k in last_eval if k.startswith("eval/rewards/"))
            plot_curves(rows, out / "reward_curve.png", keys, title="reward (train) and held-out eval")
        summary = {"start": first, "end": last_eval}
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary


def _fmt(row: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k.startswith("eval/"))
