"""A new engine is one class plus one registry entry: the toy engine below declares the engine.* key it reads and its
own rule, is registered by monkeypatching ``engines.ENGINES`` only, and trains through the unchanged config,
validation, family and loop. It composes the shared velocity source (``_graph.recompute_pairs``) on every other
planned step, so its gradient is checked against recompute's on the same pairs."""
from __future__ import annotations

import pytest
import torch

from diffgrpo.config import ConfigError, RunConfig
from diffgrpo.engines import ENGINES
from diffgrpo.engines._graph import recompute_pairs
from diffgrpo.engines.base import (
    StatsAccumulator,
    no_rollout_hooks,
    plain_sampling,
    unit_sample_weights,
)
from diffgrpo.metering import engine_run
from tests.helpers.tensors import flat_grad
from tests.helpers.tiny import TINY


def check_toy_config(cfg: RunConfig) -> None:
    if cfg.engine.window > cfg.sampler.num_steps - 1:
        raise ConfigError(f"engine.window: value {cfg.engine.window} is out of range for engine.name=toy; must be "
                          f"<= {cfg.sampler.num_steps - 1}")


class ToyEngine:
    """Trains every ``engine.window``-th planned step (exact, by a recompute forward)."""

    name = "toy"
    config_keys = ("window",)
    check_config = staticmethod(check_toy_config)
    wave_size = 0

    def __init__(self, cfg):
        self.every = int(cfg.window)

    def plan(self, plan, generator):
        keep = torch.zeros_like(plan.selected)
        keep[:, ::self.every] = True
        plan.selected = plan.selected & keep

    sampling = plain_sampling
    rollout_hooks = no_rollout_hooks
    sample_weights = unit_sample_weights

    def backward(self, ctx, rollout, epoch=0):
        acc = StatsAccumulator()
        with engine_run(ctx, self.name) as stats:
            recompute_pairs(ctx, rollout, stats, acc, rollout.selected)
        stats.metrics.update(acc.metrics())
        return stats


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(ENGINES, "toy", ToyEngine)


def test_a_registered_toy_engine_is_validated_and_trains_one_iteration(toy, make_trainer):
    with pytest.raises(ConfigError, match=r"engine\.window: value 9 is out of range for engine\.name=toy"):
        RunConfig.from_overrides([*TINY, "engine.name=toy", "engine.window=9"])  # its own rule, before any model
    with pytest.raises(ConfigError, match=r"engine\.wave_size: does not apply to engine\.name=toy; it is read only "
                                          r"by \['retain'\]"):
        RunConfig.from_overrides([*TINY, "engine.name=toy", "engine.wave_size=2"])
    with pytest.raises(ConfigError, match=r"engine\.window: does not apply to engine\.name=recompute; it is read "
                                          r"only by \['jagg', 'toy'\]"):
        RunConfig.from_overrides([*TINY, "engine.window=3"])

    tr = make_trainer("engine.name=toy", "engine.window=2", "train.num_inner_epochs=1")
    ro = tr.rollout()
    assert ro.selected.any() and not ro.selected[:, 1::2].any()  # the engine's plan reached the rollout
    stats = tr.backward(ro)
    g_toy = flat_grad(tr.params)
    ref = make_trainer("engine.name=recompute")
    ref.policy.load_state_dict(tr.policy.state_dict())
    stats_ref = ref.backward(ro)  # the same rollout and pairs through the baseline engine
    assert torch.equal(g_toy, flat_grad(ref.params)) and g_toy.norm() > 0
    assert stats.forwards_grad == stats_ref.forwards_grad == int(ro.selected.sum())
    before = [p.detach().clone() for p in tr.params]
    row = tr.step()
    assert row["iteration"] == 1 and row["forwards_grad"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, tr.params))
