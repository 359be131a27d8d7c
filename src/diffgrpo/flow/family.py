"""The flow-matching family: FlowGRPO / DanceGRPO rollouts of a velocity-field policy, trained by an engine.

One iteration of this family, top to bottom:

    plan      prompts (prompts_per_batch × group_size), group ids, initial noise x_0, trained steps; the engine
              amends the plan (``Engine.plan``: e.g. one step per group, ODE elsewhere)
    collect   ``_rollout`` of the plan in the engine's sampling context, once or in waves of complete groups
              (``Engine.wave_size``: Retain), each wave's first-update backward before the next wave
    _rollout  encode → sample T steps with ``flow_sde.step`` (forwards the engine asked for run with grad,
              ``Engine.rollout_hooks``, given the encoded conditioning) → decode → rewards → ``grpo_loss_weights`` (advantages, trained steps,
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

from .. import distributed, diversity, guard_features, guards, sources
from ..config import RunConfig
from ..data import default_prompts, digit_prompt, prompt_digit, task_metadata
from ..data_sources import EpochSampler, listing_counts, load_prompts, prompt_metadata
from ..engines import build_engine, select_steps
from ..engines.base import EngineContext
from ..errors import ConfigError
from ..family import DEFAULT_SAMPLES, Samples, Sync
from ..loss_weights import apply, grpo_loss_weights
from ..media import SampleTable, grid_frames, to_uint8, with_source
from ..models.pipelines.editing import is_edit
from ..models.regional_compile import compile_policy
from ..rewards import compute_rewards, make_rewards, tag_means
from ..samplers import flow_sde
from ..samplers import options as rollout_options
from ..samplers.rollout import sample_trajectories
from ..threads import SerialWorker
from ..types import BatchPlan, EngineStats, FlowTrajectory, Rollout
from . import rules
from .waves import merge_rollouts, split_waves


class FlowFamily:
    """Flow-matching transformers (the built-in tiny SD3, diffusers SD3/FLUX/Wan/Qwen-Image) on one GRPO loop."""

    name = "flow"

    def __init__(self, cfg: RunConfig, policy, world: distributed.WorldInfo, *, log=print):
        self.cfg, self.policy, self.world, self.log = cfg, policy, world, log
        self.device = policy.device
        self.spread = world.world_size > 1 and cfg.dist.group_layout == "spread"
        self.engine = build_engine(cfg.engine)
        if cfg.model.compile:  # regional: each transformer block once, in place (sampling and every engine)
            compile_policy(policy, cfg.model.compile_backend)
        s = cfg.sampler
        self.sigmas = flow_sde.sigma_grid(s.num_steps, s.shift, device=self.device)  # (T+1,)
        self.kernel = dict(sde_type=s.sde_type, noise_level=s.noise_level, reduce=s.logprob_reduce,
                           cps_flowgrpo_compat=s.cps_flowgrpo_compat, sigma_bounds=flow_sde.sigma_bounds(self.sigmas))
        self.ctx = EngineContext(policy=policy, kernel=self.kernel, clip_range=cfg.loss.clip_range,
                                 beta=cfg.loss.beta, kl_flowgrpo_compat=cfg.loss.kl_flowgrpo_compat,
                                 micro_batch_size=cfg.engine.micro_batch_size, sigmas=self.sigmas,
                                 forward_mult=2 if policy.uses_cfg else 1, trust_region=cfg.loss.trust_region,
                                 ratio_norm=cfg.loss.ratio_norm, kl_mask_bound=cfg.loss.kl_mask_bound,
                                 kl_step_power=cfg.diversity.step_weight_power)
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
        # reward callables on the policy's device with reward.options bound (models load on first use)
        self.reward_fns = make_rewards(cfg.reward.weights, cfg.reward.options, self.device, timeout=cfg.reward.timeout)
        self.guards = guards.EvalGuards.for_flow(cfg, self.device, log=lambda *a: self.log(*a))  # eval/guard/*
        self.plans_made = 0  # training batches planned (the sliding SDE window's clock)
        # diversity objectives: their parts act on the rewards, trained samples and advantages of ``weigh``
        self.diversity = diversity.parse_methods(cfg.diversity.method, diversity.METHODS)
        self.features = guards.diversity_feature_fn(cfg, self.device) if self.diversity else None

    # ------------------------------------------------------------------ the family protocol
    check_config = staticmethod(rules.check)  # the family's rules (rules.py), run by validation.validate

    @staticmethod
    def check_world(cfg: RunConfig, world: distributed.WorldInfo) -> None:
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
        """The next training batch, sampled in the engine's context (``Engine.sampling``): in one piece, or in waves
        of ``engine.wave_size`` complete groups, each wave's first-update gradient accumulated into ``.grad``
        (zeroed by the caller) before the next wave samples. → (rollout, first-update stats or None)."""
        plan = self.plan()
        with self.engine.sampling(self.ctx):
            if not self.engine.wave_size:
                return self._rollout(plan), None
            total, ros = EngineStats(engine=self.engine.name), []
            for sub in split_waves(plan, self.engine.wave_size):
                ro = self._rollout(sub)
                total.merge(self.engine.backward(self.ctx, ro, 0))
                ros.append(ro)
        total.metrics["waves"] = float(len(ros))
        return merge_rollouts(ros), total

    def backward(self, rollout: Rollout, epoch: int) -> EngineStats:
        return self.engine.backward(self.ctx, rollout, epoch)

    def rng_state(self) -> dict:
        state = {"prompts": self.gen_prompts.get_state(), "noise": self.gen_noise.get_state(),
                 "steps": self.gen_steps.get_state(), "group_noise": self.gen_group_noise.get_state()}
        if self.sampler is not None:
            state["prompt_sampler"] = self.sampler.state()
        if self.cfg.steps.window_shift_every > 0:  # the sliding SDE window's clock
            state["plans_made"] = torch.tensor(self.plans_made)
        return state

    def set_rng_state(self, state: dict) -> None:
        self.gen_prompts.set_state(state["prompts"])
        self.gen_noise.set_state(state["noise"])
        self.gen_steps.set_state(state["steps"])
        if "group_noise" in state:  # absent from the oldest checkpoints
            self.gen_group_noise.set_state(state["group_noise"])
        if self.sampler is not None and "prompt_sampler" in state:
            self.sampler.set_state(state["prompt_sampler"])
        self.plans_made = int(state.get("plans_made", 0))

    def extra_state(self) -> None:
        """The flow family keeps no tensors of its own beside the policy's."""
        return None

    def load_extra_state(self, state) -> None:
        return None

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
        # one x_0 per group (shared_prefix needs it); spread: a group's ranks must draw the same x_0
        if self.cfg.sampler.share_noise_in_group or self.cfg.sampler.shared_prefix:
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
            metadata = [task_metadata(p, cfg.train.task) for p in prompts]
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
        selected, sde_mask = rollout_options.plan_steps(s, selected, self.plans_made)  # sliding window, ODE outside
        self.plans_made += 1
        plan = BatchPlan(prompts=list(prompts), group_ids=group_ids, selected=selected,
                         x0=self.initial_noise(group_ids), metadata=metadata, sde_mask=sde_mask)
        self.engine.plan(plan, self.gen_steps)
        return plan

    # ------------------------------------------------------------------ sampling and scoring
    def _rollout(self, plan: BatchPlan) -> Rollout:
        """Sample, decode, score and weight the batch of ``plan`` (one wave of it, when ``plan.wave`` is set)."""
        t0 = time.perf_counter()
        # FSDP2 leaves the root's parameters unsharded from a forward (e.g. evaluation) until the next backward;
        # rollout hooks map the modules' registered parameters to the optimizer's (sharded) ones, so reshard first
        distributed.reshard(self.policy.forward_module)
        cond = self.policy.encode(plan.prompts, sources.of_batch(plan.metadata))  # editing: with its sources
        hooks = self.engine.rollout_hooks(self.ctx, plan, cond)  # a reference forward reuses the encoding
        n = self.cfg.sampler.batch_size
        extra = rollout_options.sampler_kwargs(self.cfg.sampler, plan, self.sigmas)
        if self.cfg.reward.background and hooks is None and 0 < n < len(plan.prompts):
            out, images, rewards, comps, t_reward = self._sample_scoring_behind(plan, cond, n, extra)
            t_sample = time.perf_counter() - t0 - t_reward
        else:
            out = sample_trajectories(self.policy, cond, plan.x0, self.sigmas, kernel=self.kernel,
                                      generator=self.gen_noise, sde_mask=plan.sde_mask,
                                      grad_mask=None if hooks is None else hooks.grad_mask,
                                      on_grad_step=None if hooks is None else hooks.on_grad_step,
                                      batch_size=n, **extra)
            t_sample = time.perf_counter() - t0
            t1 = time.perf_counter()
            images = self.policy.decode(out["xs"][:, -1])
            rewards, comps = compute_rewards(self.cfg.reward.weights, images, plan.prompts,
                                             sources.attach(plan.metadata), log=self.log, rewards=self.reward_fns)
            t_reward = time.perf_counter() - t1
        rollout_options.count_saved(self.policy, out["saved_forwards"])
        traj = FlowTrajectory(cond=cond, sigmas=self.sigmas, xs=out["xs"], velocities=out["velocities"],
                              log_probs=out["log_probs"], noise=out["noise"], images=images,
                              engine_state=plan.engine_state)
        ro = Rollout(prompts=plan.prompts, group_ids=plan.group_ids.to(self.device), traj=traj,
                     selected=plan.selected, rewards=rewards, reward_components=comps, metadata=plan.metadata,
                     timings={"sample": t_sample, "reward": t_reward})
        self.weigh(ro, wave=plan.wave)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    def _sample_scoring_behind(self, plan: BatchPlan, cond: dict, n: int, extra: dict):
        """``reward.background``: sample micro-batch after micro-batch of ``n`` whole trajectories, each decoded and
        handed to one worker thread that scores it while the next one samples (FlowGRPO's overlap).

        The step noise is drawn first, step by step for the whole batch, exactly as the interleaved sampler draws
        it, and every network call sees the same rows, so trajectories, images and rewards equal
        ``background=false``'s. A reward's errors surface here as ``compute_rewards`` raises them (retry once,
        then one RewardError); non-finite scores stay NaN. → (trajectory records, images, rewards (B,),
        components, seconds spent waiting for scores after the last micro-batch). ``extra``: the rollout savings'
        per-row arguments (``samplers.options.sampler_kwargs``), sliced with the rows (a group split across
        micro-batches shares its prefix within each part)."""
        B, T = plan.x0.shape[0], self.sigmas.shape[0] - 1
        noise = torch.stack([torch.randn(plan.x0.shape, generator=self.gen_noise, device=self.device)
                             for _ in range(T)], 1)  # (B, T, *S): the interleaved sampler's draws
        outs, images, futures = [], [], []
        with SerialWorker("diffgrpo-reward") as pool:  # a daemon thread: a hung reward never blocks the exit
            for lo in range(0, B, n):
                failed = next((f for f in futures if f.done() and f.exception() is not None), None)
                if failed is not None:  # stop sampling at once: the run ends with this micro-batch's error
                    raise failed.exception()
                rows = slice(lo, min(lo + n, B))
                part = {k: v[rows] if torch.is_tensor(v) else v for k, v in extra.items()}
                o = sample_trajectories(self.policy, {k: v[rows] for k, v in cond.items()}, plan.x0[rows],
                                        self.sigmas, kernel=self.kernel, step_noise=noise[rows],
                                        sde_mask=None if plan.sde_mask is None else plan.sde_mask[rows], **part)
                im = self.policy.decode(o["xs"][:, -1])
                futures.append(pool.submit(compute_rewards, self.cfg.reward.weights, im, plan.prompts[rows],
                                           sources.attach(plan.metadata[rows]), log=self.log, rewards=self.reward_fns))
                outs.append(o)
                images.append(im)
            t_wait = time.perf_counter()
            scored = [f.result() for f in futures]  # the first failing micro-batch's RewardError, as is
            t_wait = time.perf_counter() - t_wait
        out = {k: torch.cat([o[k] for o in outs]) if torch.is_tensor(outs[0][k]) else sum(o[k] for o in outs)
               for k in outs[0]}
        rewards = torch.cat([r for r, _ in scored])
        comps = {name: torch.cat([c[name] for _, c in scored]) for name in scored[0][1]}
        return out, torch.cat(images), rewards, comps, t_wait

    def weigh(self, ro: Rollout, wave: tuple | None = None) -> None:
        """Advantages, trained steps and loss weights of a scored rollout (``ro.selected`` = the planned steps),
        with the engine's per-sample weights and the diversity objectives' parts; ``wave`` as in
        :func:`~diffgrpo.loss_weights.grpo_loss_weights`."""
        part = self.diversity_part(ro)
        kw = {} if part is None else dict(bonus=part.bonus, subset=part.subset, adjust=part.adjust)
        apply(ro, grpo_loss_weights(
            ro.rewards, ro.group_ids, ro.selected, adv_cfg=self.cfg.advantage, aggregation=self.cfg.loss.aggregation,
            world=self.world, spread=self.spread, wave=wave, log=self.log,
            components=({k: (w, ro.reward_components[k]) for k, w in self.cfg.reward.weights.items()}
                        if self.cfg.advantage.per_reward_norm else None),
            sample_weights=lambda trained: self.engine.sample_weights(self.ctx, ro.traj, trained),
            kl_gate=self.cfg.diversity.gardo_gate, **kw))
        if part is not None:
            ro.advantage_stats.update(part.stats)

    @torch.no_grad()
    def diversity_part(self, ro: Rollout) -> diversity.Part | None:
        """The composed part of ``diversity.method`` for a scored rollout (None when off): each objective on the
        samples' features in the guards' feature space, or the checker's detections on the shapes tasks (one
        feature pass over the decoded samples)."""
        if not self.diversity:
            return None
        feats = self.features(ro.traj.images).float()  # (B, D)
        return diversity.compose([diversity.DIVERSITY[m](self.cfg.diversity, feats, ro.rewards, ro.group_ids)
                                  for m in self.diversity])

    # ------------------------------------------------------------------ evaluation
    def eval_prompts(self) -> tuple[list[str], list[int], list[dict]]:
        """Every evaluation prompt ``eval.seeds_per_prompt`` times → (prompts, seeds, metadata). A prompt listed k
        times (a set that weighs its categories equally) gets seeds e.seed + (k·n … k·n + n − 1) at its k-th listing
        (n = seeds_per_prompt), so a repeat adds fresh samples; a set without repeats uses e.seed + (0 … n − 1)."""
        e = self.cfg.eval
        records = (load_prompts(e.prompts_file, key="eval.prompts_file", column=self.cfg.train.prompt_column)
                   if e.prompts_file else [{"prompt": digit_prompt(d)} for d in range(10)])
        recs = [r for r in records for _ in range(e.seeds_per_prompt)]
        seeds = [e.seed + k * e.seeds_per_prompt + j for k in listing_counts([r["prompt"] for r in records])
                 for j in range(e.seeds_per_prompt)]
        return [r["prompt"] for r in recs], seeds, [prompt_metadata(r, prompt_digit(r["prompt"])) for r in recs]

    @torch.no_grad()
    def evaluate(self, table: SampleTable | None = None) -> tuple[dict[str, float], torch.Tensor]:
        """Held-out evaluation: fixed prompts and seeds, ``eval.sde_type`` sampling (ODE by default). Not counted
        as training cost. → (metrics, the first :data:`EVAL_GRID_IMAGES` samples for the grid (first frames of
        videos)).

        Sharded over ranks: rank r takes the r-th contiguous share of the samples (shares padded to one length, so
        every rank makes the same network calls), in chunks of ``eval.batch_size`` (0 = its whole share); each
        chunk's rewards (and, for the grid and ``table``, its samples as uint8) are gathered, so memory does not
        grow with the prompts. Every sample starts from the noise of its own seed, so with eval.sde_type=ode the
        metrics equal one process's; SDE evaluation draws its noise per rank and chunk. ``table`` (rank 0) gets
        one row per sample: prompt, metadata, reward components, total, its PNG / MP4."""
        prompts, seeds, metadata = self.eval_prompts()
        N, W, rank = len(prompts), self.world.world_size, self.world.rank
        share = -(-N // W)
        mine = list(range(rank * share, min((rank + 1) * share, N)))
        rows = mine + [N - 1] * (share - len(mine))  # padding rows: sampled like the others, dropped when gathered
        n = self.cfg.eval.batch_size if self.cfg.eval.batch_size > 0 else share
        g = self._eval_generator()
        want_media = table is not None or W > 1  # rank 0 alone knows whether it writes a table
        save_media = want_media and self.cfg.log.save_images
        rewards, comps, grid = torch.full((N,), float("nan")), {}, {}
        digit_guards = guards.GuardStats(self.cfg.model.image_size, self.cfg.eval.seeds_per_prompt,  # built-in tasks
                                         guard_features.task_reference(self.cfg, metadata))
        held_out = self.guards.begin()  # eval/guard/*: guard rewards, distance to the base samples, diversity
        for lo in range(0, share, n):
            idx = rows[lo:lo + n]
            im, r, c = self._eval_chunk([prompts[i] for i in idx], [seeds[i] for i in idx],
                                        [metadata[i] for i in idx], g)
            real = [j for j, i in enumerate(idx) if lo + j < len(mine)]
            src = {j: sources.first_source(metadata[idx[j]], tuple(im.shape[-2:])) for j in real}  # image edits
            guard = self.guards.chunk(im[real], [prompts[idx[j]] for j in real],
                                      sources.attach([metadata[idx[j]] for j in real]))
            feats = None  # eval/fid's features: the guards' own where both read the same feature map
            if guards.guards_apply(self.cfg, im):
                same = self.guards.features is digit_guards.features
                feats = guard["feats"] if same else digit_guards.features(im[real])
            part = {"index": [idx[j] for j in real], "reward": r[real], "comps": {k: v[real] for k, v in c.items()},
                    "grid": {idx[j]: with_source(grid_frames(im[j:j + 1])[0].cpu(), src[j]) for j in real
                             if idx[j] < EVAL_GRID_IMAGES},
                    "media": [to_uint8(im[j]) for j in real] if save_media else None,
                    "sources": [None if src[j] is None else to_uint8(src[j]) for j in real] if save_media else None,
                    "feats": feats, "guard": guard}
            del im
            for got in distributed.all_gather_object(part):
                index = torch.tensor(got["index"], dtype=torch.long)
                rewards[index] = got["reward"]
                for k, v in got["comps"].items():
                    comps.setdefault(k, torch.full((N,), float("nan")))[index] = v
                grid.update(got["grid"])
                if got["feats"] is not None:
                    digit_guards.add(got["index"], got["feats"])
                held_out.add(got["index"], got["guard"])
                if table is not None:
                    for j, i in enumerate(got["index"]):
                        table.add_sample(i, prompts[i], metadata[i], {k: v[j] for k, v in got["comps"].items()},
                                         got["reward"][j], got["media"][j] if got["media"] is not None else None,
                                         source=got["sources"][j] if got["sources"] is not None else None)
        row = {"eval/reward": float(rewards[torch.isfinite(rewards)].mean())}
        for name, v in comps.items():
            row[f"eval/rewards/{name}/mean"] = float(v[torch.isfinite(v)].mean())
            by_tag = tag_means(v, metadata)  # GenEval's categories: each one's mean, and their mean (its overall)
            row.update({f"eval/by_tag/{name}/{t}": x for t, x in by_tag.items()})
            if by_tag:
                row[f"eval/rewards/{name}/mean_of_tags"] = sum(by_tag.values()) / len(by_tag)
        row.update(digit_guards.result())  # eval/fid, eval/diversity of the built-in task's digit images
        row.update(held_out.result())
        return row, torch.stack([grid[i] for i in sorted(grid)])

    def _eval_generator(self) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.cfg.eval.seed)

    def _eval_chunk(self, prompts: list[str], seeds: list[int], metadata: list[dict], g: torch.Generator):
        """Sample, decode and score evaluation samples → (images, rewards (n,), components {name: (n,)})."""
        images = self._draw(prompts, seeds, sources.of_batch(metadata), self.cfg.eval.sde_type, g)
        rewards, comps = compute_rewards(self.cfg.reward.weights, images, prompts, sources.attach(metadata),
                                         rewards=self.reward_fns)
        return images, rewards, comps

    def _draw(self, prompts: list[str], seeds: list[int], srcs: list[tuple[str, ...]] | None, sde_type: str,
              g: torch.Generator) -> torch.Tensor:
        """Images of ``prompts[i]`` from the initial noise of ``seeds[i]`` (editing: with ``srcs[i]``), sampled with
        ``sde_type`` (its noise from ``g``) on the run's σ grid; not counted as cost. → (n, C, H, W)."""
        x0 = torch.stack([torch.randn(*self.policy.latent_shape, generator=torch.Generator().manual_seed(s))
                          for s in seeds]).to(self.device)  # (n, *S)
        kernel = dict(self.kernel, sde_type=sde_type)
        saved = dict(self.policy.counters)
        cond = self.policy.encode(prompts, srcs)
        out = sample_trajectories(self.policy, cond, x0, self.sigmas, kernel=kernel, generator=g)
        self.policy.counters.update(saved)
        return self.policy.decode(out["xs"][:, -1])

    @torch.no_grad()
    def sample(self, prompts: list[str] | None, *, seed: int, num: int | None = None, sde_type: str = "",
               source_images: tuple[str, ...] = ()) -> Samples:
        """``num`` images of each prompt (None: the task's ``data.default_prompts``), sample j of every prompt from
        the initial noise of ``seed + j`` and the SDE noise from ``seed``: what :meth:`evaluate` draws with ``eval.seed=seed``,
        ``eval.seeds_per_prompt=num`` (one chunk). ``source_images``: an editing model's source(s) for every
        prompt (refused for a text-to-image model)."""
        family = getattr(getattr(self.policy, "row", None), "name", "")
        if source_images and not is_edit(family):
            raise ConfigError(f"--image: model family {family or self.cfg.model.name} generates from text; --image "
                              "gives the source image of an editing model (Qwen-Image-Edit, FLUX.1 Kontext)")
        num = DEFAULT_SAMPLES if num is None else num
        rows = [p for p in (prompts or default_prompts(self.cfg.train.task)) for _ in range(num)]
        seeds = [seed + j for _ in range(len(rows) // num) for j in range(num)]
        srcs = [tuple(source_images)] * len(rows) if source_images else None
        g = torch.Generator(device=self.device).manual_seed(seed)
        return Samples(prompts=rows, per_prompt=num, images=self._draw(rows, seeds, srcs, sde_type or
                                                                       self.cfg.eval.sde_type, g))


EVAL_GRID_IMAGES = 64  # samples kept for the evaluation grid (the first in prompt order); the table has them all

__all__ = ["FlowFamily"]
