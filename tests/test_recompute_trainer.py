"""The recompute baseline and the trainer around it, on the real tiny SD3 transformer."""
import dataclasses
import json

import pytest
import torch

from diffgrpo.engines import ENGINES, FORWARD_ENGINES
from diffgrpo.engines.base import reference_velocity, step_loss
from diffgrpo.engines.jagg import anchor_mask
from diffgrpo.rewards import REWARDS, RewardError
from diffgrpo.samplers.flow_sde import step
from tests.helpers.tensors import flat_grad, perturb, rel_err


@pytest.mark.parametrize("sde_type", ["flow_sde", "dance_sde", "cps"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_first_update_ratio_is_one(make_trainer, sde_type, cfg_scale):
    tr = make_trainer(f"sampler.sde_type={sde_type}", f"model.guidance_scale={cfg_scale}", "loss.beta=0.05",
                      "sampler.noise_level=0.5")
    ro = tr.rollout()
    stats = tr.backward(ro)
    assert stats.metrics["ratio_max_dev"] < 1e-5
    assert stats.metrics["clip_ratio"] == 0.0
    assert stats.metrics["kl"] < 1e-10  # θ = θ_ref before the first update
    assert stats.metrics["trained_pairs"] == int(ro.selected.sum())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in tr.params)


def test_rollout_records_are_consistent_with_the_step_function(make_trainer):
    tr = make_trainer()
    ro = tr.rollout()
    T = ro.traj.num_steps
    for k in range(T):
        out = step(ro.traj.velocities[:, k], ro.traj.sigmas[k], ro.traj.sigmas[k + 1], ro.traj.xs[:, k], noise=ro.traj.noise[:, k], **tr.family.kernel)
        torch.testing.assert_close(out.prev_sample, ro.traj.xs[:, k + 1])
        torch.testing.assert_close(out.log_prob, ro.traj.log_probs[:, k])
    assert torch.all(ro.traj.log_probs[:, -1] == 0) and torch.all(ro.traj.noise[:, -1] == 0)
    assert not ro.selected[:, -1].any() and ro.selected[:, :-1].all()
    # velocities are the policy's at the stored states
    with torch.no_grad():
        v = tr.policy.velocity(ro.traj.xs[:, 2], ro.traj.sigmas[2].expand(ro.batch_size), ro.traj.cond)
    torch.testing.assert_close(v, ro.traj.velocities[:, 2])


def _direct_gradient(tr, ro):
    """Σ w·L built in one graph over all selected pairs, then one backward: an independent reference."""
    tr.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for k in range(ro.traj.num_steps):
        idx = ro.selected[:, k].nonzero().flatten()
        if len(idx) == 0:
            continue
        v_ref = reference_velocity(tr.family.ctx, ro, idx, k)
        v = tr.policy.velocity(ro.traj.xs[idx, k], ro.traj.sigmas[k].expand(len(idx)), {n: c[idx] for n, c in ro.traj.cond.items()})
        loss, _ = step_loss(tr.family.ctx, ro, idx, k, v, v_ref)
        total = total + loss
    total.backward()
    return flat_grad(tr.params)


@pytest.mark.parametrize("extra", [[], ["loss.beta=0.1", "model.guidance_scale=2.0"], ["steps.mode=random", "steps.fraction=0.5"]])
def test_recompute_equals_direct_gradient_and_micro_batching_is_invariant(make_trainer, extra):
    tr = make_trainer(*extra)
    ro = tr.rollout()
    g_direct = _direct_gradient(tr, ro)
    tr.backward(ro)
    g_full = flat_grad(tr.params)
    tr.family.ctx.micro_batch_size = 1
    stats = tr.backward(ro)
    g_mb = flat_grad(tr.params)
    assert rel_err(g_full, g_direct) < 1e-5
    assert rel_err(g_mb, g_full) < 1e-5
    n_pairs = int(ro.selected.sum())
    mult = 2 if tr.policy.uses_cfg else 1
    assert stats.backward_calls == n_pairs and stats.sample_backwards == n_pairs * mult
    assert stats.forwards_grad == n_pairs * mult
    assert stats.forwards_nograd == (n_pairs * mult if tr.cfg.loss.beta > 0 else 0)


# the forward-process engines (nft, awm) optimise another objective; tests/test_forward_engines.py covers them
@pytest.mark.parametrize("name", sorted(set(ENGINES) - set(FORWARD_ENGINES)))
def test_every_registered_engine_built_from_config_trains_the_direct_gradient(make_trainer, name):
    """Every registered engine, built by the trainer from its config name (with CFG and β > 0, θ ≠ θ_ref), gives
    the direct gradient of its own rollout (single_step: its one step per trajectory), or for JAGG (Jacobians
    interpolated inside windows of 4 steps) a close approximation; every training forward with grad (in the
    rollout or in the backward) is of an evaluated pair, and each is back-propagated once."""
    tr = make_trainer(f"engine.name={name}", "loss.beta=0.05", "model.guidance_scale=3.0")
    assert isinstance(tr.family.engine, ENGINES[name])
    perturb(tr)
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    rollout_grad = tr.policy.counters["forwards_grad"] - c0["forwards_grad"]
    stats = tr.backward(ro)
    g = flat_grad(tr.params)
    g_direct = _direct_gradient(tr, ro)
    assert g_direct.norm() > 0
    n_pairs = int(ro.selected.sum())
    if name == "jagg":  # evaluates the window endpoints only
        assert 1e-3 < rel_err(g, g_direct) < 0.25  # measured 0.14
        n_eval = int(anchor_mask(ro.selected, tr.family.engine.window).sum())
        assert n_eval < n_pairs
    else:
        assert rel_err(g, g_direct) < 1e-5
        n_eval = n_pairs
    assert stats.metrics["trained_pairs"] == n_pairs and stats.metrics["kl"] > 0
    assert rollout_grad + stats.forwards_grad == 2 * n_eval  # × 2: CFG's conditional and unconditional rows
    terms = 2 if name == "reweight" else 1  # reweight back-propagates the policy and the KL term separately
    assert stats.sample_backwards == 2 * n_eval * terms


def test_counters_and_memory_are_reported(make_trainer):
    tr = make_trainer()
    ro = tr.rollout()
    stats = tr.backward(ro)
    assert stats.engine == "recompute" and stats.peak_memory_bytes > 0
    assert stats.seconds["train"] > 0
    # one chunk per step holds one forward's activations: more samples per chunk → more memory
    tr.family.ctx.micro_batch_size = 1
    small = tr.backward(ro).peak_memory_bytes
    assert small < stats.peak_memory_bytes


def test_inner_epochs_move_the_ratio_and_clip(make_trainer):
    tr = make_trainer("train.num_inner_epochs=2", "loss.clip_range=1e-5", "train.lr=1e-3")
    ro = tr.rollout()
    tr.update(ro)
    stats = tr.backward(ro, epoch=1)
    assert stats.metrics["ratio_max_dev"] > 1e-5
    assert stats.metrics["clip_ratio"] > 0


def test_seeded_runs_are_reproducible_and_seeds_differ(make_trainer):
    rows = []
    for seed in (0, 0, 1):
        tr = make_trainer(seed=seed)
        row = tr.step()
        rows.append((row["reward"], flat_grad(tr.params).sum().item(),
                     torch.cat([p.detach().flatten() for p in tr.params]).clone()))
    assert rows[0][0] == rows[1][0]
    assert torch.equal(rows[0][2], rows[1][2])
    assert rows[0][0] != rows[2][0]


def test_nan_reward_is_excluded_and_raising_reward_names_itself(make_trainer, monkeypatch):
    def half_nan(images, prompts, metadata):
        r = images.flatten(1).mean(1)
        r[0] = float("nan")
        return r

    monkeypatch.setitem(REWARDS, "half_nan", half_nan)
    logs = []
    tr = make_trainer("reward.weights={half_nan: 1.0}")
    tr.log = logs.append
    ro = tr.rollout()
    assert not ro.valid[0] and ro.valid[1:].all()
    assert ro.advantages[0] == 0 and not ro.selected[0].any()
    assert torch.isfinite(ro.advantages).all()
    assert any("non-finite reward" in m for m in logs)

    def broken(images, prompts, metadata):
        raise ValueError("scorer offline")

    monkeypatch.setitem(REWARDS, "broken", broken)
    tr = make_trainer("reward.weights={broken: 1.0}")
    with pytest.raises(RewardError, match="reward 'broken' raised ValueError: scorer offline .after one retry"):
        tr.rollout()


def test_weighted_multi_reward_logs_each_component(make_trainer):
    tr = make_trainer("reward.weights={jpeg_incompressibility: 1.0, jpeg_compressibility: 0.5}")
    ro = tr.rollout()
    c = ro.reward_components
    assert set(c) == {"jpeg_incompressibility", "jpeg_compressibility"}
    torch.testing.assert_close(ro.rewards, c["jpeg_incompressibility"] + 0.5 * c["jpeg_compressibility"])
    row = tr.step()
    assert "rewards/jpeg_compressibility/mean" in row and "rewards/jpeg_incompressibility/mean" in row


def test_train_writes_the_outputs_a_user_expects(make_trainer, tmp_path):
    tr = make_trainer("train.num_iterations=2", "eval.every=1", "eval.seeds_per_prompt=1",
                      f"log.output_dir={tmp_path}", "log.save_images=true")
    summary = tr.train()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "reward" in r]
    eval_rows = [r for r in rows if "eval/reward" in r]
    assert [r["iteration"] for r in train_rows] == [1, 2]
    assert [r["iteration"] for r in eval_rows] == [0, 1, 2]
    for key in ("reward", "reward_std", "rewards/jpeg_incompressibility/mean", "kl", "clip_ratio",
                "frac_reward_zero_std", "time/rollout", "time/train", "forwards_grad", "sample_backwards"):
        assert key in train_rows[0], key
    assert "eval/rewards/jpeg_incompressibility/mean" in eval_rows[0]
    for f in ("samples_start.png", "samples_end.png", "reward_curve.png", "weights.safetensors", "config.yaml",
              "summary.json"):
        assert (tmp_path / f).is_file(), f
    assert summary["end"]["eval/reward"] == eval_rows[-1]["eval/reward"]
    # same fixed prompts and seeds at start and end: with no update in between the evaluation is identical
    tr2 = make_trainer("eval.seeds_per_prompt=1")
    a, _ = tr2.evaluate()
    b, _ = tr2.evaluate()
    assert a == b


def test_checkpoint_rng_layout_of_earlier_versions_still_loads(make_trainer):
    """Earlier checkpoints kept the flow streams at the top level of ``rng`` (no "family" entry). Loading one
    restores the same streams, so the next rollout is the one the saving trainer would have drawn."""
    tr = make_trainer()
    tr.rollout()  # move every stream away from its seed
    st = tr.state()
    old = {"torch": st.rng["torch"], **st.rng["family"]}  # the earlier flat layout
    assert set(old) == {"torch", "prompts", "noise", "steps", "group_noise"}
    expected = tr.rollout()
    fresh = make_trainer()
    fresh.load_state(dataclasses.replace(st, rng=old, iteration=1))
    got = fresh.rollout()
    assert got.prompts == expected.prompts
    assert torch.equal(got.traj.xs, expected.traj.xs) and torch.equal(got.selected, expected.selected)
