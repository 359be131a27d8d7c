"""``advantage.per_reward_norm``: GDPO-style decoupled group normalisation of a weighted sum of rewards, against a
numpy reference, and through a flow rollout with two rewards."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.advantages import group_advantages, per_reward_advantages
from diffgrpo.config import ConfigError


def _numpy_gdpo(r: np.ndarray, w: np.ndarray, gids: np.ndarray, eps=1e-4, clip=5.0) -> np.ndarray:
    per = np.zeros_like(r)
    for k in range(r.shape[0]):
        for g in np.unique(gids):
            m = gids == g
            per[k, m] = (r[k, m] - r[k, m].mean()) / (r[k, m].std(ddof=1) + eps)
    a = (w[:, None] * per).sum(0)
    return np.clip(a / (a.std(ddof=1) + eps), -clip, clip)


def test_per_reward_advantages_match_numpy_and_decouple_the_scales():
    g = np.random.default_rng(0)
    gids = np.repeat(np.arange(3), 4)
    r = np.stack([g.normal(size=12) * 100.0, g.normal(size=12)])  # one reward 100× the other's spread
    w = np.array([1.0, 2.0])
    got, stats = per_reward_advantages(torch.tensor(r), torch.tensor(w), torch.tensor(gids))
    np.testing.assert_allclose(got.numpy(), _numpy_gdpo(r, w, gids), rtol=1e-5, atol=1e-5)
    summed, _ = group_advantages(torch.tensor((w[:, None] * r).sum(0)), torch.tensor(gids))
    # the summed reward's advantages follow the large reward; the decoupled ones weigh both
    big = group_advantages(torch.tensor(r[0]), torch.tensor(gids))[0]
    assert float(torch.corrcoef(torch.stack([summed, big]))[0, 1]) > 0.999
    assert float(torch.corrcoef(torch.stack([got, big]))[0, 1]) < 0.9
    assert stats["num_invalid"] == 0 and 0 <= stats["frac_reward_zero_std"] <= 1
    # an invalid sample (a non-finite component) gets 0 and stays out of the statistics
    r2 = r.copy()
    r2[1, 5] = np.nan
    got2, stats2 = per_reward_advantages(torch.tensor(r2), torch.tensor(w), torch.tensor(gids))
    assert float(got2[5]) == 0.0 and stats2["num_invalid"] == 1 and torch.isfinite(got2).all()


def test_per_reward_norm_in_a_flow_rollout(make_trainer):
    tr = make_trainer("reward.weights={jpeg_incompressibility: 1.0, tests.test_bench_quality:mean_brightness: 3.0}",
                      "advantage.per_reward_norm=true")
    ro = tr.rollout()
    comps = ro.reward_components
    want, _ = per_reward_advantages(torch.stack([comps["jpeg_incompressibility"],
                                                 comps["tests.test_bench_quality:mean_brightness"]]),
                                    torch.tensor([1.0, 3.0]), ro.group_ids.cpu())
    torch.testing.assert_close(ro.advantages.cpu(), want)
    plain, _ = group_advantages(ro.rewards, ro.group_ids.cpu())
    assert not torch.allclose(ro.advantages.cpu(), plain)  # the option changes the advantages
    with pytest.raises(ConfigError, match="advantage.per_reward_norm: does not apply to model.name=tiny_mlm"):
        RunConfig.from_overrides(["model.name=tiny_mlm", "advantage.per_reward_norm=true"])
