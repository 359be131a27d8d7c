"""The masked diffusion LM family: LLaDA-style rollouts with verifiable rewards, trained by a likelihood method.

One iteration of this family, top to bottom:

    examples  prompts_per_batch task instances (P/W per rank in the local layout, a share of every group in the
              spread layout), each repeated group_size times
    rollout   semi-autoregressive masked decoding (``samplers.masked.sample``, recording per token its commit
              step, confidence, entropy, margin and decode order) → decode → the task's verifier →
              ``grpo_loss_weights`` over the completion tokens (advantage baseline and std from the method unless
              ``dllm.method_defaults=false``) → the method's masks and ℓ_old (ℓ_ref) → DPS token weights →
              :class:`~diffgrpo.types.Rollout` whose payload is a :class:`~diffgrpo.types.TokenTrajectory`
    backward  :meth:`diffgrpo.dllm.grpo.TokenGRPO.backward`
    evaluate  the held-out test split, ``dllm.eval_samples`` completions per prompt at ``dllm.eval_temperature``

Data parallel (``dist.mode=ddp``): each rank samples its share with its own sampling and mask streams; rewards
and group ids are all-gathered for the advantages and the token-mean normaliser counts every rank's trained
tokens (× W, as DDP averages), so W ranks take the one-process step on the union of their samples. FSDP2
(``dist.mode=fsdp2``, ``hf_masked_lm`` only) shards the model's blocks before the trainer shards the root; every
rank makes the same forwards (the sampler's steps and the estimator's rows do not depend on the samples).
"""
from __future__ import annotations

import time

import torch

from .. import consistency, distributed, guards
from ..config import RunConfig
from ..errors import ConfigError
from ..family import DEFAULT_SAMPLES, Samples, Sync
from ..loss_weights import apply, grpo_loss_weights
from ..metering import engine_run
from ..models.block_cache import BlockKVCache
from ..models.hf_masked_lm import shard_blocks
from ..models.kv_cache import KVCache
from ..rewards import TASK_REWARD, compute_rewards, make_rewards
from ..rewards.verifiers import d1_format_components
from ..samplers import block, masked
from ..tasks import Example, examples_from_file, get_task
from ..tasks.code import attach_sandbox
from ..types import EngineStats, Rollout, TokenTrajectory
from . import credit, decoding, rules
from .grpo import METHODS, TokenContext, TokenGRPO
from .likelihood import completion_mask
from .trace_critic import TraceCritic

SAMPLER_RECORDS = ("commit_step", "confidence", "entropy", "margin", "block_rank", "order", "step_log_prob")


