"""Fidelity and diversity guards for the built-in digits task: is a reward gain real, or is the classifier gamed?

- Fidelity, ``eval/fid``: the Fréchet distance between Gaussians fitted to the digit classifier's penultimate
  features (the 64-d ReLU layer before the logits of ``rewards.image.DigitClassifier``) of the generated samples and
  of the digits *test* split,
      d² = ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2·(Σ₁^{1/2} Σ₂ Σ₁^{1/2})^{1/2}),
  computed with symmetric eigendecompositions in float64 (exact up to round-off; no iterative sqrtm). It is the
  FID recipe on a small in-domain feature extractor; with the default 40 evaluation samples it is a biased but
  fixed-size estimate, comparable across runs that evaluate the same number of samples.
- Diversity, ``eval/diversity``: per prompt, the mean pairwise Euclidean distance between the features of that
  prompt's samples; averaged over prompts with at least two samples. A policy that collapses every seed of a
  prompt onto one image scores 0.

Cost: one classifier forward per evaluation image (the classifier is a few-kFLOP CNN); the test split's statistics
are computed once per image size and kept in memory.
"""
from __future__ import annotations

import math

import torch

from .data import digits_split
from .rewards import image as image_rewards

_REFERENCE: dict[int, tuple] = {}  # image size → (classifier, μ, Σ)


# ---------------------------------------------------------------------- pure functions
def gaussian_stats(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """feats (N, D) → (mean (D,), unbiased covariance (D, D)), float64. N ≥ 2."""
    f = feats.double()
    mu = f.mean(0)
    c = f - mu
    return mu, c.T @ c / (f.shape[0] - 1)


def _psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Square root of a symmetric PSD matrix (D, D) via eigh; negative round-off eigenvalues clamp to 0."""
    w, v = torch.linalg.eigh((m + m.T) / 2)
    return (v * w.clamp_min(0).sqrt()) @ v.T


def frechet_distance(mu1: torch.Tensor, cov1: torch.Tensor, mu2: torch.Tensor, cov2: torch.Tensor) -> float:
    """Fréchet (2-Wasserstein²) distance between N(mu1, cov1) and N(mu2, cov2). mu (D,), cov (D, D) → float.

    tr((Σ₁Σ₂)^{1/2}) = tr((Σ₁^{1/2} Σ₂ Σ₁^{1/2})^{1/2}), the symmetric form, so only PSD square roots are needed.
    """
    mu1, mu2, cov1, cov2 = (t.double() for t in (mu1, mu2, cov1, cov2))
    s1 = _psd_sqrt(cov1)
    cross = _psd_sqrt(s1 @ cov2 @ s1)
    d = float(((mu1 - mu2) ** 2).sum() + torch.trace(cov1) + torch.trace(cov2) - 2 * torch.trace(cross))
    return max(d, 0.0)


def per_prompt_diversity(feats: torch.Tensor, prompts: list[str]) -> float:
    """Mean over prompts (with ≥ 2 samples) of the mean pairwise L2 distance among that prompt's features.

    feats (N, D); prompts length N. NaN when no prompt has two samples.
    """
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    per = []
    for idx in groups.values():
        if len(idx) < 2:
            continue
        f = feats[idx].double()  # (n, D)
        d = torch.cdist(f, f)  # (n, n)
        n = len(idx)
        per.append(float(d.sum() / (n * (n - 1))))  # diagonal is 0
    return sum(per) / len(per) if per else float("nan")


# ---------------------------------------------------------------------- the digit classifier's features
def penultimate_features(clf, images: torch.Tensor) -> torch.Tensor:
    """images (B, 1, S, S) in [0, 1] → (B, 64): the classifier's last hidden layer (after ReLU)."""
    with torch.no_grad():
        return clf.fc[:-1](clf.conv(images.float().cpu()))


def reference_stats(image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ, Σ) of the penultimate features of the digits test split at ``image_size`` (cached per process)."""
    clf, _ = image_rewards.load_classifier(image_size)
    cached = _REFERENCE.get(image_size)
    if cached is None or cached[0] is not clf:  # computed with this very classifier
        _, (x_te, _) = digits_split(image_size)
        cached = _REFERENCE[image_size] = (clf, *gaussian_stats(penultimate_features(clf, x_te)))
    return cached[1], cached[2]


def digit_quality(images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """{"eval/fid", "eval/diversity"} of evaluation images (B, 1, S, S) in [0, 1] with their prompts (diversity
    only when some prompt has two or more samples)."""
    clf, _ = image_rewards.load_classifier(images.shape[-1])
    feats = penultimate_features(clf, images)
    mu_r, cov_r = reference_stats(images.shape[-1])
    mu, cov = gaussian_stats(feats)
    out = {"eval/fid": frechet_distance(mu, cov, mu_r, cov_r)}
    div = per_prompt_diversity(feats, prompts)
    if math.isfinite(div):  # no prompt with two samples (eval.seeds_per_prompt=1): no diversity, rather than a NaN row
        out["eval/diversity"] = div
    return out


def flow_eval_quality(cfg, images: torch.Tensor, prompts: list[str]) -> dict[str, float]:
    """The guards for a flow family's evaluation: on the built-in task (tiny model, digit images, every evaluation
    image at hand) the metrics of :func:`digit_quality`, else nothing."""
    if cfg.model.name != "tiny" or images is None or len(images) != len(prompts) or len(images) < 2:
        return {}
    if images.dim() != 4 or images.shape[1] != 1:
        return {}
    return digit_quality(images, prompts)


__all__ = ["gaussian_stats", "frechet_distance", "per_prompt_diversity", "penultimate_features", "reference_stats",
           "digit_quality", "flow_eval_quality"]
