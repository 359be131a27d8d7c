"""The rollout–train consistency check: does the first update see the likelihood the rollout recorded?

On the first update after a rollout θ = θ_old, so an update that recomputes the log-likelihood of a sampled unit
must find the value the rollout recorded. A difference means rollout and update run different computations (a
guidance scale dropped between them, another noise record than the one the rollout drew, a bf16 or compiled rollout
against an fp32 update, an approximate key/value cache) and the ratio of the update starts away from 1.

What is measured, per iteration, on the units whose likelihood the first update recomputes:

  flow      per (sample, step) pair: ℓ_old the rollout recorded (``FlowTrajectory.log_probs``, the per-step
            Gaussian log-prob of the taken transition, ``sampler.logprob_reduce`` as configured) against the step
            density the first update evaluates on a fresh forward at θ_old (``recompute_pairs``: recompute,
            every engine's exact pairs, jagg's window endpoints). No extra forward: the update computes both.
            Pairs the update trains on the rollout's own velocity (retain's and single_step's kept graphs, jagg's
            interior steps) are not measured (their Δ is 0 by construction); the forward-process engines (nft,
            awm, dgpo) have no per-step log-prob ratio. Where no pair is measured the row logs
            ``consistency/applies = 0`` and nothing else.
  masked LM per completion token: the log-probability of the committed token the decoder recorded at its commit
            step (``confidence``, under softmax(logits) of that step's forward: cached forwards included) against
            a full forward at θ_old of the same decoding state (the completion positions committed at or after
            that step masked). Replayed for one step per third of the decoding steps after the rollout
            (:func:`replay_steps`): 3 no-grad sequence-forwards per completion per iteration. The out-of-clip
            fraction is of the first update's per-token ratios exp(ℓ − ℓ_old) of the configured estimator.

Keys (``PREFIX``): ``applies`` (1 measured, 0 the check does not apply), ``pairs`` (units measured),
``abs_dlogp_mean`` / ``abs_dlogp_max`` (|Δ log p|), ``dlogp_over_clip`` (``abs_dlogp_mean`` / ε), ``out_of_clip_frac`` (units whose first-update ratio lies
outside [1 − ε, 1 + ε], ε the configured clip range), and ``<bucket>/abs_dlogp_mean`` for the early / middle / late
third of the sampling steps. Exact configurations read 0 (bitwise on CPU, where rollout and update forward the same
batch). ``train.on_inconsistency`` (warn | stop | off) acts when ``dlogp_over_clip`` exceeds
``train.max_inconsistency`` (:func:`judge`): the mean unit's log-ratio at the first update is that fraction of the
way to the clip edge (ε = ``loss.clip_range``, FlowGRPO's 1e-4 on a mean-reduced step density; ``dllm.clip_range``
for masked LMs), a scale that follows the loss rather than the model's size.
"""
from __future__ import annotations

import math

import torch

from .samplers import masked

PREFIX = "consistency/"
BUCKETS = ("early", "middle", "late")
MODES = ("warn", "stop", "off")
FIRST = "first_epoch/"


