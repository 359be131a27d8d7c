"""``diffgrpo bench quality --tune``: a grid per variant on tuning seeds, the choice (least cost to the target
inside the guards; ties: the highest end reward inside them), then the measurement on other seeds."""
from __future__ import annotations

import json
import math

import pytest
import yaml

from diffgrpo import RunConfig, guards
from diffgrpo.cli.app import main
from diffgrpo.errors import ConfigError
from diffgrpo.studies import quality_tune as qt
from diffgrpo.studies.quality_stats import GuardCheck
from tests.helpers.tiny import FAST_CLI


def _first_at_target(curve, target, th):
    """Independent of the study: the cost of the first evaluation after the start at the target with no guard out."""
    start = curve[0]["metrics"]
    for p in curve[1:]:
        m = {k: math.nan if v is None else v for k, v in p["metrics"].items()}
        if m["eval/reward"] >= target and not guards.tripped(start, m, th):
            return p["cost"]
    return math.inf


def test_tuning_chooses_the_cell_first_at_the_target_and_measures_it_on_other_seeds(tmp_path):
    out = tmp_path / "bq"
    code = main(["bench", "quality", *FAST_CLI, "--variant", "a=engine.name=recompute", "--seeds", "0",
                 "--iterations", "3", "--evals", "3", "--tune", "--tune-seeds", "7",
                 "--tune-grid", "train.lr=x3,0", "--target", "0.35", "--out", str(out)])
    assert code == 0
    tune = json.loads((out / "tune" / "summary.json").read_text())
    grid = json.loads((out / "tune" / "grid.json").read_text())
    tuned = json.loads((out / "tuned.json").read_text())
    main_s = json.loads((out / "summary.json").read_text())
    assert [r["settings"] for r in grid] == [{"train.lr": "0.003"}, {"train.lr": "0"}]  # x3 of FAST_CLI's 1e-3
    th = guards.Thresholds(**tune["thresholds"])
    by_cell = {c["variant"]: c for c in tune["cells"]}
    costs = {r["cell"]: _first_at_target(by_cell[r["cell"]]["evaluations"], tune["target"], th) for r in grid}
    for r in grid:  # the grid table's cost to target is the first evaluation at the target inside the guards
        assert (r["cost_to_target"] if r["cost_to_target"] is not None else math.inf) == costs[r["cell"]]
    for r in grid:  # ends inside the guards: its one tuning seed's last evaluation against its start
        ev = [{"metrics": {k: math.nan if v is None else v for k, v in p["metrics"].items()}}
              for p in by_cell[r["cell"]]["evaluations"]]
        assert r["held"] == float(not guards.tripped(ev[0]["metrics"], ev[-1]["metrics"], th))
    most = max(r["held"] for r in grid)
    costs = {c: k for c, k in costs.items() if next(r["held"] for r in grid if r["cell"] == c) == most}
    best = min(costs.values())
    tied = [c for c, k in costs.items() if k == best]
    want = max(tied, key=lambda c: next(r["end_inside"] for r in grid if r["cell"] == c))
    assert tuned["chosen"]["a"]["cell"] == want
    assert tuned["chosen"]["a"]["settings"] == next(r["settings"] for r in grid if r["cell"] == want)
    # measured on the measuring seed only, never on the tuning seed, with the chosen settings
    assert {c["seed"] for c in tune["cells"]} == {7} and {c["seed"] for c in main_s["cells"]} == {0}
    cfg = yaml.safe_load((out / "configs" / "a_seed0.yaml").read_text())
    assert cfg["train"]["lr"] == pytest.approx(float(tuned["chosen"]["a"]["settings"]["train.lr"]))
    assert main_s["meta"]["tuning"]["chosen"] == {"a": tuned["chosen"]["a"]["settings"]}
    assert tuned["cost"]["counted_cost"] == pytest.approx(sum(c["cost"] for c in tune["cells"]))
    assert tuned["cost"]["seconds"] > 0
    from diffgrpo.studies.quality import eval_marks

    focus = main_s["meta"]["focus"]  # dense marks where the tuned reference crossed the target (when it did)
    marks = eval_marks(main_s["meta"]["budget_cost"], 3, "linear", focus)
    assert all(len(c["evaluations"]) == 1 + len(marks) for c in main_s["cells"])
    table, grid_md = (out / "table.md").read_text(), (out / "tune" / "grid.md").read_text()
    assert "Settings tuned first" in table and "Cost of the tuning" in grid_md
    assert grid_md.count("**yes**") == 1 and f"| {want} |" in grid_md.split("**yes**")[0].splitlines()[-1]


def test_tuning_seeds_must_differ_from_measuring_seeds(tmp_path, capsys):
    code = main(["bench", "quality", *FAST_CLI, "--variant", "a", "--seeds", "0", "1", "--iterations", "2",
                 "--tune", "--tune-seeds", "1", "--tune-grid", "train.lr=x1", "--out", str(tmp_path / "o")])
    assert code == 2 and "--tune-seeds" in capsys.readouterr().err


