"""The rollout–train consistency check: exact configurations read 0, every planted cause of a rollout that differs
from the update is flagged above the default threshold, and train.on_inconsistency=stop ends the run with exit 4.

Not planted: a compiled rollout. torch.compile's inductor on CPU needs a C++ toolchain and minutes of compilation
per graph; its reordered float arithmetic changes Δ log p at float round-off only, which the exact-configuration
bound below already covers. Rank-local noise is planted as the record it leaves: a rollout whose stored states are
not the ones its log-probs were drawn with.
"""
from __future__ import annotations

import json

import pytest
import torch

from diffgrpo import consistency
from diffgrpo.config import RunConfig
from diffgrpo.flow.family import FlowFamily
from tests.helpers.tiny import FAST_CLI
from tests.helpers.tiny import decoding_dllm_trainer as _mlm_trainer

LIMIT = RunConfig().train.max_inconsistency  # the default threshold (a fraction of the clip range)
P = consistency.PREFIX


def _metrics(stats) -> dict[str, float]:
    return {k: v for k, v in stats.metrics.items() if k.startswith(P)}


def _flagged(m: dict) -> bool:
    return consistency.judge(m, "stop", LIMIT) is not None


# ---------------------------------------------------------------------------------------------- exact: 0
@pytest.mark.parametrize("extra", [[], ["model.guidance_scale=3.0"], ["engine.name=jagg"],
                                   ["sampler.sde_type=dance_sde", "loss.beta=0.05"]])
def test_exact_flow_configurations_read_zero(make_trainer, extra):
    tr = make_trainer(*extra)
    ro = tr.rollout()
    m = _metrics(tr.backward(ro))
    assert m[P + "applies"] == 1.0 and m[P + "pairs"] > 0
    assert m[P + "abs_dlogp_max"] == 0.0 and m[P + "out_of_clip_frac"] == 0.0  # bitwise: same batch, same code
    assert {f"{P}{b}/abs_dlogp_mean" for b in consistency.BUCKETS} <= set(m)
    assert not _flagged(m)


def test_recompute_measures_every_selected_pair(make_trainer):
    tr = make_trainer()
    ro = tr.rollout()
    assert _metrics(tr.backward(ro))[P + "pairs"] == int(ro.selected.sum())


def test_an_engine_training_on_the_rollout_graph_logs_that_the_check_does_not_apply(make_trainer):
    tr = make_trainer("engine.name=retain")
    ro = tr.rollout()
    assert _metrics(tr.backward(ro)) == {P + "applies": 0.0}
    _, info = tr.update(tr.rollout())
    assert info[P + "applies"] == 0.0 and not any(k.startswith("first_epoch/" + P) for k in info)


def test_the_row_of_an_iteration_carries_the_first_updates_consistency(make_trainer):
    row = make_trainer("train.num_inner_epochs=2").step()
    assert row[P + "applies"] == 1.0 and row[P + "abs_dlogp_max"] == 0.0
    assert "first_epoch/clip_ratio" in row and not any(k.startswith("first_epoch/" + P) for k in row)


def test_the_masked_lm_with_the_default_decode_reads_zero():
    tr = _mlm_trainer()
    ro = tr.rollout()
    m = _metrics(tr.backward(ro))
    assert m[P + "applies"] == 1.0 and m[P + "pairs"] > 0
    assert m[P + "abs_dlogp_max"] < 1e-6 and m[P + "out_of_clip_frac"] == 0.0
    assert not _flagged(m)
    assert _metrics(tr.backward(ro, epoch=1)) == {}  # measured on the first update only


def test_the_masked_lm_replays_nothing_when_the_check_is_off():
    tr = _mlm_trainer("train.on_inconsistency=off")
    ro = tr.rollout()
    assert "replay_log_conf" not in ro.traj.records and _metrics(tr.backward(ro)) == {}


# ---------------------------------------------------------------------------------------------- planted causes
def test_a_guidance_scale_dropped_between_rollout_and_update_is_flagged(make_trainer):
    tr = make_trainer("model.guidance_scale=3.0")
    ro = tr.rollout()
    tr.policy.guidance_scale = 1.0  # the update forgets the rollout's guidance
    m = _metrics(tr.backward(ro))
    assert _flagged(m) and m[P + "out_of_clip_frac"] > 0.5


