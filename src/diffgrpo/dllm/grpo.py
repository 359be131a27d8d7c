"""GRPO for masked diffusion LMs: the dLLM "family" that :class:`~diffgrpo.trainer.Trainer` delegates to.

The trainer stays the one training loop; when ``model.name`` is a masked LM (``tiny_mlm``, ``hf_masked_lm``)
its ``rollout``, ``backward`` and ``evaluate`` call :class:`DLLMFamily`. A base method is a likelihood
estimator (:mod:`diffgrpo.dllm.likelihood`) plus an advantage baseline, on one shared GRPO loss:

  diffu_grpo    (d1)          mean-field estimate, A = r − mean(group) (no std)
  coupled_grpo  (DiffuCoder)  complementary mask pair, leave-one-out baseline (no std)
  random_mask   (UniGRPO)     m random mask ratios with ELBO weights, A = (r − mean) / std

Per completion token j of sample i (tokens up to and including the first <eos>), with ℓ the estimated
per-token log-prob under masks drawn once per rollout (stored in ``rollout.extras["masks"]``):

    L_ij = u_ij · max(−A_i·ρ_ij, −A_i·clip(ρ_ij, 1−ε, 1+ε)) + β·(exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1),  ρ = exp(ℓ − ℓ_old)

(k3 KL), with ℓ scored under the rollout's sampling distribution softmax(logits / dllm.temperature), and ε =
``loss.clip_range`` except that the untouched flow-model default (1e-4) becomes :data:`DLLM_CLIP_RANGE` = 0.2;
aggregated by :func:`diffgrpo.losses.aggregation_weights` ("mean" = token mean over the batch).
u_ij are optional per-token weights (``token_weights`` hook; None = 1) for credit-assignment plug-ins; they
multiply the policy term only. ``draw_masks`` is the hook for further estimators (e.g. stratified, K forwards).

DACA-GRPO plug-ins (``daca.*``, on any base method):
  * Denoising Progress Scores (``daca.dps_score`` ≠ none): ``token_weights`` = :func:`credit.family_token_weights`,
    per-token weights from the sampler records (zero extra forwards), logged as ``dps/*`` in the update metrics.
  * Stratified Masking Likelihood (``daca.likelihood=sml``): the base masks are refined into K groups
    (:func:`likelihood.stratify`, strata in ``extras["strata"]``, K in ``extras["sml_groups"]``); every token is
    scored by exactly one group, so the loss splits over groups and ``backward`` runs one forward + backward per
    group (peak memory of one base forward). Cost K·M forwards (grad) per update and K·M no-grad for ℓ_old.

Data parallel (``dist.mode=ddp`` under torchrun): each rank samples its share of the batch (whole groups, or a
share of every group with ``dist.group_layout=spread``) with its own sampling and mask streams; rewards and group
ids are all-gathered, so advantages see whole groups, and the token-mean normaliser counts every rank's trained
tokens (× W, as DDP averages), so W ranks take the one-process step on the union of their samples. Every rank
runs a forward + backward for each of its rows (rows without a trained token at weight 0) and only the last
backward syncs gradients, so no rank skips the one collective.

Rollout mapping: ``xs`` (B, 1, P+L) final token ids, ``log_probs`` (B, L) old per-token estimates,
``selected`` (B, L) trained tokens, ``loss_weights`` (B, L); sampler records in ``extras["sampler"]``.
Cost per update: B·M forwards with grad and B·M sample-backwards (M = forwards per estimate), plus B·M
no-grad forwards per rollout for ℓ_old (and B·M for ℓ_ref when β > 0).
"""
from __future__ import annotations

import contextlib
import time

import torch

from .. import distributed
from ..advantages import group_advantages
from ..engines.base import EngineContext, chunks, engine_run
from ..losses import aggregate, aggregation_weights, ppo_clip_loss
from ..samplers import masked
from ..types import EngineStats, Rollout
from . import credit, likelihood
from .tasks import Example, get_task

METHODS = {
    "diffu_grpo": dict(estimator="mean_field", baseline="mean", std_mode="none"),
    "coupled_grpo": dict(estimator="coupled", baseline="leave_one_out", std_mode="none"),
    "random_mask": dict(estimator="random_mask", baseline="mean", std_mode="group"),
}
DLLM_MODELS = ("tiny_mlm", "hf_masked_lm")


DLLM_CLIP_RANGE = 0.2  # PPO ε on per-token ratios (d1, TRL); the flow default (1e-4) suits per-step Gaussian ratios


