"""``dgpo`` (Direct Group Preference Optimization): the group-level DPO loss and its gradient against an autograd
computation of −log σ(R(G⁺) − R(G⁻)) on a tiny model, chunking, zero advantages, the direction of an update, LoRA,
CFG-free forwards, the plan (times, group-shared noise, ODE) and the config keys. Two ranks (DDP, FSDP2) against
one process are in ``tests/test_forward_engines.py`` (the forward engines' shared two-rank fixture)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from diffgrpo import RunConfig
from diffgrpo.config import ConfigError
from diffgrpo.engines.dgpo import group_margin, truncated_grid_times
from diffgrpo.validation import validate
from tests.helpers.tensors import flat_grad, perturb, rel_err

BETA = 100.0


def _units(ro):
    """Every trained unit as float64: rows, cols, t, u = ε − x_0, x_t, weight, clamped advantage, group id."""
    st = ro.traj.engine_state
    K = st.idx.shape[1]
    rows, cols = ro.selected[:, :K].nonzero(as_tuple=True)
    t = ro.traj.sigmas[st.idx[rows, cols]].double()
    x0 = ro.traj.xs[rows, -1].double()
    eps = st.noise[rows, cols].double()
    tt = t.view(-1, 1, 1, 1)
    return dict(rows=rows, cols=cols, t=t, u=eps - x0, x_t=(1 - tt) * x0 + tt * eps,
                w=ro.loss_weights[rows, cols].double(), adv=ro.advantages[rows].double().clamp(-5, 5),
                gid=ro.group_ids[rows])


def _errors(tr, ro, units, grad=False, reference=False):
    cond = {k: v[units["rows"]] for k, v in ro.traj.cond.items()}
    with torch.set_grad_enabled(grad), (tr.policy.reference() if reference else contextlib.nullcontext()):
        v = tr.policy.velocity(units["x_t"].float(), units["t"].float(), cond).double()
    return ((v - units["u"]) ** 2).mean((1, 2, 3))


def _hand_loss(e, e_ref, units, beta=BETA):
    """Σ_{g,j} (W/β)·(−log σ(R(G⁺) − R(G⁻))), R(G±) = ∓β·Σ_{i∈G±} (w_i/W)·|A_i|·(e_θ − e_ref), by explicit loops
    over (group, unit column) pairs and the positive / negative sets."""
    total = e.new_zeros(())
    for g in units["gid"].unique().tolist():
        for j in units["cols"].unique().tolist():
            m = (units["gid"] == g) & (units["cols"] == j)
            W = units["w"][m].sum()
            a, d, w = units["adv"][m], (e - e_ref)[m], units["w"][m] / W
            r_pos = -beta * (w[a > 0] * a[a > 0].abs() * d[a > 0]).sum()
            r_neg = -beta * (w[a < 0] * a[a < 0].abs() * d[a < 0]).sum()
            total = total + W / beta * -F.logsigmoid(r_pos - r_neg)
    return total


@pytest.mark.parametrize("mbs", [0, 4])
def test_dgpo_loss_and_gradient_equal_autograd_of_the_group_preference_loss(make_trainer, mbs):
    """θ away from the reference (else every margin is 0): the engine's surrogate gradient Σ w·σ(s)·A·∇e equals
    autograd of the stated loss, for one chunk per unit column (every group whole, s formed in the chunk) and for
    chunks of 4 units that split groups (s from a no-grad pass first)."""
    tr = make_trainer("engine.name=dgpo", f"engine.micro_batch_size={mbs}", "train.group_size=4")
    perturb(tr, 0.05)
    ro = tr.rollout()
    assert ro.advantages.abs().sum() > 0
    stats = tr.backward(ro)
    g_engine = flat_grad(tr.params)
    units = _units(ro)
    e_ref = _errors(tr, ro, units, reference=True)
    for p in tr.params:
        p.grad = None
    e = _errors(tr, ro, units, grad=True)
    assert float((e.detach() - e_ref).abs().max()) > 1e-4  # the margins are not trivially zero
    loss = _hand_loss(e, e_ref, units)
    loss.backward()
    assert abs(stats.metrics["loss"] - loss.item()) < 1e-5 * abs(loss.item())
    assert rel_err(g_engine, flat_grad(tr.params)) < 1e-4
    sig = stats.metrics["dgpo_sigmoid_mean"]
    assert 0 < sig < 1 and sig != 0.5
    # counters: K = 4 units per sample; one grad forward + backward and one reference forward each (+ one θ forward
    # each when chunks split groups)
    n = int(ro.selected.sum())
    assert n == ro.batch_size * 4
    assert (stats.forwards_grad, stats.sample_backwards) == (n, n)
    assert stats.forwards_nograd == (n if mbs == 0 else 2 * n)


def test_chunking_does_not_change_the_gradient(make_trainer):
    grads = []
    for mbs in (0, 1, 5):
        tr = make_trainer("engine.name=dgpo", f"engine.micro_batch_size={mbs}", "loss.beta=0.1")
        perturb(tr, 0.05)
        tr.backward(tr.rollout())
        grads.append(flat_grad(tr.params))
    assert rel_err(grads[1], grads[0]) < 1e-5 and rel_err(grads[2], grads[0]) < 1e-5


def test_margin_of_a_group_with_uniform_weights_is_the_released_sum():
    """ŵ = 1/G: s = β/G·Σ A_i·Δ_i; a group of zero weight (filtered) gets s = 0."""
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -2.0, 0.0])
    delta = torch.tensor([0.1, 0.3, -0.2, 0.05, 0.02, 0.7])
    idx = torch.tensor([0, 0, 0, 1, 1, 1])
    w = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0]) / 3
    s = group_margin(adv, delta, w, idx, 10.0)
    expect = 10.0 / 3 * (0.1 - 0.3 - 0.1)
    torch.testing.assert_close(s, torch.tensor([expect] * 3 + [0.0] * 3))


def test_zero_advantages_give_zero_gradient(make_trainer):
    tr = make_trainer("engine.name=dgpo")
    perturb(tr, 0.05)
    ro = tr.rollout()
    tr.backward(ro)
    g_ref = flat_grad(tr.params).norm()
    assert g_ref > 0
    ro.advantages = torch.zeros_like(ro.advantages)
    tr.backward(ro)
    assert float(flat_grad(tr.params).norm()) == 0.0


def test_at_the_reference_the_gradient_is_half_the_advantage_weighted_matching_gradient(make_trainer):
    """θ = θ_ref: every margin is 0 and σ(0) = 1/2, so ∇L = ½·Σ w·A·∇e (exactly)."""
    tr = make_trainer("engine.name=dgpo")
    ro = tr.rollout()
    stats = tr.backward(ro)
    assert stats.metrics["dgpo_sigmoid_mean"] == 0.5 and stats.metrics["dgpo_margin_mean"] == 0.0
    g = flat_grad(tr.params)
    units = _units(ro)
    for p in tr.params:
        p.grad = None
    e = _errors(tr, ro, units, grad=True)
    (0.5 * units["w"] * units["adv"] * e).sum().backward()
    assert rel_err(g, flat_grad(tr.params)) < 1e-5


def test_update_lowers_flow_matching_error_of_the_positive_set(make_trainer):
    tr = make_trainer("engine.name=dgpo")
    perturb(tr, 0.05)
    ro = tr.rollout()
    units = _units(ro)
    before = _errors(tr, ro, units)
    tr.backward(ro)
    with torch.no_grad():
        for p in tr.params:
            p.sub_(1e-3 * p.grad)
    de = _errors(tr, ro, units) - before
    adv = units["adv"]
    assert float((adv * de).sum()) < 0
    assert float(de[adv > 0].mean()) < 0 < float(de[adv < 0].mean())


def test_lora_trains_only_the_adapter_and_matches_autograd(make_trainer):
    tr = make_trainer("engine.name=dgpo", "model.lora_rank=4", "train.group_size=4")
    assert all("lora" in n for n in tr.policy.named_trainable_parameters())
    assert tr.policy._ref is None  # the reference is the base model with the adapter disabled
    perturb(tr, 0.2)  # moves the adapter only (the trainer's params)
    ro = tr.rollout()
    tr.backward(ro)
    g_engine = flat_grad(tr.params)
    units = _units(ro)
    e_ref = _errors(tr, ro, units, reference=True)
    for p in tr.params:
        p.grad = None
    e = _errors(tr, ro, units, grad=True)
    assert float((e.detach() - e_ref).abs().max()) > 1e-5
    _hand_loss(e, e_ref, units).backward()
    assert rel_err(g_engine, flat_grad(tr.params)) < 1e-4


def test_full_fine_tune_keeps_a_frozen_reference_without_kl(make_trainer):
    tr = make_trainer("engine.name=dgpo")
    assert tr.cfg.loss.beta == 0 and tr.policy._ref is not None
    assert make_trainer("engine.name=nft").policy._ref is None


def test_training_forwards_are_cfg_free(make_trainer):
    tr = make_trainer("engine.name=dgpo", "model.guidance_scale=3.0")
    perturb(tr, 0.05)
    assert tr.policy.uses_cfg
    ro = tr.rollout()
    stats = tr.backward(ro)
    assert stats.sample_backwards == int(ro.selected.sum())
    g_cfg = flat_grad(tr.params)
    tr.policy.guidance_scale = 1.0
    tr.family.ctx.forward_mult = 1
    tr.backward(ro)
    assert rel_err(g_cfg, flat_grad(tr.params)) < 1e-6


# ---------------------------------------------------------------------- planning and config
def test_plan_draws_high_noise_times_and_group_shared_noise(make_trainer):
    g = torch.Generator().manual_seed(0)
    idx = truncated_grid_times(10, 3, 4, 0.6, g)
    assert idx.shape == (3, 4) and len(set(idx[0].tolist())) == 4 and int(idx.max()) <= 6
    assert torch.equal(idx[0], idx[1]) and torch.equal(idx[0], idx[2])
    tr = make_trainer("engine.name=dgpo", "train.group_size=3", "train.prompts_per_batch=2")
    ro = tr.rollout()
    st = ro.traj.engine_state
    assert bool((ro.traj.noise == 0).all())  # ODE rollout
    assert ro.selected[:, :4].all() and not ro.selected[:, 4:].any()
    assert int(st.idx.max()) <= int(0.6 * 6)
    gid = ro.group_ids
    for i in range(ro.batch_size):
        for k in range(ro.batch_size):
            same = torch.equal(st.noise[i], st.noise[k])
            assert same == bool(gid[i] == gid[k])


def test_config_keys_and_errors():
    validate(RunConfig.from_overrides(["engine.name=dgpo", "sampler.sde_type=ode", "engine.dgpo_beta=10"]))
    cases = {("engine.name=nft", "engine.dgpo_beta=10"): "engine.dgpo_beta: does not apply",
             ("engine.name=dgpo", "engine.nft_beta=0.5"): "engine.nft_beta: does not apply",
             ("engine.name=dgpo", "steps.mode=random"): "steps.mode: does not apply",
             ("engine.name=dgpo", "engine.dgpo_beta=0"): "engine.dgpo_beta",
             ("engine.name=dgpo", "engine.forward_timesteps=5"): "engine.forward_timesteps",
             ("engine.name=dgpo", "dist.mode=ddp", "dist.group_layout=spread"): "dist.group_layout"}
    for ov, msg in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(RunConfig.from_overrides(["sampler.num_steps=6", *ov]))
        assert msg in str(e.value) and "\n" not in str(e.value)
