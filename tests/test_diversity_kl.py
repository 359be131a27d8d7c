"""The KL side of the diversity objectives: GARDO's gated regularisation (a per-sample KL weight), DiverseGRPO's
early-step weights (a per-step KL weight), their path into every flow engine, and one process = two ranks."""
from __future__ import annotations

import dataclasses
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from diffgrpo.config import AdvantageConfig, ConfigError, RunConfig
from diffgrpo.distributed import WorldInfo
from diffgrpo.diversity import diversegrpo, gardo
from diffgrpo.engines import ENGINES
from diffgrpo.loss_weights import grpo_loss_weights
from diffgrpo.losses import ppo_clip_loss
from diffgrpo.samplers import flow_sde
from tests.helpers.distributed import free_port, join_gloo

FLOW_ENGINES = ["recompute", "jagg", "retain", "reweight", "single_step", "nft", "awm", "dgpo"]


# ---------------------------------------------------------------------- closed forms
def test_gate_keeps_exactly_the_top_quantile_of_the_valid_samples():
    adv = torch.tensor([0.1, -2.0, 0.5, 1.5, -0.2, 3.0, 0.0, -1.0])
    valid = torch.tensor([True] * 7 + [False])
    # |A| of the valid seven: 0.1 2.0 0.5 1.5 0.2 3.0 0.0; the 0.5-quantile is the median, 0.5
    w = gardo.kl_gate_weights(adv, valid, 0.5)
    assert w.tolist() == [0, 1, 1, 1, 0, 1, 0, 0]
    assert w.dtype == torch.float32
    assert gardo.kl_gate_weights(adv, valid, 1.0).tolist() == [0, 0, 0, 0, 0, 1, 0, 0]  # the largest alone
    assert gardo.uncertainty_gate(adv.abs(), 0.0).all()  # 0: every sample, the invalid one included
    assert not gardo.uncertainty_gate(adv.abs(), 0.5, torch.zeros(8, dtype=torch.bool)).any()


def test_step_weights_have_mean_one_grow_with_noise_and_power_zero_is_uniform():
    sig = flow_sde.sigma_grid(6, 3.0)  # (7,)
    for p in (0.5, 1.0, 2.0):
        w = diversegrpo.early_step_weights(sig, p)  # (6,)
        torch.testing.assert_close(w.mean(), torch.tensor(1.0), rtol=0, atol=1e-6)
        torch.testing.assert_close(w, sig[:-1] ** p / (sig[:-1] ** p).mean(), rtol=1e-6, atol=0)
        assert bool((w[:-1] > w[1:]).all())  # the high-noise (early) steps weigh most
    assert torch.equal(diversegrpo.early_step_weights(sig, 0.0), torch.ones(6))


@pytest.mark.parametrize("overrides, words", [
    (["diversity.gardo_gate=0.5"], "loss.beta > 0"),
    (["diversity.step_weight_power=1"], "loss.beta > 0"),
    (["diversity.gardo_ref_every=2"], "loss.beta > 0"),
    (["diversity.gardo_gate=1.5", "loss.beta=0.1"], "gardo_gate"),
    (["model.name=tiny_mlm", "loss.beta=0.1", "diversity.gardo_gate=0.5"], "diversity.gardo_gate"),
])
def test_kl_knobs_that_cannot_apply_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig.from_overrides(overrides)


# ---------------------------------------------------------------------- through every engine
def _one_step(make_trainer, engine, *overrides, patch_weights=None):
    """Parameters after one update from a policy moved off its reference (else the KL gradient is 0)."""
    t = make_trainer(f"engine.name={engine}", "loss.beta=0.5", *overrides)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in t.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    if patch_weights is not None:
        fam, weigh = t.family, t.family.weigh

        def patched(ro, wave=None):
            weigh(ro, wave=wave)
            ro.kl_weights = patch_weights(ro)

        fam.weigh = patched
    t.step()
    return [p.detach().clone() for p in t.params]


