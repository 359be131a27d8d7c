"""reward.background: each sampling micro-batch is scored in a worker thread while the next one samples. The
rollout (trajectories, images, rewards, advantages) equals synchronous scoring's, scoring really overlaps
sampling, and compute_rewards' rules hold in the thread: retry once, NaN marks a sample invalid, a reward that
keeps raising stops the run with the same one-line RewardError."""
from __future__ import annotations

import threading
import time

import pytest
import torch

from diffgrpo.config import ConfigError
from diffgrpo.errors import RewardError
from diffgrpo.rewards import compute_rewards

BASE = ["sampler.batch_size=2", "train.prompts_per_batch=2", "train.group_size=3"]
CALLS: list[tuple[str, int]] = []


def brightness(images, prompts, metadata):
    CALLS.append((threading.current_thread().name, len(prompts)))
    return images.flatten(1).mean(1)


def _rollout(make_trainer, *extra):
    tr = make_trainer(*BASE, "reward.weights={tests.test_background_rewards:brightness: 1.0, "
                                             "jpeg_incompressibility: 0.5}", *extra)
    return tr, tr.rollout()


@pytest.mark.parametrize("engine", [[], ["engine.name=single_step"], ["engine.name=jagg", "engine.window=2"]],
                         ids=["recompute", "single_step", "jagg"])
def test_background_scoring_equals_synchronous(make_trainer, engine):
    CALLS.clear()
    _, sync = _rollout(make_trainer, *engine)
    assert [(t.removesuffix(":timed"), n) for t, n in CALLS] == [("MainThread", 6)]  # reward.timeout's waiter
    CALLS.clear()
    _, bg = _rollout(make_trainer, *engine, "reward.background=true")
    assert [n for _, n in CALLS] == [2, 2, 2] and all(t.startswith("diffgrpo-reward") for t, _ in CALLS)
    assert bool((sync.traj.noise != 0).flatten(2).any(-1).any(-1).all())  # every trajectory has an SDE step
    for k in ("xs", "velocities", "log_probs", "noise", "images"):
        assert torch.equal(getattr(bg.traj, k), getattr(sync.traj, k)), k
    for k in ("rewards", "advantages", "loss_weights", "selected"):
        assert torch.equal(getattr(bg, k), getattr(sync, k)), k
    assert bg.reward_components.keys() == sync.reward_components.keys()
    assert all(torch.equal(bg.reward_components[k], sync.reward_components[k]) for k in sync.reward_components)


def test_scoring_overlaps_the_next_micro_batch(make_trainer, monkeypatch):
    """The first micro-batch's reward waits until the policy has run forwards for the next micro-batch: that
    can only happen when scoring runs beside sampling (synchronous scoring would wait out the deadline)."""
    from diffgrpo.rewards import REWARDS

    tr = make_trainer(*BASE, "reward.background=true")
    seen = []

    def waiting(images, prompts, metadata):
        if not seen:
            start, deadline = tr.policy.counters["forwards_nograd"], time.monotonic() + 20
            while tr.policy.counters["forwards_nograd"] == start and time.monotonic() < deadline:
                time.sleep(0.002)
            seen.append(tr.policy.counters["forwards_nograd"] - start)
        return images.flatten(1).mean(1)

    monkeypatch.setitem(REWARDS, "waiting", waiting)
    tr.cfg.reward.weights = {"waiting": 1.0}
    t0 = time.monotonic()
    tr.rollout()
    assert seen[0] > 0 and time.monotonic() - t0 < 20


FAIL = {"left": 0}


def flaky(images, prompts, metadata):
    """Raises while FAIL['left'] > 0; NaN for the prompts of even digits."""
    if FAIL["left"] > 0:
        FAIL["left"] -= 1
        raise OSError("scoring server busy")
    out = images.flatten(1).mean(1)
    out[torch.tensor([m["digit"] % 2 == 0 for m in metadata])] = float("nan")
    return out


def test_retry_nan_and_error_rules_hold_in_the_thread(make_trainer):
    args = ["reward.weights={tests.test_background_rewards:flaky: 1.0}"]
    FAIL["left"] = 0
    sync = make_trainer(*BASE, *args).rollout()
    FAIL["left"] = 1  # the first micro-batch's first call fails: retried once, same result
    logs = []
    tr = make_trainer(*BASE, *args, "reward.background=true")
    tr.family.log = logs.append
    bg = tr.rollout()
    assert any("retrying once" in m for m in logs)
    even = torch.tensor([m["digit"] % 2 == 0 for m in bg.metadata])
    assert 0 < even.sum() < len(even) and torch.equal(bg.rewards.isnan(), even)
    assert torch.equal(bg.rewards.nan_to_num(), sync.rewards.nan_to_num())
    assert torch.equal(bg.loss_weights, sync.loss_weights) and torch.all(bg.loss_weights[even] == 0)
    FAIL["left"] = 10 ** 6  # keeps failing: the run stops with compute_rewards' own message
    tr = make_trainer(*BASE, *args, "reward.background=true")
    tr.family.log = lambda *a: None
    with pytest.raises(RewardError) as bg_err:
        tr.rollout()
    with pytest.raises(RewardError) as sync_err:
        compute_rewards({"tests.test_background_rewards:flaky": 1.0}, torch.rand(2, 1, 8, 8), ["a", "b"],
                        [{"digit": 1}, {"digit": 2}], log=lambda *a: None)
    FAIL["left"] = 0
    assert str(bg_err.value) == str(sync_err.value) and "\n" not in str(bg_err.value)


def test_background_needs_sampling_micro_batches(make_trainer):
    with pytest.raises(ConfigError, match=r"^reward\.background: .*sampler\.batch_size > 0"):
        make_trainer("reward.background=true")
