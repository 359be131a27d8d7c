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
  prompt onto one image scores 0. Evaluation accumulates both in fixed memory (:class:`GuardStats`: running
  moments, and each prompt record's seeds until the record is complete), so its peak memory does not grow with
  the number of evaluation prompts.

Cost: one classifier forward per evaluation image (the classifier is a few-kFLOP CNN); the test split's statistics
are computed once per image size and kept in memory.
"""
from __future__ import annotations

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
    per = [mean_pairwise_distance(feats[idx]) for idx in groups.values() if len(idx) >= 2]
    return sum(per) / len(per) if per else float("nan")


def mean_pairwise_distance(f: torch.Tensor) -> float:
    """Mean L2 distance over the n(n−1) ordered pairs of distinct rows of f (n ≥ 2, D), in float64."""
    f = f.double()
    n = f.shape[0]
    return float(torch.cdist(f, f).sum() / (n * (n - 1)))  # the diagonal is 0


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


def digit_features(images: torch.Tensor) -> torch.Tensor:
    """Evaluation images (B, 1, S, S) in [0, 1] → (B, 64) penultimate features of the digit classifier; an
    evaluation in chunks keeps these (256 bytes a sample) instead of its images."""
    clf, _ = image_rewards.load_classifier(images.shape[-1])
    return penultimate_features(clf, images)


def guards_apply(cfg, images: torch.Tensor) -> bool:
    """Whether a flow evaluation's images get the guards: the built-in task's one-channel digit images."""
    return cfg.model.name == "tiny" and images.dim() == 4 and images.shape[1] == 1


def gaussian_from_sums(n: int, s1: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, Σf (D,), Σffᵀ (D, D)) → (mean (D,), unbiased covariance (D, D)), float64; n ≥ 2."""
    mu = s1 / n
    return mu, (s2 - n * torch.outer(mu, mu)) / (n - 1)



class Moments:
    """Features of one evaluation added chunk by chunk: float64 Σf, Σffᵀ, and per record (``group`` consecutive
    samples: one prompt's seeds) its features until the record is complete, then their mean pairwise distance."""

    def __init__(self, group: int):
        self.group, self.n, self.s1, self.s2 = group, 0, None, None
        self.open: dict[int, dict[int, torch.Tensor]] = {}
        self.spreads: list[float] = []

    def add(self, index: list[int], feats: torch.Tensor) -> None:
        """Samples ``index`` (their evaluation order) with features (n, D)."""
        f = feats.detach().double().cpu()
        if self.s1 is None:
            self.s1, self.s2 = torch.zeros(f.shape[1], dtype=torch.float64), torch.zeros(f.shape[1], f.shape[1],
                                                                                           dtype=torch.float64)
        self.n += f.shape[0]
        self.s1 += f.sum(0)
        self.s2 += f.T @ f
        if self.group < 2:
            return
        for j, i in enumerate(index):
            rec = self.open.setdefault(i // self.group, {})
            rec[i] = f[j]
            if len(rec) == self.group:
                self.spreads.append(mean_pairwise_distance(torch.stack([rec[k] for k in sorted(rec)])))
                del self.open[i // self.group]

    def diversity(self) -> float:
        return sum(self.spreads) / len(self.spreads) if self.spreads else float("nan")


class GuardStats:
    """The digit guards of one evaluation accumulated chunk by chunk in fixed memory (:class:`Moments`: float64
    sums of the features and of their outer products, and one record's features — ``group_size`` consecutive
    samples, one prompt's seeds — until it is complete). With distinct prompts it equals :func:`frechet_distance`
    of :func:`gaussian_stats` against :func:`reference_stats` and :func:`per_prompt_diversity` on the whole feature
    set (up to float64 round-off)."""

    def __init__(self, image_size: int, group_size: int):
        self.image_size, self.moments = image_size, Moments(group_size)

    def add(self, index: list[int], feats: torch.Tensor) -> None:
        """Samples ``index`` (their evaluation order) with features (n, D)."""
        self.moments.add(index, feats)

    def result(self) -> dict[str, float]:
        """{"eval/fid", "eval/diversity"} (diversity when some record has two samples); {} below two samples."""
        m = self.moments
        if m.n < 2:
            return {}
        mu, cov = gaussian_from_sums(m.n, m.s1, m.s2)
        mu_r, cov_r = reference_stats(self.image_size)
        out = {"eval/fid": frechet_distance(mu, cov, mu_r, cov_r)}
        if m.spreads:
            out["eval/diversity"] = m.diversity()
        return out


__all__ = ["gaussian_stats", "frechet_distance", "per_prompt_diversity", "mean_pairwise_distance",
           "penultimate_features", "reference_stats", "digit_features", "guards_apply", "GuardStats",
           "Moments", "gaussian_from_sums"]
