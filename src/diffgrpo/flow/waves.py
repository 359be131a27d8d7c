"""Rollout waves of the flow family: a batch sampled in parts of complete groups (``Engine.wave_size``), each
wave's first-update gradient accumulated before the next wave samples, so only one wave's retained graphs are
alive at a time; the wave rollouts are merged for the metrics and later inner epochs."""
from __future__ import annotations

import torch

from ..types import BatchPlan, FlowTrajectory, Rollout


def split_waves(plan: BatchPlan, groups_per_wave: int) -> list[BatchPlan]:
    """Sub-plans of ``groups_per_wave`` complete groups each (in batch order); [plan] if one wave suffices.
    Each sub-plan carries ``wave`` = (the whole batch's selected (B_all, T), its rows (B,)) for the loss weights."""
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
                               metadata=[plan.metadata[i] for i in rows.tolist()] if plan.metadata else [],
                               sde_mask=None if plan.sde_mask is None else plan.sde_mask[dev_rows],
                               engine_state=plan.engine_state, wave=(plan.selected, dev_rows)))
    return waves


def merge_rollouts(ros: list[Rollout]) -> Rollout:
    """Concatenate wave rollouts along the batch (for metrics and later inner epochs, which recompute).

    Advantage statistics are the waves' averaged by their number of groups (clip fraction by valid samples)."""
    if len(ros) == 1:
        return ros[0]
    cat = lambda get: torch.cat([get(r) for r in ros])  # noqa: E731
    t0 = ros[0].traj
    traj = FlowTrajectory(cond={k: cat(lambda r: r.traj.cond[k]) for k in t0.cond}, sigmas=t0.sigmas,
                          xs=cat(lambda r: r.traj.xs), velocities=cat(lambda r: r.traj.velocities),
                          log_probs=cat(lambda r: r.traj.log_probs), noise=cat(lambda r: r.traj.noise),
                          images=None if t0.images is None else cat(lambda r: r.traj.images))
    n_groups = [float(len(r.group_ids.unique())) for r in ros]
    n_valid = [float(r.valid.sum()) for r in ros]
    stats = {"frac_reward_zero_std": sum(n * r.advantage_stats["frac_reward_zero_std"] for n, r in zip(n_groups, ros))
             / max(sum(n_groups), 1.0),
             "adv_clip_frac": sum(n * r.advantage_stats["adv_clip_frac"] for n, r in zip(n_valid, ros))
             / max(sum(n_valid), 1.0),
             "num_invalid": sum(int(r.advantage_stats["num_invalid"]) for r in ros),
             "trained_units": sum(r.advantage_stats["trained_units"] for r in ros)}
    return Rollout(prompts=sum((r.prompts for r in ros), []), group_ids=cat(lambda r: r.group_ids), traj=traj,
                   selected=cat(lambda r: r.selected), trained=cat(lambda r: r.trained),
                   rewards=cat(lambda r: r.rewards),
                   reward_components={k: cat(lambda r: r.reward_components[k]) for k in ros[0].reward_components},
                   valid=cat(lambda r: r.valid), advantages=cat(lambda r: r.advantages),
                   loss_weights=cat(lambda r: r.loss_weights), batch_rewards=cat(lambda r: r.batch_rewards),
                   advantage_stats=stats, metadata=sum((r.metadata for r in ros), []),
                   timings={k: sum(r.timings.get(k, 0.0) for r in ros) for k in ros[0].timings})
