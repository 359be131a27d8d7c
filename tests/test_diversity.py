"""Diversity objectives (diffgrpo.diversity): zero effect when off, closed forms on identical and distinct groups,
the gradient against hand-built advantages, every flow engine with every method, one process equals two ranks."""
from __future__ import annotations

import tempfile

import pytest
import torch
import torch.multiprocessing as mp

from diffgrpo import diversity
from diffgrpo.config import AdvantageConfig, ConfigError, RunConfig
from diffgrpo.distributed import WorldInfo
from diffgrpo.diversity import diversegrpo, drift, gardo
from diffgrpo.engines import ENGINES
from diffgrpo.loss_weights import grpo_loss_weights
from tests.helpers.distributed import free_port, join_gloo

EYE = torch.eye(4)  # four mutually orthogonal feature rows: every pairwise cosine distance is 1
SAME = torch.ones(4, 3)  # four identical rows
ONE_GROUP = torch.zeros(4, dtype=torch.long)


# ---------------------------------------------------------------------- closed forms
def test_identical_group_gets_no_amplification_constant_bonus_and_no_shaping():
    assert torch.equal(gardo.normalised_diversity(SAME, ONE_GROUP), torch.zeros(4))
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    assert torch.equal(gardo.amplify(adv, torch.zeros(4), 3.0), adv)
    sizes, clusters = diversegrpo.cluster_sizes(SAME, ONE_GROUP, 0.05)
    assert sizes.tolist() == [4.0] * 4 and clusters.tolist() == [1]
    assert torch.allclose(diversegrpo.cluster_bonus(sizes, 0.4), torch.full((4,), 0.1))
    assert torch.equal(drift.diversity_shaping(SAME, ONE_GROUP, 2.0), torch.zeros(4))


def test_distinct_group_closed_forms():
    assert torch.allclose(gardo.normalised_diversity(EYE, ONE_GROUP), torch.ones(4))
    adv = torch.tensor([1.0, -1.0, 0.5, 0.0])
    assert torch.allclose(gardo.amplify(adv, torch.ones(4), 2.0), torch.tensor([3.0, -1.0, 1.5, 0.0]))
    sizes, clusters = diversegrpo.cluster_sizes(EYE, ONE_GROUP, 0.05)
    assert sizes.tolist() == [1.0] * 4 and clusters.tolist() == [1 * 4]
    assert torch.allclose(drift.diversity_shaping(EYE, ONE_GROUP, 2.0), torch.zeros(4), atol=1e-6)  # equidistant


def test_mixed_group_closed_forms():
    """Rows 0 and 1 coincide, row 2 is orthogonal to both: d01 = 0, d02 = d12 = 1, Φ(G) = 2/3,
    Φ(G∖0) = Φ(G∖1) = 1, Φ(G∖2) = 0; cluster sizes 2, 2, 1; nearest-neighbour distances 0, 0, 1."""
    f, g = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 1.0]]), torch.zeros(3, dtype=torch.long)
    assert torch.allclose(drift.diversity_shaping(f, g, 3.0), torch.tensor([-1.0, -1.0, 2.0]), atol=1e-6)
    assert diversegrpo.cluster_sizes(f, g, 0.05)[0].tolist() == [2.0, 2.0, 1.0]
    assert torch.allclose(gardo.normalised_diversity(f, g), torch.tensor([0.0, 0.0, 1.0]))


def test_reward_concentrated_subset_drops_the_outliers_of_each_group():
    r = torch.tensor([0.0, 1.0, 1.1, 1.2, 10.0, 5.0, 5.0, float("nan"), 5.0, 5.0])
    g = torch.tensor([0] * 5 + [1] * 5)
    keep = drift.concentrated_subset(r, g, 0.6)
    assert keep.tolist() == [False, True, True, True, False] + [True, True, False, False, False]  # 3 of 5; 2 of 4, ties in order
    assert drift.concentrated_subset(r, g, 1.0).tolist() == torch.isfinite(r).tolist()


