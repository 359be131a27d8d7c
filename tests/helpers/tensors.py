"""Tensor helpers the gradient tests compare with: flattened gradients, relative errors, moved weights."""
from __future__ import annotations

import torch


def flat_grad(params) -> torch.Tensor:
    """All parameter gradients as one float64 vector (zeros where .grad is None)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def perturb(tr, scale=0.02, seed=7):
    """Move θ away from the frozen reference so that the KL gradient is not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for q in tr.params:
            q.add_(scale * torch.randn(q.shape, generator=g))
