"""LeanGRPO's recompute-free engines (retain, reweight): exact against recompute on the first update, waves,
inner-epoch fallback, counters and per-sample gradients (two ranks against one process: test_distributed.py)."""
import pytest
import torch

from diffgrpo.engines._graph import retained_velocity
from diffgrpo.engines._per_sample import PerSampleGrads, per_sample_grads_loop
from diffgrpo.engines.recompute import RecomputeEngine
from diffgrpo.losses import aggregation_weights
from tests.helpers.tensors import flat_grad, perturb, rel_err

TOL = 1e-5


def _engine_vs_recompute(tr):
    ro = tr.rollout()
    stats = tr.backward(ro, 0)
    g = flat_grad(tr.params)
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, 0)
    return ro, stats, g, flat_grad(tr.params)


CASES = [
    [],
    ["loss.beta=0.1"],
    ["model.guidance_scale=3.0"],
    ["model.guidance_scale=3.0", "loss.beta=0.05"],
    ["advantage.std_mode=global", "steps.mode=random", "steps.fraction=0.5"],
    ["steps.mode=first_fraction", "steps.fraction=0.5", "loss.aggregation=sample_mean"],
    ["steps.mode=window", "steps.window_size=2", "advantage.baseline=leave_one_out", "advantage.clip=0.5"],
]


@pytest.mark.parametrize("engine", ["retain", "reweight"])
@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(o) or "default")
def test_first_update_equals_recompute(make_trainer, engine, overrides):
    tr = make_trainer(f"engine.name={engine}", *overrides)
    beta = any(o.startswith("loss.beta") for o in overrides)
    if beta:
        perturb(tr)
    ro, stats, g, g_ref = _engine_vs_recompute(tr)
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) < TOL
    assert stats.metrics["fallback_recompute"] == 0.0
    assert stats.metrics["trained_pairs"] == int(ro.selected.sum())
    if beta:
        assert stats.metrics["kl"] > 0


def test_kl_gradient_is_included(make_trainer):
    """With θ ≠ θ_ref the β·KL term changes the gradient, and both engines follow recompute there."""
    grads = {}
    for beta in (0.0, 0.5):
        tr = make_trainer("engine.name=reweight", f"loss.beta={beta}", "model.guidance_scale=1.0")
        if beta:
            perturb(tr)
        else:
            tr2 = make_trainer("engine.name=reweight", "loss.beta=0.5")  # same init, then same perturbation
            tr.policy.load_state_dict(tr2.policy.state_dict())
            perturb(tr)
        _, _, g, g_ref = _engine_vs_recompute(tr)
        assert rel_err(g, g_ref) < TOL
        grads[beta] = g
    assert rel_err(grads[0.5], grads[0.0]) > 1e-3


def test_retain_counters_and_release(make_trainer):
    tr = make_trainer("engine.name=retain")
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    B, T = ro.batch_size, ro.traj.num_steps
    n_pairs = int(ro.selected.sum())
    # the rollout ran the selected pairs' forwards with grad and nothing else extra
    assert tr.policy.counters["forwards_grad"] - c0["forwards_grad"] == n_pairs
    assert tr.policy.counters["forwards_nograd"] - c0["forwards_nograd"] == B * T - n_pairs
    store = ro.traj.engine_state
    k = 2
    idx = ro.selected[:, k].nonzero().flatten()[:2]
    v = retained_velocity(ro, k, idx)
    assert v.requires_grad
    torch.testing.assert_close(v.detach(), ro.traj.velocities[idx, k])
    stats = tr.backward(ro)
    assert stats.retained_graphs == T - 1  # one batched graph per selected step
    assert stats.backward_calls == 1
    assert stats.sample_backwards == n_pairs
    assert stats.forwards_grad == 0 and stats.forwards_nograd == 0  # no recompute forward
    assert "rollout_extra" in stats.seconds
    assert store.released and store.items == []
    with pytest.raises(KeyError):
        retained_velocity(ro, k, idx)


