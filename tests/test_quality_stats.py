"""The statistics of ``diffgrpo bench quality``: bootstrap intervals, the plateau check, the paired speed-up, the first
evaluation at the target inside the guards, the first guard out, the whole summary; and that they need no torch."""
from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from diffgrpo import guards
from diffgrpo.studies import quality_stats as qs
from diffgrpo.studies.quality import guard_check

STATS = Path(qs.__file__)


def test_bootstrap_interval_and_plateau_check():
    x = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    lo, hi = qs.bootstrap_ci(x, np.mean, n=4000, seed=1)
    assert lo < 3.0 < hi and 1.0 <= lo and hi <= 5.0
    assert math.isnan(qs.bootstrap_ci(x[:1], np.mean)[0])  # one seed: no interval
    # speed-up with paired seeds: a seed the variant never reaches makes the ratio 0 in the resamples that draw it
    paired = np.array([[10.0, 5.0], [12.0, 6.0], [8.0, math.inf]])
    assert qs.speedup(paired) == 0.0 and qs.speedup(paired[:2]) == pytest.approx(2.0)
    flat = qs.plateau([1, 2, 3, 4, 5, 6, 7, 8], [0, .5, .8, .9, .91, .90, .91, .905], [.02] * 8, seeds=4)
    assert flat["plateaued"] and flat["points"] == 2 and flat["level"] == pytest.approx(0.9075)
    rising = qs.plateau([1, 2, 3, 4, 5, 6, 7, 8], [.1 * i for i in range(8)], [.02] * 8, seeds=4)
    assert rising["plateaued"] is False and rising["trend"] == pytest.approx(0.1)
    assert qs.plateau([1, 2], [0, 1], [0, 0], seeds=1)["plateaued"] is None


def _point(it, r, g, d):
    return {"iteration": it, "seconds": it * 2.0, "cost": it * 10.0,
            "metrics": {"eval/reward": r, "eval/guard/rewards/a/mean": g, "eval/guard/drift": d}}


def _curve():
    return [_point(0, 0.1, 1.0, 0.0), _point(1, 0.6, 0.5, 0.1), _point(2, 0.7, 0.95, 0.2), _point(3, 0.9, 0.95, 0.9)]


def test_first_reach_needs_the_guards_inside():
    check = guard_check(guards.Thresholds(max_reward_drop=0.1, max_drift=0.5))
    curve = _curve()
    low = qs.first_reach(curve, 0.05, "eval/reward", check)  # the start is above it, but never counts
    assert low["raw_seconds"] == 2.0 and low["iteration"] == 2
    r = qs.first_reach(curve, 0.55, "eval/reward", check)
    assert r["iteration"] == 2 and r["seconds"] == 4.0 and r["raw_seconds"] == 2.0 and r["hacks"]
    never = qs.first_reach(curve, 0.95, "eval/reward", check)
    assert never["seconds"] == math.inf and never["iteration"] is None and not never["hacks"]


def test_first_guard_out_and_the_recorded_limits():
    th = guards.Thresholds(max_reward_drop=0.1, max_drift=0.5)
    check = guard_check(th)
    assert check.limits == vars(th)
    out = qs.first_out(_curve(), check, budget=40.0)
    assert out == {"guards": ["eval/guard/rewards/a/mean"], "cost_fraction": 0.25, "reward": 0.6}
    inside = [p for p in _curve() if p["iteration"] != 1][:2]
    assert qs.first_out(inside, check, budget=40.0) is None


def _cell(variant, seed, rewards, cost=10.0, failed=""):
    curve = [{"iteration": i, "seconds": i * 1.0, "cost": i * cost, "metrics": {"eval/reward": r}}
             for i, r in enumerate(rewards)]
    n = len(rewards) - 1
    return SimpleNamespace(variant=variant, seed=seed, overrides=[], seconds=float(n), cost=n * cost, iterations=n,
                           curve=curve, failed=failed, phases={"sample": 0.5 * n, "reward": 0.1 * n, "train": 0.2 * n})


