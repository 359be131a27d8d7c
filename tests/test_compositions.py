"""Compositions with LeanGRPO's Retain: ``jagg`` and ``single_step`` with ``engine.evaluation=retain``.

On the first update they must give the gradient of the same engine with recompute evaluation on the same
rollout, without any training forward with grad; later inner epochs fall back to recompute evaluation."""
import dataclasses
import math

import pytest
import torch

from diffgrpo.engines._graph import RetainedSteps
from diffgrpo.engines.jagg import JaggEngine, anchor_mask
from diffgrpo.engines.recompute import RecomputeEngine
from diffgrpo.engines.single_step import SingleStepEngine
from tests.helpers.tensors import flat_grad, perturb, rel_err

TOL = 1e-5


def _grad(tr, ro, engine, epoch=0):
    tr.optimizer.zero_grad(set_to_none=True)
    stats = engine.backward(tr.family.ctx, ro, epoch)
    return flat_grad(tr.params), stats


def _recompute_eval(tr, cls):
    return cls(dataclasses.replace(tr.cfg.engine, evaluation="recompute"))


def _rollout(tr):
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    return ro, {k: tr.policy.counters[k] - c0[k] for k in c0}


# ------------------------------------------------------------------------------------------------ jagg + retain

JAGG_CASES = [
    [],
    ["loss.beta=0.05"],
    ["model.guidance_scale=3.0"],
    ["model.guidance_scale=3.0", "loss.beta=0.05"],
    ["steps.mode=random", "steps.fraction=0.6", "engine.window=3"],
    ["engine.window=5", "engine.micro_batch_size=2"],
]


@pytest.mark.parametrize("extra", JAGG_CASES, ids=lambda o: ",".join(o) or "default")
def test_jagg_retain_equals_jagg_on_first_update(make_trainer, extra):
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=4", *extra)
    beta = any(o.startswith("loss.beta") for o in extra)
    if beta:
        perturb(tr)
    mult = 2 if tr.policy.uses_cfg else 1
    ro, roll = _rollout(tr)
    B, T = ro.batch_size, ro.traj.num_steps
    anchors = anchor_mask(ro.selected, tr.family.engine.window)
    n_anchor, n_pairs = int(anchors.sum()), int(ro.selected.sum())
    # the rollout ran exactly the window endpoints with grad, everything else without
    assert roll["forwards_grad"] == n_anchor * mult
    assert roll["forwards_nograd"] == (B * T - n_anchor + (n_anchor if beta else 0)) * mult
    assert ro.traj.engine_state.mask.equal(anchors)
    g, s = _grad(tr, ro, tr.family.engine)
    g_ref, s_ref = _grad(tr, ro, _recompute_eval(tr, JaggEngine))
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) < TOL
    # no training forward with grad; one backward call over every retained graph
    assert s.forwards_grad == 0 and s_ref.forwards_grad == n_anchor * mult
    assert s.backward_calls == 1
    assert s.sample_backwards == s_ref.sample_backwards == n_anchor * mult
    assert s.retained_graphs == n_anchor
    # β > 0: the endpoints' reference forwards ran in the rollout, the interiors' run here (no grad)
    assert s.forwards_nograd == ((n_pairs - n_anchor) * mult if beta else 0)
    assert s.forwards_nograd + (n_anchor * mult if beta else 0) == s_ref.forwards_nograd
    assert s.metrics["fallback_recompute"] == 0.0 and "rollout_extra" in s.seconds
    assert s.metrics["trained_pairs"] == n_pairs and s.metrics["ratio_max_dev"] < 1e-5
    if beta:
        assert s.metrics["kl"] > 0
    assert ro.traj.engine_state.released


def test_jagg_retain_two_graphs_per_window(make_trainer):
    """T = 6 → 5 trainable steps, W = 5: one window per trajectory, so exactly 2 retained graphs each."""
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=5")
    ro, roll = _rollout(tr)
    g, s = _grad(tr, ro, tr.family.engine)
    assert s.retained_graphs == 2 * ro.batch_size and roll["forwards_grad"] == 2 * ro.batch_size
    assert (s.forwards_grad, s.forwards_nograd, s.sample_backwards) == (0, 0, 2 * ro.batch_size)
    g_ref, _ = _grad(tr, ro, _recompute_eval(tr, JaggEngine))
    assert rel_err(g, g_ref) < TOL