def test_reweight_counters(make_trainer):
    tr = make_trainer("engine.name=reweight", "loss.beta=0.1")
    ro = tr.rollout()
    B, T = ro.batch_size, ro.traj.num_steps
    stats = tr.backward(ro)
    assert stats.grad_buffers == 2 * B  # policy-gradient and KL buffer per trajectory
    assert stats.backward_calls == 2 * (T - 1)  # one batched backward per step and term
    assert stats.sample_backwards == 2 * int(ro.selected.sum())
    assert stats.forwards_grad == 0
    assert stats.allreduce_calls == 0  # world size 1
    assert stats.metrics["grad_buffer_bytes"] == 2 * B * sum(p.numel() for p in tr.params) * 4
    assert ro.traj.engine_state.released


@pytest.mark.parametrize("engine", ["retain", "reweight"])
def test_dropped_samples_are_excluded(make_trainer, monkeypatch, engine):
    """An invalid reward (and zero-std filtering) drops a trajectory after its buffers/graphs were made."""
    import diffgrpo.flow.family as trainer_mod

    real = trainer_mod.compute_rewards

    def nan_first(*a, **k):
        r, comps = real(*a, **k)
        r = r.clone()
        r[1] = float("nan")
        return r, comps

    monkeypatch.setattr(trainer_mod, "compute_rewards", nan_first)
    tr = make_trainer(f"engine.name={engine}", "advantage.filter_zero_std=true")
    ro, stats, g, g_ref = _engine_vs_recompute(tr)
    assert not ro.selected[1].any()
    assert rel_err(g, g_ref) < TOL


@pytest.mark.parametrize("engine", ["retain", "reweight"])
def test_inner_epoch_falls_back_to_recompute(make_trainer, engine):
    tr = make_trainer(f"engine.name={engine}", "train.num_inner_epochs=2", "loss.clip_range=0.01")
    ro = tr.rollout()
    tr.backward(ro, 0)
    tr.optimizer.step()
    stats = tr.backward(ro, 1)
    g = flat_grad(tr.params)
    assert stats.metrics["fallback_recompute"] == 1.0
    assert stats.forwards_grad == int(ro.selected.sum())
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, 1)
    assert rel_err(g, flat_grad(tr.params)) < 1e-12
    assert stats.metrics["ratio_max_dev"] > 0  # θ moved: this is a genuine later epoch
    # the whole iteration through the trainer: epoch 0 without a training forward, epoch 1 recomputes every pair
    row = make_trainer(f"engine.name={engine}", "train.num_inner_epochs=2").step()
    n_pairs = int(ro.selected.sum())  # same step selection as above
    assert row["skipped_updates"] == 0 and row["first_epoch/fallback_recompute"] == 0.0
    assert row["forwards_grad"] == n_pairs and row["sample_backwards"] == 2 * n_pairs
    assert row["first_epoch/ratio_max_dev"] == 0.0 and row["clip_ratio"] > 0  # epoch 1 trains θ ≠ θ_old


@pytest.mark.parametrize("aggregation", ["mean", "sample_mean"])
def test_waves_equal_one_wave(make_trainer, aggregation):
    """Waves of one group each accumulate exactly the whole-batch first-update gradient (whole-batch
    normalisation), which is what one wave (== recompute, test above) gives on the same samples."""
    tr = make_trainer("engine.name=retain", "engine.wave_size=1", "train.prompts_per_batch=3",
                      "steps.mode=random", "steps.fraction=0.5", f"loss.aggregation={aggregation}")
    tr.optimizer.zero_grad(set_to_none=True)
    ro, stats = tr.family.collect()
    g = flat_grad(tr.params)
    assert stats.metrics["waves"] == 3.0
    assert stats.retained_graphs == 3 * (ro.traj.num_steps - 1)
    assert ro.batch_size == 9
    torch.testing.assert_close(ro.loss_weights, aggregation_weights(ro.selected, aggregation))
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, 0)
    assert rel_err(g, flat_grad(tr.params)) < TOL
    # the trainer's step uses the waves
    row = tr.step()
    assert row["first_epoch/waves"] == 3.0 and row["skipped_updates"] == 0


