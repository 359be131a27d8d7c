"""Guards on every evaluation (``diffgrpo.guards``): held-out guard rewards, the Fréchet distance to the base model's
own samples, per-prompt diversity, and the ``train.on_hacking`` / ``train.keep_best`` policy, against independent
references (numpy / scipy statistics of the very features, the reward called directly)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from scipy.spatial.distance import pdist

from diffgrpo import RunConfig, feature_stats, guard_checks, guards
from diffgrpo.cli.app import main
from diffgrpo.config import ConfigError
from diffgrpo.rewards import image as image_rewards
from diffgrpo.rewards import verifiers
from tests.helpers.tensors import perturb
from tests.helpers.tiny import TINY, make_dllm_trainer

CALLS = {"falling": 0}


def pixel_features(images):
    """A plug-in feature space: the flattened images (B, C·H·W)."""
    return images.flatten(1).float()


def falling(images, prompts, metadata):
    """A guard reward that is 1 at the run's first evaluation and 0 afterwards (a guard that falls)."""
    CALLS["falling"] += 1
    return torch.full((len(prompts),), 1.0 if CALLS["falling"] == 1 else 0.0)


# ---------------------------------------------------------------------------------------------- pure parts
def test_text_features_are_unit_hashed_trigram_counts():
    f = guards.text_features(["abcabc", "abcabc", "xy", "12+3=15"])
    assert f.shape == (4, guards.TEXT_BUCKETS)
    assert torch.equal(f[0], f[1]) and float(f[2].abs().sum()) == 0  # no trigram in a 2-character text
    torch.testing.assert_close(f[[0, 3]].norm(dim=1), torch.ones(2, dtype=torch.float64))
    assert float(f[0].max()) > float(f[0][f[0] > 0].min())  # "abc" occurs twice, "bca"/"cab" once


def test_tripped_judges_each_guard_against_the_start():
    th = guards.Thresholds(max_fid_ratio=1.5, max_drift=0.5, min_diversity_ratio=0.8, max_reward_drop=0.1)
    start = {"eval/fid": 10.0, "eval/guard/diversity": 2.0, "eval/guard/rewards/aesthetic/mean": 5.0,
             "eval/guard/drift": 0.0}
    inside = {"eval/fid": 14.9, "eval/guard/diversity": 1.61, "eval/guard/rewards/aesthetic/mean": 4.51,
              "eval/guard/drift": 0.49}
    assert guards.tripped(start, inside, th) == []
    out = guards.tripped(start, {"eval/fid": 15.1, "eval/guard/diversity": 1.59,
                                 "eval/guard/rewards/aesthetic/mean": 4.49, "eval/guard/drift": 0.51}, th)
    assert [o.split()[0] for o in out] == ["eval/fid", "eval/guard/drift", "eval/guard/diversity",
                                           "eval/guard/rewards/aesthetic/mean"]
    # a negative start: the drop is relative to |start|; a NaN start is not judged; 0 turns a limit off
    assert guards.tripped({"eval/guard/rewards/r/mean": -2.0}, {"eval/guard/rewards/r/mean": -2.19}, th) == []
    assert guards.tripped({"eval/guard/rewards/r/mean": -2.0}, {"eval/guard/rewards/r/mean": -2.21}, th)
    assert guards.tripped({"eval/fid": float("nan")}, {"eval/fid": 100.0}, th) == []
    assert guards.tripped(start, {**inside, "eval/fid": 100.0}, guards.Thresholds(max_fid_ratio=0)) == []
    improves = guard_checks.improves
    assert improves(1.0, None) and improves(2.0, 1.0) and not improves(1.0, 1.0)
    assert not improves(float("nan"), None)


