"""Flash-GRPO ``single_step``: iso-temporal grouping, ODE-but-one-step rollouts, temporal gradient
rectification, and exactness against ``recompute`` on the same rollout."""
from __future__ import annotations

import math

import pytest
import torch

from diffgrpo.config import ConfigError, EngineConfig, RunConfig
from diffgrpo.engines.base import EngineContext, step_loss
from diffgrpo.engines.recompute import RecomputeEngine
from diffgrpo.engines.single_step import (
    SingleStepEngine,
    SingleStepState,
    candidate_steps,
    rectification_factor,
    rectification_weights,
)
from diffgrpo.losses import aggregation_weights
from diffgrpo.samplers import flow_sde
from diffgrpo.types import FlowTrajectory, Rollout
from tests.helpers.tensors import flat_grad, rel_err


# ---------------------------------------------------------------------- rectification
def _c_closed_form(sig: float, sig_next: float, sde_type: str, a: float, compat: bool = False) -> float:
    """|∂μ/∂v| / s written out from the kernel definitions (independent of kernel_coefficients)."""
    delta = sig - sig_next
    if sde_type in ("flow_sde", "dance_sde"):
        if sde_type == "flow_sde":
            tilde = sig_next if sig >= 1 else sig
            eps = a * math.sqrt(sig / (1 - tilde))
        else:
            eps = a
        return delta * (1 + eps**2 * (1 - sig) / (2 * sig)) / (eps * math.sqrt(delta))
    s = sig_next * math.sin(a * math.pi / 2)
    c_v = abs(sig * (1 - sig_next) - sig_next * math.cos(a * math.pi / 2) * (1 - sig))
    return c_v * s if compat else c_v / s


def _per_step_rollout(sde_type: str, a: float, compat: bool, T: int = 10):
    """B = T−1 samples, sample i trained at step i with the same noise ε (equal norm) and advantage 1."""
    g = torch.Generator().manual_seed(0)
    S = (1, 4, 4)
    B = T - 1
    sigmas = flow_sde.sigma_grid(T, 3.0)
    kernel = dict(sde_type=sde_type, noise_level=a, reduce="mean", cps_flowgrpo_compat=compat)
    xs = torch.randn(B, T + 1, *S, generator=g)
    vel = torch.randn(B, T, *S, generator=g)
    eps = torch.randn(*S, generator=g)
    lps = torch.zeros(B, T)
    for i in range(B):
        out = flow_sde.step(vel[i:i + 1, i], sigmas[i], sigmas[i + 1], xs[i:i + 1, i], noise=eps[None], **kernel)
        xs[i, i + 1] = out.prev_sample[0]
        lps[i, i] = flow_sde.step(vel[i:i + 1, i], sigmas[i], sigmas[i + 1], xs[i:i + 1, i],
                                  prev_sample=out.prev_sample, **kernel).log_prob[0]
    selected = torch.zeros(B, T, dtype=torch.bool)
    selected[torch.arange(B), torch.arange(B)] = True
    traj = FlowTrajectory(cond={}, sigmas=sigmas, xs=xs, velocities=vel, log_probs=lps, noise=torch.zeros(B, T, *S),
                          engine_state=SingleStepState(k=torch.arange(B)))
    ro = Rollout(prompts=[""] * B, group_ids=torch.arange(B), traj=traj, selected=selected, advantages=torch.ones(B))
    ctx = EngineContext(policy=None, kernel=kernel)
    return ro, ctx


def _dl_dv_norms(ro, ctx, rectify: bool) -> torch.Tensor:
    """‖∂L/∂v‖ per sample (step), by autograd through step_loss, with the engine's loss weights."""
    eng = SingleStepEngine(EngineConfig(name="single_step", candidate_steps="all", rectify=rectify))
    w = eng.sample_weights(ctx, ro.traj, ro.selected)
    ro.loss_weights = aggregation_weights(ro.selected, "mean", w)
    norms = []
    for i in range(ro.batch_size):
        v = ro.traj.velocities[i:i + 1, i].clone().requires_grad_(True)
        loss, terms = step_loss(ctx, ro, torch.tensor([i]), i, v)
        assert float((terms["ratio"] - 1).abs().max()) < 1e-6
        (g,) = torch.autograd.grad(loss, v)
        norms.append(float(g.norm()))
    return torch.tensor(norms, dtype=torch.float64), w


@pytest.mark.parametrize("sde_type,a,compat", [("flow_sde", 0.7, False), ("dance_sde", 0.7, False),
                                               ("cps", 0.7, False), ("cps", 0.7, True)])
