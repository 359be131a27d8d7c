"""The rollout–train consistency check: exact configurations read 0, every planted cause of a rollout that differs
from the update is flagged above the default threshold, and train.on_inconsistency=stop ends the run with exit 4.

A compiled rollout (regional compile, model.compile): with model.compile=true both rollout and update run the
compiled blocks and read 0 with aot_eager. Planted as a rollout sampled through the compiled blocks against an
eager update (torch.compiler's force_eager stance), it differs at float round-off only: aot_eager (tracing without
code generation) reads 0; inductor (C++ code generation, 15-35 s for the tiny model on a 2-core CPU: behind the
slow marker) reads |Δ log p| ≤ 1.2e-7, one float32 ulp of the step log-prob (dlogp_over_clip 1.2e-4 against the
0.5 threshold). Both stay below a bound derived from float32 round-off of evaluating the step log-prob
(:func:`_roundoff_bound`, about 3e-6), far inside the clip range. A bf16 compiled rollout is flagged as the eager
one is. Rank-local noise is planted as the record it leaves: a rollout whose stored states are not the ones its
log-probs were drawn with.
"""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch._dynamo
import torch._inductor.config

from diffgrpo import consistency
from diffgrpo.config import RunConfig
from diffgrpo.flow.family import FlowFamily
from diffgrpo.models.regional_compile import COMPILE_BACKENDS, compile_policy
from diffgrpo.samplers import flow_sde
from tests.helpers.tiny import FAST_CLI
from tests.helpers.tiny import decoding_dllm_trainer as _mlm_trainer

LIMIT = RunConfig().train.max_inconsistency  # the default threshold (a fraction of the clip range)
P = consistency.PREFIX


def _metrics(stats) -> dict[str, float]:
    return {k: v for k, v in stats.metrics.items() if k.startswith(P)}


def _flagged(m: dict) -> bool:
    return consistency.judge(m, "stop", LIMIT) is not None


def _roundoff_bound(tr, ro) -> float:
    """Float32 round-off of evaluating one step log-prob ℓ = mean_j t_j over D elements, t_j = −z_j²/2 − log s − c
    (z the recorded standard-normal noise, s the step's std): (⌈log₂ D⌉ + 3)·eps·mean_j |t_j| (a pairwise sum of D
    terms, three rounded operations per term), the largest over the rollout's stochastic (sample, step) pairs."""
    k = tr.family.kernel
    sig = ro.traj.sigmas  # (T+1,)
    _, _, std = flow_sde.kernel_coefficients(sig[:-1], sig[1:], sde_type=k["sde_type"], noise_level=k["noise_level"],
                                             sigma_bounds=k["sigma_bounds"])  # (T,)
    z2 = ro.traj.noise.flatten(2).double().square().mean(2)  # (B, T) mean z²
    live = std > 0
    terms = z2[:, live] / 2 + std[live].double().log().abs() + 0.5 * math.log(2 * math.pi)  # (B, T') mean |t_j|
    dim = ro.traj.noise[0, 0].numel()
    return (math.ceil(math.log2(dim)) + 3) * torch.finfo(torch.float32).eps * float(terms.max())


class GraphCounter:
    """A torch.compile backend that counts the graphs it compiles and hands them to the named backend."""

    def __init__(self, backend: str):
        self.backend, self.graphs = torch._dynamo.lookup_backend(backend), 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return self.backend(gm, example_inputs)


def _compiled_rollout(tr, backend: str, monkeypatch):
    """The rollout sampled through the regionally compiled blocks (counted: they ran compiled)."""
    torch._dynamo.reset()
    counter = GraphCounter(backend)
    monkeypatch.setattr("diffgrpo.models.regional_compile.COMPILE_BACKENDS", (*COMPILE_BACKENDS, counter))
    compile_policy(tr.policy, counter)
    ro = tr.rollout()
    assert counter.graphs > 0
    return ro, counter


def _eager_update(tr, ro, counter) -> dict[str, float]:
    """The first update of ``ro`` with every compiled block run eagerly (nothing compiled for it)."""
    graphs = counter.graphs
    with torch.compiler.set_stance("force_eager"):
        m = _metrics(tr.backward(ro))
    assert counter.graphs == graphs  # the update's grad-mode forward would have compiled its own graph
    return m


# ---------------------------------------------------------------------------------------------- exact: 0
@pytest.mark.parametrize("extra", [[], ["model.guidance_scale=3.0"], ["engine.name=jagg"],
                                   ["sampler.sde_type=dance_sde", "loss.beta=0.05"],
                                   ["model.compile=true", "model.compile_backend=aot_eager"]])
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


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_compiled_rollout_with_an_eager_update_differs_at_float_round_off_only(backend, make_trainer, monkeypatch,
                                                                                  tmp_path):
    """Rollout through the compiled blocks, update eager: |Δ log p| stays within the float32 round-off of evaluating
    the step log-prob (:func:`_roundoff_bound`, not a multiple of a measured Δ), so no ratio leaves the clip range
    and the check stays below its default threshold. Measured on the tiny model: aot_eager 0 (bitwise), inductor
    max 1.2e-7 (one ulp), dlogp_over_clip 1.2e-4, against a bound of about 3e-6."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # generated code: this test's dir
    monkeypatch.setattr(torch._inductor.config, "cpp_cache_precompile_headers", False)  # no shared header cache
    tr = make_trainer()
    ro, counter = _compiled_rollout(tr, backend, monkeypatch)
    m = _eager_update(tr, ro, counter)
    bound = _roundoff_bound(tr, ro)
    assert bound < 0.1 * tr.cfg.loss.clip_range  # round-off is far inside the clip range
    assert m[P + "pairs"] > 0 and m[P + "abs_dlogp_max"] <= bound
    assert m[P + "out_of_clip_frac"] == 0.0 and not _flagged(m)


def test_a_bf16_compiled_rollout_with_an_eager_fp32_update_is_flagged(make_trainer, monkeypatch):
    tr = make_trainer()
    tr.policy.amp_dtype = torch.bfloat16  # autocast in the compiled rollout only
    ro, counter = _compiled_rollout(tr, "aot_eager", monkeypatch)
    tr.policy.amp_dtype = None
    m = _eager_update(tr, ro, counter)
    assert _flagged(m) and m[P + "out_of_clip_frac"] > 0.5


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
