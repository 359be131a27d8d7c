"""The rollout-savings options of a run (``sampler.shared_prefix``, ``sampler.tail_*``, ``steps.window_shift_*``,
``steps.ode_outside``) turned into the flow family's plan and sampler arguments. See ``savings`` for the math."""
from __future__ import annotations

import torch

from ..config import SamplerConfig, StepsConfig
from . import savings


def plan_steps(steps_cfg: StepsConfig, selected: torch.Tensor, iteration: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """selected (B, T) from ``select_steps`` → (selected, sde_mask (B, T) or None) for training iteration
    ``iteration`` (0-based): the MixGRPO sliding window replaces a fixed window when ``window_shift_every`` > 0;
    ``ode_outside`` makes every unselected step an ODE step."""
    B, T = selected.shape
    s = steps_cfg
    if s.mode == "window" and s.window_shift_every > 0 and s.window_start >= 0:
        start = savings.sliding_window_start(iteration, start=s.window_start, size=s.window_size, k_max=T - 1,
                                             every=s.window_shift_every, stride=s.window_shift_stride,
                                             roll_back=s.window_roll_back)
        selected = savings.window_selection(B, T, start, s.window_size, device=selected.device)
    return selected, (selected.clone() if s.ode_outside else None)


def sampler_kwargs(sampler_cfg: SamplerConfig, plan, sigmas: torch.Tensor) -> dict:
    """Extra ``sample_trajectories`` arguments for a plan: shared prefix (group ids) and the cheap tail."""
    s = sampler_cfg
    out: dict = {}
    if s.shared_prefix:
        out["share_groups"] = plan.group_ids
    if s.tail_solver != "full":
        B, T = plan.selected.shape
        out["tail_start"] = savings.tail_starts(T, plan.sde_mask, plan.selected,
                                                stochastic_kernel=s.sde_type != "ode", batch=B,
                                                device=plan.selected.device)
        out["tail_solver"], out["tail_steps"] = s.tail_solver, s.tail_steps
    return out


def count_saved(policy, saved: int) -> None:
    """Add a rollout's saved sample-forwards to ``policy.counters['forwards_saved']`` (× 2 under CFG)."""
    mult = 2 if getattr(policy, "uses_cfg", False) else 1
    policy.counters["forwards_saved"] = policy.counters.get("forwards_saved", 0) + saved * mult
