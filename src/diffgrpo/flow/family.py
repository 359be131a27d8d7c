"""The flow-matching family: FlowGRPO / DanceGRPO rollouts of a velocity-field policy, trained by an engine.

One iteration of this family, top to bottom:

    plan      prompts (prompts_per_batch × group_size), group ids, initial noise x_0, trained steps; the engine
              amends the plan (``Engine.plan``: e.g. one step per group, ODE elsewhere)
    collect   the engine runs the plan through ``_rollout`` once, or in waves of complete groups (Retain)
    _rollout  encode → sample T steps with ``flow_sde.step`` (forwards the engine asked for run with grad,
              ``Engine.rollout_hooks``) → decode → rewards → ``grpo_loss_weights`` (advantages, trained steps,
              aggregation weights × the engine's ``sample_weights``) → :class:`~diffgrpo.types.Rollout` whose
              payload is a :class:`~diffgrpo.types.FlowTrajectory`
    backward  ``Engine.backward`` fills ``.grad``
    evaluate  fixed prompts and seeds, ``eval.sde_type`` sampling (ODE by default), the configured rewards

Random streams (one generator each, so that e.g. the eval schedule never changes training samples): prompts
(digit prompts; a prompt file's records come from a seeded epoch sampler, ``data_sources.EpochSampler``, whose
position is part of the RNG state), steps (selection and engine plans), initial/SDE noise (per rank), and group
noise (shared x_0 in the spread layout). A prompt record's metadata travels with its samples to the rewards
(``Rollout.metadata``); each rank scores its own samples, so nothing is gathered for them. In the spread layout every rank plans the same whole batch and keeps its share of every group.
"""
from __future__ import annotations

import time

import torch

from .. import distributed
from ..data import digit_prompt, prompt_digit
from ..data_sources import EpochSampler, load_prompts, prompt_metadata
from ..engines import build_engine, select_steps
from ..engines.base import EngineContext
from ..errors import ConfigError
from ..family import Sync
from ..loss_weights import apply, grpo_loss_weights
from ..rewards import compute_rewards
from ..samplers import flow_sde
from ..samplers.rollout import sample_trajectories
from ..types import BatchPlan, EngineStats, FlowTrajectory, Rollout