def test_choice_breaks_ties_by_the_end_reward_inside_the_guards():
    rows = [{"variant": "a", "cell": "a.t0", "held": 1.0, "cost_to_target": 50.0, "end_inside": 0.7},
            {"variant": "a", "cell": "a.t1", "held": 1.0, "cost_to_target": 50.0, "end_inside": 0.8},
            {"variant": "a", "cell": "a.t2", "held": 1.0, "cost_to_target": 80.0, "end_inside": 0.9},
            {"variant": "b", "cell": "b.t0", "held": 1.0, "cost_to_target": math.inf, "end_inside": 0.6},
            {"variant": "b", "cell": "b.t1", "held": 1.0, "cost_to_target": math.inf, "end_inside": 0.65}]
    assert qt.choose(rows) == {"a": "a.t1", "b": "b.t1"}


def test_a_cell_that_touches_the_target_and_then_leaves_the_guards_is_not_chosen():
    """A setting at the target sooner that ends out of the guards loses to one that gets there later and stays."""
    rows = [{"variant": "a", "cell": "a.t0", "held": 0.0, "cost_to_target": 20.0, "end_inside": 0.24},
            {"variant": "a", "cell": "a.t1", "held": 1.0, "cost_to_target": 70.0, "end_inside": 0.33},
            {"variant": "a", "cell": "a.t2", "held": 0.5, "cost_to_target": 10.0, "end_inside": 0.30}]
    assert qt.choose(rows) == {"a": "a.t1"}
    th = guards.Thresholds(**vars(guards.thresholds(RunConfig().train)))
    check = GuardCheck(vars(th), lambda a, b: guards.tripped(a, b, th))
    start = {"eval/reward": 0.2, "eval/guard/ok": 1.0, "eval/fid": 10.0, "eval/diversity": 1.0}
    inside = [{"metrics": start}, {"metrics": {**start, "eval/reward": 0.3}}]
    out = [*inside, {"metrics": {**start, "eval/reward": 0.35, "eval/fid": 100.0}}]  # FID 10x its start
    assert qt.held(inside, check) and not qt.held(out, check)


def test_the_grid_resolves_multiples_and_adds_the_diversity_strength():
    cfg = RunConfig.from_overrides(["train.task=digits", "diversity.method=drift", "loss.beta=0.2", "train.lr=1e-4"])
    g = qt.variant_grid(cfg, {})
    assert g == {"train.lr": ["x0.5", "x1", "x2"], "loss.beta": ["x0.5", "x1", "x2"],
                 "diversity.drift_shaping": ["x0.5", "x1", "x2"]}
    cells = qt.grid_settings(cfg, {"train.lr": ["x2", "2e-4"], "loss.beta": ["x1"]})
    assert cells == [{"train.lr": "0.0002", "loss.beta": "0.2"}]  # the two lr values coincide: one cell
    assert qt.parse_grid(["train.lr=1e-4,x2", "loss.beta=0"]) == {"train.lr": ["1e-4", "x2"], "loss.beta": ["0"]}
    with pytest.raises(ConfigError, match="not a config key"):
        qt.grid_settings(cfg, {"train.lrr": ["x1"]})


def test_dense_marks_around_the_crossing_are_at_most_20_iterations_of_the_cheapest_variant_apart():
    from diffgrpo.studies.quality import eval_marks

    budget, cost_per_it = 10_000.0, 7.0  # the cheapest variant: 1428 iterations in the budget
    lo, hi, n = qt.focus_window(0.3, cost_per_it / budget)
    assert (lo, hi) == pytest.approx((0.15, 0.45))
    marks = eval_marks(budget, 4, "linear", (lo, hi, n))
    inside = [m for m in marks if lo * budget - 1e-9 <= m <= hi * budget + 1e-9]
    gaps = [b - a for a, b in zip(inside, inside[1:])]
    assert max(gaps) <= 20 * cost_per_it + 1e-9 and marks[-1] == budget and marks == sorted(set(marks))
    assert set(eval_marks(budget, 4, "linear")) <= set(marks)  # the regular marks stay
    assert qt.focus_window(math.inf, 0.01) is None  # the reference never crossed: no dense marks


def test_guards_on_the_mean_of_neighbouring_evaluations():
    """--guard-mean 2: a single noisy FID spike no longer counts as out of the guards, a lasting rise still does; the
    reward is not averaged."""
    from diffgrpo.studies.quality import guard_check
    from diffgrpo.studies.quality_stats import first_out, first_reach, guard_means

    def curve(fids, rewards):
        return [{"iteration": j, "seconds": float(j), "cost": 10.0 * j,
                 "metrics": {"eval/fid": f, "eval/reward": r}} for j, (f, r) in enumerate(zip(fids, rewards))]

    check = guard_check(guards.Thresholds())  # eval/fid ≤ 1.5 × start
    spike = curve([10, 16, 10, 10], [0.5, 0.9, 0.9, 0.9])
    assert first_reach(spike, 0.85, "eval/reward", check)["cost"] == 20.0  # the spike at cost 10 is out
    assert first_reach(guard_means(spike, 2), 0.85, "eval/reward", check)["cost"] == 10.0  # (16 + 10) / 2 = 13 inside
    assert guard_means(spike, 2)[1]["metrics"]["eval/reward"] == 0.9 and guard_means(spike, 1) is spike
    lasting = curve([10, 16, 16, 16], [0.5, 0.6, 0.7, 0.8])
    assert first_out(guard_means(lasting, 2), check, 30.0)["cost_fraction"] == pytest.approx(1 / 3)