def dllm_clip_range(clip_range: float) -> float:
    """ε used on token ratios: the configured ``loss.clip_range``, except that the untouched flow-model default
    (``LossConfig.clip_range``) maps to :data:`DLLM_CLIP_RANGE`."""
    from ..config import LossConfig

    return DLLM_CLIP_RANGE if clip_range == LossConfig().clip_range else clip_range


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per element: exp(d) − d − 1 with d = ℓ_ref − ℓ. (N,) → (N,)."""
    d = ref_log_prob - log_prob
    return torch.exp(d) - d - 1


def completion_mask(completions: torch.Tensor, eos_id: int) -> torch.Tensor:
    """(B, L) ids → (B, L) bool: tokens up to and including the first <eos> (all if there is none)."""
    is_eos = completions == eos_id
    before = torch.cumsum(is_eos.long(), 1) - is_eos.long()  # number of eos strictly before j
    return before == 0


def grpo_token_loss(log_prob, old_log_prob, advantages, clip_range, *, ref_log_prob=None, beta=0.0,
                    token_weights=None):
    """Per-token GRPO loss. log_prob/old/ref (n, L), advantages (n,), token_weights (n, L) or None.

    → (loss (n, L), terms {"ratio", "clipped", "kl"} each (n, L) detached)."""
    n, L = log_prob.shape
    adv = advantages.unsqueeze(1).expand(n, L).reshape(-1)
    pg, ratio, clipped = ppo_clip_loss(log_prob.reshape(-1), old_log_prob.reshape(-1), adv, clip_range)
    pg = pg.view(n, L)
    if token_weights is not None:
        pg = pg * token_weights.detach()
    kl = torch.zeros_like(pg)
    if beta > 0:
        kl = k3_kl(log_prob, ref_log_prob.detach())
        pg = pg + beta * kl
    return pg, {"ratio": ratio.view(n, L).detach(), "clipped": clipped.view(n, L), "kl": kl.detach()}


class DLLMFamily:
    """Rollout / backward / evaluate for masked diffusion LMs on the shared trainer."""

    def __init__(self, trainer):
        cfg = trainer.cfg
        self.cfg, self.d = cfg, cfg.dllm
        self.policy = trainer.policy
        self.vocab = self.policy.vocab
        self.task = get_task(self.d.task)
        self.gen_length = self.d.gen_length or self.task.gen_length
        self.block_length = self.d.block_length or self.gen_length
        self.steps = self.d.diffusion_steps or self.gen_length
        masked.schedule(self.gen_length, self.block_length, self.steps)  # validates the sizes
        self.method = METHODS[self.d.method]
        a = cfg.advantage
        self.baseline = self.method["baseline"] if self.d.method_defaults else a.baseline
        self.std_mode = self.method["std_mode"] if self.d.method_defaults else a.std_mode
        self.ctx = EngineContext(policy=self.policy, kernel={}, clip_range=dllm_clip_range(cfg.loss.clip_range),
                                 beta=cfg.loss.beta, micro_batch_size=cfg.engine.micro_batch_size)
        self.gen_prompts = trainer.gen_prompts
        self.world, self.spread = trainer.world, trainer._spread
        rank = self.world.rank  # own sampling and mask streams per rank (rank 0 keeps the one-process seeds)
        self.gen_sample = torch.Generator(device=trainer.device).manual_seed(distributed.seed_for(cfg.seed + 11, rank))
        self.gen_masks = torch.Generator(device=trainer.device).manual_seed(distributed.seed_for(cfg.seed + 12, rank))
        if trainer.dp_module is not None:  # gradient sync on the last backward of an update only
            self.ctx.no_sync = trainer.ctx.no_sync
        self.token_weights = None  # optional hook: (family, rollout) -> (B, L) per-token policy-loss weights
        self.daca = cfg.daca
        if self.daca.dps_score != "none":
            self.token_weights = credit.family_token_weights
        self.device = trainer.device
        if self.ctx.clip_range != cfg.loss.clip_range:
            trainer.log(f"dLLM: loss.clip_range left at the flow-model default {cfg.loss.clip_range}; using the "
                        f"token-ratio default {DLLM_CLIP_RANGE}")
        elif cfg.train.num_inner_epochs > 1 and cfg.loss.clip_range < 1e-2:
            trainer.log(f"warning: loss.clip_range={cfg.loss.clip_range} is very small for token ratios of dLLMs "
                        f"(usually {DLLM_CLIP_RANGE})")

    def rng_state(self) -> dict:
        """The family's own streams (sampling, masks), checkpointed with the trainer's."""
        return {"sample": self.gen_sample.get_state(), "masks": self.gen_masks.get_state()}

    def set_rng_state(self, state: dict) -> None:
        self.gen_sample.set_state(state["sample"])
        self.gen_masks.set_state(state["masks"])

    # ------------------------------------------------------------------ pieces
    def draw_masks(self, B: int, P: int, L: int, records: masked.MaskedSample | None = None):
        """Masks and weights of the configured estimator, drawn from this family's generator."""
        name, dev, g = self.method["estimator"], self.device, self.gen_masks
        if name == "mean_field":
            return likelihood.mean_field(B, P, L, p_mask_prompt=self.d.p_mask_prompt, generator=g, device=dev)
        if name == "coupled":
            return likelihood.coupled(B, P, L, generator=g, device=dev)
        return likelihood.random_mask(B, P, L, num_samples=self.d.num_mask_samples, generator=g, device=dev)

    def refine_masks(self, masks, weights, smp: masked.MaskedSample):
        """SML (``daca.likelihood=sml``): base masks (B, M, N) → K groups (B, K·M, N), strata (B, L) or None."""
        d = self.daca
        if d.likelihood != "sml":
            return masks, weights, None
        valid = completion_mask(smp.completions, self.vocab.eos_id)  # (B, L)
        K = d.sml_strata
        strata = (torch.zeros_like(valid, dtype=torch.long) if K == 1 else  # K = 1 draws nothing
                  likelihood.assign_strata(valid, K, d.sml_partition, order=smp.order, generator=self.gen_masks))
        strata = torch.where(valid, strata, torch.full_like(strata, -1))
        m, w = likelihood.stratify(masks, weights, strata, K, chain=d.sml_mode == "chain")
        return m, w, strata

    def estimate(self, ids, masks, weights, groups: int = 1):
        """ℓ (n, L) summed over ``groups`` consecutive slices of the forwards (one batched forward per group)."""
        M = masks.shape[1] // groups
        out = None
        for k in range(groups):
            lp = self.log_probs(ids, masks[:, k * M:(k + 1) * M], weights[:, k * M:(k + 1) * M])
            out = lp if out is None else out + lp
        return out

    def log_probs(self, ids, masks, weights):
        """Per-token estimates (n, L) for rows of a rollout (grad follows the caller's mode), under the rollout's
        sampling distribution softmax(logits / dllm.temperature)."""
        return likelihood.token_log_probs(self.policy, ids, masks, weights, self.vocab.mask_id,
                                          temperature=self.d.temperature)

    def generate(self, examples: list[Example], *, temperature: float, generator=None) -> masked.MaskedSample:
        ids = self.vocab.encode_prompts([e.prompt for e in examples], self.task.prompt_length).to(self.device)
        return masked.sample(self.policy, ids, mask_id=self.vocab.mask_id, gen_length=self.gen_length,
                             block_length=self.block_length, steps=self.steps, temperature=temperature,
                             remasking=self.d.remasking, generator=generator)

    def _examples(self, prompts):
        if prompts is None:
            t, W = self.cfg.train, self.world.world_size
            n = t.prompts_per_batch if W == 1 or self.spread else t.prompts_per_batch // W  # local: P/W per rank
            ex = [e for e in self.task.sample("train", n, self.gen_prompts) for _ in range(t.group_size)]
            gids = torch.arange(n).repeat_interleave(t.group_size)
            if W > 1 and self.spread:  # the same prompts on every rank (shared stream); keep this rank's share
                rows = distributed.rank_rows(gids, self.world.rank, W)
                ex, gids = [ex[i] for i in rows.tolist()], gids[rows]
            return ex, gids
        lookup = {e.prompt: e for s in ("train", "test") for e in self.task.instances(s)}
        ex = [p if isinstance(p, Example) else lookup[p] for p in prompts]
        return ex, torch.arange(len(ex)) // self.cfg.train.group_size

    # ------------------------------------------------------------------ trainer hooks
    def rollout(self, trainer, prompts=None, group_ids=None) -> Rollout:
        """Sample a group per prompt, score, compute advantages, draw masks, store ℓ_old (and ℓ_ref)."""
        t0 = time.perf_counter()
        examples, gids = self._examples(prompts)
        group_ids = gids if group_ids is None else group_ids
        smp = self.generate(examples, temperature=self.d.temperature, generator=self.gen_sample)
        t_sample = time.perf_counter() - t0
        t1 = time.perf_counter()
        comps = smp.completions
        texts = [self.vocab.decode(c) for c in comps]
        scored = self.task.rewards(texts, examples)
        rewards = scored.pop("reward")
        t_reward = time.perf_counter() - t1
        a = self.cfg.advantage
        valid = torch.isfinite(rewards)
        W, rank, B = self.world.world_size, self.world.rank, len(rewards)
        # statistics over every rank's samples (rank r's rows are r·B … r·B+B−1 of the gathered batch)
        all_rewards, all_gids = distributed.gather_groups(rewards, group_ids, spread=self.spread)
        adv, stats = group_advantages(all_rewards, all_gids, valid=torch.isfinite(all_rewards),
                                      std_mode=self.std_mode, baseline=self.baseline, clip=a.clip, eps=a.eps)
        adv = adv[rank * B:(rank + 1) * B] if W > 1 else adv
        keep = valid.clone()
        if a.filter_zero_std:
            keep &= adv != 0
        B, N = smp.sequences.shape
        L = self.gen_length
        P = N - L
        selected = completion_mask(comps, self.vocab.eos_id) & keep.to(self.device).unsqueeze(1)  # (B, L)
        masks, mweights = self.draw_masks(B, P, L, smp)
        masks, mweights, strata = self.refine_masks(masks, mweights, smp)
        G = 1 if strata is None else self.daca.sml_strata
        with torch.no_grad():
            old = torch.cat([self.estimate(smp.sequences[i], masks[i], mweights[i], G)
                             for i in chunks(torch.arange(B, device=self.device), self.ctx.micro_batch_size)])
            ref = None
            if self.ctx.beta > 0:
                with self.policy.reference():
                    ref = torch.cat([self.estimate(smp.sequences[i], masks[i], mweights[i], G)
                                     for i in chunks(torch.arange(B, device=self.device), self.ctx.micro_batch_size)])
        records = {k: getattr(smp, k) for k in ("commit_step", "confidence", "entropy", "margin", "block_rank",
                                                  "order", "step_log_prob")}
        comp_stats = {k: v for k, v in scored.items()}
        ro = Rollout(prompts=[e.prompt for e in examples], group_ids=group_ids.to(self.device),
                     cond={"prompt_ids": smp.sequences[:, :P]}, sigmas=torch.zeros(0, device=self.device),
                     xs=smp.sequences.unsqueeze(1), velocities=torch.zeros(B, 0, device=self.device),
                     log_probs=old, noise=torch.zeros(B, 0, device=self.device), selected=selected,
                     rewards=rewards, reward_components={"task": rewards.clone(), **comp_stats}, valid=valid.to(self.device),
                     advantages=adv.to(self.device), metadata=[{"completion": t} for t in texts],
                     timings={"sample": t_sample, "reward": t_reward},
                     extras={"masks": masks, "mask_weights": mweights, "ref_log_probs": ref, "sampler": records,
                             "examples": examples, "advantage_stats": stats, "completions": texts,
                             "strata": strata, "sml_groups": G})
        if W > 1:  # the normaliser counts every rank's trained tokens; × W as DDP averages the ranks' gradients
            ro.extras["batch_rewards"] = all_rewards
            every = distributed.all_gather(selected.to(torch.uint8)).bool()
            ro.extras["batch_trains"] = bool(every.any())  # False: every rank skips the update together
            ro.loss_weights = aggregation_weights(every, self.cfg.loss.aggregation)[rank * B:(rank + 1) * B] * W
        else:
            ro.loss_weights = aggregation_weights(selected, self.cfg.loss.aggregation)
        if self.token_weights is not None:
            ro.extras["token_weights"] = self.token_weights(self, ro)
        ro.timings["rollout"] = time.perf_counter() - t0
        return ro

    def backward(self, trainer, ro: Rollout, epoch: int = 0) -> EngineStats:
        """Accumulate ∇ Σ w·L into ``.grad`` (the caller zeroed it). Masks come from the rollout."""
        ctx = self.ctx
        ids = ro.xs[:, 0]
        masks, mw = ro.extras["masks"], ro.extras["mask_weights"]
        ref, tw = ro.extras.get("ref_log_probs"), ro.extras.get("token_weights")
        G = ro.extras.get("sml_groups", 1)
        Mg = masks.shape[1] // G  # forwards per group
        strata = ro.extras.get("strata")
        group = None if strata is None else strata.clamp_min(0)  # (B, L): the group scoring each token
        n_clip = n_tok = 0.0
        kl_sum = ratio_sum = 0.0
        ratio_dev = 0.0
        with engine_run(ctx, f"dllm/{self.d.method}") as stats:
            # data parallel: every row, so that every rank makes its backwards (untrained rows weigh 0), unless
            # no rank trains a token (then none makes any, as one process would)
            rows = (torch.arange(len(ids), device=ids.device) if ro.extras.get("batch_trains", False) else
                    torch.nonzero(ro.selected.any(1)).flatten())
            work = [(i, k) for i in chunks(rows, ctx.micro_batch_size) for k in range(G)]
            for j, (idx, k) in enumerate(work):
                sl = slice(k * Mg, (k + 1) * Mg)  # group k: tokens of stratum k depend on these forwards only
                with contextlib.nullcontext() if j == len(work) - 1 else ctx.no_sync():  # sync once, at the end
                    lp = self.log_probs(ids[idx], masks[idx][:, sl], mw[idx][:, sl])  # (n, L) with grad
                    loss, terms = grpo_token_loss(lp, ro.log_probs[idx], ro.advantages[idx], ctx.clip_range,
                                                  ref_log_prob=None if ref is None else ref[idx], beta=ctx.beta,
                                                  token_weights=None if tw is None else tw[idx])
                    lw, sel = ro.loss_weights[idx], ro.selected[idx]
                    if group is not None and G > 1:
                        in_k = group[idx] == k  # (n, L)
                        lw, sel = torch.where(in_k, lw, torch.zeros_like(lw)), sel & in_k
                    total = aggregate(loss, lw)
                    total.backward()
                stats.backward_calls += 1
                stats.sample_backwards += len(idx) * Mg
                n_tok += float(sel.sum())
                n_clip += float((terms["clipped"] & sel).sum())
                kl_sum += float((terms["kl"] * sel).sum())
                ratio_sum += float((terms["ratio"] * sel).sum())
                if sel.any():
                    ratio_dev = max(ratio_dev, float((terms["ratio"][sel] - 1).abs().max()))
        n = max(n_tok, 1.0)
        stats.metrics.update({"clip_ratio": n_clip / n, "kl": kl_sum / n, "ratio_mean": ratio_sum / n,
                              "ratio_max_dev": ratio_dev, "trained_tokens": n_tok,
                              **ro.extras.get("dps_metrics", {})})
        return stats

    @torch.no_grad()
    def score(self, examples: list[Example], *, temperature: float, samples: int = 1, seed: int = 0,
              prefix: str = "eval/") -> dict[str, float]:
        """Decode ``samples`` completions per example (seeded, batches of 256) and average the task's reward
        components: → {prefix+"reward", prefix+"accuracy", prefix+"rewards/<k>/mean"}. Not counted as cost."""
        ex = [e for e in examples for _ in range(samples)]
        saved = dict(self.policy.counters)
        g = torch.Generator(device=self.device).manual_seed(seed)
        outs = []
        for i in range(0, len(ex), 256):
            smp = self.generate(ex[i:i + 256], temperature=temperature, generator=g)
            outs += [self.vocab.decode(c) for c in smp.completions]
        self.policy.counters.update(saved)  # evaluation is not training cost
        scored = self.task.rewards(outs, ex)
        row = {f"{prefix}reward": float(scored["reward"].mean()), f"{prefix}accuracy": float(scored["correct"].mean())}
        for k, v in scored.items():
            row[f"{prefix}rewards/{k}/mean"] = float(v.mean())
        return row

    def evaluate(self, trainer):
        """Held-out test split (first ``dllm.eval_size`` instances), ``dllm.eval_samples`` completions each at
        ``dllm.eval_temperature``."""
        pool = self.task.instances("test")
        ex = pool[: self.d.eval_size] if self.d.eval_size else pool
        return self.score(ex, temperature=self.d.eval_temperature, samples=self.d.eval_samples,
                          seed=self.cfg.eval.seed), None


def family_for(trainer):
    """The dLLM family when the policy is a masked diffusion LM, else None (flow models)."""
    return DLLMFamily(trainer) if trainer.cfg.model.name in DLLM_MODELS else None


__all__ = ["DLLMFamily", "DLLM_CLIP_RANGE", "METHODS", "dllm_clip_range", "family_for", "grpo_token_loss", "k3_kl",
           "completion_mask"]