class FlowFamily:
    """Flow-matching transformers (the built-in tiny SD3, diffusers SD3/FLUX/Wan/Qwen-Image) on one GRPO loop."""

    name = "flow"

    def __init__(self, cfg, policy, world: distributed.WorldInfo, *, log=print):
        self.cfg, self.policy, self.world, self.log = cfg, policy, world, log
        self.device = policy.device
        self.spread = world.world_size > 1 and cfg.dist.group_layout == "spread"
        self.engine = build_engine(cfg.engine)
        s = cfg.sampler
        self.kernel = dict(sde_type=s.sde_type, noise_level=s.noise_level, reduce=s.logprob_reduce,
                           cps_flowgrpo_compat=s.cps_flowgrpo_compat)
        self.sigmas = flow_sde.sigma_grid(s.num_steps, s.shift, device=self.device)  # (T+1,)
        self.ctx = EngineContext(policy=policy, kernel=self.kernel, clip_range=cfg.loss.clip_range,
                                 beta=cfg.loss.beta, kl_flowgrpo_compat=cfg.loss.kl_flowgrpo_compat,
                                 micro_batch_size=cfg.engine.micro_batch_size, sigmas=self.sigmas,
                                 forward_mult=2 if policy.uses_cfg else 1, trust_region=cfg.loss.trust_region,
                                 ratio_norm=cfg.loss.ratio_norm, kl_mask_bound=cfg.loss.kl_mask_bound)
        rank = world.rank
        plan_seed = (lambda x: x) if self.spread else (lambda x: distributed.seed_for(x, rank))
        self.gen_prompts = torch.Generator().manual_seed(plan_seed(cfg.seed))
        self.gen_noise = torch.Generator(device=self.device).manual_seed(distributed.seed_for(cfg.seed + 1, rank))
        self.gen_steps = torch.Generator().manual_seed(plan_seed(cfg.seed + 2))
        self.gen_group_noise = torch.Generator(device=self.device).manual_seed(cfg.seed + 3)  # spread + shared x0
        t = cfg.train
        # prompt files: records {"prompt", **metadata} in a seeded epoch order, the same on every rank
        self.records = load_prompts(t.prompts_file, column=t.prompt_column) if t.prompts_file else []
        self.sampler = EpochSampler(len(self.records), cfg.seed) if self.records else None

    # ------------------------------------------------------------------ the family protocol
    @staticmethod
    def check_world(cfg, world) -> None:
        """FSDP2 all-gathers weights in every network call, so every rank must make the same calls."""
        if world.world_size == 1 or cfg.dist.mode != "fsdp2":
            return
        s, e = cfg.steps, cfg.engine
        if s.mode == "random" or (s.mode == "window" and s.window_start < 0):
            # that sequence follows each rank's selected steps (a step's rows split into a grad and a no-grad
            # forward, a backward per step with selected rows); steps drawn per trajectory differ across ranks
            raise ConfigError(f"dist.mode=fsdp2 needs the same trained steps on every trajectory; steps.mode="
                              f"{s.mode}{' with window_start=-1' if s.mode == 'window' else ''} draws them per "
                              "trajectory (use all, first_fraction or window with window_start >= 0, or dist.mode=ddp)")
        if e.name == "jagg" and (0 < e.jagg_frac < 1 or e.jagg_min_score > -1):
            # routing by window score sends different steps of each rank to the exact path
            raise ConfigError(f"dist.mode=fsdp2 with engine.name=jagg needs the same network calls on every rank; "
                              f"engine.jagg_frac={e.jagg_frac} / engine.jagg_min_score={e.jagg_min_score} route "
                              "windows by their score, which differs across ranks (use jagg_frac=1 with "
                              "jagg_min_score=-1, jagg_frac=0, or dist.mode=ddp)")

    def network(self) -> torch.nn.Module:
        return self.policy.transformer

    def connect(self, sync: Sync) -> None:
        self.ctx.params, self.ctx.no_sync, self.ctx.all_reduce = sync.params, sync.no_sync, sync.all_reduce

    def rollout(self, prompts: list | None = None, group_ids: torch.Tensor | None = None) -> Rollout:
        return self._rollout(self.plan(prompts, group_ids))

    def collect(self) -> tuple[Rollout, EngineStats | None]:
        return self.engine.collect(self.ctx, self.plan(), self._rollout)

    def backward(self, rollout: Rollout, epoch: int) -> EngineStats:
        return self.engine.backward(self.ctx, rollout, epoch)

    def rng_state(self) -> dict:
        state = {"prompts": self.gen_prompts.get_state(), "noise": self.gen_noise.get_state(),
                 "steps": self.gen_steps.get_state(), "group_noise": self.gen_group_noise.get_state()}
        if self.sampler is not None:
            state["prompt_sampler"] = self.sampler.state()
        return state

    def set_rng_state(self, state: dict) -> None:
        self.gen_prompts.set_state(state["prompts"])
        self.gen_noise.set_state(state["noise"])
        self.gen_steps.set_state(state["steps"])
        if "group_noise" in state:  # absent from the oldest checkpoints
            self.gen_group_noise.set_state(state["group_noise"])
        if self.sampler is not None and "prompt_sampler" in state:
            self.sampler.set_state(state["prompt_sampler"])

    # ------------------------------------------------------------------ planning
    def sample_prompts(self) -> tuple[list[str], torch.Tensor, list[dict]]:
        """``prompts_per_batch`` prompts (P/W per rank in the local layout), each repeated ``group_size`` times.
        → (prompts (B,), group_ids (B,), metadata (B,)).

        Digit prompts are drawn uniformly with replacement. A prompt file's records are drawn by the epoch sampler
        (every record once per epoch, in a permutation seeded by ``seed`` and the epoch): every rank draws the same
        whole batch of P records; in the local layout rank r keeps records [r·P/W, (r+1)·P/W), in the spread layout
        every rank keeps them all (and ``plan`` keeps its share of every group). Groups stay whole either way."""
        t, w = self.cfg.train, self.world
        n = t.prompts_per_batch if self.spread else t.prompts_per_batch // w.world_size
        if self.sampler is not None:
            pick = self.sampler.take(t.prompts_per_batch)
            if not self.spread:
                pick = pick[w.rank * n:(w.rank + 1) * n]
            recs = [self.records[i] for i in pick for _ in range(t.group_size)]
            prompts = [r["prompt"] for r in recs]
            metadata = [prompt_metadata(r, prompt_digit(r["prompt"])) for r in recs]
        else:
            digits = torch.tensor(t.digits)
            pick = digits[torch.randint(len(digits), (n,), generator=self.gen_prompts)]
            prompts = [digit_prompt(int(d)) for d in pick for _ in range(t.group_size)]
            metadata = [{"digit": prompt_digit(p)} for p in prompts]
        return prompts, torch.arange(n).repeat_interleave(t.group_size), metadata

    def initial_noise(self, group_ids: torch.Tensor) -> torch.Tensor:
        """x_0 (B, *S); one draw per group when ``sampler.share_noise_in_group``."""
        shape = self.policy.latent_shape
        if self.cfg.sampler.share_noise_in_group:  # spread: a group's ranks must draw the same x_0
            n = int(group_ids.max()) + 1
            gen = self.gen_group_noise if self.spread else self.gen_noise
            z = torch.randn(n, *shape, generator=gen, device=self.device)
            return z[group_ids.to(self.device)]
        return torch.randn(len(group_ids), *shape, generator=self.gen_noise, device=self.device)

    def plan(self, prompts: list[str] | None = None, group_ids: torch.Tensor | None = None) -> BatchPlan:
        """Decide everything about the next batch before sampling: prompts (with their metadata), groups, initial
        noise, trained steps; then the engine amends the plan (``Engine.plan``)."""
        cfg = self.cfg
        if prompts is None:
            prompts, group_ids, metadata = self.sample_prompts()
        else:
            metadata = [{"digit": prompt_digit(p)} for p in prompts]
            if group_ids is None:
                group_ids = torch.arange(len(prompts)) // cfg.train.group_size
        B, T = len(prompts), cfg.sampler.num_steps
        s = cfg.steps
        selected = select_steps(s.mode, T, B, fraction=s.fraction, window_start=s.window_start,
                                window_size=s.window_size, generator=self.gen_steps).to(self.device)
        if self.spread:  # the same whole batch on every rank; keep this rank's share of every group
            rows = distributed.rank_rows(group_ids, self.world.rank, self.world.world_size)
            prompts, group_ids = [prompts[i] for i in rows.tolist()], group_ids[rows]
            metadata = [metadata[i] for i in rows.tolist()]
            selected = selected[rows.to(self.device)]
        plan = BatchPlan(prompts=list(prompts), group_ids=group_ids, selected=selected,
                         x0=self.initial_noise(group_ids), metadata=metadata)
        self.engine.plan(plan, self.gen_steps)
        return plan

    # ------------------------------------------------------------------ sampling and scoring
    def _rollout(self, plan: BatchPlan) -> Rollout:
        """Sample, decode, score and weight the batch of ``plan`` (one wave of it, when ``plan.wave`` is set)."""
        t0 = time.perf_counter()
        # FSDP2 leaves the root's parameters unsharded from a forward (e.g. evaluation) until the next backward;
        # rollout hooks map the modules' registered parameters to the optimizer's (sharded) ones, so reshard first
        distributed.reshard(self.policy.forward_module)
        hooks = self.engine.rollout_hooks(self.ctx, plan)
        cond = self.policy.encode(plan.prompts)
        out = sample_trajectories(self.policy, cond, plan.x0, self.sigmas, kernel=self.kernel,
                                  generator=self.gen_noise, sde_mask=plan.sde_mask,
                                  grad_mask=None if hooks is None else hooks.grad_mask,
                                  on_grad_step=None if hooks is None else hooks.on_grad_step,
                                  batch_size=self.cfg.sampler.batch_size)
        t_sample = time.perf_counter() - t0
        t1 = time.perf_counter()
        images = self.policy.decode(out["xs"][:, -1])
        rewards, comps = compute_rewards(self.cfg.reward.weights, images, plan.prompts, plan.metadata, log=self.log)
        t_reward = time.perf_counter() - t1
        traj = FlowTrajectory(cond=cond, sigmas=self.sigmas, xs=out["xs"], velocities=out["velocities"],
                              log_probs=out["log_probs"], noise=out["noise"], images=images,
                              engine_state=plan.engine_state)
        ro = Rollout(prompts=plan.prompts, group_ids=plan.group_ids.to(self.device), traj=traj,
                     selected=plan.selected, rewards=rewards, reward_components=comps, metadata=plan.metadata,
                     timings={"sample": t_sample, "reward": t_reward})
        self.weigh(ro, wave=plan.wave)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    def weigh(self, ro: Rollout, wave: tuple | None = None) -> None:
        """Advantages, trained steps and loss weights of a scored rollout (``ro.selected`` = the planned steps),
        with the engine's per-sample weights; ``wave`` as in :func:`~diffgrpo.loss_weights.grpo_loss_weights`."""
        apply(ro, grpo_loss_weights(
            ro.rewards, ro.group_ids, ro.selected, adv_cfg=self.cfg.advantage, aggregation=self.cfg.loss.aggregation,
            world=self.world, spread=self.spread, wave=wave, log=self.log,
            sample_weights=lambda trained: self.engine.sample_weights(self.ctx, ro.traj, trained)))

    # ------------------------------------------------------------------ evaluation
    def eval_prompts(self) -> tuple[list[str], list[int], list[dict]]:
        """Every evaluation prompt ``eval.seeds_per_prompt`` times → (prompts, seeds, metadata)."""
        e = self.cfg.eval
        records = (load_prompts(e.prompts_file, key="eval.prompts_file", column=self.cfg.train.prompt_column)
                   if e.prompts_file else [{"prompt": digit_prompt(d)} for d in range(10)])
        recs = [r for r in records for _ in range(e.seeds_per_prompt)]
        seeds = [e.seed + j for _ in records for j in range(e.seeds_per_prompt)]
        return [r["prompt"] for r in recs], seeds, [prompt_metadata(r, prompt_digit(r["prompt"])) for r in recs]

    @torch.no_grad()
    def evaluate(self) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out evaluation: fixed prompts and seeds, ``eval.sde_type`` sampling (ODE by default). Not counted
        as training cost. ``eval.batch_size`` > 0 samples, decodes and scores that many at a time, keeping only
        the rewards and the first :data:`EVAL_GRID_IMAGES` images, so memory does not grow with the prompts (each
        chunk continues the SDE noise stream: with eval.sde_type=ode the samples are those of one batch)."""
        prompts, seeds, metadata = self.eval_prompts()
        n = self.cfg.eval.batch_size
        if n <= 0 or n >= len(prompts):
            images, rewards, comps = self._eval_chunk(prompts, seeds, metadata, self._eval_generator())
        else:
            g, kept, parts = self._eval_generator(), [], []
            for lo in range(0, len(prompts), n):
                im, r, c = self._eval_chunk(prompts[lo:lo + n], seeds[lo:lo + n], metadata[lo:lo + n], g)
                if sum(len(i) for i in kept) < EVAL_GRID_IMAGES:
                    kept.append(im[:EVAL_GRID_IMAGES - sum(len(i) for i in kept)])
                parts.append((r, c))
                del im
            images = torch.cat(kept)
            rewards = torch.cat([r for r, _ in parts])
            comps = {name: torch.cat([c[name] for _, c in parts]) for name in parts[0][1]}
        row = {"eval/reward": float(rewards[torch.isfinite(rewards)].mean())}
        for name, v in comps.items():
            row[f"eval/rewards/{name}/mean"] = float(v[torch.isfinite(v)].mean())
        return row, images

    def _eval_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.cfg.eval.seed)

    def _eval_chunk(self, prompts: list[str], seeds: list[int], metadata: list[dict], g: torch.Generator):
        """Sample, decode and score evaluation samples → (images, rewards (n,), components {name: (n,)})."""
        x0 = torch.stack([torch.randn(*self.policy.latent_shape, generator=torch.Generator().manual_seed(s))
                          for s in seeds]).to(self.device)
        kernel = dict(self.kernel, sde_type=self.cfg.eval.sde_type)
        saved = dict(self.policy.counters)
        out = sample_trajectories(self.policy, self.policy.encode(prompts), x0, self.sigmas, kernel=kernel, generator=g)
        self.policy.counters.update(saved)
        images = self.policy.decode(out["xs"][:, -1])
        del out
        rewards, comps = compute_rewards(self.cfg.reward.weights, images, prompts, metadata)
        return images, rewards, comps


EVAL_GRID_IMAGES = 64  # images kept for the sample grid when evaluation runs in chunks (eval.batch_size > 0)

__all__ = ["FlowFamily"]