def test_summary_target_speedup_and_time_shares():
    """The target from the reference's plateau, each variant's time and cost to it and the paired speed-up."""
    cells = [_cell("ref", 0, [0.0, 0.4, 0.8, 1.04, 0.96]), _cell("ref", 1, [0.0, 0.4, 0.8, 0.96, 1.04]),
             _cell("fast", 0, [0.0, 1.0, 1.0, 1.0, 1.0]), _cell("fast", 1, [0.0, 0.5, 1.0, 1.0, 1.0])]
    s = qs.summarize(cells, "ref", metric="eval/reward", target_fraction=0.95, check=guard_check(guards.Thresholds()))
    assert s["start"] == 0.0 and s["target"] == pytest.approx(0.95) and s["plateau"]["plateaued"]
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows["ref"]["time_to_target"] == 3.0 and rows["fast"]["time_to_target"] == 1.5
    assert rows["fast"]["speedup"] == pytest.approx(2.0) and rows["fast"]["cost_speedup"] == pytest.approx(2.0)
    assert rows["fast"]["iterations_to_target"] == 1.5 and rows["ref"]["reached"] == 2
    assert rows["ref"]["time_shares"] == pytest.approx({"sample": 0.5, "reward": 0.1, "train": 0.2, "other": 0.2})
    assert s["thresholds"] == vars(guards.Thresholds())


def test_diversity_at_the_target_is_each_reaching_seeds_ratio_to_its_start():
    """Per seed, the headline diversity (the checker's detections before the feature-space one) at its first
    evaluation at the target inside the guards ÷ its own start; the row's value is the mean over the seeds that reached
    it. A seed whose diversity at the target is below the guard's 0.8× never counts as there."""
    def cell(seed, divs, rewards, det=None):
        c = _cell("v", seed, rewards)
        for p, d in zip(c.curve, divs):
            p["metrics"]["eval/guard/diversity"] = d
        for p, d in zip(c.curve, det or []):
            p["metrics"]["eval/guard/detection_diversity"] = d
        return c

    check = guard_check(guards.Thresholds())
    cells = [cell(0, [10.0, 9.0, 8.5], [0.0, 1.0, 1.0]),  # at the target at 1: 0.9×
             cell(1, [20.0, 19.0, 17.0], [0.0, 0.5, 1.0]),  # at 2: 0.85×
             cell(2, [10.0, 5.0, 5.0], [0.0, 1.0, 1.0])]  # at the target only at 0.5×: out of the guard, never there
    s = qs.summarize(cells, "v", metric="eval/reward", target_fraction=0.95, check=check, target=0.9)
    row = s["rows"][0]
    assert s["diversity_key"] == "eval/guard/diversity" and row["reached"] == 2
    assert row["diversity_at_target"] == {"eval/guard/diversity": pytest.approx((0.9 + 0.85) / 2)}
    assert [r["diversity"] for r in row["per_seed"]][2] == {}
    det = [cell(0, [10.0, 9.0], [0.0, 1.0], det=[4.0, 3.6])]
    s = qs.summarize(det, "v", metric="eval/reward", target_fraction=0.95, check=check, target=0.9)
    assert s["diversity_key"] == "eval/guard/detection_diversity"
    assert s["rows"][0]["diversity_at_target"]["eval/guard/detection_diversity"] == pytest.approx(0.9)
    assert qs.diversity_ratios({"eval/diversity": 0.0}, {"eval/diversity": 1.0}) == {}  # no ratio to a zero start