def test_jagg_retain_window_two_is_exact(make_trainer):
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=2", "loss.beta=0.05")
    perturb(tr)
    ro = tr.rollout()
    g, s = _grad(tr, ro, tr.family.engine)
    g_ref, _ = _grad(tr, ro, RecomputeEngine())
    assert rel_err(g, g_ref) < TOL and s.forwards_grad == 0 and s.forwards_nograd == 0


@pytest.mark.parametrize("frac", [0.5, 0.0])
def test_jagg_retain_exact_windows_use_retained_endpoints(make_trainer, frac):
    """Windows routed to the exact path: retained endpoints + recomputed interiors (3 of 5 steps)."""
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=5",
                      f"engine.jagg_frac={frac}", "loss.beta=0.05")
    perturb(tr)
    ro = tr.rollout()
    B = ro.batch_size
    n_j = math.ceil(frac * B)
    g, s = _grad(tr, ro, tr.family.engine)
    g_ref, s_ref = _grad(tr, ro, _recompute_eval(tr, JaggEngine))
    assert rel_err(g, g_ref) < TOL
    assert s.metrics["jagg_frac_routed"] == s_ref.metrics["jagg_frac_routed"] == n_j / B
    assert s.forwards_grad == 3 * (B - n_j)  # interiors of the exact windows only
    assert s.sample_backwards == s_ref.sample_backwards == 2 * n_j + 5 * (B - n_j)
    assert s.retained_graphs == 2 * B
    if frac == 0:  # everything exact: the recompute gradient
        g_rc, _ = _grad(tr, ro, RecomputeEngine())
        assert rel_err(g, g_rc) < TOL


def test_jagg_retain_later_epoch_falls_back(make_trainer):
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=4", "train.lr=3e-3",
                      "loss.clip_range=1e-2")
    ro = tr.rollout()
    store = ro.traj.engine_state
    _grad(tr, ro, tr.family.engine)
    assert store.released
    tr.optimizer.step()
    g1, s1 = _grad(tr, ro, tr.family.engine, epoch=1)
    g_ref, s_ref = _grad(tr, ro, _recompute_eval(tr, JaggEngine), epoch=1)
    assert rel_err(g1, g_ref) < 1e-12
    assert s1.metrics["fallback_recompute"] == 1.0 and s1.forwards_grad == s_ref.forwards_grad > 0
    assert s1.metrics["ratio_max_dev"] > 0  # θ moved: a genuine later epoch
    # an epoch > 0 call before epoch 0 also releases the graphs and recomputes
    ro2 = tr.rollout()
    _, s2 = _grad(tr, ro2, tr.family.engine, epoch=1)
    assert ro2.traj.engine_state.released and s2.metrics["fallback_recompute"] == 1.0


def test_jagg_retain_dropped_sample(make_trainer, monkeypatch):
    import diffgrpo.flow.family as trainer_mod

    real = trainer_mod.compute_rewards

    def nan_second(*a, **k):
        r, comps = real(*a, **k)
        r = r.clone()
        r[1] = float("nan")
        return r, comps

    monkeypatch.setattr(trainer_mod, "compute_rewards", nan_second)
    tr = make_trainer("engine.name=jagg", "engine.evaluation=retain", "engine.window=3")
    ro = tr.rollout()
    assert not ro.selected[1].any()
    g, s = _grad(tr, ro, tr.family.engine)
    g_ref, _ = _grad(tr, ro, _recompute_eval(tr, JaggEngine))
    assert rel_err(g, g_ref) < TOL and s.forwards_grad == 0


# ----------------------------------------------------------------------------------------- single_step + retain

SINGLE_CASES = [
    [],
    ["model.guidance_scale=3.0", "engine.micro_batch_size=2"],
    ["loss.beta=0.05", "sampler.sde_type=cps", "engine.rectify=false"],
    ["loss.beta=0.05", "model.guidance_scale=3.0"],
]