def test_guard_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="eval.guard_rewards: 'jpeg_incompressibility' is also in reward.weights"):
        RunConfig.from_overrides([*TINY, "eval.guard_rewards=[jpeg_incompressibility]"])
    with pytest.raises(ConfigError, match="eval.guard_rewards: unknown reward 'nope'"):
        RunConfig.from_overrides([*TINY, "eval.guard_rewards=[nope]"])
    with pytest.raises(ConfigError, match="eval.guard_features: 'clip'"):
        RunConfig.from_overrides([*TINY, "eval.guard_features=clip"])
    with pytest.raises(ConfigError, match="eval.guard_features: value 'pixels'"):
        RunConfig.from_overrides([*TINY, "eval.guard_features=pixels"])
    with pytest.raises(ConfigError, match="train.keep_best: value 'reward'"):
        RunConfig.from_overrides([*TINY, "train.keep_best=reward"])
    with pytest.raises(ConfigError, match="train.on_hacking"):
        RunConfig.from_overrides([*TINY, "train.on_hacking=halt"])
    with pytest.raises(ConfigError, match="eval.guard_rewards: 'jpeg_compressibility' does not score text"):
        RunConfig.from_overrides(["model.name=tiny_mlm", "eval.guard_rewards=[jpeg_compressibility]"])
    with pytest.raises(ConfigError, match="reward.options.clip_score: reward 'clip_score' is not in"):
        RunConfig.from_overrides([*TINY, "reward.options={clip_score: {batch_size: 2}}"])
    cfg = RunConfig.from_overrides([*TINY, "eval.guard_rewards=[clip_score]",  # options of a guard reward
                                    "reward.options={clip_score: {batch_size: 2}}"])
    assert guards.feature_kind(cfg) == "digits"


# ------------------------------------------------------------------------------------------ the built-in task's digits
def test_penultimate_features_feed_the_logits():
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval()
    x = torch.rand(5, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    f = guards.penultimate_features(clf, x)
    assert f.shape == (5, 64) and bool((f >= 0).all())  # after the ReLU
    torch.testing.assert_close(clf.fc[-1](f), clf(x).detach())


def test_evaluation_logs_fid_and_diversity(make_trainer, monkeypatch):
    """The flow family's evaluation reports eval/fid and eval/diversity of its own images on the built-in task."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)  # untrained: the pipeline, not the numbers
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    tr = make_trainer()
    row, images = tr.evaluate()
    prompts, _, _ = tr.family.eval_prompts()
    assert len(images) == len(prompts)
    from diffgrpo.data import digits_split

    _, (x_te, _) = digits_split(images.shape[-1])
    mu_r, cov_r = feature_stats.gaussian_stats(guards.penultimate_features(clf, x_te))
    mu, cov = feature_stats.gaussian_stats(guards.penultimate_features(clf, images))
    assert row["eval/fid"] == pytest.approx(feature_stats.frechet_distance(mu, cov, mu_r, cov_r), rel=1e-9)
    assert row["eval/diversity"] == pytest.approx(
        feature_stats.per_prompt_diversity(guards.penultimate_features(clf, images), prompts), rel=1e-9)
    assert row["eval/fid"] > 0 and row["eval/diversity"] > 0


def test_guards_are_the_same_when_evaluation_is_chunked(make_trainer, monkeypatch):
    """eval.batch_size samples in chunks; the built-in task keeps its (tiny) images, so the guards cover every
    sample and equal the unchunked evaluation's (each sample starts from its own seed's noise)."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    whole, _ = make_trainer("eval.seeds_per_prompt=8").evaluate()  # 80 images
    chunked, _ = make_trainer("eval.batch_size=7", "eval.seeds_per_prompt=8").evaluate()
    for key in ("eval/fid", "eval/diversity", "eval/reward"):
        assert chunked[key] == pytest.approx(whole[key], rel=1e-4, abs=1e-5), key