def test_the_kl_side_functions():
    u = torch.tensor([0.1, 0.9, 0.5, 0.7])
    assert gardo.uncertainty_gate(u, 0.5).tolist() == [False, True, False, True]
    assert gardo.uncertainty_gate(u, 0.0).all()
    assert [gardo.refresh_due(i, 3) for i in range(7)] == [False, False, False, True, False, False, True]
    w = diversegrpo.early_step_weights(torch.tensor([1.0, 0.5, 0.25, 0.0]))
    assert torch.allclose(w, torch.tensor([3 / 1.75, 1.5 / 1.75, 0.75 / 1.75])) and bool((w[:-1] > w[1:]).all())


def test_compose_and_parse():
    a = diversity.Part(bonus=torch.ones(2), subset=torch.tensor([True, False]), adjust=lambda x: x * 2)
    b = diversity.Part(bonus=torch.ones(2), subset=torch.tensor([True, True]), adjust=lambda x: x + 1)
    c = diversity.compose([a, b])
    assert c.bonus.tolist() == [2.0, 2.0] and c.subset.tolist() == [True, False]
    assert c.adjust(torch.tensor([1.0])).tolist() == [3.0]
    assert diversity.parse_methods("off", diversity.METHODS) == ()
    assert diversity.parse_methods("drift,gardo", diversity.METHODS) == ("drift", "gardo")
    for bad in ("gardo,off", "gardo,gardo", "nope"):
        with pytest.raises(ValueError):
            diversity.parse_methods(bad, diversity.METHODS)


@pytest.mark.parametrize("overrides, words", [
    (["diversity.method=nope"], "unknown method"),
    (["diversity.method=gardo", "eval.guard_features=none"], "feature space"),
    (["model.name=diffusers", "model.pretrained=org/model", "reward.weights={jpeg_incompressibility: 1.0}",
      "diversity.method=gardo"], r"^diversity\.method: needs a feature space .*eval\.guard_features=auto gives none "
                                 r"here \(use clip, a module:function, or digits with train\.task=digits\)$"),
    (["train.task=digits", "diversity.method=gardo", "dist.group_layout=spread"], "spread"),
    (["train.task=digits", "diversity.method=drift", "advantage.per_reward_norm=true",
      "reward.weights={jpeg_incompressibility: 1.0}"], "per_reward_norm"),
    (["model.name=tiny_mlm", "diversity.method=gardo"], "diversity.method"),
])
def test_combinations_that_cannot_apply_are_refused(overrides, words):
    with pytest.raises(ConfigError, match=words):
        RunConfig.from_overrides(overrides)


# ---------------------------------------------------------------------- through the trainer
NEUTRAL = ["diversity.method=[gardo,diversegrpo,drift]", "diversity.gardo_amplify=0", "diversity.cluster_bonus=0",
           "diversity.drift_subset=1", "diversity.drift_shaping=0"]


def _two_iterations(make_trainer, *overrides):
    t = make_trainer("engine.name=recompute", *overrides)
    for _ in range(2):
        t.step()
    return [p.detach().clone() for p in t.params], [p.grad.clone() for p in t.params if p.grad is not None]


def test_off_is_bitwise_todays_training_and_a_method_changes_it(make_trainer):
    """Neutral knobs (every part on, every strength 0) train bit for bit like diversity.method=off; a method at a
    non-zero strength does not."""
    off_w, off_g = _two_iterations(make_trainer)
    n_w, n_g = _two_iterations(make_trainer, *NEUTRAL)
    assert all(torch.equal(a, b) for a, b in zip(off_w, n_w)) and all(torch.equal(a, b) for a, b in zip(off_g, n_g))
    on_w, _ = _two_iterations(make_trainer, "diversity.method=diversegrpo", "diversity.cluster_bonus=5")
    assert not all(torch.equal(a, b) for a, b in zip(off_w, on_w))


