"""Statistics of a feature space, for the guards (:mod:`diffgrpo.guards` computes the features and judges the values).

- The Fréchet (2-Wasserstein²) distance between Gaussians fitted to two feature sets,
      d² = ‖μ₁ − μ₂‖² + tr(Σ₁ + Σ₂ − 2·(Σ₁^{1/2} Σ₂ Σ₁^{1/2})^{1/2}),
  computed with symmetric eigendecompositions in float64 (exact up to round-off; no iterative sqrtm). On a
  classifier's features it is the FID recipe; with a fixed number of samples it is a biased but fixed-size estimate,
  comparable across runs that evaluate the same number of samples.
- Diversity: per prompt, the mean pairwise Euclidean distance between the features of that prompt's samples,
  averaged over prompts with at least two samples (0 when every seed of a prompt gives one sample).
- KID (kernel inception distance): the unbiased estimator of MMD² with the cubic polynomial kernel
      k(x, y) = (x·y / D + 1)³,   MMD²ᵤ = Σ_{i≠j} k(xᵢ, xⱼ)/(n(n−1)) + Σ_{i≠j} k(yᵢ, yⱼ)/(m(m−1)) − 2·Σ k(xᵢ, yⱼ)/(nm),
  on any features (D = their dimension). Unbiased: its expectation is 0 for two samples of one distribution (a
  single value may be negative), and it needs no covariance, so it is less noisy than the Fréchet distance at small
  sample counts. Exact in float64; cost O((n + m)²·D) and the (n + m) feature rows in memory.
- :class:`Moments`: both accumulated chunk by chunk in fixed memory (float64 Σf and Σffᵀ, and a prompt's features
  only until its seeds are complete), whatever the number of samples.
"""
from __future__ import annotations

import torch


def gaussian_stats(feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """feats (N, D) → (mean (D,), unbiased covariance (D, D)), float64. N ≥ 2."""
    f = feats.double()
    mu = f.mean(0)
    c = f - mu
    return mu, c.T @ c / (f.shape[0] - 1)


def gaussian_from_sums(n: int, s1: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, Σf (D,), Σffᵀ (D, D)) → (mean (D,), unbiased covariance (D, D)), float64; n ≥ 2."""
    mu = s1 / n
    return mu, (s2 - n * torch.outer(mu, mu)) / (n - 1)


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


def kid(x: torch.Tensor, y: torch.Tensor) -> float:
    """Unbiased MMD² between feature sets x (n, D) and y (m, D), n, m ≥ 2, with k(a, b) = (a·b / D + 1)³; float64."""
    x, y = x.double(), y.double()
    d = x.shape[1]
    kxx = (x @ x.T / d + 1) ** 3  # (n, n)
    kyy = (y @ y.T / d + 1) ** 3  # (m, m)
    kxy = (x @ y.T / d + 1) ** 3  # (n, m)
    return float(_off_diagonal_mean(kxx) + _off_diagonal_mean(kyy) - 2 * kxy.mean())


def _off_diagonal_mean(k: torch.Tensor) -> torch.Tensor:
    """Mean of a square matrix (s, s) over its s(s − 1) entries off the diagonal."""
    s = k.shape[0]
    return (k.sum() - k.diagonal().sum()) / (s * (s - 1))


def mean_pairwise_distance(f: torch.Tensor) -> float:
    """Mean L2 distance over the n(n−1) ordered pairs of distinct rows of f (n ≥ 2, D), in float64."""
    f = f.double()
    n = f.shape[0]
    return float(torch.cdist(f, f).sum() / (n * (n - 1)))  # the diagonal is 0


def prompt_groups(prompts: list[str]) -> list[list[int]]:
    """The sample indices of each prompt with ≥ 2 samples, in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    return [idx for idx in groups.values() if len(idx) >= 2]


def per_prompt_diversity(feats: torch.Tensor, prompts: list[str]) -> float:
    """Mean over prompts (with ≥ 2 samples) of the mean pairwise L2 distance among that prompt's features.

    feats (N, D); prompts length N. NaN when no prompt has two samples.
    """
    per = [mean_pairwise_distance(feats[idx]) for idx in prompt_groups(prompts)]
    return sum(per) / len(per) if per else float("nan")


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
            d = f.shape[1]
            self.s1, self.s2 = torch.zeros(d, dtype=torch.float64), torch.zeros(d, d, dtype=torch.float64)
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
        """Mean of the complete records' spreads; NaN when no record had two samples."""
        return sum(self.spreads) / len(self.spreads) if self.spreads else float("nan")


__all__ = ["gaussian_stats", "gaussian_from_sums", "frechet_distance", "kid", "mean_pairwise_distance",
           "per_prompt_diversity", "prompt_groups", "Moments"]