def test_one_sample_per_prompt_logs_fid_only(make_trainer, monkeypatch):
    """eval.seeds_per_prompt=1: no pair of samples shares a prompt, so no diversity (and no NaN in the metrics)."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    row, _ = make_trainer("eval.seeds_per_prompt=1").evaluate()
    assert "eval/diversity" not in row and np.isfinite(row["eval/fid"])


def test_streamed_guards_equal_the_whole_set_computation(monkeypatch):
    """GuardStats (fixed memory, chunk by chunk, chunks out of order) equals the whole-set computation (Fréchet
    distance of the Gaussian fit, per-prompt diversity) when every record's prompt is distinct."""
    torch.manual_seed(0)
    clf = image_rewards.DigitClassifier().eval().requires_grad_(False)
    monkeypatch.setattr(image_rewards, "load_classifier", lambda image_size=16, *a, **k: (clf, 0.0))
    feats = torch.randn(30, 64).relu()
    prompts = [f"p{i // 3}" for i in range(30)]  # 10 records × 3 seeds
    mu, cov = feature_stats.gaussian_stats(feats)
    whole = {"eval/fid": feature_stats.frechet_distance(mu, cov, *guards.reference_stats(16)),
             "eval/diversity": feature_stats.per_prompt_diversity(feats, prompts),
             "eval/guard/kid": feature_stats.kid(feats, guards.reference_features(16))}
    g = guards.GuardStats(16, 3)
    for lo in (16, 0, 8, 24):  # chunks of 8 (the last 6), records split across chunks
        idx = list(range(lo, min(lo + 8, 30)))
        g.add(idx, feats[idx])
    got = g.result()
    assert got.keys() == whole.keys() == {"eval/fid", "eval/diversity", "eval/guard/kid"}
    for k in got:
        assert got[k] == pytest.approx(whole[k], rel=1e-9), k


# ---------------------------------------------------------------------------------------------- flow evaluation
@pytest.mark.parametrize("batch_size", [0, 7])
def test_flow_guards_against_independent_statistics(make_trainer, batch_size):
    """Start: the distance to the base samples is 0; after the weights move it is the Fréchet distance of the
    features of the two sets of samples (numpy statistics, feature_stats.frechet_distance), the guard reward is the
    reward called on the samples, and the diversity is pdist's per prompt; chunked evaluation changes nothing."""
    tr = make_trainer("eval.seeds_per_prompt=3", "eval.guard_rewards=[jpeg_compressibility]",
                      "eval.guard_features=tests.test_guards:pixel_features", f"eval.batch_size={batch_size}")
    row0, grid0 = tr.evaluate()
    assert grid0.shape[0] == 30  # every evaluation sample is in the grid (fewer than 64)
    assert row0["eval/guard/fd_base"] == pytest.approx(0.0, abs=1e-9) and row0["eval/guard/drift"] < 1e-9
    perturb(tr, scale=0.05)
    row1, grid1 = tr.evaluate()
    f0, f1 = (pixel_features(g).double().numpy() for g in (grid0, grid1))
    want = feature_stats.frechet_distance(*(torch.from_numpy(t) for t in (f1.mean(0), np.cov(f1, rowvar=False),
                                                                     f0.mean(0), np.cov(f0, rowvar=False))))
    assert want > 1e-4 and row1["eval/guard/fd_base"] == pytest.approx(want, rel=1e-6)
    assert row1["eval/guard/drift"] == pytest.approx(want / np.trace(np.cov(f0, rowvar=False)), rel=1e-6)
    prompts, _, meta = tr.family.eval_prompts()
    jpeg = image_rewards.jpeg_compressibility(grid1, prompts, meta)
    assert row1["eval/guard/rewards/jpeg_compressibility/mean"] == pytest.approx(float(torch.as_tensor(jpeg).mean()),
                                                                               rel=1e-5)
    assert row1["eval/guard/diversity"] == pytest.approx(np.mean([pdist(f1[i:i + 3]).mean() for i in range(0, 30, 3)]),
                                                         rel=1e-6)
    assert row1["eval/diversity"] > 0 and "eval/fid" in row1  # the built-in task's own guards stay


