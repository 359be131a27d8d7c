"""Shared fixtures: tiny, seeded, CPU-only trainers built from the real model classes."""
from __future__ import annotations

import os

import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.tiny import build_tiny_policy

# The test models are far too small to gain from threads, and thread synchronisation on a busy machine costs
# milliseconds per small matmul: one thread keeps the suite fast and its float results independent of the host.
torch.set_num_threads(1)

# A model small enough for unit tests: 8×8 images, one transformer block, 6 sampling steps.
TINY = [
    "model.image_size=8", "model.patch_size=2", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8",
    "model.text_dim=16", "sampler.num_steps=6", "train.prompts_per_batch=2", "train.group_size=3",
    "log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
]


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """Keep built-in models and classifiers out of the user's cache unless DIFFGRPO_CACHE is set."""
    if "DIFFGRPO_CACHE" not in os.environ:
        os.environ["DIFFGRPO_CACHE"] = str(tmp_path_factory.mktemp("diffgrpo-cache"))
    yield


@pytest.fixture
def make_trainer():
    """make_trainer(*overrides, pretrained=False, seed=0) -> Trainer on the tiny model (random init by default)."""

    def _make(*overrides, pretrained=False, seed=0):
        cfg = RunConfig.from_overrides([*TINY, f"seed={seed}", *overrides])
        torch.manual_seed(seed)
        policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=pretrained)
        return Trainer(cfg, policy=policy, log=lambda *a: None)

    return _make


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
