"""Fidelity (Fréchet distance of classifier features) and per-prompt diversity, against independent references."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import linalg
from scipy.spatial.distance import pdist

from diffgrpo import quality
from diffgrpo.rewards import image as image_rewards


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
    got = quality.frechet_distance(*(torch.from_numpy(t) for t in (mu1, s1, mu2, s2)))
    assert got == pytest.approx(_scipy_fd(mu1, s1, mu2, s2), rel=1e-8)


def test_frechet_distance_closed_forms():
    mu, s = _random_gaussian(5, 3)
    mu, s = torch.from_numpy(mu), torch.from_numpy(s)
    d = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0], dtype=torch.float64)
    assert quality.frechet_distance(mu, s, mu, s) == pytest.approx(0.0, abs=1e-9)
    assert quality.frechet_distance(mu, s, mu + d, s) == pytest.approx(float((d**2).sum()), rel=1e-9)
    # isotropic covariances a²I and b²I: D·(a − b)²
    eye = torch.eye(5, dtype=torch.float64)
    assert quality.frechet_distance(mu, 4 * eye, mu, 9 * eye) == pytest.approx(5 * (2 - 3) ** 2, rel=1e-9)


def test_gaussian_stats_match_numpy():
    x = torch.randn(50, 7, generator=torch.Generator().manual_seed(0))
    mu, cov = quality.gaussian_stats(x)
    np.testing.assert_allclose(mu.numpy(), x.double().numpy().mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(cov.numpy(), np.cov(x.double().numpy(), rowvar=False), rtol=1e-10, atol=1e-12)


def test_per_prompt_diversity_matches_pdist():
    g = torch.Generator().manual_seed(1)
    feats = torch.randn(11, 4, generator=g)
    prompts = ["a"] * 4 + ["b"] * 5 + ["c"] * 1 + ["a"]  # prompt "a" appears non-contiguously; "c" has one sample
    want = np.mean([pdist(feats[[0, 1, 2, 3, 10]].double().numpy()).mean(), pdist(feats[4:9].double().numpy()).mean()])
    assert quality.per_prompt_diversity(feats, prompts) == pytest.approx(want, rel=1e-10)
    collapsed = feats[:1].expand(6, 4)
    assert quality.per_prompt_diversity(collapsed, ["x"] * 3 + ["y"] * 3) == 0.0


def test_penultimate_features_feed_the_logits():
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval()
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    f = quality.penultimate_features(clf, x)
    assert f.shape == (5, 64) and bool((f >= 0).all())  # after the ReLU
    torch.testing.assert_close(clf.fc[-1](f), clf(x).detach())


def test_evaluation_logs_fid_and_diversity(make_trainer, monkeypatch):
    """The flow family's evaluation reports eval/fid and eval/diversity of its own images on the built-in task."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)  # untrained: the pipeline, not the numbers
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    tr = make_trainer()
    row, images = tr.evaluate()
    prompts, _, _ = tr.family.eval_prompts()
    assert len(images) == len(prompts)
    from diffgrpo.data import digits_split

    _, (x_te, _) = digits_split(images.shape[-1])
    mu_r, cov_r = quality.gaussian_stats(quality.penultimate_features(clf, x_te))
    mu, cov = quality.gaussian_stats(quality.penultimate_features(clf, images))
    assert row["eval/fid"] == pytest.approx(quality.frechet_distance(mu, cov, mu_r, cov_r), rel=1e-9)
    assert row["eval/diversity"] == pytest.approx(
        quality.per_prompt_diversity(quality.penultimate_features(clf, images), prompts), rel=1e-9)
    assert row["eval/fid"] > 0 and row["eval/diversity"] > 0


def test_guards_are_the_same_when_evaluation_is_chunked(make_trainer, monkeypatch):
    """eval.batch_size samples in chunks; the built-in task keeps its (tiny) images, so the guards cover every
    sample and equal the unchunked evaluation's (each sample starts from its own seed's noise)."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    whole, _ = make_trainer("eval.seeds_per_prompt=8").evaluate()  # 80 images
    chunked, _ = make_trainer("eval.batch_size=7", "eval.seeds_per_prompt=8").evaluate()
    for key in ("eval/fid", "eval/diversity", "eval/reward"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), key


def test_one_sample_per_prompt_logs_fid_only(make_trainer, monkeypatch):
    """eval.seeds_per_prompt=1: no pair of samples shares a prompt, so no diversity (and no NaN in the metrics)."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    row, _ = make_trainer("eval.seeds_per_prompt=1").evaluate()
    assert "eval/diversity" not in row and np.isfinite(row["eval/fid"])


def test_streamed_guards_equal_the_whole_set_computation(monkeypatch):
    """GuardStats (fixed memory, chunk by chunk, chunks out of order) equals the whole-set computation (Fréchet
    distance of the Gaussian fit, per-prompt diversity) when every record's prompt is distinct."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    feats = torch.randn(30, 64).relu()
    prompts = [f"p{i // 3}" for i in range(30)]  # 10 records × 3 seeds
    mu, cov = quality.gaussian_stats(feats)
    whole = {"eval/fid": quality.frechet_distance(mu, cov, *quality.reference_stats(16)),
             "eval/diversity": quality.per_prompt_diversity(feats, prompts)}
    g = quality.GuardStats(16, 3)
    for lo in (16, 0, 8, 24):  # chunks of 8 (the last 6), records split across chunks
        idx = list(range(lo, min(lo + 8, 30)))
        g.add(idx, feats[idx])
    got = g.result()
    assert got.keys() == whole.keys() == {"eval/fid", "eval/diversity"}
    for k in got:
        assert got[k] == pytest.approx(whole[k], rel=1e-9), k