def test_base_statistics_survive_a_resume(make_trainer, tmp_path):
    """The distance at the end of a resumed run is measured against the base samples of its start (read back from
    the run directory), and equals the uninterrupted run's."""
    common = ("eval.seeds_per_prompt=2", "eval.guard_features=tests.test_guards:pixel_features", "eval.every=0",
              "train.lr=3e-3", "train.save_every=1")
    whole = make_trainer(*common, "train.num_iterations=2", f"log.output_dir={tmp_path / 'whole'}").train()
    make_trainer(*common, "train.num_iterations=1", f"log.output_dir={tmp_path / 'part'}").train()
    assert (tmp_path / "part" / guards.BASE_FILE).is_file()
    resumed = make_trainer(*common, "train.num_iterations=2", f"log.output_dir={tmp_path / 'part'}").train(resume=True)
    assert whole["end"]["eval/guard/fd_base"] > 0
    assert resumed["end"]["eval/guard/fd_base"] == pytest.approx(whole["end"]["eval/guard/fd_base"], rel=1e-9)
    (tmp_path / "part" / guards.BASE_FILE).unlink()  # without it the distance is not reported (never re-anchored)
    again = make_trainer(*common, "train.num_iterations=3", f"log.output_dir={tmp_path / 'part'}").train(resume=True)
    assert "eval/guard/fd_base" not in again["end"] and "eval/guard/diversity" in again["end"]


# ---------------------------------------------------------------------------------------------- the policy
def _cli_run(tmp_path, name, *extra):
    CALLS["falling"] = 0
    out = tmp_path / name
    code = main(["train", *TINY, "pretrain.steps=20", "pretrain.batch_size=16", "eval.seeds_per_prompt=1",
                 "eval.every=1", "train.num_iterations=3", "train.save_every=0", "train.lr=1e-3",
                 "eval.guard_rewards=[tests.test_guards:falling]", "train.keep_best=eval/reward",
                 "train.guard_max_drift=0", "train.guard_max_fid_ratio=0", "train.guard_min_diversity_ratio=0",
                 f"log.output_dir={out}", *extra])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return code, out, [r for r in rows if "eval/reward" in r]


def test_on_hacking_stop_stops_a_run_whose_guard_falls(tmp_path, capsys):
    code, out, evals = _cli_run(tmp_path, "stop", "train.on_hacking=stop")
    printed = capsys.readouterr().out
    assert code == 3
    assert [r["iteration"] for r in evals] == [0, 1]  # stopped at the first evaluation after the fall
    assert [r["eval/guard/ok"] for r in evals] == [1.0, 0.0]
    assert "stopped: guard out of limits at iteration 1: eval/guard/rewards/tests.test_guards:falling/mean 0" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"].startswith("guard out of limits at iteration 1") and summary["end"]["iteration"] == 1
    assert summary["best"] == {"iteration": 0, "metric": "eval/reward", "value": evals[0]["eval/reward"]}
    assert json.loads((out / "best" / "best.json").read_text()) == summary["best"]
    best, last = load_file(str(out / "best" / "weights.safetensors")), load_file(str(out / "weights.safetensors"))
    assert best.keys() == last.keys() and any(not torch.equal(best[k], last[k]) for k in best)  # the start's weights
    assert main(["report", str(out)]) == 0  # the report says why the run stopped and plots the guards
    page = (out / "report.html").read_text()
    assert "Stopped by a guard" in page and "at iteration 1" in page and "<h2>Guards" in page
    assert "Best weights inside the guards: eval/reward" in page
    # a guard reward or feature plug-in is code: a resume takes it from the command line, never from config.yaml
    assert main(["train", "--resume", str(out)]) == 2
    assert "eval.guard_rewards=['tests.test_guards:falling']" in capsys.readouterr().err

    # train.guard_patience=2: the first evaluation out warns, the second in a row stops the run
    code, out, evals = _cli_run(tmp_path, "patience", "train.on_hacking=stop", "train.guard_patience=2")
    printed = capsys.readouterr().out
    assert code == 3 and [r["iteration"] for r in evals] == [0, 1, 2]
    assert "evaluation 1 of 2 in a row" in printed and "at iteration 2" in printed and "2 evaluations in a row" in printed

    code, out, evals = _cli_run(tmp_path, "warn", "train.on_hacking=warn")
    assert code == 0 and [r["iteration"] for r in evals] == [0, 1, 2, 3]
    assert "warning: guard out of limits at iteration 1" in capsys.readouterr().out
    code, out, evals = _cli_run(tmp_path, "off")  # off (the default): logged only
    assert code == 0 and [r["eval/guard/ok"] for r in evals] == [1.0, 0.0, 0.0, 0.0]
    assert "warning: guard" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------- masked LMs
