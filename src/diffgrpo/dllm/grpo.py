"""GRPO for masked diffusion LMs: the likelihood method that forms the gradient of a token rollout.

:class:`TokenGRPO` is to the masked-LM family (:mod:`diffgrpo.dllm.family`) what a gradient engine is to the
flow family: it draws the estimator's masks for a rollout, scores ℓ_old (and ℓ_ref), and back-propagates the
loss. A base method is a likelihood estimator (:mod:`diffgrpo.dllm.likelihood`) plus an advantage baseline, on
one shared GRPO loss:

  diffu_grpo    (d1)          mean-field estimate, A = r − mean(group) (no std)
  coupled_grpo  (DiffuCoder)  complementary mask pair, leave-one-out baseline (no std); ``dllm.coupled_form``:
                              paper (the pair, weight 1: 2 forwards) or released (DiffuCoder's trainer: a full-mask
                              forward averaged with the 1/t, 1/(1−t)-weighted pair: 3 forwards)
  random_mask   (UniGRPO)     m random mask ratios with ELBO weights, A = (r − mean) / std
  trace_rl      (TraceRL)     the sampler's own decoding steps, one masked forward per step (:mod:`.trace_rl`),
                              A = (r − mean) / std; on a block-causal model every estimator scores each block with
                              the exact clean prefix (:mod:`.block_likelihood`)

and two ratio-free base methods with their own objectives (one module each):

  spg           (SPG)         :mod:`diffgrpo.dllm.spg`: ELBO for A > 0, upper bound (EUBO / mix) for A ≤ 0,
                              block-wise masks, A = r − mean (no std)
  wd1           (wd1)         :mod:`diffgrpo.dllm.wd1`: group-softmax weighted mean-field likelihood, A = r − mean

Per completion token j of sample i (tokens up to and including the first <eos>), with ℓ the estimated
per-token log-prob under masks drawn once per rollout (stored in the rollout's ``TokenTrajectory.masks``):

    L_ij = u_ij · max(−A_i·ρ_ij, −A_i·clip(ρ_ij, 1−ε, 1+ε)) + β·(exp(ℓ_ref − ℓ) − (ℓ_ref − ℓ) − 1),  ρ = exp(ℓ − ℓ_old)

(k3 KL), with ℓ scored under the rollout's sampling distribution softmax(logits / dllm.temperature), ε =
``dllm.clip_range`` (0.2 as in d1 and TRL; the flow family's ``loss.clip_range`` is a per-step Gaussian ratio's)
and the loss weights of :func:`diffgrpo.loss_weights.grpo_loss_weights` ("mean" = token mean over the batch).
u_ij are optional per-token weights (``TokenTrajectory.token_weights``; None = 1) for credit-assignment plug-ins;
they multiply the policy term only. :meth:`TokenGRPO.draw_masks` is the hook for further estimators.

DACA-GRPO plug-ins (``daca.*``, on any base method):
  * Denoising Progress Scores (``daca.dps_score`` ≠ none): token weights from :func:`credit.dps_weights` on the
    sampler records (zero extra forwards, set by the family), logged as ``dps/*`` in the update metrics.
  * Stratified Masking Likelihood (``daca.likelihood=sml``): the base masks are refined into K groups
    (:func:`likelihood.stratify`, strata in ``TokenTrajectory.strata``, K in ``.groups``); every token is
    scored by exactly one group, so the loss splits over groups and ``backward`` runs one forward + backward per
    group (peak memory of one base forward). Cost K·M forwards (grad) per update and K·M no-grad for ℓ_old.

Cost per update: B·M forwards with grad and B·M sample-backwards (M = forwards per estimate,
:func:`forwards_per_estimate`), plus B·M no-grad forwards per rollout for ℓ_old (none for the ratio-free spg and
wd1) and B·M for ℓ_ref when β > 0.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .. import consistency
from ..losses import aggregate, ppo_clip_loss
from ..metering import chunks, engine_run, record_backward
from ..types import EngineStats, Rollout, TokenTrajectory
from . import likelihood, spg, trace_rl, wd1
from .block_likelihood import block_token_log_probs

METHODS = {
    "diffu_grpo": dict(estimator="mean_field", baseline="mean", std_mode="none", objective="grpo"),
    "coupled_grpo": dict(estimator="coupled", baseline="leave_one_out", std_mode="none", objective="grpo"),
    "random_mask": dict(estimator="random_mask", baseline="mean", std_mode="group", objective="grpo"),
    "spg": dict(estimator="spg_blocks", baseline="mean", std_mode="none", objective="spg"),
    "wd1": dict(estimator="mean_field", baseline="mean", std_mode="none", objective="wd1"),
    "trace_rl": dict(estimator="trace", baseline="mean", std_mode="group", objective="grpo"),  # trace_rl.py
}


@dataclass
class TokenContext:
    """What :class:`TokenGRPO` uses besides the rollout and its config sections. Built by the family once per run;
    ``no_sync`` is set when the trainer connects the family."""

    policy: Any  # adapter: called on ids (n, N) → logits (n, N, V); reference(), vocab, device, counters
    clip_range: float = 0.2  # ε of the per-token ratio clip (dllm.clip_range)
    beta: float = 0.0  # weight of the k3 KL to the reference (loss.beta)
    micro_batch_size: int = 0  # rows per forward; 0: the whole batch in one
    no_sync: Callable[[], contextlib.AbstractContextManager] = field(default=contextlib.nullcontext)  # no all-reduce


def forwards_per_estimate(d, daca) -> int:
    """Sequence-forwards per completion of one likelihood estimate (M, × K with SML): the grad-forwards a method
    spends per completion per update. d: the dllm config section, daca: the daca section."""
    m = d.method
    if m == "trace_rl":  # one forward per decoding step (× trace_shrink)
        return trace_rl.forwards_per_completion(d.diffusion_steps or d.gen_length, d.trace_shrink)
    base = {"diffu_grpo": 1, "wd1": 1, "random_mask": d.num_mask_samples, "spg": d.spg_num_t,
            "coupled_grpo": 3 if d.coupled_form == "released" else 2}[m]
    return base * (daca.sml_strata if daca.likelihood == "sml" else 1)


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(π‖π_ref) per element: exp(d) − d − 1 with d = ℓ_ref − ℓ. (N,) → (N,)."""
    d = ref_log_prob - log_prob
    return torch.exp(d) - d - 1