def test_gradient_equals_the_hand_amplified_advantages(make_trainer):
    """GARDO through the family equals recompute on advantages amplified by hand: A·(1 + λ·d_i/max d) where A > 0,
    d_i the smallest 1 − cos to another member of the group, in the digit classifier's features."""
    t = make_trainer("engine.name=recompute", "diversity.method=gardo", "diversity.gardo_amplify=2")
    fam = t.family
    ro = fam.rollout()
    t.optimizer.zero_grad(set_to_none=True)
    fam.backward(ro, 0)
    got = [p.grad.clone() for p in t.params]
    feats = fam.features(ro.traj.images).float()
    fam.diversity = ()
    fam.weigh(ro)  # off: today's advantages
    adv = ro.advantages.clone()
    for g in ro.group_ids.unique():
        rows = (ro.group_ids == g).nonzero().flatten().tolist()
        d = []
        for i in rows:
            cos = [float(torch.dot(feats[i], feats[j]) / (feats[i].norm() * feats[j].norm())) for j in rows if j != i]
            d.append(min(1 - c for c in cos))
        for i, di in zip(rows, d):
            if adv[i] > 0:
                adv[i] = adv[i] * (1 + 2 * di / max(d))
    assert not torch.allclose(adv, ro.advantages)  # the hand amplification changed something
    ro.advantages = adv
    t.optimizer.zero_grad(set_to_none=True)
    fam.backward(ro, 0)
    for a, b in zip(got, [p.grad for p in t.params]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


FLOW_ENGINES = ["recompute", "jagg", "retain", "reweight", "single_step", "nft", "awm", "dgpo"]


@pytest.mark.parametrize("method", diversity.METHODS)
@pytest.mark.parametrize("engine", FLOW_ENGINES)
def test_every_flow_engine_trains_with_every_method(make_trainer, engine, method):
    assert engine in ENGINES
    t = make_trainer(f"engine.name={engine}", f"diversity.method={method}")
    row = t.step()
    assert any(k.startswith("diversity/") for k in row)
    assert all(torch.isfinite(p).all() for p in t.params)


# ---------------------------------------------------------------------- one process = two ranks
def _batch(seed: int = 0):
    """Two ranks' batches of two groups of three: rewards (12,), features (12, 5), local group ids."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(12, 5, generator=g)
    feats[1] = feats[0]  # a duplicate pair inside a group
    return torch.rand(12, generator=g), feats, torch.arange(4).repeat_interleave(3)


def _weights(rewards, feats, gids, world: WorldInfo, knobs):
    part = diversity.compose([diversity.DIVERSITY[m](knobs, feats, rewards, gids) for m in diversity.METHODS])
    return grpo_loss_weights(rewards, gids, torch.ones(len(rewards), 4, dtype=torch.bool),
                             adv_cfg=AdvantageConfig(), aggregation="mean", world=world, bonus=part.bonus,
                             subset=part.subset, adjust=part.adjust)


def _rank(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    join_gloo(rank, world, port)
    try:
        rewards, feats, gids = _batch()
        rows = slice(rank * 6, rank * 6 + 6)
        knobs = RunConfig().diversity
        w = _weights(rewards[rows], feats[rows], gids[rows] - 2 * rank, WorldInfo(rank, world, rank), knobs)
        torch.save({"adv": w.advantages, "weights": w.loss_weights, "trained": w.trained}, f"{out}/{rank}.pt")
    finally:  # a process group left to the interpreter's exit can abort the rank (SIGABRT in gloo's teardown)
        dist.destroy_process_group()


def test_one_process_equals_two_ranks():
    rewards, feats, gids = _batch()
    one = _weights(rewards, feats, gids, WorldInfo(0, 1, 0), RunConfig().diversity)
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_rank, args=(2, free_port(), d), nprocs=2, join=True)
        parts = [torch.load(f"{d}/{r}.pt") for r in range(2)]
    assert not one.trained.all()  # drift's subset left samples out
    torch.testing.assert_close(torch.cat([p["adv"] for p in parts]), one.advantages, rtol=0, atol=1e-6)
    assert torch.equal(torch.cat([p["trained"] for p in parts]), one.trained)
    torch.testing.assert_close(torch.cat([p["weights"] for p in parts]) / 2, one.loss_weights, rtol=1e-6, atol=0)
