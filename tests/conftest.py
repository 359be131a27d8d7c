"""Shared fixtures: tiny, seeded, CPU-only trainers built from the real model classes, a tiny SD3 pipeline on
disk, and a finished run of the built-in model."""
from __future__ import annotations

import os

import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.tiny import build_tiny_policy
from tests.helpers.pipelines import save_sd3_pipeline
from tests.helpers.tiny import FAST_CLI, TINY

# The test models are far too small to gain from threads, and thread synchronisation on a busy machine costs
# milliseconds per small matmul: one thread keeps the suite fast and its float results independent of the host.
torch.set_num_threads(1)


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


@pytest.fixture(scope="module")
def sd3_dir(tmp_path_factory):
    """A full StableDiffusion3Pipeline of tiny random components, saved with save_pretrained."""
    return save_sd3_pipeline(tmp_path_factory.mktemp("tiny-sd3"))


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """A finished one-iteration run of the built-in model with a checkpoint."""
    from diffgrpo.cli.app import main

    out = tmp_path_factory.mktemp("small") / "run"
    assert main(["train", *FAST_CLI, "train.num_iterations=1", "train.save_every=1", f"log.output_dir={out}"]) == 0
    return out
