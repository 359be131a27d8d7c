"""The GRPO loss weights of a scored batch, for every family: one function, one set of rules.

From the rewards of this rank's B samples and the (B, N) units planned for training (N = sampling steps of a
flow model, completion tokens of a masked LM) it forms

  advantages  group-relative, with statistics over EVERY rank's samples (rewards and group ids all-gathered;
              rank r's rows are r·B … r·B+B−1 of the gathered batch), non-finite rewards excluded;
  trained     planned units of samples with a finite reward (and a non-zero advantage under ``filter_zero_std``);
  weights     ``losses.aggregation_weights`` over the trained units of every rank (and of the whole batch when it
              is rolled out in waves), times optional per-sample weights (e.g. Flash-GRPO's rectification),
              times the world size W, because DDP and FSDP2 AVERAGE gradients over ranks and × W makes that
              average the one-process sum;
  selected    the units the engine runs. Data parallel: when some rank trains, every rank runs all of its
              planned units (filtered ones at weight 0, adding nothing) so that the gradient collectives pair up
              across ranks; when no rank trains, all skip together. In one process: the trained units.

Exact: in one process without waves the weights are ``aggregation_weights(trained, mode, sample_weights)``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import distributed
from .advantages import group_advantages, per_reward_advantages
from .config import AdvantageConfig
from .diversity import gardo
from .losses import aggregation_weights


@dataclass
class GRPOWeights:
    advantages: torch.Tensor  # (B,)
    valid: torch.Tensor  # (B,) bool: finite reward
    trained: torch.Tensor  # (B, N) bool: units whose loss counts
    selected: torch.Tensor  # (B, N) bool: units the engine runs (see the module docstring)
    loss_weights: torch.Tensor  # (B, N)
    batch_rewards: torch.Tensor  # (W·B,) every rank's rewards
    stats: dict[str, float]  # advantage statistics (frac_reward_zero_std, adv_clip_frac, …, trained_units: all ranks')
    kl_weights: torch.Tensor | None = None  # (B,) per-sample weight of the KL term (None: every sample 1)


def grpo_loss_weights(rewards: torch.Tensor, group_ids: torch.Tensor, planned: torch.Tensor, *, adv_cfg: AdvantageConfig,
                      aggregation: str, world: distributed.WorldInfo, spread: bool = False,
                      std_mode: str | None = None, baseline: str | None = None,
                      sample_weights: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
                      wave: tuple | None = None, components: dict | None = None, log=print,
                      bonus: torch.Tensor | None = None, subset: torch.Tensor | None = None,
                      adjust: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      kl_gate: float = 0.0) -> GRPOWeights:
    """rewards (B,), group_ids (B,), planned (B, N) bool → :class:`GRPOWeights` (tensors on ``planned``'s device).

    ``adv_cfg``: the ``advantage`` config section (clip, eps, filter_zero_std, and std_mode / baseline unless
    given). ``sample_weights(trained (B, N)) -> (B,) | None`` per-sample multipliers computed from the trained
    units. ``wave``: (whole batch's planned (B_all, N), this wave's rows (B,)) when the batch is rolled out in
    waves: the normaliser then counts the whole batch's planned units (samples dropped in other waves count as
    planned), so that the waves sum to the one-wave objective. ``components``: {name: (weight, scores (B,))} of a
    weighted sum of rewards, normalised one by one (``advantages.per_reward_advantages``) when
    ``adv_cfg.per_reward_norm``. Diversity objectives (``diversity.compose``): ``bonus`` (B,) added to the rewards
    the advantages are formed from (``batch_rewards`` stay the scored ones), ``subset`` (B,) bool: the samples that
    enter the statistics and the loss, ``adjust``: this rank's advantages (B,) → (B,); ``kl_gate`` > 0: GARDO's
    gate (``diversity.gardo.kl_gate_weights``) over EVERY rank's samples, this rank's rows as ``kl_weights``
    (0 = None, the KL term as it is). A collective when W > 1 (every rank calls it).
    """
    W, rank, B = world.world_size, world.rank, len(rewards)
    dev = planned.device
    valid = torch.isfinite(rewards)
    all_rewards, all_gids = rewards, group_ids.cpu()
    if W > 1:
        all_rewards, all_gids = distributed.gather_groups(rewards, all_gids, spread=spread)
    shaped, in_stats = _diversity_inputs(all_rewards, group_ids, bonus, subset, W > 1, spread)
    kw = dict(valid=in_stats, std_mode=std_mode or adv_cfg.std_mode,
              baseline=baseline or adv_cfg.baseline, clip=adv_cfg.clip, eps=adv_cfg.eps, std=adv_cfg.std)
    if adv_cfg.per_reward_norm and components:
        scores = torch.stack([v.float().cpu() for _, v in components.values()])  # (K, B)
        if W > 1:
            scores = torch.stack([distributed.gather_groups(s, group_ids.cpu(), spread=spread)[0] for s in scores])
        w_k = torch.tensor([float(w) for w, _ in components.values()])
        adv, stats = per_reward_advantages(scores.to(all_rewards.device), w_k.to(all_rewards.device), all_gids, **kw)
    else:
        adv, stats = group_advantages(shaped, all_gids, **kw)
    kl_w = None
    if kl_gate > 0:  # over the whole (W·B,) batch, before this rank's slice and adjustment
        kl_w = gardo.kl_gate_weights(adv, in_stats, kl_gate)
        stats["diversity/kl_gated_share"] = float(kl_w[in_stats].mean()) if bool(in_stats.any()) else 0.0
        kl_w = (kl_w[rank * B:(rank + 1) * B] if W > 1 else kl_w).to(dev)
    adv = adv[rank * B:(rank + 1) * B] if W > 1 else adv
    if adjust is not None:
        adv = adjust(adv)
    keep = valid.clone()
    if subset is not None:
        keep &= subset.to(keep.device)
    if adv_cfg.filter_zero_std:
        keep &= adv != 0
    if int((~valid).sum()):
        log(f"warning: {int((~valid).sum())} sample(s) had a non-finite reward and are excluded "
            "from the statistics and the loss")
    trained = planned & keep.to(dev).unsqueeze(1)  # (B, N)
    sw = sample_weights(trained) if sample_weights is not None else None  # (B,) or None
    full, rows = wave if wave is not None else (trained, torch.arange(B, device=dev))
    full = full.clone()
    full[rows] = trained
    full_sw = None
    if sw is not None:
        full_sw = torch.ones(full.shape[0], device=sw.device)
        full_sw[rows] = sw
    if W > 1:  # the normaliser counts every rank's trained units
        rows = rows + rank * full.shape[0]
        full = distributed.all_gather(full.to(torch.uint8)).bool()
        full_sw = None if full_sw is None else distributed.all_gather(full_sw.float())
    weights = aggregation_weights(full, aggregation, full_sw)[rows] * W  # (B, N)
    n_trained = trained.sum().reshape(1).float()
    if W > 1:
        n_trained = distributed.all_gather(n_trained)  # (W,): every rank's trained units
    stats = {**stats, "trained_units": float(n_trained.sum())}
    # some rank trains: every rank runs its planned units (filtered ones at weight 0) so collectives pair up
    selected = planned if (W > 1 and bool(full.any())) else trained
    return GRPOWeights(advantages=adv.to(dev), valid=valid.to(dev), trained=trained, selected=selected,
                       loss_weights=weights, batch_rewards=all_rewards, stats=stats, kl_weights=kl_w)


def _diversity_inputs(all_rewards: torch.Tensor, group_ids: torch.Tensor, bonus: torch.Tensor | None,
                      subset: torch.Tensor | None, gather: bool, spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(W·B,) rewards the advantages are formed from (with ``bonus``) and the samples in their statistics (finite,
    and in ``subset``); this rank's (B,) bonus and subset gathered like the rewards."""
    def every_rank(x: torch.Tensor) -> torch.Tensor:
        x = x.to(all_rewards.device).float()
        return distributed.gather_groups(x, group_ids.cpu(), spread=spread)[0] if gather else x

    valid = torch.isfinite(all_rewards)
    shaped = all_rewards if bonus is None else all_rewards + every_rank(bonus)
    if subset is not None:
        valid = valid & (every_rank(subset) > 0)
    return shaped, valid


def apply(ro, w: GRPOWeights) -> None:
    """Write ``w`` into the rollout ``ro``'s GRPO fields."""
    ro.advantages, ro.valid, ro.trained, ro.selected = w.advantages, w.valid, w.trained, w.selected
    ro.loss_weights, ro.batch_rewards, ro.advantage_stats = w.loss_weights, w.batch_rewards, w.stats
    ro.kl_weights = w.kl_weights


__all__ = ["GRPOWeights", "grpo_loss_weights", "apply"]