@pytest.mark.parametrize("engine", FLOW_ENGINES)
def test_unit_kl_weights_are_bitwise_todays_update_and_the_knobs_change_it(make_trainer, engine):
    """Weights of exactly 1 on every sample reach each engine's KL term and leave its update bit for bit as
    without them; the gate and the step weights change it."""
    assert engine in ENGINES
    today = _one_step(make_trainer, engine)
    ones = _one_step(make_trainer, engine, patch_weights=lambda ro: torch.ones(len(ro.rewards)))
    assert all(torch.equal(a, b) for a, b in zip(today, ones))
    gated = _one_step(make_trainer, engine, "diversity.gardo_gate=0.5")
    assert not all(torch.equal(a, b) for a, b in zip(today, gated))
    stepped = _one_step(make_trainer, engine, "diversity.step_weight_power=2")
    assert not all(torch.equal(a, b) for a, b in zip(today, stepped))


def test_gradient_equals_a_hand_computation(make_trainer):
    """recompute's gradient with the gate and the step weights equals ∇ Σ_ik w_ik (L^clip_ik + β·g_i·s_k·KL_ik)
    formed by hand from the step density (g: the gate, s: σ_k^p over its mean)."""
    beta, power = 0.5, 2.0
    t = make_trainer("engine.name=recompute", f"loss.beta={beta}", "diversity.gardo_gate=0.5",
                     f"diversity.step_weight_power={power}")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in t.params:
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    fam = t.family
    ro = fam.rollout()
    assert ro.kl_weights is not None and 0 < float(ro.kl_weights.sum()) < len(ro.kl_weights)
    assert ro.advantage_stats["diversity/kl_gated_share"] == float(ro.kl_weights[ro.valid].mean())
    t.optimizer.zero_grad(set_to_none=True)
    fam.backward(ro, 0)
    got = [p.grad.clone() for p in t.params]

    tr, pol = ro.traj, fam.policy
    gate = (ro.advantages.abs() >= torch.quantile(ro.advantages.abs(), 0.5)).float()  # (B,)
    s = tr.sigmas[:-1] ** power
    s = s / s.mean()  # (T,)
    t.optimizer.zero_grad(set_to_none=True)
    for k in range(tr.sigmas.numel() - 1):
        idx = ro.selected[:, k].nonzero().flatten()
        if idx.numel() == 0:
            continue
        cond = {key: v[idx] for key, v in tr.cond.items()}
        sig = tr.sigmas[k].expand(len(idx))
        with torch.no_grad(), pol.reference():
            v_ref = pol.velocity(tr.xs[idx, k], sig, cond)
        with torch.enable_grad():
            v = pol.velocity(tr.xs[idx, k], sig, cond)
            out = flow_sde.step(v, tr.sigmas[k], tr.sigmas[k + 1], tr.xs[idx, k], prev_sample=tr.xs[idx, k + 1],
                                **fam.kernel)
            ref = flow_sde.step(v_ref, tr.sigmas[k], tr.sigmas[k + 1], tr.xs[idx, k], prev_sample=tr.xs[idx, k + 1],
                                **fam.kernel).mean
            kl = ((out.mean - ref) ** 2).flatten(1).mean(1) / (2 * out.std ** 2)  # (n,)
            pg = ppo_clip_loss(out.log_prob, tr.log_probs[idx, k], ro.advantages[idx], fam.ctx.clip_range)[0]
            loss = (ro.loss_weights[idx, k] * (pg + beta * gate[idx] * s[k] * kl)).sum()
            loss.backward()
    for a, b in zip(got, [p.grad for p in t.params]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------- one process = two ranks
def _batch():
    """Two ranks × two groups of three: rank 0's groups evenly spread (|z| = 1, 0, 1), rank 1's with a tie
    (|z| = 1/√3, 1/√3, 2/√3)."""
    rewards = torch.tensor([0.0, 0.5, 1.0, 0.2, 0.7, 1.2, 0.0, 0.0, 1.0, 0.3, 0.3, 0.9])
    return rewards, torch.arange(4).repeat_interleave(3)


def _gate(rewards, gids, world: WorldInfo):
    return grpo_loss_weights(rewards, gids, torch.ones(len(rewards), 4, dtype=torch.bool), adv_cfg=AdvantageConfig(),
                             aggregation="mean", world=world, kl_gate=0.5)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port)
    try:
        rewards, gids = _batch()
        rows = slice(rank * 6, rank * 6 + 6)
        w = _gate(rewards[rows], gids[rows] - 2 * rank, WorldInfo(rank, world, rank))
        torch.save({"kl": w.kl_weights, "share": w.stats["diversity/kl_gated_share"]}, f"{out}/{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_the_gate_quantile_is_over_the_global_batch():
    """Two ranks gate exactly the samples one process gates: the median |z| of all twelve lies between 1/√3 and 1,
    so rank 0's four |z| = 1 and rank 1's two 2/√3 are gated (rank 1 on its own, its median ≈ 1/√3, would gate four or more)."""
    rewards, gids = _batch()
    one = _gate(rewards, gids, WorldInfo(0, 1, 0))
    assert one.kl_weights.tolist() == [1, 0, 1, 1, 0, 1] + [0, 0, 1, 0, 0, 1]
    assert _gate(rewards[6:], gids[6:] - 2, WorldInfo(0, 1, 0)).kl_weights.sum() >= 4  # a per-rank quantile
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(2, free_port(), d), nprocs=2, join=True)
        parts = [torch.load(f"{d}/{r}.pt") for r in range(2)]
    assert torch.equal(torch.cat([p["kl"] for p in parts]), one.kl_weights)
    assert parts[0]["share"] == parts[1]["share"] == one.stats["diversity/kl_gated_share"] == 0.5


