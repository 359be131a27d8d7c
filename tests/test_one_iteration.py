"""examples/one_iteration.py, the written-out GRPO iteration, against ``Trainer.step()``: the same rewards, loss,
gradient norm and updated weights from the same seed, config and initial weights."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "one_iteration.py"


def _example():
    spec = importlib.util.spec_from_file_location("one_iteration", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_one_iteration_updates_the_weights_exactly_as_the_trainer(make_trainer):
    """Bitwise equal, not merely close: both run the same tensor operations in the same order on one CPU thread
    (the sampler's noise from the same generators, the per-step backwards accumulated step by step, the same
    clip and AdamW step), so any difference is a difference in what the example does."""
    clip = "train.max_grad_norm=0.02"  # below the gradient's norm (about 0.05): the clip acts
    ref, mine = make_trainer(clip), make_trainer(clip)  # the tiny model, the same seed: equal initial weights
    start = [p.detach().clone() for p in mine.policy.trainable_parameters()]
    row = ref.step()
    out = _example().one_iteration(mine.cfg, mine.policy, log=lambda *a: None)
    assert len(out["prompts"]) == 6 and bool((out["advantages"] != 0).any())  # two groups of three, a signal
    assert float(out["rewards"].mean()) == row["reward"] and float(out["rewards"].std()) == row["reward_std"]
    assert out["loss"] == row["loss"] and out["grad_norm"] == row["grad_norm"] > 0.02
    after_ref, after_mine = list(ref.policy.trainable_parameters()), list(mine.policy.trainable_parameters())
    assert len(after_ref) == len(after_mine) == len(start) > 0
    assert any(not torch.equal(p, q) for p, q in zip(after_mine, start))  # the update moved the weights
    for p, q in zip(after_ref, after_mine):
        assert torch.equal(p, q)


def test_one_iteration_refuses_what_it_does_not_write_out(make_trainer):
    tr = make_trainer("loss.beta=0.1")
    try:
        _example().one_iteration(tr.cfg, tr.policy, log=lambda *a: None)
    except ValueError as e:
        assert "loss.beta=0.0 only" in str(e)
    else:
        raise AssertionError("a KL term was run by a file that does not write it out")
