"""KID (``feature_stats.kid``): the unbiased MMD² with the cubic polynomial kernel, against an independent numpy
double loop, its zero expectation for two samples of one distribution, and its report beside FID on the built-in
task's evaluation."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffgrpo import guards
from diffgrpo.feature_stats import kid


def kid_loops(x: np.ndarray, y: np.ndarray) -> float:
    """The estimator written out term by term over index pairs (no matrix algebra)."""
    d = x.shape[1]

    def k(a, b):
        return (float(np.dot(a, b)) / d + 1.0) ** 3

    n, m = len(x), len(y)
    xx = sum(k(x[i], x[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    yy = sum(k(y[i], y[j]) for i in range(m) for j in range(m) if i != j) / (m * (m - 1))
    xy = sum(k(x[i], y[j]) for i in range(n) for j in range(m)) / (n * m)
    return xx + yy - 2 * xy


def test_kid_equals_the_pairwise_sums():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(7, 5)), rng.normal(0.5, 1.3, size=(9, 5))
    assert kid(torch.tensor(x), torch.tensor(y)) == pytest.approx(kid_loops(x, y), rel=1e-12)
    assert kid(torch.tensor(x, dtype=torch.float32), torch.tensor(y)) == pytest.approx(kid_loops(x.astype(np.float32).astype(float), y), rel=1e-6)


def test_kid_is_unbiased_for_one_distribution_and_positive_for_two():
    """Over many independent pairs of samples of one distribution the mean of KID is 0 within its standard error
    (a single value may be negative: the estimator is unbiased, not clipped); a shifted distribution is far above."""
    g = torch.Generator().manual_seed(0)
    same = np.array([kid(torch.randn(20, 8, generator=g), torch.randn(30, 8, generator=g)) for _ in range(400)])
    se = same.std(ddof=1) / np.sqrt(len(same))
    assert abs(same.mean()) < 3 * se and (same < 0).any()
    shifted = np.array([kid(torch.randn(20, 8, generator=g), torch.randn(30, 8, generator=g) + 0.5) for _ in range(50)])
    assert shifted.mean() > same.mean() + 20 * se and (shifted > 0).all()


def test_kid_guard_is_absolute_over_the_start_and_replaces_fid():
    """train.guard_distance=kid: eval/guard/kid may rise at most guard_max_kid above its start value, and FID's ratio
    is then not judged; with fid (the default) KID is reported but not judged."""
    start = {"eval/fid": 10.0, "eval/guard/kid": 0.02}
    kid_th = guards.Thresholds(distance="kid", max_kid=0.05)
    assert guards.tripped(start, {"eval/fid": 100.0, "eval/guard/kid": 0.069}, kid_th) == []
    out = guards.tripped(start, {"eval/fid": 10.0, "eval/guard/kid": 0.071}, kid_th)
    assert len(out) == 1 and out[0].startswith("eval/guard/kid")
    fid_out = guards.tripped(start, {"eval/fid": 100.0, "eval/guard/kid": 1.0}, guards.Thresholds())
    assert [g.split()[0] for g in fid_out] == ["eval/fid"]


def test_guard_distance_comes_from_the_config():
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    cfg = RunConfig.from_overrides(["train.guard_distance=kid", "train.guard_max_kid=0.02"])
    th = guards.thresholds(cfg.train)
    assert th.distance == "kid" and th.max_kid == 0.02 and RunConfig().train.guard_distance == "fid"
    with pytest.raises(ConfigError, match="train.guard_distance"):
        RunConfig.from_overrides(["train.guard_distance=mmd"])


def test_evaluation_reports_kid_beside_fid(make_trainer, monkeypatch):
    """The built-in task's evaluation reports eval/guard/kid on the same classifier features as eval/fid."""
    from diffgrpo.data import digits_split
    from diffgrpo.rewards import image as image_rewards

    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)  # untrained: the pipeline, not the numbers
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    row, images = make_trainer().evaluate()
    _, (x_te, _) = digits_split(images.shape[-1])
    want = kid(guards.penultimate_features(clf, images), guards.penultimate_features(clf, x_te))
    assert row["eval/guard/kid"] == pytest.approx(want, rel=1e-9) and "eval/fid" in row