@pytest.mark.parametrize("extra", SINGLE_CASES, ids=lambda o: ",".join(o) or "default")
def test_single_step_retain_equals_single_step(make_trainer, extra):
    tr = make_trainer("engine.name=single_step", "engine.evaluation=retain", "engine.candidate_steps=all",
                      "train.prompts_per_batch=4", *extra)
    beta = any(o.startswith("loss.beta") for o in extra)
    if beta:
        perturb(tr)
    mult = 2 if tr.policy.uses_cfg else 1
    ro, roll = _rollout(tr)
    B = ro.batch_size
    assert roll["forwards_grad"] == B * mult  # one retained graph per sample
    g, s = _grad(tr, ro, tr.family.engine)
    g_ref, s_ref = _grad(tr, ro, _recompute_eval(tr, SingleStepEngine))
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) < TOL
    assert (s.forwards_grad, s.forwards_nograd) == (0, 0)  # no recompute at all, references in the rollout
    assert s_ref.forwards_grad == B * mult
    assert s.retained_graphs == B and s.backward_calls == 1 and s.sample_backwards == B * mult
    assert s.metrics["fallback_recompute"] == 0.0 and "rollout_extra" in s.seconds
    if beta:
        assert s.metrics["kl"] > 0
    # later epoch: graphs released, recompute evaluation, same gradient as single_step
    tr.optimizer.step()
    g1, s1 = _grad(tr, ro, tr.family.engine, epoch=1)
    g1_ref, _ = _grad(tr, ro, _recompute_eval(tr, SingleStepEngine), epoch=1)
    assert rel_err(g1, g1_ref) < 1e-12 and s1.metrics["fallback_recompute"] == 1.0
    assert s1.forwards_grad == B * mult and ro.traj.engine_state.store.released


@pytest.mark.parametrize("engine,evaluated,interior", [(["engine.name=jagg", "engine.window=4"], 3, 2),
                                                        (["engine.name=single_step"], 1, 0)])
def test_full_iteration_with_inner_epochs(make_trainer, engine, evaluated, interior):
    """Two inner epochs: the first update back-propagates the retained rollout graphs (no forward), the second
    falls back to recompute evaluation. Per trajectory ``evaluated`` pairs (JAGG, W = 4 on 5 steps: windows
    [0..3] and [4], 3 endpoints; single_step: 1) and, after the update, ``interior`` no-grad refreshes."""
    tr = make_trainer(*engine, "engine.evaluation=retain", "train.num_inner_epochs=2")
    before = [p.detach().clone() for p in tr.params]
    row = tr.step()
    B = 6  # train.prompts_per_batch × train.group_size
    assert row["skipped_updates"] == 0 and row["first_epoch/fallback_recompute"] == 0.0
    assert row["forwards_grad"] == evaluated * B  # the second epoch's recompute evaluation only
    assert row["sample_backwards"] == 2 * evaluated * B  # one per evaluated pair and epoch
    assert row["forwards_nograd"] == interior * B
    # the second epoch trains θ ≠ θ_old (ratios off 1, some clipped), and both updates moved the weights: one
    # AdamW step moves a weight by about lr at most
    assert row["ratio_mean"] != 1.0 and row["clip_ratio"] > 0 and row["grad_norm"] > 0
    assert max(float((a - b.detach()).abs().max()) for a, b in zip(before, tr.params)) > 1.5 * tr.cfg.train.lr


def test_retained_steps_gather():
    store = RetainedSteps(3, 4, "cpu")
    w = torch.randn(2, requires_grad=True)
    v1 = torch.arange(6.0).reshape(3, 2) * w  # step 1, trajectories 0, 1, 2
    v2 = torch.arange(4.0).reshape(2, 2) * w  # step 3, trajectories 0, 2
    store.add(1, torch.tensor([0, 1, 2]), v1, None)
    store.add(3, torch.tensor([0, 2]), v2, v2.detach() + 1)
    out = store.gather(torch.tensor([2, 0, 1, 2]), torch.tensor([3, 1, 1, 1]))
    torch.testing.assert_close(out.detach(), torch.stack([v2[1], v1[0], v1[1], v1[2]]).detach())
    out.sum().backward()  # one backward through rows of both graphs
    assert w.grad is not None
    torch.testing.assert_close(store.gather(torch.tensor([2]), torch.tensor([3]), reference=True), v2[1:].detach() + 1)
    assert store.gather(torch.tensor([1]), torch.tensor([1]), reference=True) is None
    assert store.mask.sum() == 5 and store.num_graphs == 2
    with pytest.raises(KeyError):
        store.gather(torch.tensor([1]), torch.tensor([3]))
    store.release()
    with pytest.raises(KeyError):
        store.velocity(1, torch.tensor([0]))