# ---------------------------------------------------------------------- the adaptive reference
def test_the_adaptive_reference_refreshes_on_its_clock_and_resumes_bitwise(make_trainer, tmp_path):
    """Every 2 iterations the reference becomes the policy (bitwise); a checkpoint after a refresh restores that
    reference and its clock, and the resumed run's next update equals the uninterrupted one's bit for bit (without
    the restored reference it does not)."""
    from diffgrpo.diversity.reference import reference_weights
    from diffgrpo.run.checkpoint import load_checkpoint

    args = ("loss.beta=0.5", "diversity.gardo_ref_every=2", f"log.output_dir={tmp_path / 'run'}")
    t = make_trainer(*args)
    ref0 = {n: p.clone() for n, p in reference_weights(t.policy).items()}
    row = t.step()
    assert row["diversity/ref_refreshes"] == 0 and row["diversity/ref_age"] == 1
    assert all(torch.equal(p, ref0[n]) for n, p in reference_weights(t.policy).items())
    row = t.step()
    assert row["diversity/ref_refreshes"] == 1 and row["diversity/ref_age"] == 0
    online = t.policy.named_trainable_parameters()
    assert all(torch.equal(p, online[n]) for n, p in reference_weights(t.policy).items())
    assert not all(torch.equal(p, ref0[n]) for n, p in reference_weights(t.policy).items())
    t.step()  # iteration 3: the policy moves on, the reference stays
    ref2 = {n: p.clone() for n, p in reference_weights(t.policy).items()}
    st = load_checkpoint(t.save_checkpoint())
    assert st.reference is not None and st.extra["reference"] == {"last": 2, "refreshes": 1}

    resumed = make_trainer(*args)
    resumed.load_state(st)
    assert all(torch.equal(p, ref2[n]) for n, p in reference_weights(resumed.policy).items())
    assert (resumed.adaptive_ref.last, resumed.adaptive_ref.refreshes) == (2, 1)
    bare = make_trainer(*args)
    bare.load_state(dataclasses.replace(st, reference=None))
    t.step()
    resumed.step()
    bare.step()
    assert all(torch.equal(a, b) for a, b in zip(t.params, resumed.params))
    assert not all(torch.equal(a, b) for a, b in zip(t.params, bare.params))


def test_the_adaptive_reference_is_refused_where_it_has_no_weights_to_reset():
    for extra in (["model.lora_rank=2"], ["dist.mode=fsdp2"]):
        with pytest.raises(ConfigError, match="gardo_ref_every"):
            RunConfig.from_overrides(["loss.beta=0.1", "diversity.gardo_ref_every=2", *extra])