def test_rectification_flattens_dl_dv(sde_type, a, compat):
    ro, ctx = _per_step_rollout(sde_type, a, compat)
    raw, w_off = _dl_dv_norms(ro, ctx, rectify=False)
    assert torch.equal(w_off, torch.ones_like(w_off))
    s = ro.traj.sigmas.tolist()
    c = torch.tensor([_c_closed_form(s[k], s[k + 1], sde_type, a, compat) for k in range(ro.batch_size)],
                     dtype=torch.float64)
    # without rectification the spread across steps is the closed form's, step by step
    assert float(raw.max() / raw.min()) == pytest.approx(float(c.max() / c.min()), rel=1e-4)
    assert torch.allclose(raw / raw[0], c / c[0], rtol=1e-4)
    assert float(raw.max() / raw.min()) > 2.5  # the effect being corrected is real on this grid
    flat, w_on = _dl_dv_norms(ro, ctx, rectify=True)
    assert float(flat.max() / flat.min()) < 1.05
    assert float(w_on.mean()) == pytest.approx(1.0, rel=1e-6)


def test_flow_sde_factor_spread_matches_design():
    """DESIGN §6: c(σ) varies ~17× across a FlowGRPO SD3 grid (T = 10, shift 3, a = 0.7)."""
    s = flow_sde.sigma_grid(10, 3.0)
    c = rectification_factor(s[:-2], s[1:-1], sde_type="flow_sde", noise_level=0.7)
    assert 15 < float(c.max() / c.min()) < 19


def test_rectification_weights_mean_and_all_reduce_seam():
    c = torch.tensor([1.0, 2.0, 4.0, 8.0])
    trained = torch.tensor([True, True, True, False])
    w = rectification_weights(c, trained)
    assert float(w[trained].mean()) == pytest.approx(1.0)
    assert float(w[0] / w[2]) == pytest.approx(4.0)
    # two identical ranks: the global mean equals the local one
    assert torch.allclose(rectification_weights(c, trained, all_reduce=lambda t: 2 * t), w)
    # another rank with larger 1/c moves the global mean: local weights shrink
    other = torch.tensor([10.0, 3.0])  # (Σ 1/c, count) of a second rank
    w_glob = rectification_weights(c, trained, all_reduce=lambda t: t + other)
    assert torch.all(w_glob[trained] < w[trained])


# ---------------------------------------------------------------------- grouping and rollout
@pytest.mark.parametrize("spec,groups,cands", [("first_half", 6, [0, 1, 2]), ("all", 10, [0, 1, 2, 3, 4]),
                                               ("1,3", 5, [1, 3])])
def test_iso_temporal_grouping_covers_candidates(make_trainer, spec, groups, cands):
    tr = make_trainer("engine.name=single_step", f"engine.candidate_steps={spec}",
                      f"train.prompts_per_batch={groups}")
    seen_orders = set()
    for _ in range(4):
        plan = tr.family.plan()
        k = plan.engine_state.k
        B = len(plan.prompts)
        assert plan.selected.sum(1).tolist() == [1] * B
        assert torch.equal(plan.selected[torch.arange(B), k], torch.ones(B, dtype=torch.bool))
        assert torch.equal(plan.sde_mask, plan.selected)
        per_group = {}
        for gid, kk in zip(plan.group_ids.tolist(), k.tolist()):
            per_group.setdefault(gid, set()).add(kk)
        assert all(len(v) == 1 for v in per_group.values())  # one step per group
        ks = [next(iter(per_group[g])) for g in sorted(per_group)]
        counts = [ks.count(c) for c in cands]
        assert set(ks) <= set(cands)
        assert max(counts) - min(counts) <= 1 and sum(counts) == groups  # even coverage
        seen_orders.add(tuple(ks))
    assert len(seen_orders) > 1  # the assignment is drawn, not fixed


def test_rollout_is_ode_except_selected_step(make_trainer):
    tr = make_trainer("engine.name=single_step", "engine.candidate_steps=all", "train.prompts_per_batch=5")
    ro = tr.rollout()
    sel = ro.selected
    k = ro.traj.engine_state.k
    assert torch.equal(sel[torch.arange(ro.batch_size), k], torch.ones(ro.batch_size, dtype=torch.bool))
    T = ro.traj.num_steps
    for step in range(T):
        off = ~sel[:, step]
        assert torch.all(ro.traj.log_probs[off, step] == 0)
        assert torch.all(ro.traj.noise[off, step] == 0)
        dt = ro.traj.sigmas[step + 1] - ro.traj.sigmas[step]
        ode = ro.traj.xs[off, step] + dt * ro.traj.velocities[off, step]
        assert torch.allclose(ro.traj.xs[off, step + 1], ode, atol=1e-6)
        on = sel[:, step]
        if on.any():
            assert torch.all(ro.traj.log_probs[on, step] != 0)
            assert torch.all(ro.traj.noise[on, step].flatten(1).norm(dim=1) > 0)
    stats = tr.backward(ro, 0)
    assert stats.metrics["ratio_max_dev"] < 1e-5  # first update: r == 1
    assert stats.metrics["trained_pairs"] == ro.batch_size
    assert stats.sample_backwards == ro.batch_size and stats.forwards_grad == ro.batch_size


