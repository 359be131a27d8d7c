"""The diversity objectives against independent re-derivations of their sources' formulas on identical tensors.

GARDO's released trainer (tinnerhrhe/GARDO@1cc77fb341a8f84013cbb51e7685805acbef3425: ``flow_grpo/stat_tracking.py``
``PerPromptStatTracker.update`` with ``type='gardo'``, ``scripts/train_sd3_grpo_gardo.py`` ``main``) is re-derived
below in float64 numpy from its formulas (not its code): the nearest-neighbour cosine distance, the diversity-aware
advantage and the rank-disagreement gate. Measured on the seeded tensors here (float32 ours vs float64 reference):
nearest-neighbour distance max |Δ| = 9.7e-8, diversity-aware advantage max |Δ| = 8.6e-8 (with our default
normaliser instead: 0.28), gate: identical masks off ties (β = 0.1, 0.15, 0.2 on 48 samples) and one tie case.
DRIFT's subset is checked against ``numpy.median`` (no released code was found).
"""
from __future__ import annotations

import numpy as np
import torch

from diffgrpo.diversity import drift, gardo
from diffgrpo.diversity.groups import nearest_neighbour_distance


def _batch(seed: int = 0, groups: int = 4, n: int = 6, dim: int = 16):
    gen = torch.Generator().manual_seed(seed)
    feats = torch.randn(groups * n, dim, generator=gen)  # (B, D)
    rewards = torch.rand(groups * n, generator=gen)  # (B,)
    gids = torch.arange(groups).repeat_interleave(n)  # (B,)
    return feats, rewards, gids


def _released_nn_distance(feats: np.ndarray) -> np.ndarray:
    """min_{j≠i} (1 − clip(cos, −1, 1)) within one group. feats (n, D) → (n,)."""
    u = feats / np.linalg.norm(feats, axis=1, keepdims=True)
    dist = 1.0 - np.clip(u @ u.T, -1.0, 1.0)
    np.fill_diagonal(dist, np.inf)
    return dist.min(axis=1)


def _released_gardo_advantage(rewards: np.ndarray, feats: np.ndarray, gids: np.ndarray) -> np.ndarray:
    """(r − r̄_g)·w, w = d_i / mean_g d where r ≥ r̄_g and 1 elsewhere; no division by the group's std."""
    out = np.zeros_like(rewards)
    for g in np.unique(gids):
        rows = gids == g
        centred = rewards[rows] - rewards[rows].mean()
        d = _released_nn_distance(feats[rows])
        out[rows] = centred * np.where(centred < 0, 1.0, d / d.mean())
    return out


def _descending_ranks(x: np.ndarray) -> np.ndarray:
    """Rank 1 for the largest value, N for the smallest. x (N,) → (N,) float."""
    ranks = np.empty(len(x))
    ranks[np.argsort(-x, kind="stable")] = np.arange(1, len(x) + 1)
    return ranks


def test_nearest_neighbour_distance_matches_the_released_diversity_measure():
    """Ours (float32) against the float64 re-derivation: max |Δ| = 9.7e-8 on these seeded features."""
    feats, _, gids = _batch()
    ours = nearest_neighbour_distance(feats, gids).double().numpy()
    ref = np.concatenate([_released_nn_distance(feats[gids == g].double().numpy()) for g in range(4)])
    assert np.abs(ours - ref).max() < 1e-6


def test_released_diversity_advantage_is_our_amplification_with_the_mean_normaliser():
    """The released estimator is ``amplify`` with λ = 1 and d/mean_g(d) − 1 in place of our d/max_g(d), applied to the
    mean-centred reward (no std division): max |Δ| = 8.6e-8. Our default (d/max, λ = 1) differs from it by design
    (max |Δ| = 0.28 here)."""
    feats, rewards, gids = _batch(seed=1)
    d = nearest_neighbour_distance(feats, gids)  # (B,)
    group_mean = lambda x: torch.stack([x[gids == g].mean() for g in range(4)])[gids]  # noqa: E731
    centred = rewards - group_mean(rewards)  # (B,)
    ours = gardo.amplify(centred, d / group_mean(d) - 1, 1.0).double().numpy()
    ref = _released_gardo_advantage(rewards.double().numpy(), feats.double().numpy(), gids.numpy())
    assert np.abs(ours - ref).max() < 1e-6
    default = gardo.amplify(centred, gardo.normalised_diversity(feats, gids), 1.0).double().numpy()
    assert np.abs(default - ref).max() > 1e-2  # the documented difference is real on these tensors
    neg = centred.numpy() < 0
    assert np.array_equal(default[neg], centred.double().numpy()[neg])  # both leave A < 0 as it is
    assert np.abs(default[neg] - ref[neg]).max() < 1e-6


def test_uncertainty_gate_reproduces_the_released_percentile_gate_off_ties():
    """The released gate: u = rank(main) − mean(rank(aux₁), rank(aux₂)) over the whole batch (rank 1 = best), KL
    kept where u > the (100 − 100β)-th percentile of the u ≥ 0. Ours with quantile 1 − β over the valid u ≥ 0 keeps
    the same samples except one equal to the threshold (ours keeps it, ≥; the release drops it, >)."""
    gen = np.random.default_rng(3)
    main, aux1, aux2 = gen.random(48), gen.random(48), gen.random(48)
    u = _descending_ranks(main) - (_descending_ranks(aux1) + _descending_ranks(aux2)) / 2  # (48,) multiples of ½
    for beta in (0.1, 0.15, 0.2):
        thr = np.percentile(u[u >= 0], 100 - beta * 100)
        released = u > thr
        ours = gardo.uncertainty_gate(torch.from_numpy(u), 1 - beta, torch.from_numpy(u >= 0)).numpy()
        off_tie = u != thr
        assert np.array_equal(ours[off_tie], released[off_tie])
        assert ours[~off_tie].all() and not released[~off_tie].any()
    tie = torch.tensor([0.0, 1.0, 2.0, 3.0, 4.0, -1.0], dtype=torch.float64)  # 75th percentile of the u ≥ 0: 3 exactly
    assert gardo.uncertainty_gate(tie, 0.75, tie >= 0).tolist() == [False, False, False, True, True, False]
    assert (tie.numpy() > np.percentile(tie.numpy()[:5], 75)).tolist() == [False] * 4 + [True, False]


def test_concentrated_subset_centres_on_the_median_of_an_even_group():
    """rewards 0, 1, 2, 3 (median 1.5), keep 2: the middle pair {1, 2}. A lower median (1) would keep {0, 1} and
    drop the top of the group only."""
    r, g = torch.tensor([0.0, 1.0, 2.0, 3.0]), torch.zeros(4, dtype=torch.long)
    assert drift.concentrated_subset(r, g, 0.5).tolist() == [False, True, True, False]


def test_concentrated_subset_matches_a_numpy_median_rederivation():
    """Groups of 6 (even: the median is the midpoint of the middle pair), ρ = 0.5: the 3 rewards nearest
    ``numpy.median``, ties in sample order."""
    _, rewards, gids = _batch(seed=2)
    r = rewards.double().numpy()
    ref = np.zeros(len(r), dtype=bool)
    for g in range(4):
        rows = np.flatnonzero(gids.numpy() == g)
        gap = np.abs(r[rows] - np.median(r[rows]))
        ref[rows[np.argsort(gap, kind="stable")[:3]]] = True
    assert drift.concentrated_subset(rewards, gids, 0.5).numpy().tolist() == ref.tolist()