def test_a_rollout_noise_record_other_than_the_drawn_one_is_flagged(make_trainer):
    tr = make_trainer()
    ro = tr.rollout()
    g = torch.Generator().manual_seed(1)  # another rank's stream: the stored states move
    ro.traj.xs[:, 1:] += 0.05 * torch.randn(ro.traj.xs[:, 1:].shape, generator=g)
    m = _metrics(tr.backward(ro))
    assert _flagged(m) and m[P + "out_of_clip_frac"] > 0.5


def test_a_bf16_rollout_with_an_fp32_update_is_flagged(make_trainer):
    tr = make_trainer()
    tr.policy.amp_dtype = torch.bfloat16  # autocast in the rollout only
    ro = tr.rollout()
    tr.policy.amp_dtype = None
    m = _metrics(tr.backward(ro))
    assert _flagged(m) and m[P + "abs_dlogp_max"] > 0


@pytest.mark.parametrize("cache", ["prefix", "dual"])
def test_the_approximate_kv_cache_is_flagged(cache):
    tr = _mlm_trainer(f"dllm.kv_cache={cache}")
    ro = tr.rollout()
    m = _metrics(tr.backward(ro))
    assert _flagged(m), m


# ---------------------------------------------------------------------------------------------- the policy
def test_judge_reads_the_ratio_to_the_clip_range():
    row = {"iteration": 3, P + "dlogp_over_clip": 0.6, P + "abs_dlogp_mean": 6e-5, P + "abs_dlogp_max": 1e-4,
           P + "out_of_clip_frac": 0.25}
    msg = consistency.judge(row, "warn", 0.5)
    assert msg and "iteration 3" in msg and "train.max_inconsistency=0.5" in msg and "25.0%" in msg
    assert consistency.judge(row, "warn", 0.7) is None
    assert consistency.judge(row, "off", 0.5) is None and consistency.judge(row, "stop", 0.0) is None
    assert consistency.judge({P + "applies": 0.0}, "stop", 0.5) is None  # not measured: not judged


def test_summaries_buckets_and_replayed_steps():
    m = consistency.summarize(torch.tensor([0.0, 2e-4, 4e-4]), torch.tensor([0, 1, 2]),
                              torch.tensor([False, True, True]), 1e-4)
    assert m[P + "abs_dlogp_mean"] == pytest.approx(2e-4) and m[P + "abs_dlogp_max"] == pytest.approx(4e-4)
    assert m[P + "dlogp_over_clip"] == pytest.approx(2.0) and m[P + "out_of_clip_frac"] == pytest.approx(2 / 3)
    assert m[P + "late/abs_dlogp_mean"] == pytest.approx(4e-4)
    assert [consistency.bucket(k, 6) for k in range(6)] == [0, 0, 1, 1, 2, 2]
    assert consistency.replay_steps(12) == [2, 6, 10] and consistency.replay_steps(1) == [0]
    assert consistency.summarize(torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.bool), 0.2) == \
        {P + "applies": 0.0}


def test_on_inconsistency_stop_ends_the_run_with_exit_4_and_its_outputs(tmp_path, monkeypatch, capsys):
    from diffgrpo.cli.app import main

    backward = FlowFamily.backward

    def forgetful(self, rollout, epoch):  # the update drops the rollout's guidance scale
        scale, self.policy.guidance_scale = self.policy.guidance_scale, 1.0
        try:
            return backward(self, rollout, epoch)
        finally:
            self.policy.guidance_scale = scale

    monkeypatch.setattr(FlowFamily, "backward", forgetful)
    out = tmp_path / "run"
    code = main(["train", *FAST_CLI, "model.guidance_scale=3.0", "train.num_iterations=3", "eval.every=0",
                 "train.on_inconsistency=stop", f"log.output_dir={out}"])
    assert code == 4
    assert "stopped: rollout and update disagree at iteration 1" in capsys.readouterr().out
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows if P + "dlogp_over_clip" in r] == [1]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["inconsistent"].startswith("rollout and update disagree") and "end" in summary
    assert (out / "weights.safetensors").exists()
    from diffgrpo.cli.report import write_report

    page = write_report(out).read_text()
    assert "rollout and update disagree (train.on_inconsistency=stop)" in page and "<h2>Consistency" in page