class DLLMFamily:
    """Masked diffusion LMs (``tiny_mlm``, ``hf_masked_lm``) on the one GRPO loop."""

    name = "dllm"

    def __init__(self, cfg: RunConfig, policy, world: distributed.WorldInfo, *, log=print):
        self.cfg, self.d, self.daca = cfg, cfg.dllm, cfg.daca
        self.policy, self.world, self.log = policy, world, log
        self.device = policy.device
        self.vocab = policy.vocab
        self.task = get_task(self.d.task)
        attach_sandbox(self.task, self.d, log)  # code tasks: the dllm.sandbox pool, checked now
        # dllm.data_file replaces the task's generated train split (drawn the same way: uniformly, seeded)
        fields = {"prompt_field": self.d.prompt_field, "answer_field": self.d.answer_field}
        self.train_pool = examples_from_file(self.d.data_file, self.task, **fields) if self.d.data_file else None
        self.eval_pool = eval_pool(self.d, self.task, self.train_pool, fields, log)
        self.prompt_length = self.d.prompt_length or self.task.prompt_length
        if hasattr(self.vocab, "prompt_ids"):  # a transformers tokenizer (chat template): prompts may not fit
            warn_long_prompts(self.vocab, (self.train_pool or self.task.instances("train")) + self.eval_pool,
                              self.prompt_length, log)
        if world.world_size > 1 and cfg.dist.mode == "fsdp2":  # blocks below the root, before the trainer's wrap
            shard_blocks(policy.model, param_dtype=cfg.dist.fsdp_param_dtype,
                         cpu_offload=cfg.dist.fsdp_cpu_offload)
        self.gen_length = self.d.gen_length or self.task.gen_length
        self.block_size = getattr(policy, "block_size", 0)  # > 0: block-causal (exact block cache, block rollouts)
        self.block_length = self.block_size or self.d.block_length or self.gen_length
        if self.block_size:
            rules.check_block_model(self.d, self.block_size, self.gen_length)
            self.prompt_length = -(-self.prompt_length // self.block_size) * self.block_size  # blocks start at P
        self.steps = self.d.diffusion_steps or self.gen_length
        masked.schedule(self.gen_length, self.block_length, self.steps)  # validates the sizes
        self.kv_cache = None if self.d.kv_cache == "none" or self.block_size else KVCache(  # checks the model
            policy, self.d.kv_cache, prompt_length=self.prompt_length, gen_length=self.gen_length)
        method = METHODS[self.d.method]
        a = cfg.advantage
        self.baseline = method["baseline"] if self.d.method_defaults else a.baseline
        self.std_mode = method["std_mode"] if self.d.method_defaults else a.std_mode
        self.spread = world.world_size > 1 and cfg.dist.group_layout == "spread"
        rank = world.rank  # own sampling and mask streams per rank (rank 0 keeps the one-process seeds)
        self.gen_prompts = torch.Generator().manual_seed(cfg.seed if self.spread else distributed.seed_for(cfg.seed, rank))
        self.gen_sample = torch.Generator(device=self.device).manual_seed(distributed.seed_for(cfg.seed + 11, rank))
        gen_masks = torch.Generator(device=self.device).manual_seed(distributed.seed_for(cfg.seed + 12, rank))
        self.ctx = TokenContext(policy=policy, clip_range=self.d.clip_range, beta=cfg.loss.beta,
                                micro_batch_size=cfg.engine.micro_batch_size)
        self.method = TokenGRPO(self.d, self.daca, self.ctx, generator=gen_masks)
        self.critic = TraceCritic(policy, self.d, lr=self.d.trace_value_lr or 5 * cfg.train.lr,
                                  max_grad_norm=cfg.train.max_grad_norm,
                                  micro_batch_size=cfg.engine.micro_batch_size) if self.d.trace_value else None
        self.guards = guards.EvalGuards.for_text(cfg, log=lambda *a: self.log(*a))  # eval/guard/*
        # reward.weights: rewards added to the task's verifier, whose own weight is reward.weights.task (default 1)
        extra = dict(cfg.reward.weights) if rules.extra_rewards(cfg) else {}
        self.task_weight = float(extra.pop(TASK_REWARD, 1.0))
        self.extra_weights = {n: float(w) for n, w in extra.items()}
        self.reward_fns = make_rewards(self.extra_weights, cfg.reward.options, self.device,
                                       timeout=cfg.reward.timeout)

    # ------------------------------------------------------------------ the family protocol
    check_config = staticmethod(rules.check)  # the family's rules (rules.py), run by validation.validate

    @staticmethod
    def check_world(cfg: RunConfig, world: distributed.WorldInfo) -> None:
        if world.world_size > 1 and cfg.dist.mode == "fsdp2" and cfg.model.name != "hf_masked_lm":
            raise ConfigError(f"dist.mode=fsdp2 for masked diffusion LMs shards the blocks of model.name=hf_masked_lm; "
                              f"the built-in {cfg.model.name} trains data parallel with dist.mode=ddp")
        if world.world_size > 1 and cfg.dllm.trace_value:
            raise ConfigError(f"dllm.trace_value: value on trains its value network in one process; got "
                              f"{world.world_size} ranks")

    def network(self) -> torch.nn.Module:
        return self.policy.model

    def connect(self, sync: Sync) -> None:
        self.ctx.no_sync = sync.no_sync  # the method syncs gradients at its last backward only

    def collect(self) -> tuple[Rollout, EngineStats | None]:
        return self.rollout(), None

    def backward(self, rollout: Rollout, epoch: int) -> EngineStats:
        stats = self.method.backward(rollout, epoch)
        if self.critic is not None:  # dllm.trace_value: one value step per policy update, metered with it
            with engine_run(self.ctx, "dllm/trace_value") as vs:
                metrics = self.critic.update(rollout, vs)
            stats.merge(vs)
            stats.metrics.update(metrics)
        return stats

    def extra_state(self) -> dict[str, torch.Tensor] | None:
        """Tensors the checkpoint keeps beside the policy's (``family.safetensors``): the value network's."""
        return None if self.critic is None else self.critic.state()

    def load_extra_state(self, state: dict[str, torch.Tensor] | None) -> None:
        if self.critic is None:
            return
        if state is None:
            raise ConfigError("dllm.trace_value: the checkpoint holds no value network (written with "
                              "dllm.trace_value=off); resume with dllm.trace_value=off")
        self.critic.load(state)

    def rng_state(self) -> dict:
        return {"prompts": self.gen_prompts.get_state(), "sample": self.gen_sample.get_state(),
                "masks": self.method.gen_masks.get_state()}

    def set_rng_state(self, state: dict) -> None:
        self.gen_prompts.set_state(state["prompts"])
        if "sample" not in state:
            self.log("warning: the checkpoint holds no dLLM sampling streams (written by an older version); "
                     "sampling continues from fresh streams, so the run does not replay the uninterrupted one")
            return
        self.gen_sample.set_state(state["sample"])
        self.method.gen_masks.set_state(state["masks"])

    # ------------------------------------------------------------------ pieces
    def generate(self, examples: list[Example], *, temperature: float, generator=None) -> masked.MaskedSample:
        ids = self.vocab.encode_prompts([e.prompt for e in examples], self.prompt_length).to(self.device)
        if self.block_size:  # block by block with the exact cache, stopping at <eos>
            opts = {k: v for k, v in decoding.sampler_options(self.d).items() if k != "cache_refresh"}
            return block.sample_blocks(self.policy, ids, mask_id=self.vocab.mask_id, gen_length=self.gen_length,
                                       block_length=self.block_length, steps=self.steps, temperature=temperature,
                                       generator=generator, cache=BlockKVCache(self.policy),
                                       eos_id=self.vocab.eos_id, **opts)
        return masked.sample(self.policy, ids, mask_id=self.vocab.mask_id, gen_length=self.gen_length,
                             block_length=self.block_length, steps=self.steps, temperature=temperature,
                             generator=generator, cache=self.kv_cache, **decoding.sampler_options(self.d))

    def examples(self, prompts=None) -> tuple[list[Example], torch.Tensor]:
        """A fresh training batch (→ examples (B,), group ids (B,)), or the instances of given prompts."""
        t, W = self.cfg.train, self.world.world_size
        if prompts is None:
            n = t.prompts_per_batch if W == 1 or self.spread else t.prompts_per_batch // W  # local: P/W per rank
            if self.train_pool is not None:
                pick = torch.randint(len(self.train_pool), (n,), generator=self.gen_prompts)
                drawn = [self.train_pool[int(i)] for i in pick]
            else:
                drawn = self.task.sample("train", n, self.gen_prompts)
            ex = [e for e in drawn for _ in range(t.group_size)]
            gids = torch.arange(n).repeat_interleave(t.group_size)
            if W > 1 and self.spread:  # the same prompts on every rank (shared stream); keep this rank's share
                rows = distributed.rank_rows(gids, self.world.rank, W)
                ex, gids = [ex[i] for i in rows.tolist()], gids[rows]
            return ex, gids
        lookup = {e.prompt: e for s in ("train", "test") for e in self.task.instances(s)}
        lookup.update({e.prompt: e for e in (self.train_pool or []) + self.eval_pool})
        ex = [p if isinstance(p, Example) else lookup[p] for p in prompts]
        return ex, torch.arange(len(ex)) // t.group_size

    def rewards(self, texts: list[str], examples: list[Example]) -> dict[str, torch.Tensor]:
        """The task's reward components, plus d1's format rewards × ``dllm.format_reward`` when it is > 0, plus
        the ``reward.weights`` rewards (each a component under its name; the task's reward × ``reward.weights.task``
        + Σ weight × reward is "reward"; NaN where one is not finite). "task" is the task's verifier as it scored,
        before any weight ("correct" too), so the logs tell the verifier from the weighted total."""
        scored = self.task.rewards(texts, examples)
        scored["task"] = scored["reward"].clone()  # (B,) the verifier, unweighted
        if self.d.format_reward > 0:
            fmt = {k: torch.tensor([d1_format_components(t)[k] for t in texts]) for k in D1_FORMAT_KEYS}
            scored["reward"] = scored["reward"] + self.d.format_reward * sum(fmt.values())
            scored.update(fmt)
        if self.task_weight != 1.0:
            scored["reward"] = self.task_weight * scored["reward"]
        if self.extra_weights:
            meta = [{"answer": e.answer, **e.meta} for e in examples]  # the reference, as the text verifiers read it
            total, comps = compute_rewards(self.extra_weights, list(texts), [e.prompt for e in examples], meta,
                                           self.log, rewards=self.reward_fns)
            scored["reward"] = scored["reward"] + total
            scored.update({(n if n not in scored else f"reward.{n}"): v for n, v in comps.items()})
        return scored

    # ------------------------------------------------------------------ rollout
    def rollout(self, prompts: list | None = None, group_ids: torch.Tensor | None = None) -> Rollout:
        """Sample a group per prompt, score, weight, draw the estimator's masks, store ℓ_old (and ℓ_ref)."""
        t0 = time.perf_counter()
        examples, gids = self.examples(prompts)
        group_ids = gids if group_ids is None else group_ids
        smp = self.generate(examples, temperature=self.d.temperature, generator=self.gen_sample)
        t_sample = time.perf_counter() - t0
        t1 = time.perf_counter()
        texts = [self.vocab.decode(c) for c in smp.completions]
        scored = self.rewards(texts, examples)
        rewards = scored.pop("reward")
        t_reward = time.perf_counter() - t1
        L = self.gen_length
        planned = completion_mask(smp.completions, self.vocab.eos_id)  # (B, L)
        w = grpo_loss_weights(rewards, group_ids, planned, adv_cfg=self.cfg.advantage,
                              aggregation=self.cfg.loss.aggregation, world=self.world, spread=self.spread,
                              std_mode=self.std_mode, baseline=self.baseline, log=self.log)
        records = {k: getattr(smp, k) for k in SAMPLER_RECORDS}
        if self.cfg.train.on_inconsistency != "off":  # the decoder's records against full forwards (consistency)
            records["replay_log_conf"], records["replay_third"] = consistency.replay_log_conf(
                self.policy, smp.sequences, smp.commit_step, smp.num_steps, self.vocab.mask_id)
        est = self.method.score_rollout(smp.sequences, L, smp.order, smp.commit_step)
        traj = TokenTrajectory(sequences=smp.sequences, prompt_length=smp.sequences.shape[1] - L,
                               log_probs=est["log_probs"], ref_log_probs=est["ref_log_probs"], masks=est["masks"],
                               mask_weights=est["mask_weights"], strata=est["strata"], groups=est["groups"],
                               records=records, examples=examples, completions=texts)
        if self.daca.dps_score != "none":  # DACA's denoising progress scores: per-token weights, zero forwards
            d = self.daca
            traj.token_weights = credit.dps_weights(records, planned, score=d.dps_score, mix=d.dps_mix,
                                                    clip_min=d.dps_clip_min, clip_max=d.dps_clip_max,
                                                    steps=smp.num_steps, block_length=self.block_length)
            traj.token_weight_stats = credit.weight_stats(traj.token_weights, planned)
        ro = Rollout(prompts=[e.prompt for e in examples], group_ids=group_ids.to(self.device), traj=traj,
                     selected=planned, rewards=rewards, reward_components=scored,  # rewards/task/*: the verifier
                     metadata=[{"completion": t} for t in texts], timings={"sample": t_sample, "reward": t_reward})
        apply(ro, w)
        if self.critic is not None:  # dllm.trace_value: V_old, returns and per-token advantages (trace_critic)
            self.critic.attach(ro)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def score(self, examples: list[Example], *, temperature: float, samples: int = 1, seed: int = 0,
              prefix: str = "eval/", table=None, guard: bool = False) -> dict[str, float]:
        """Decode ``samples`` completions per example (seeded, batches of 256) and average the task's reward
        components: → {prefix+"reward" (the weighted total), prefix+"accuracy", prefix+"rewards/<k>/mean" (k: "task",
        the verifier, and every other component) (and with ``guard`` the
        eval/guard/* metrics of :mod:`diffgrpo.guards`). Not counted as cost."""
        ex = [e for e in examples for _ in range(samples)]
        outs = self._complete(ex, temperature, torch.Generator(device=self.device).manual_seed(seed))
        scored = self.rewards(outs, ex)
        if table is not None:  # the completions table (media.SampleTable): prompt, answer, components, completion
            for i, (e, text) in enumerate(zip(ex, outs)):
                table.add_completion(i, e.prompt, {"answer": e.answer}, {k: v[i] for k, v in scored.items()
                                                                          if k != "reward"},
                                     scored["reward"][i], text)
        # NaN (a sample not scored, e.g. a program the sandbox could not run) is left out of every mean
        row = {f"{prefix}reward": float(scored["reward"].nanmean()),
               f"{prefix}accuracy": float(scored["correct"].nanmean())}
        for k, v in scored.items():
            if k != "reward":  # the weighted total is prefix+"reward" itself
                row[f"{prefix}rewards/{k}/mean"] = float(v.nanmean())
        if guard:
            row.update(self.guards.texts(outs, [e.prompt for e in ex], [{"answer": e.answer} for e in ex]))
        return row

    def _complete(self, ex: list[Example], temperature: float, g: torch.Generator) -> list[str]:
        """The decoded completions of ``ex``, in batches of 256 from the one generator ``g``; not training cost."""
        saved = dict(self.policy.counters)
        outs = []
        for i in range(0, len(ex), 256):
            smp = self.generate(ex[i:i + 256], temperature=temperature, generator=g)
            outs += [self.vocab.decode(c) for c in smp.completions]
        self.policy.counters.update(saved)  # evaluation is not training cost
        return outs

    @torch.no_grad()
    def sample(self, prompts: list[str] | None, *, seed: int, num: int | None = None, sde_type: str = "",
               source_images: tuple[str, ...] = ()) -> Samples:
        """``num`` completions of each prompt (None: the task's first 8 test prompts), decoded from one generator
        seeded with ``seed``: what :meth:`score` decodes for them with ``seed`` and ``samples=num``. ``sde_type``
        ``"ode"``: greedy decoding; ``""``: ``dllm.eval_temperature``; any other: ``dllm.temperature``."""
        if source_images:
            raise ConfigError(f"--image: model.name={self.cfg.model.name} generates text; --image gives the source "
                              "image of an editing model (Qwen-Image-Edit, FLUX.1 Kontext)")
        for p in prompts or []:
            try:
                self.vocab.encode(p)
            except ValueError as e:
                raise ConfigError(f"--prompt: {p!r} cannot be encoded: {e} of model.name="
                                  f"{self.cfg.model.name}") from None
        examples = [Example(prompt=p, answer="") for p in prompts] if prompts else self.task.instances("test")[:8]
        if not examples:  # a file task (gsm8k, …) has no built-in test prompts
            raise ConfigError(f"--prompt: dllm.task={self.d.task} has no built-in test prompts; give the prompts to "
                              "complete with --prompt TEXT (repeatable)")
        notes: tuple[str, ...] = ()
        if sde_type == "ode":  # greedy decoding: every sample of a prompt would be the same completion
            if num is not None and num > 1:
                notes = (f"note: greedy decoding (--sde-type ode) gives each prompt one completion; writing one per "
                         f"prompt, not {num} copies (--sde-type flow_sde draws {num} at dllm.temperature)",)
            num = 1
        num = DEFAULT_SAMPLES if num is None else num
        ex = [e for e in examples for _ in range(num)]
        temperature = 0.0 if sde_type == "ode" else self.d.temperature if sde_type else self.d.eval_temperature
        texts = self._complete(ex, temperature, torch.Generator(device=self.device).manual_seed(seed))
        return Samples(prompts=[e.prompt for e in ex], per_prompt=num, texts=texts, notes=notes)

    def evaluate(self, table=None) -> tuple[dict[str, float], None]:
        """Held-out test split (first ``dllm.eval_size`` instances), ``dllm.eval_samples`` completions each at
        ``dllm.eval_temperature``; ``table`` (a ``media.SampleTable``) gets each completion with its rewards."""
        pool = self.eval_pool
        ex = pool[: self.d.eval_size] if self.d.eval_size else pool
        return self.score(ex, temperature=self.d.eval_temperature, samples=self.d.eval_samples,
                          seed=self.cfg.eval.seed, table=table, guard=True), None


D1_FORMAT_KEYS = ("format_strict", "format_soft", "format_xmlcount")


def warn_long_prompts(vocab, examples: list[Example], length: int, log, limit: int = 10000) -> int:
    """Log how many of (the first ``limit``) prompts, chat template included, exceed ``length`` tokens (they keep
    their last ``length`` tokens). → that count."""
    sizes = [len(vocab.prompt_ids(e.prompt)) for e in examples[:limit]]
    long = [n for n in sizes if n > length]
    if long:
        log(f"warning: {len(long)} of {len(sizes)} prompts are longer than dllm.prompt_length={length} tokens "
            f"(longest {max(long)}, chat template included); they keep their last {length} tokens")
    return len(long)


def eval_pool(d, task, train_pool, fields: dict, log) -> list[Example]:
    """Held-out examples: ``dllm.eval_file``, else the task's test split; a task without a generator (gsm8k) and
    no eval file evaluates on ``dllm.data_file`` itself (said in the log: that is training-set accuracy)."""
    if d.eval_file:
        return examples_from_file(d.eval_file, task, key="dllm.eval_file", **fields)
    pool = task.instances("test")
    if not pool and train_pool:
        log(f"dllm.eval_file is not set and dllm.task={d.task} has no test split: evaluating on dllm.data_file "
            f"(training prompts)")
        return list(train_pool)
    return pool


__all__ = ["DLLMFamily", "SAMPLER_RECORDS", "eval_pool", "warn_long_prompts"]