def bucket(step: int, num_steps: int) -> int:
    """The third (0 early, 1 middle, 2 late) of ``num_steps`` sampling steps that step ``step`` falls in."""
    return min(3 * step // max(num_steps, 1), 2)


def replay_steps(num_steps: int) -> list[int]:
    """One decoding step per third of ``num_steps``: the middle step of each third (distinct, ascending)."""
    return sorted({min((2 * b + 1) * num_steps // 6, num_steps - 1) for b in range(3)}) if num_steps > 0 else []


def not_applicable() -> dict[str, float]:
    return {PREFIX + "applies": 0.0}


def summarize(delta: torch.Tensor, buckets: torch.Tensor, outside: torch.Tensor, clip_range: float) -> dict[str, float]:
    """Metrics of measured units: |Δ log p| ``delta`` (n,), their third ``buckets`` (n,) long, and ``outside`` (n,)
    bool (ratio outside the clip range ε at the first update). n = 0: the check does not apply."""
    n = delta.numel()
    if n == 0:
        return not_applicable()
    d = delta.double()
    out = {PREFIX + "applies": 1.0, PREFIX + "pairs": float(n), PREFIX + "abs_dlogp_mean": float(d.mean()),
           PREFIX + "abs_dlogp_max": float(d.max()), PREFIX + "out_of_clip_frac": float(outside.double().mean()),
           PREFIX + "dlogp_over_clip": float(d.mean()) / clip_range if clip_range > 0 else float("inf")}
    for b, name in enumerate(BUCKETS):
        sel = buckets == b
        if bool(sel.any()):
            out[f"{PREFIX}{name}/abs_dlogp_mean"] = float(d[sel].mean())
    return out


class Tally:
    """Measured units of one update, gathered chunk by chunk (detached; float64 |Δ|)."""

    def __init__(self):
        self.delta, self.buckets, self.outside = [], [], []
        self.clip_range = 0.0

    def add(self, delta: torch.Tensor, buckets: torch.Tensor, outside: torch.Tensor, clip_range: float) -> None:
        self.clip_range = float(clip_range)
        self.delta.append(delta.detach().double().flatten().cpu())
        self.buckets.append(buckets.flatten().long().cpu())
        self.outside.append(outside.flatten().bool().cpu())

    def metrics(self) -> dict[str, float]:
        if not self.delta:
            return not_applicable()
        return summarize(torch.cat(self.delta), torch.cat(self.buckets), torch.cat(self.outside), self.clip_range)


def step_terms(log_prob: torch.Tensor, old_log_prob: torch.Tensor, step: int, num_steps: int,
               clip_range: float) -> dict[str, torch.Tensor]:
    """Per-pair consistency terms of one flow step: log_prob at the update, old_log_prob recorded, each (n,)."""
    d = (log_prob.detach().double() - old_log_prob.double())  # (n,)
    return {"dlogp": d.abs(), "bucket": torch.full_like(d, bucket(step, num_steps), dtype=torch.long),
            "outside": (torch.exp(d) - 1).abs() > clip_range, "clip_range": torch.tensor(float(clip_range))}


def first_update(metrics: dict[str, float]) -> dict[str, float]:
    """The first update's engine metrics as row keys: ``first_epoch/<k>``, and the consistency keys at the top
    level (``consistency/applies = 0`` when the engine measured none)."""
    out = {FIRST + k: v for k, v in metrics.items() if not k.startswith(PREFIX)}
    mine = {k: v for k, v in metrics.items() if k.startswith(PREFIX)}
    return {**out, **(mine or not_applicable())}


def judge(row: dict, mode: str, limit: float) -> str | None:
    """A message when ``row``'s mean |Δ log p| exceeds ``limit`` × ε (``consistency/dlogp_over_clip`` > limit)
    under ``mode`` warn or stop, else None."""
    v = row.get(PREFIX + "dlogp_over_clip")
    if mode == "off" or limit <= 0 or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= limit:
        return None
    frac = row.get(PREFIX + "out_of_clip_frac", float("nan"))
    return (f"rollout and update disagree at iteration {row.get('iteration', '?')}: {PREFIX}abs_dlogp_mean "
            f"{row.get(PREFIX + 'abs_dlogp_mean', float('nan')):.4g} is {v:.3g} × the clip range > "
            f"train.max_inconsistency={limit:g} (max {row.get(PREFIX + 'abs_dlogp_max', float('nan')):.4g}, "
            f"{frac:.1%} of the units outside the clip range at the first update)")


def replay_log_conf(logits_fn, sequences: torch.Tensor, commit_step: torch.Tensor, num_steps: int,
                    mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked LM: log p(committed token) under softmax(logits) of a full forward of the decoding state at each
    step of :func:`replay_steps`, as the sampler scores it. sequences (B, P+L), commit_step (B, L) →
    (log-confidence (B, L) float32, NaN at tokens not committed at a replayed step; their third (B, L) long, −1
    there). No grad; one forward of B rows per replayed step."""
    B, N = sequences.shape
    L = commit_step.shape[1]
    out = torch.full((B, L), float("nan"), device=sequences.device)
    third = torch.full((B, L), -1, dtype=torch.long, device=sequences.device)
    with torch.no_grad():
        for s in replay_steps(num_steps):
            now = commit_step == s  # (B, L); forwarded even when empty (sharded models: every rank calls alike)
            state = sequences.clone()  # the decoder's state entering step s
            state[:, N - L:] = torch.where(commit_step >= s, torch.full_like(commit_step, mask_id), sequences[:, N - L:])
            logits = masked.token_logits(logits_fn(state)[:, N - L:].float(), mask_id)  # (B, L, V)
            p, _, _ = masked.predictive_stats(logits)
            lp = p.gather(-1, sequences[:, N - L:].unsqueeze(-1)).squeeze(-1).log()  # (B, L)
            out = torch.where(now, lp, out)
            third = torch.where(now, torch.full_like(third, bucket(s, num_steps)), third)
    return out, third


def token_metrics(recorded_conf: torch.Tensor, replayed: torch.Tensor, third: torch.Tensor,
                  out_of_clip_frac: float, clip_range: float) -> dict[str, float]:
    """Masked-LM consistency metrics: |Δ log p| between the decoder's recorded confidence (B, L) and the replayed
    log-confidence (B, L) (:func:`replay_log_conf`, with its thirds), and the fraction of trained tokens whose
    first-update ratio lies outside the clip range (counted by the update)."""
    sel = torch.isfinite(replayed)  # (B, L)
    d = (replayed[sel].double() - recorded_conf[sel].double().log()).abs()  # (n,)
    out = summarize(d.cpu(), third[sel].cpu(), torch.zeros(d.shape, dtype=torch.bool), clip_range)
    if out[PREFIX + "applies"]:
        out[PREFIX + "out_of_clip_frac"] = float(out_of_clip_frac)
    return out


__all__ = ["BUCKETS", "MODES", "PREFIX", "Tally", "bucket", "first_update", "judge", "not_applicable",
           "replay_log_conf", "replay_steps", "step_terms", "summarize", "token_metrics"]
