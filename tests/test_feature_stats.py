"""Feature-space statistics (``diffgrpo.feature_stats``): the Fréchet distance, per-prompt diversity and their
fixed-memory accumulation, against independent references (scipy / numpy)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import linalg
from scipy.spatial.distance import pdist

from diffgrpo import feature_stats


def _random_gaussian(D: int, seed: int):
    g = np.random.default_rng(seed)
    a = g.normal(size=(D, D))
    return g.normal(size=D), a @ a.T / D + 0.1 * np.eye(D)


def _scipy_fd(mu1, s1, mu2, s2) -> float:
    """The textbook FID formula with scipy's general matrix square root."""
    covmean = linalg.sqrtm(s1 @ s2)
    covmean = covmean.real if np.iscomplexobj(covmean) else covmean
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.trace(covmean))


@pytest.mark.parametrize("D,seed", [(3, 0), (8, 1), (64, 2)])
def test_frechet_distance_matches_scipy_sqrtm(D, seed):
    mu1, s1 = _random_gaussian(D, seed)
    mu2, s2 = _random_gaussian(D, seed + 100)
    got = feature_stats.frechet_distance(*(torch.from_numpy(t) for t in (mu1, s1, mu2, s2)))
    assert got == pytest.approx(_scipy_fd(mu1, s1, mu2, s2), rel=1e-8)


def test_frechet_distance_closed_forms():
    mu, s = _random_gaussian(5, 3)
    mu, s = torch.from_numpy(mu), torch.from_numpy(s)
    d = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], dtype=torch.float64)
    assert feature_stats.frechet_distance(mu, s, mu, s) == pytest.approx(0.0, abs=1e-9)
    assert feature_stats.frechet_distance(mu, s, mu + d, s) == pytest.approx(float((d**2).sum()), rel=1e-9)
    # isotropic covariances a²I and b²I: D·(a − b)²
    eye = torch.eye(5, dtype=torch.float64)
    assert feature_stats.frechet_distance(mu, 4 * eye, mu, 9 * eye) == pytest.approx(5 * (2 - 3) ** 2, rel=1e-9)


def test_gaussian_stats_match_numpy():
    x = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    mu, cov = feature_stats.gaussian_stats(x)
    np.testing.assert_allclose(mu.numpy(), x.double().numpy().mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cov.numpy(), np.cov(x.double().numpy(), rowvar=False), rtol=1e-10, atol=1e-12)


def test_per_prompt_diversity_matches_pdist():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(11, 4, generator=g)
    prompts = ["a"] * 4 + ["b"] * 5 + ["c"] * 1 + ["a"]  # prompt "a" appears non-contiguously; "c" has one sample
    want = np.mean([pdist(feats[[0, 1, 2, 3, 10]].double().numpy()).mean(), pdist(feats[4:9].double().numpy()).mean()])
    assert feature_stats.per_prompt_diversity(feats, prompts) == pytest.approx(want, rel=1e-10)
    collapsed = feats[:1].expand(6, 4)
    assert feature_stats.per_prompt_diversity(collapsed, ["x"] * 3 + ["y"] * 3) == 0.0


def test_moments_in_chunks_match_whole_set_statistics():
    g = torch.Generator().manual_seed(0)
    feats = torch.randn(12, 5, generator=g)
    m = feature_stats.Moments(group=3)
    order = [7, 0, 11, 3, 4, 1, 9, 2, 5, 10, 6, 8]  # records complete out of order, across chunks
    for lo in range(0, 12, 5):
        idx = order[lo:lo + 5]
        m.add(idx, feats[idx])
    mu, cov = feature_stats.gaussian_from_sums(m.n, m.s1, m.s2)
    x = feats.double().numpy()
    np.testing.assert_allclose(mu.numpy(), x.mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cov.numpy(), np.cov(x, rowvar=False), rtol=1e-10, atol=1e-12)
    assert m.diversity() == pytest.approx(np.mean([pdist(x[i:i + 3]).mean() for i in range(0, 12, 3)]), rel=1e-10)
    assert not m.open  # every record closed: nothing kept but the sums
