"""Rollout savings: shared deterministic prefix (exact, counted), the MixGRPO sliding SDE window, the cheap tail."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from diffgrpo.config import ConfigError, RunConfig
from diffgrpo.engines.single_step import SingleStepState
from diffgrpo.samplers import savings
from diffgrpo.samplers.rollout import sample_trajectories

KERNEL = dict(sde_type="flow_sde", noise_level=0.7, reduce="mean", cps_flowgrpo_compat=False)


def _grouped_batch(trainer, G: int, n_groups: int, seed: int = 0):
    """n_groups prompts × G samples, x0 shared inside each group → (cond, x0 (B, *S), group_ids (B,))."""
    pol = trainer.policy
    prompts = [f"a handwritten digit {d}" for d in range(n_groups) for _ in range(G)]
    group_ids = torch.arange(n_groups).repeat_interleave(G)
    g = torch.Generator().manual_seed(seed)
    x0 = torch.randn(n_groups, *pol.latent_shape, generator=g)[group_ids]
    return pol.encode(prompts), x0, group_ids


def _sample(trainer, cond, x0, sde_mask, seed, **kw):
    pol = trainer.policy
    before = pol.counters["forwards_nograd"]
    out = sample_trajectories(pol, cond, x0, trainer.family.sigmas, kernel=KERNEL,
                              generator=torch.Generator().manual_seed(seed), sde_mask=sde_mask, **kw)
    return out, pol.counters["forwards_nograd"] - before


@pytest.mark.parametrize("mode", ["one_step", "late_window"])
def test_shared_prefix_equals_unshared_and_saves_exactly(make_trainer, mode):
    tr = make_trainer()
    T = tr.cfg.sampler.num_steps  # 6
    G, n_groups = 4, 3
    cond, x0, gid = _grouped_batch(tr, G, n_groups)
    B = G * n_groups
    k_group = torch.tensor([0, 2, 4])  # each group's first stochastic step
    sde = torch.zeros(B, T, dtype=torch.bool)
    for i in range(B):
        k = int(k_group[gid[i]])
        if mode == "one_step":
            sde[i, k] = True
        else:  # an SDE window that starts late (and a row that starts one step later still shares only k)
            sde[i, k:T - 1] = True
    if mode == "late_window":
        sde[1, 0] = False  # group 0: rows differ, the group shares min over its rows = 0 steps
    full, n_full = _sample(tr, cond, x0, sde, seed=7)
    shared, n_shared = _sample(tr, cond, x0, sde, seed=7, share_groups=gid)
    for key in ("xs", "velocities", "log_probs", "noise"):
        torch.testing.assert_close(shared[key], full[key], msg=key)
    expected = sum(G * T - (int(k) + G * (T - int(k))) for k in k_group)  # G·T − (k + G·(T−k)) per group
    assert n_full == B * T and full["saved_forwards"] == 0
    assert n_full - n_shared == expected == shared["saved_forwards"]


def test_shared_prefix_needs_equal_noise(make_trainer):
    """Rows of a group with different x0 are not identical: nothing is shared, nothing is saved."""
    tr = make_trainer()
    T = tr.cfg.sampler.num_steps
    cond, x0, gid = _grouped_batch(tr, 3, 2)
    x0 = x0 + 0.01 * torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    sde = torch.zeros(len(gid), T, dtype=torch.bool)
    sde[:, 3] = True
    full, n_full = _sample(tr, cond, x0, sde, seed=3)
    shared, n_shared = _sample(tr, cond, x0, sde, seed=3, share_groups=gid)
    assert n_shared == n_full and shared["saved_forwards"] == 0
    torch.testing.assert_close(shared["xs"], full["xs"])


@pytest.mark.parametrize("evaluation", ["recompute", "retain"])
def test_single_step_shared_prefix_counts(make_trainer, evaluation):
    """single_step's iso-temporal groups: the trainer's rollout saves Σ_g (G−1)·k_g forwards, and trains."""
    tr = make_trainer("engine.name=single_step", "sampler.shared_prefix=true", f"engine.evaluation={evaluation}",
                      "train.group_size=4", "engine.candidate_steps=all")
    T, G = tr.cfg.sampler.num_steps, 4
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    k = ro.traj.engine_state.k if isinstance(ro.traj.engine_state, SingleStepState) else None
    per_group = {int(g): int(k[i]) for i, g in enumerate(ro.group_ids)}
    expected = sum(G * T - (kg + G * (T - kg)) for kg in per_group.values())
    assert tr.policy.counters["forwards_saved"] - c0.get("forwards_saved", 0) == expected
    ran = (tr.policy.counters["forwards_nograd"] + tr.policy.counters["forwards_grad"]
           - c0["forwards_nograd"] - c0["forwards_grad"])
    assert ran == len(ro.prompts) * T - expected
    for g in per_group:  # a group's samples are identical up to its stochastic step, and differ after it
        rows = (ro.group_ids == g).nonzero().flatten()
        kg = per_group[g]
        assert torch.equal(ro.traj.xs[rows, :kg + 1], ro.traj.xs[rows[:1], :kg + 1].expand_as(ro.traj.xs[rows, :kg + 1]))
        assert not torch.allclose(ro.traj.xs[rows[0], kg + 1], ro.traj.xs[rows[1], kg + 1])
    stats = tr.backward(ro)
    assert stats.sample_backwards == len(ro.prompts)


# ---------------------------------------------------------------------- sliding SDE window (MixGRPO)
def _mixgrpo_reference(iterations: int, *, start, size, k_max, every, stride, roll_back):
    """Stateful simulation of MixGRPO's progressive schedule: shift by ``stride`` after every ``every``
    iterations; past the last window position, roll back to the left boundary (or hold at the end)."""
    last = k_max - size
    cur, out = start, []
    for it in range(iterations):
        out.append(cur)
        if (it + 1) % every == 0:
            cur += stride
            if cur > last:
                cur = start if roll_back else last
    return out


@pytest.mark.parametrize("start,size,every,stride,roll_back", [(0, 3, 2, 1, True), (1, 2, 3, 2, True),
                                                                (0, 4, 1, 1, False)])
def test_sliding_window_schedule(start, size, every, stride, roll_back):
    k_max = 9
    ref = _mixgrpo_reference(30, start=start, size=size, k_max=k_max, every=every, stride=stride, roll_back=roll_back)
    got = [savings.sliding_window_start(i, start=start, size=size, k_max=k_max, every=every, stride=stride,
                                        roll_back=roll_back) for i in range(30)]
    assert got == ref


def test_sliding_window_in_the_trainer(make_trainer):
    """steps.window_shift_every moves the trained window each iteration; ODE (no noise, log-prob 0) outside."""
    tr = make_trainer("steps.mode=window", "steps.window_start=0", "steps.window_size=2", "steps.window_shift_every=1",
                      "steps.ode_outside=true")
    T = tr.cfg.sampler.num_steps
    starts = []
    for _ in range(5):
        ro = tr.rollout()
        cols = ro.selected.any(0).nonzero().flatten().tolist()
        starts.append(cols[0])
        assert cols == [cols[0], cols[0] + 1]
        off = ~ro.selected
        assert torch.all(ro.traj.noise[off] == 0) and torch.all(ro.traj.log_probs[off] == 0)
        assert torch.all(ro.traj.log_probs[ro.selected] != 0)
    assert starts == [0, 1, 2, 3, 0]  # T = 6: windows of 2 start at 0 … 3, then roll back
    assert T == 6


def test_sliding_window_config_errors():
    with pytest.raises(ConfigError, match="steps.window_shift_every"):
        RunConfig.from_overrides(["steps.window_shift_every=2"])
    with pytest.raises(ConfigError, match="steps.window_shift_every"):
        RunConfig.from_overrides(["steps.mode=window", "steps.window_shift_every=2"])  # random start per sample
    with pytest.raises(ConfigError, match="sampler.tail_solver"):
        RunConfig.from_overrides(["sampler.tail_solver=rk4"])


# ---------------------------------------------------------------------- cheap tail
def test_tail_with_every_step_equals_full_rollout(make_trainer):
    """Euler over all remaining grid points is the full ODE tail: same sample, nothing saved; one tail step
    saves T − s − 1 forwards per row and changes the sample."""
    tr = make_trainer()
    T = tr.cfg.sampler.num_steps
    cond, x0, gid = _grouped_batch(tr, 2, 2)
    B = len(gid)
    sde = torch.zeros(B, T, dtype=torch.bool)
    sde[torch.arange(B), torch.tensor([0, 1, 1, 2])] = True
    start = savings.tail_starts(T, sde, None, stochastic_kernel=True, batch=B)
    assert start.tolist() == [1, 2, 2, 3]
    full, n_full = _sample(tr, cond, x0, sde, seed=5)
    same, n_same = _sample(tr, cond, x0, sde, seed=5, tail_start=start, tail_solver="euler", tail_steps=T)
    torch.testing.assert_close(same["xs"][:, -1], full["xs"][:, -1])
    assert same["saved_forwards"] == 0 and n_same == n_full
    for i, s in enumerate(start.tolist()):  # the stochastic part is untouched
        torch.testing.assert_close(same["xs"][i, :s + 1], full["xs"][i, :s + 1])
        torch.testing.assert_close(same["log_probs"][i], full["log_probs"][i])
    cheap, n_cheap = _sample(tr, cond, x0, sde, seed=5, tail_start=start, tail_solver="euler", tail_steps=1)
    expected = sum(T - s - 1 for s in start.tolist())
    assert cheap["saved_forwards"] == expected == n_full - n_cheap
    assert not torch.allclose(cheap["xs"][:, -1], full["xs"][:, -1])
    assert torch.isnan(cheap["xs"][0, 2:T]).all() and torch.isfinite(cheap["xs"][:, -1]).all()


def test_heun_tail_against_closed_form():
    """Heun on v(x, σ) = a·x + σ over one interval [σ0, σ1 > 0] equals the trapezoid predictor–corrector."""
    a = 0.3
    def vel(x, s):
        return a * x + s.reshape(-1, 1)
    x = torch.tensor([[1.0, -2.0]])
    sub = torch.tensor([0.8, 0.5])
    got, calls = savings.solve_tail(vel, x, sub, "heun")
    dt = -0.3
    v1 = a * x + 0.8
    xp = x + dt * v1
    v2 = a * xp + 0.5
    torch.testing.assert_close(got, x + dt * (v1 + v2) / 2)
    assert calls == 2
    _, calls0 = savings.solve_tail(vel, x, torch.tensor([0.5, 0.0]), "heun")  # into σ = 0: Euler, one call
    assert calls0 == 1


def test_tail_refuses_grad_steps_inside(make_trainer):
    tr = make_trainer()
    T = tr.cfg.sampler.num_steps
    cond, x0, _ = _grouped_batch(tr, 2, 1)
    grad = torch.zeros(2, T, dtype=torch.bool)
    grad[:, 3] = True
    with pytest.raises(ValueError, match="tail"):
        sample_trajectories(tr.policy, cond, x0, tr.family.sigmas, kernel=KERNEL, grad_mask=grad,
                            on_grad_step=lambda *a: None, tail_start=torch.tensor([2, 2]), tail_solver="euler")


def test_trainer_with_tail_and_prefix_trains(make_trainer):
    """MixGRPO-style run with every saving on: the counters add up and an update is finite."""
    tr = make_trainer("steps.mode=window", "steps.window_start=2", "steps.window_size=2", "steps.ode_outside=true",
                      "sampler.shared_prefix=true", "sampler.tail_solver=heun", "sampler.tail_steps=1")
    T, B = tr.cfg.sampler.num_steps, 6
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    ran = tr.policy.counters["forwards_nograd"] - c0["forwards_nograd"]
    # prefix: 2 steps shared by 3 samples in each of 2 groups → 2·2·2 saved; tail from step 4: 2 steps, Heun into
    # σ = 0 over one interval is Euler → 1 call instead of 2 per row
    assert tr.policy.counters["forwards_saved"] - c0.get("forwards_saved", 0) == 8 + 6 == B * T - ran
    row = tr.step()
    assert torch.isfinite(torch.tensor(row["loss"]))
    assert torch.isfinite(ro.traj.xs[:, -1]).all()


def test_sliding_window_clock_survives_a_checkpoint(make_trainer):
    """The window position is part of the saved state: a resumed run continues the schedule."""
    over = ("steps.mode=window", "steps.window_start=0", "steps.window_size=2", "steps.window_shift_every=1",
            "steps.ode_outside=true")
    tr = make_trainer(*over)
    tr.rollout(), tr.rollout()
    st = tr.state()
    expected = tr.rollout().selected
    fresh = make_trainer(*over)
    fresh.load_state(dataclasses.replace(st, iteration=2))
    assert torch.equal(fresh.rollout().selected, expected)
    assert bool(expected[:, 2:4].all()) and not bool(expected[:, :2].any())
