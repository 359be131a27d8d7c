"""The KL-optimal tilted policy's diversity (studies/tilt.py) against hand computations and its defining property."""
from __future__ import annotations

import math

import pytest
import torch

from diffgrpo.feature_stats import per_prompt_diversity
from diffgrpo.studies import tilt


def test_uniform_weights_give_the_guards_diversity_exactly():
    g = torch.Generator().manual_seed(0)
    f = torch.randn(40, 5, generator=g)
    prompts = [f"p{i % 4}" for i in range(40)]
    r = torch.rand(40, generator=g)
    point = tilt.tilted_point(f, r, prompts, target=0.0)  # the base already reaches it: β = ∞
    assert point["inv_beta"] == 0.0 and point["kl"] == pytest.approx(0.0, abs=1e-12)
    assert point["diversity"] == pytest.approx(per_prompt_diversity(f, prompts), rel=1e-12)
    assert point["diversity_ratio"] == pytest.approx(1.0, rel=1e-12) and point["ess_min"] == pytest.approx(10.0)


def test_weighted_spread_by_hand():
    f = torch.tensor([[0.0], [1.0], [3.0]])
    w = torch.tensor([0.5, 0.25, 0.25])
    # Σ_{i≠j} w_i w_j d_ij = 2 (0.5·0.25·1 + 0.5·0.25·3 + 0.25·0.25·2) = 1.25; 1 − Σ w² = 0.625
    assert tilt.weighted_spread(f, w) == pytest.approx(2.0, rel=1e-12)


def test_the_solved_beta_meets_the_target_and_the_edges():
    r = torch.tensor([0.1, 0.5, 0.9, 0.2, 0.3, 0.4])
    groups = [torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5])]
    inv = tilt.solve_inv_beta(r, groups, 0.6)
    assert inv > 0 and tilt.tilted_reward(r, groups, inv) == pytest.approx(0.6, abs=1e-6)
    # by hand: the tilted mean of each prompt is Σ r e^{r/β} / Σ e^{r/β}
    by_hand = sum(sum(x * math.exp(x * inv) for x in v) / sum(math.exp(x * inv) for x in v)
                  for v in ([0.1, 0.5, 0.9], [0.2, 0.3, 0.4])) / 2
    assert by_hand == pytest.approx(0.6, abs=1e-6)
    assert tilt.solve_inv_beta(r, groups, 0.3) == 0.0  # the base's mean (0.4) is already above
    assert tilt.solve_inv_beta(r, groups, 0.65) is None  # the best samples average (0.9 + 0.4) / 2 = 0.65
    assert math.isnan(tilt.tilted_point(torch.zeros(6, 2), r, ["a"] * 3 + ["b"] * 3, 0.7)["diversity"])


def test_the_tilted_weights_are_the_nearest_in_kl_among_reweightings_with_that_mean():
    g = torch.Generator().manual_seed(1)
    r = torch.rand(50, generator=g).double()
    w = tilt.tilt_weights(r, 4.0)
    mean = float(w @ r)
    kl = float((w * torch.log(w * 50)).sum())
    for _ in range(20):  # other reweightings: the tilt times random noise, tilted again by e^{μr} to that mean
        v0 = w * torch.exp(0.5 * torch.randn(50, generator=g, dtype=torch.float64))
        lo, hi = -100.0, 100.0
        for _ in range(200):  # the mean of v0·e^{μr} rises with μ
            mid = (lo + hi) / 2
            v = v0 * torch.exp(mid * r)
            lo, hi = (mid, hi) if float(v @ r / v.sum()) < mean else (lo, mid)
        v = v / v.sum()
        assert float(v @ r) == pytest.approx(mean, abs=1e-9)
        assert float((v * torch.log(v * 50)).sum()) > kl


def test_a_reward_carried_by_one_mode_costs_diversity_and_an_independent_one_does_not():
    g = torch.Generator().manual_seed(2)
    n = 4000
    mode = torch.rand(n, generator=g) < 0.5  # two clusters of features
    f = torch.randn(n, 3, generator=g) * 0.1 + mode[:, None].float() * torch.tensor([4.0, 0.0, 0.0])
    tied = mode.float() * 0.5 + 0.5 * torch.rand(n, generator=g)  # high reward only in one cluster
    free = torch.rand(n, generator=g)  # reward independent of the features
    prompts = ["p"] * n
    t_tied = tilt.tilted_point(f, tied, prompts, target=0.9)
    t_free = tilt.tilted_point(f, free, prompts, target=0.9)
    assert t_tied["diversity_ratio"] < 0.3  # nearly all weight in one cluster
    assert t_free["diversity_ratio"] == pytest.approx(1.0, abs=0.05)
    assert t_tied["ess_min"] > 50 and t_free["ess_min"] > 50


def test_the_benchmark_reads_a_study_and_draws_its_evaluations_over_the_curve(tmp_path):
    import importlib.util
    import json
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "kl_optimal_diversity.py"
    spec = importlib.util.spec_from_file_location("kl_optimal_diversity", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ev = [{"metrics": {"eval/reward": r, "eval/guard/diversity": d}} for r, d in ((0.6, 10.0), (0.8, 9.0), (0.9, 8.0))]
    summary = {"target": 0.75, "diversity_key": "eval/guard/diversity",
               "rows": [{"variant": "a", "reached": 1, "diversity_at_target": {"eval/guard/diversity": 0.9}},
                        {"variant": "b", "reached": 0, "diversity_at_target": {}}],
               "cells": [{"variant": "a", "evaluations": ev}, {"variant": "b", "evaluations": ev[:1]}]}
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    curves, means, target = bench.study_points(tmp_path)
    assert target == 0.75 and means == {"a": (0.9, 1)}
    assert curves["a"] == [(0.6, 1.0), (0.8, 0.9), (0.9, 0.8)] and curves["b"] == [(0.6, 1.0)]
    f = torch.randn(64, 3, generator=torch.Generator().manual_seed(3))
    r = torch.linspace(0, 1, 64)
    curve = [tilt.tilted_point(f, r, ["p"] * 64, t) for t in (0.5, 0.7, 2.0)]
    bench.plot(tmp_path, curve, curves, 0.5, target)
    assert (tmp_path / "frontier.png").stat().st_size > 0