# ---------------------------------------------------------------------- exactness vs recompute
def _single_vs_recompute(tr, ro, epoch=0):
    tr.optimizer.zero_grad(set_to_none=True)
    tr.family.engine.backward(tr.family.ctx, ro, epoch)
    g1 = flat_grad(tr.params)
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, epoch)
    g2 = flat_grad(tr.params)
    return g1, g2


def test_fixed_step_equals_recompute_restricted_to_it(make_trainer):
    tr = make_trainer("engine.name=single_step", "engine.candidate_steps=2")
    ro = tr.rollout()
    assert ro.selected[:, 2].all() and ro.selected.sum() == ro.batch_size
    assert torch.allclose(ro.loss_weights[:, 2], torch.full((ro.batch_size,), 1.0 / ro.batch_size))
    g1, g2 = _single_vs_recompute(tr, ro)
    assert g2.norm() > 0
    assert rel_err(g1, g2) < 1e-5


@pytest.mark.parametrize("extra", [
    [],
    ["model.guidance_scale=3.0", "engine.micro_batch_size=2"],
    ["loss.beta=0.05", "sampler.sde_type=cps", "engine.rectify=false"],
    ["sampler.sde_type=dance_sde"],
])
def test_mixed_steps_equal_recompute_on_same_rollout(make_trainer, extra):
    tr = make_trainer("engine.name=single_step", "engine.candidate_steps=all", "train.prompts_per_batch=4",
                      *extra)
    ro = tr.rollout()
    assert len(ro.traj.engine_state.k.unique()) == 4
    g1, g2 = _single_vs_recompute(tr, ro)
    assert rel_err(g1, g2) < 1e-5
    # a later inner epoch (θ ≠ θ_old, ratio ≠ 1) still trains the same single step, exactly
    tr.optimizer.zero_grad(set_to_none=True)
    tr.family.engine.backward(tr.family.ctx, ro, 0)
    tr.optimizer.step()
    g1, g2 = _single_vs_recompute(tr, ro, epoch=1)
    assert rel_err(g1, g2) < 1e-5


def test_rectification_enters_loss_weights(make_trainer):
    tr = make_trainer("engine.name=single_step", "engine.candidate_steps=all", "train.prompts_per_batch=5")
    ro = tr.rollout()
    k = ro.traj.engine_state.k
    w = ro.loss_weights[torch.arange(ro.batch_size), k] * ro.batch_size  # aggregation "mean": 1/B each
    assert float(w.mean()) == pytest.approx(1.0, rel=1e-5)
    c = rectification_factor(ro.traj.sigmas[k], ro.traj.sigmas[k + 1], sde_type="flow_sde", noise_level=0.7)
    assert torch.allclose(w * c, (w * c)[0].expand_as(w), rtol=1e-5)  # w ∝ 1/c
    tr_off = make_trainer("engine.name=single_step", "engine.candidate_steps=all", "train.prompts_per_batch=5",
                          "engine.rectify=false")
    ro_off = tr_off.rollout()
    assert torch.allclose(ro_off.loss_weights.sum(1), torch.full((ro.batch_size,), 1.0 / ro.batch_size))


def test_full_iteration_with_inner_epochs(make_trainer):
    tr = make_trainer("engine.name=single_step", "train.num_inner_epochs=2")
    row = tr.step()
    assert row["forwards_grad"] == 2 * 6 and row["sample_backwards"] == 2 * 6
    assert math.isfinite(row["grad_norm"]) and row["grad_norm"] > 0


# ---------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("bad", ["last_half", "a,b", "0;1", "-1", "", "1.5"])
def test_bad_candidate_steps_syntax(make_trainer, bad):
    with pytest.raises(ConfigError, match=r"engine\.candidate_steps.*first_half"):
        make_trainer("engine.name=single_step", f"engine.candidate_steps='{bad}'")


@pytest.mark.parametrize("bad", ["5", "0,7"])
def test_bad_candidate_steps_range(bad):
    """The range on the run's grid is checked with the config, before any model loads (T = 6: steps 0..4)."""
    with pytest.raises(ConfigError, match=r"engine\.candidate_steps.*out of range.*0\.\.4"):
        RunConfig.from_overrides(["engine.name=single_step", f"engine.candidate_steps='{bad}'", "sampler.num_steps=6"])


def test_candidate_presets():
    assert candidate_steps("first_half", 10) == [0, 1, 2, 3, 4]
    assert candidate_steps("all", 6) == [0, 1, 2, 3, 4]
    assert candidate_steps(" 3,1,1 ", 6) == [1, 3]