def test_waves_refuse_global_std(make_trainer):
    # refused when the config is read, before any model is built (ConfigError is a ValueError)
    with pytest.raises(ValueError, match="advantage.std_mode=global"):
        make_trainer("engine.name=retain", "engine.wave_size=1", "advantage.std_mode=global")


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_per_sample_grads_match_one_backward_per_sample(make_trainer, cfg_scale):
    tr = make_trainer(f"model.guidance_scale={cfg_scale}")
    pol = tr.policy
    psg = PerSampleGrads(pol, tr.params)
    assert psg.supported()
    n = 3
    x = torch.randn(n, *pol.latent_shape)
    cond = pol.encode(["a handwritten digit 1", "a handwritten digit 2", "a handwritten digit 3"])
    gout = torch.randn(n, *pol.latent_shape)
    with psg.recording():
        with torch.enable_grad():
            v = pol.velocity(x, torch.full((n,), 0.6), cond)
        G = psg.grads(psg.take(), v, gout, n, retain_graph=True)
    G_ref = per_sample_grads_loop(tr.params, v, gout, retain_graph=False)
    assert rel_err(G.double(), G_ref.double()) < TOL
    assert G.norm(dim=1).min() > 0


@pytest.mark.parametrize("overrides", [[], ["loss.beta=0.1"]], ids=["default", "kl"])
def test_fused_per_sample_accumulation_keeps_reweights_gradient(make_trainer, monkeypatch, overrides):
    """The Linear layers' per-sample gradients accumulated into the buffers by one GEMM (the fast path) give the
    gradient of the einsum-then-add path they replace, within float rounding, through the whole engine."""
    from diffgrpo.engines import _per_sample

    grads = {}
    for fused in (False, True):
        monkeypatch.setattr(_per_sample, "_FUSED", fused)
        tr = make_trainer("engine.name=reweight", *overrides)
        if overrides:
            perturb(tr)
        ro = tr.rollout()
        tr.backward(ro, 0)
        grads[fused] = flat_grad(tr.params)
    assert grads[False].norm() > 0
    assert rel_err(grads[True], grads[False]) < 1e-6


def test_fused_per_sample_grads_match_one_backward_per_sample(make_trainer):
    """The fast path into the buffers (every row, in order) equals one backward per sample; a subset of rows
    takes the index_add path, which must agree too."""
    tr = make_trainer()
    pol = tr.policy
    psg = PerSampleGrads(pol, tr.params)
    n = 3
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, *pol.latent_shape, generator=g)
    cond = pol.encode(["a handwritten digit 1", "a handwritten digit 2", "a handwritten digit 3"])
    gout = torch.randn(n, *pol.latent_shape, generator=g)
    with psg.recording():
        with torch.enable_grad():
            v = pol.velocity(x, torch.full((n,), 0.6), cond)
        recs = psg.take()
        buf = torch.full((n, psg.numel), 0.5)  # accumulates onto what the buffer holds
        psg.grads(recs, v, gout, n, retain_graph=True, into=(buf, torch.arange(n)))
        sub = torch.zeros(n + 2, psg.numel)
        psg.grads(recs, v, gout, n, retain_graph=True, into=(sub, torch.tensor([4, 0, 2])))
    G_ref = per_sample_grads_loop(tr.params, v, gout, retain_graph=False)
    assert rel_err((buf - 0.5).double(), G_ref.double()) < TOL
    assert rel_err(sub[[4, 0, 2]].double(), G_ref.double()) < TOL and sub[[1, 3]].abs().max() == 0