def test_stop_and_keep_best_keep_the_best_evaluation_inside_the_guards_before_the_first_one_out():
    """A user's run with train.on_hacking=stop and train.keep_best=eval/reward: it ends at the first evaluation out of
    the guards and keeps the best inside one before it (the start when none is better)."""
    check = guard_check(guards.Thresholds(max_reward_drop=0.1, max_drift=0.5))
    k = qs.kept(_curve(), check, "eval/reward")  # evaluation 1 is out (guard reward 0.5 < 0.9): stopped there
    assert k["stopped"] and k["reward"] == 0.1 and k["iteration"] == 0 and k["run_seconds"] == 2.0
    inside = [p for p in _curve() if p["iteration"] != 1]  # 0.1, 0.7 (inside), 0.9 (drift 0.9 > 0.5: out)
    k = qs.kept(inside, check, "eval/reward")
    assert k["stopped"] and k["reward"] == 0.7 and k["iteration"] == 2 and k["run_seconds"] == 6.0
    k = qs.kept(inside[:2], check, "eval/reward")
    assert not k["stopped"] and k["reward"] == 0.7 and k["run_seconds"] == 4.0
    # train.guard_patience=2: evaluation 1 alone out does not stop the run; 0.7 at 2 (inside) is kept, 3 is out once
    k = qs.kept(_curve(), check, "eval/reward", patience=2)
    assert not k["stopped"] and k["reward"] == 0.7 and k["run_seconds"] == 6.0
    twice = _curve() + [{**_curve()[3], "iteration": 4, "seconds": 8.0}]  # out at 3 and 4: stopped at 4
    k = qs.kept(twice, check, "eval/reward", patience=2)
    assert k["stopped"] and k["reward"] == 0.7 and k["run_seconds"] == 8.0
    cells = [_cell("v", 0, [0.0, 0.5, 0.4]), _cell("v", 1, [0.0, 0.3, 0.6])]
    row = qs.summarize(cells, "v", metric="eval/reward", target_fraction=0.95,
                       check=guard_check(guards.Thresholds()))["rows"][0]
    assert row["kept_reward"] == pytest.approx(0.55) and row["kept_stopped"] == 0


def test_frontier_objectives_and_pareto_points():
    from diffgrpo.studies.quality_report import objective, pareto

    assert objective({"overrides": ["engine.name=nft", "diversity.method=gardo"]}) == "gardo"
    assert objective({"overrides": ["diversity.method=[gardo, drift]"]}) == "gardo,drift"
    assert objective({"overrides": ["engine.name=nft"]}) == "off" and objective({}) == "off"
    pts = [(0.9, 1.0), (0.85, 2.0), (0.8, 1.5), (0.95, 0.5), (0.9, 1.0)]
    assert pareto(pts) == [(0.85, 2.0), (0.9, 1.0), (0.95, 0.5)]  # (0.8, 1.5) is beaten by (0.85, 2.0)


def test_the_statistics_import_and_run_without_torch():
    """The statistics module imports numpy and the standard library only: with torch made unimportable it loads
    from its file and summarises cells, its guards judged by a plain function."""
    code = f"""
import importlib.util, sys
from types import SimpleNamespace
sys.modules["torch"] = None
spec = importlib.util.spec_from_file_location("quality_stats", {str(STATS)!r})
qs = importlib.util.module_from_spec(spec)
sys.modules["quality_stats"] = qs
spec.loader.exec_module(qs)
def cell(v, s, rs):
    curve = [{{"iteration": i, "seconds": float(i), "cost": 10.0 * i, "metrics": {{"eval/reward": r}}}}
             for i, r in enumerate(rs)]
    return SimpleNamespace(variant=v, seed=s, overrides=[], seconds=4.0, cost=40.0, iterations=4, curve=curve,
                           failed="", phases={{"sample": 1.0, "reward": 1.0, "train": 1.0}})
check = qs.GuardCheck({{}}, lambda start, row: ["eval/guard/drift"] if row["eval/reward"] > 1.5 else [])
cells = [cell("ref", s, [0, .5, .9, 1, 1]) for s in (0, 1)] + [cell("b", s, [0, 1, 2, 2, 2]) for s in (0, 1)]
s = qs.summarize(cells, "ref", metric="eval/reward", target_fraction=0.95, check=check)
rows = {{r["variant"]: r for r in s["rows"]}}
assert rows["ref"]["time_to_target"] == 3.0 and rows["b"]["time_to_target"] == 1.0, rows
assert rows["b"]["speedup"] == 3.0 and rows["b"]["hacks"]
assert rows["b"]["first_out_of_guards"][0]["cost_fraction"] == 0.5
assert "torch" not in [m for m in sys.modules if sys.modules[m] is not None]
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    text = STATS.read_text()
    imports = [line for line in text.splitlines() if line.startswith(("import ", "from "))]
    allowed = {"__future__", "collections", "dataclasses", "math", "statistics", "numpy"}  # numpy and the stdlib
    assert all(line.split()[1].split(".")[0] in allowed for line in imports), imports