def test_text_guards_on_a_masked_lm():
    tr = make_dllm_trainer("dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8",
                           "eval.guard_rewards=[d1_format]", "dllm.eval_samples=2", "dllm.eval_temperature=1.0")
    seen = []
    texts = tr.family.guards.texts
    tr.family.guards.texts = lambda t, p, m: seen.append((t, p, m)) or texts(t, p, m)
    row0, _ = tr.evaluate()
    (t0, p0, m0), = seen
    assert row0["eval/guard/fd_base"] == pytest.approx(0.0, abs=1e-9)
    want = float(np.mean(verifiers.d1_format(t0, p0, m0)))
    assert row0["eval/guard/rewards/d1_format/mean"] == pytest.approx(want)
    f = guards.text_features(t0).numpy()
    assert row0["eval/guard/diversity"] == pytest.approx(np.mean([np.linalg.norm(f[i] - f[i + 1])
                                                                  for i in range(0, len(f), 2)]), rel=1e-9)
    perturb(tr, scale=0.5)
    row1, _ = tr.evaluate()
    assert row1["eval/guard/fd_base"] > 0


def test_guard_patience_stops_at_the_nth_evaluation_in_a_row_out_of_the_guards(tmp_path):
    """train.guard_patience=2: one evaluation out (the noise of one evaluation) warns, an evaluation back inside
    resets the count, the second in a row stops the run; a resumed run counts on from its evaluation rows."""
    t = RunConfig.from_overrides(["train.on_hacking=stop", "train.guard_patience=2"]).train
    msgs = []
    w = guards.Watch(t, log=msgs.append)
    p = guards.PREFIX
    start = {"iteration": 0, p + "drift": 0.0}
    rows = [dict(start)] + [{"iteration": i, p + "drift": d} for i, d in ((1, 0.9), (2, 0.1), (3, 0.9), (4, 0.9))]
    stops = []
    for r in rows:
        w.judge(r, run_dir=tmp_path, lead=True, weights=dict)
        stops.append(w.stop)
    assert [r[p + "ok"] for r in rows] == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert stops[:4] == [None] * 4 and "iteration 4" in stops[4] and "2 evaluations in a row" in stops[4]
    assert sum("warning:" in m and "evaluation 1 of 2" in m for m in msgs) == 2 and msgs[-1].startswith("stopping")
    again = guards.Watch(t, log=msgs.append)  # resumed after iteration 3: one evaluation out so far
    again.resume(rows[0], tmp_path, guards.EvalGuards(2, reward_fns={}, features=None, log=lambda *a: None),
                 rows[:4])
    assert again.streak == 1
    again.judge({"iteration": 4, p + "drift": 0.9}, run_dir=tmp_path, lead=True, weights=dict)
    assert again.stop and "iteration 4" in again.stop
    one = guards.Watch(RunConfig.from_overrides(["train.on_hacking=stop"]).train, log=lambda *a: None)
    for r in rows[:2]:
        one.judge(dict(r), run_dir=tmp_path, lead=True, weights=dict)
    assert one.stop and "in a row" not in one.stop  # the default, 1: the first evaluation out stops