def grpo_token_loss(log_prob, old_log_prob, advantages, clip_range, *, ref_log_prob=None, beta=0.0,
                    token_weights=None):
    """Per-token GRPO loss. log_prob/old/ref (n, L), advantages (n,) or per token (n, L), token_weights (n, L) or
    None.

    → (loss (n, L), terms {"ratio", "clipped", "kl"} each (n, L) detached)."""
    n, L = log_prob.shape
    adv = (advantages if advantages.dim() == 2 else advantages.unsqueeze(1).expand(n, L)).reshape(-1)
    pg, ratio, clipped = ppo_clip_loss(log_prob.reshape(-1), old_log_prob.reshape(-1), adv, clip_range)
    pg = pg.view(n, L)
    if token_weights is not None:
        pg = pg * token_weights.detach()
    kl = torch.zeros_like(pg)
    if beta > 0:
        kl = k3_kl(log_prob, ref_log_prob.detach())
        pg = pg + beta * kl
    return pg, {"ratio": ratio.view(n, L).detach(), "clipped": clipped.view(n, L), "kl": kl.detach()}


class TokenGRPO:
    """The masked-LM likelihood method (``dllm.method`` + ``daca.likelihood``): masks, ℓ estimates, backward.

    ``ctx``: the policy and the loss constants (:class:`TokenContext`). ``generator`` draws the masks and SML
    strata (checkpointed by the family).
    """

    def __init__(self, d, daca, ctx: TokenContext, *, generator: torch.Generator):
        self.d, self.daca, self.ctx, self.gen_masks = d, daca, ctx, generator
        self.method = METHODS[d.method]
        self.name = f"dllm/{d.method}"
        self.policy = ctx.policy
        self.mask_id = self.policy.vocab.mask_id
        self.eos_id = self.policy.vocab.eos_id

    # ------------------------------------------------------------------ masks and estimates
    def draw_masks(self, B: int, P: int, L: int, completions: torch.Tensor | None = None,
                   commit_step: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Masks (B, M, P+L) and weights (B, M, L) of the configured estimator, from this method's generator.
        completions (B, L) ids: needed by SPG's block masks (the valid tokens decide the blocks); commit_step (B, L):
        the sampler's steps, trace_rl's masks."""
        name, dev, g, d = self.method["estimator"], self.policy.device, self.gen_masks, self.d
        if name == "trace":
            return trace_rl.trace_masks(commit_step, P, d.trace_shrink)
        if name == "mean_field":
            return likelihood.mean_field(B, P, L, p_mask_prompt=d.p_mask_prompt, generator=g, device=dev)
        if name == "coupled":
            fn = likelihood.coupled_released if d.coupled_form == "released" else likelihood.coupled
            return fn(B, P, L, generator=g, device=dev)
        if name == "spg_blocks":
            valid = likelihood.completion_mask(completions, self.eos_id)  # (B, L)
            masks = spg.block_masks(valid, P, block_length=d.spg_block_length or d.block_length or L,
                                    num_t=d.spg_num_t, t_min=d.spg_t_min, t_max=d.spg_t_max,
                                    p_mask_prompt=d.p_mask_prompt, generator=g)
            return masks, spg.elbo_weights(masks, valid)
        return likelihood.random_mask(B, P, L, num_samples=d.num_mask_samples, generator=g, device=dev)

    def refine_masks(self, masks, weights, completions: torch.Tensor, order: torch.Tensor):
        """SML (``daca.likelihood=sml``): base masks (B, M, N) → K groups (B, K·M, N), strata (B, L) or None.
        completions (B, L) ids; order (B, L) the sampler's decode order."""
        d = self.daca
        if d.likelihood != "sml":
            return masks, weights, None
        valid = likelihood.completion_mask(completions, self.eos_id)  # (B, L)
        K = d.sml_strata
        strata = (torch.zeros_like(valid, dtype=torch.long) if K == 1 else  # K = 1 draws nothing
                  likelihood.assign_strata(valid, K, d.sml_partition, order=order, generator=self.gen_masks))
        strata = torch.where(valid, strata, torch.full_like(strata, -1))
        m, w = likelihood.stratify(masks, weights, strata, K, chain=d.sml_mode == "chain")
        return m, w, strata

    def log_probs(self, ids, masks, weights):
        """Per-token estimates (n, L) for rows of a rollout (grad follows the caller's mode), under the rollout's
        sampling distribution softmax(logits / dllm.temperature); a block-causal policy (``block_size``) scores each
        block with the exact clean prefix (:mod:`.block_likelihood`)."""
        if getattr(self.policy, "block_size", 0):
            return block_token_log_probs(self.policy, ids, masks, weights, self.mask_id, self.policy.block_size,
                                         temperature=self.d.temperature)
        return likelihood.token_log_probs(self.policy, ids, masks, weights, self.mask_id,
                                          temperature=self.d.temperature)

    def estimate(self, ids, masks, weights, groups: int = 1):
        """ℓ (n, L) summed over ``groups`` consecutive slices of the forwards (one batched forward per group)."""
        M = masks.shape[1] // groups
        out = None
        for k in range(groups):
            lp = self.log_probs(ids, masks[:, k * M:(k + 1) * M], weights[:, k * M:(k + 1) * M])
            out = lp if out is None else out + lp
        return out

    def score_rollout(self, sequences: torch.Tensor, L: int, order: torch.Tensor,
                      commit_step: torch.Tensor | None = None) -> dict:
        """Masks for a fresh rollout of sequences (B, P+L), and ℓ_old (ℓ_ref when β > 0) under them, no grad.
        → {"masks", "mask_weights", "strata", "groups", "log_probs", "ref_log_probs"}."""
        B, N = sequences.shape
        P = N - L
        masks, mweights = self.draw_masks(B, P, L, sequences[:, P:], commit_step)
        masks, mweights, strata = self.refine_masks(masks, mweights, sequences[:, P:], order)
        G = 1 if strata is None else self.daca.sml_strata
        rows = chunks(torch.arange(B, device=sequences.device), self.ctx.micro_batch_size)
        with torch.no_grad():
            if self.method["objective"] == "grpo":
                old = torch.cat([self.estimate(sequences[i], masks[i], mweights[i], G) for i in rows])
            else:  # ratio-free objectives (spg, wd1) never read ℓ_old: no forwards spent on it
                old = torch.zeros(B, L, device=sequences.device)
            ref = None
            if self.ctx.beta > 0:
                with self.policy.reference():
                    ref = torch.cat([self.estimate(sequences[i], masks[i], mweights[i], G) for i in rows])
        return {"masks": masks, "mask_weights": mweights, "strata": strata, "groups": G, "log_probs": old,
                "ref_log_probs": ref}

    # ------------------------------------------------------------------ gradient
    def token_loss(self, ro: Rollout, idx: torch.Tensor, sl: slice):
        """Per-token loss (n, L) of rows ``idx`` under the forwards ``sl`` (one SML group), with grad, and the
        detached terms {"ratio", "clipped", "kl"} (ratio-free objectives report ratio 1, clipped False)."""
        tj: TokenTrajectory = ro.traj
        ids, masks, mw = tj.sequences[idx], tj.masks[idx][:, sl], tj.mask_weights[idx][:, sl]
        ref = None if tj.ref_log_probs is None else tj.ref_log_probs[idx]
        tw = None if tj.token_weights is None else tj.token_weights[idx]
        adv = tj.records["value_advantage"][idx] if "value_advantage" in tj.records else ro.advantages[idx]
        ctx, obj = self.ctx, self.method["objective"]  # per-token advantages: dllm.trace_value (trace_critic)
        if obj == "grpo":
            lp = self.log_probs(ids, masks, mw)  # (n, L) with grad
            return grpo_token_loss(lp, tj.log_probs[idx], adv, ctx.clip_range, ref_log_prob=ref, beta=ctx.beta,
                                   token_weights=tw)
        if obj == "spg":
            L = mw.shape[-1]
            lpf = likelihood.forward_log_probs(self.policy, ids, masks, L, self.mask_id,
                                               temperature=self.d.temperature)  # (n, M, L) with grad
            valid = likelihood.completion_mask(ids[:, -L:], self.eos_id)  # (n, L)
            bound = spg.sandwich(lpf, masks, valid, adv, negative=self.d.spg_negative, beta=self.d.spg_beta,
                                 mix_weight=self.d.spg_mix_weight)  # (n, L)
            loss, lp = spg.spg_token_loss(bound, adv, tw), bound
        else:  # wd1
            lp = self.log_probs(ids, masks, mw)  # (n, L) with grad
            coef = wd1.wd1_coefficients(ro.advantages, ro.group_ids, ro.valid)[idx]  # (n,)
            loss = wd1.wd1_token_loss(lp, coef, tw)
        kl = torch.zeros_like(loss)
        if ctx.beta > 0 and ref is not None:
            kl = k3_kl(lp, ref.detach())
            loss = loss + ctx.beta * kl
        return loss, {"ratio": torch.ones_like(loss).detach(), "clipped": torch.zeros_like(loss, dtype=torch.bool),
                      "kl": kl.detach()}

    def backward(self, ro: Rollout, epoch: int = 0) -> EngineStats:
        """Accumulate ∇ Σ w·L into ``.grad`` (the caller zeroed it). Masks come from the rollout.

        Every row with a unit to run (``ro.selected``: under data parallelism every planned token of every row
        while some rank trains, filtered ones at weight 0) makes its forwards and backwards, and only the last
        backward syncs gradients. Metrics count the trained tokens (``ro.trained``)."""
        ctx = self.ctx
        tj: TokenTrajectory = ro.traj
        G = tj.groups
        Mg = tj.masks.shape[1] // G  # forwards per group
        group = None if tj.strata is None else tj.strata.clamp_min(0)  # (B, L): the group scoring each token
        n_clip = n_tok = kl_sum = ratio_sum = ratio_dev = n_out = 0.0
        with engine_run(ctx, self.name) as stats:
            rows = torch.nonzero(ro.selected.any(1)).flatten()
            work = [(i, k) for i in chunks(rows, ctx.micro_batch_size) for k in range(G)]
            for j, (idx, k) in enumerate(work):
                sl = slice(k * Mg, (k + 1) * Mg)  # group k: tokens of stratum k depend on these forwards only
                with contextlib.nullcontext() if j == len(work) - 1 else ctx.no_sync():  # sync once, at the end
                    loss, terms = self.token_loss(ro, idx, sl)
                    lw, sel = ro.loss_weights[idx], ro.trained[idx]
                    if group is not None and G > 1:
                        in_k = group[idx] == k  # (n, L)
                        lw, sel = torch.where(in_k, lw, torch.zeros_like(lw)), sel & in_k
                    aggregate(loss, lw).backward()
                record_backward(stats, len(idx) * Mg)
                n_tok += float(sel.sum())
                n_clip += float((terms["clipped"] & sel).sum())
                kl_sum += float((terms["kl"] * sel).sum())
                ratio_sum += float((terms["ratio"] * sel).sum())
                n_out += float((((terms["ratio"] - 1).abs() > ctx.clip_range) & sel).sum())
                if sel.any():
                    ratio_dev = max(ratio_dev, float((terms["ratio"][sel] - 1).abs().max()))
        n = max(n_tok, 1.0)
        stats.metrics.update({"clip_ratio": n_clip / n, "kl": kl_sum / n, "ratio_mean": ratio_sum / n,
                              "ratio_max_dev": ratio_dev, "trained_tokens": n_tok, **tj.token_weight_stats})
        if epoch == 0 and "replay_log_conf" in tj.records:  # rollout–train consistency (diffgrpo.consistency)
            stats.metrics.update(consistency.token_metrics(tj.records["confidence"], tj.records["replay_log_conf"],
                                                           tj.records["replay_third"], n_out / n, ctx.clip_range))
        return stats


__all__ = ["METHODS", "TokenContext", "TokenGRPO", "forwards_per_estimate", "grpo_token_loss", "k3_kl"]
