"""``diffgrpo bench quality``: variants × seeds of one base config, stepped interleaved, budget in counted cost,
start-anchored guards, bootstrap intervals; end to end on a tiny diffusers pipeline, and its pure parts."""
from __future__ import annotations

import json

import pytest
import yaml

from diffgrpo import guards
from diffgrpo.cli.app import main
from diffgrpo.studies import quality as bench_quality
from diffgrpo.studies.quality_report import to_markdown
from diffgrpo.studies.quality_stats import plateau, summarize
from tests.helpers.rewards import save_tiny_clip


def _refuse(name):
    raise ValueError(f"not strict JSON: {name}")


def mean_brightness(images, prompts, metadata):
    """A plug-in training reward: the mean pixel value of each image."""
    return images.float().flatten(1).mean(1)


def test_bench_quality_on_a_tiny_diffusers_pipeline(sd3_dir, tmp_path, capsys):
    """Two variants × two seeds end to end: a plug-in training reward and a CLIP guard reward (a tiny CLIP saved
    locally, whose image features also give the distance to the base samples), the budget in reference
    iterations as counted cost, every cell evaluated at the same cost marks, one resolved config per cell."""
    clip = save_tiny_clip(tmp_path / "clip")
    out = tmp_path / "bq"
    base = ["model.name=diffusers", f"model.pretrained={sd3_dir}", "model.resolution=16", "model.max_sequence_length=8",
            "model.lora_rank=4", "model.lora_alpha=8", "sampler.num_steps=3", "train.prompts_per_batch=2",
            "train.group_size=2", "train.lr=0.05", "log.progress=false", "log.save_images=false",
            "reward.weights={tests.test_bench_quality:mean_brightness: 1.0}", "eval.guard_rewards=[clip_score]",
            f"reward.options={{clip_score: {{model: {clip}}}}}", f"train.prompts_file={sd3_dir / 'prompts.txt'}",
            f"eval.prompts_file={sd3_dir / 'prompts.txt'}", "eval.seeds_per_prompt=2"]
    code = main(["bench", "quality", *base, "--variant", "recompute=engine.name=recompute",
                 "--variant", "half=steps.mode=first_fraction,steps.fraction=0.5", "--seeds", "0", "1",
                 "--iterations", "2", "--evals", "2", "--eval-spacing", "quadratic", "--out", str(out)])
    assert code == 0
    s = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)
    cells = {(c["variant"], c["seed"]): c for c in s["cells"]}
    assert set(cells) == {("recompute", 0), ("recompute", 1), ("half", 0), ("half", 1)}
    budget = s["meta"]["budget_cost"]
    ref = cells[("recompute", 0)]
    assert ref["iterations"] == 2 and budget == pytest.approx(ref["cost"])  # 2 reference iterations of cost
    for c in s["cells"]:
        assert c["cost"] >= budget and len(c["evaluations"]) == 3  # start + 2 marks
        ev0 = c["evaluations"][0]["metrics"]
        assert ev0["eval/guard/fd_base"] == pytest.approx(0.0, abs=1e-9)
        assert "eval/guard/rewards/clip_score/mean" in ev0 and "eval/guard/diversity" in ev0
        assert c["evaluations"][-1]["cost"] == c["cost"] and c["evaluations"][0]["cost"] == 0
        # evaluated when the cost passed budget/4 and budget (quadratic marks), not before
        assert [e["cost"] >= m for e, m in zip(c["evaluations"][1:], (budget / 4, budget))] == [True, True]
    assert cells[("half", 0)]["iterations"] > 2  # cheaper iterations: more of them in the same counted cost
    # every cell starts from the same base model, prompts and seeds: identical start evaluations
    starts = [c["evaluations"][0]["metrics"]["eval/reward"] for c in s["cells"]]
    assert max(starts) - min(starts) < 1e-6
    moved = [c["evaluations"][-1]["metrics"]["eval/guard/fd_base"] for c in s["cells"]]
    assert min(moved) > 0  # training moved the samples away from the base model's
    rows = {r["variant"]: r for r in s["rows"]}
    assert s["target"] == pytest.approx(s["start"] + 0.95 * (s["plateau"]["level"] - s["start"]))
    assert rows["recompute"]["overrides"] == ["engine.name=recompute"] and len(rows["half"]["speedup_ci"]) == 2
    for name in ("table.md", "curves.png", "frontier.png", "command.txt"):
        assert (out / name).is_file()
    table = (out / "table.md").read_text()
    assert "| recompute |" in table and "| half |" in table and "Reference plateaued" in table
    cfg = yaml.safe_load((out / "configs" / "half_seed1.yaml").read_text())
    assert cfg["seed"] == 1 and cfg["steps"]["mode"] == "first_fraction" and cfg["eval"]["guard_rewards"] == ["clip_score"]
    assert "--variant half=steps.mode=first_fraction,steps.fraction=0.5" in (out / "command.txt").read_text()
    assert "--eval-spacing quadratic" in (out / "command.txt").read_text() and "quadratic in cost" in table
    assert not list(out.rglob("metrics.jsonl"))  # no per-iteration logs
    # summarised again from its cells with another target fraction: nothing trains, the cells stay as they were
    assert main(["bench", "quality", "--from", str(out), "--target-fraction", "0.5"]) == 0
    again = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)  # strict JSON: no NaN / Infinity
    assert again["target"] == pytest.approx(s["start"] + 0.5 * (s["plateau"]["level"] - s["start"]))
    assert again["target_fraction"] == 0.5 and again["plateau"] == pytest.approx(s["plateau"])
    assert [c["evaluations"] for c in again["cells"]] == [c["evaluations"] for c in s["cells"]]
    lines = (out / "command.txt").read_text().splitlines()
    assert lines[0].startswith("diffgrpo bench quality") and lines[1].endswith("--from " + str(out) + " --target-fraction 0.5")
    assert not again["target_given"] and "= start" in (out / "table.md").read_text()
    # an explicit target is said to be one, not derived from the reference's gain
    assert main(["bench", "quality", "--from", str(out), "--target", "0.5"]) == 0
    given = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)
    assert given["target"] == 0.5 and given["target_given"]
    assert "Target: eval/reward ≥ 0.5000, given with --target" in (out / "table.md").read_text()
    capsys.readouterr()
    assert main(["bench", "quality", "--from", str(out), "--variant", "x"]) == 2
    assert "--from: --variant cannot change a finished benchmark's cells" in capsys.readouterr().err
    assert main(["bench", "quality", "--from", str(tmp_path)]) == 2  # not a bench quality output


def test_evaluation_marks_and_the_plateau_window():
    assert bench_quality.eval_marks(100.0, 4) == [25.0, 50.0, 75.0, 100.0]
    q = bench_quality.eval_marks(100.0, 4, "quadratic")
    assert q == [6.25, 25.0, 56.25, 100.0]  # denser early: a several-times faster variant is still resolved
    with pytest.raises(bench_quality.ConfigError, match="--eval-spacing: 'log' is not one of"):
        bench_quality.eval_marks(1.0, 4, "log")
    # the plateau is judged over the last quarter of the budget, however the marks are spaced
    xs = [0.0, *q]
    p = plateau(xs, [0.0, 0.5, 0.8, 0.9, 0.9], [0.01] * 5, seeds=5)
    assert p["points"] == 2 and p["level"] == pytest.approx(0.9) and p["plateaued"]


class _FakeTrainer:
    """Stands in for a Trainer: a fixed cost per iteration, a reward rising by 0.1 per iteration, and an optional
    iteration at which training stops with a TrainingError."""

    def __init__(self, cost: int, fail_at: int = 0, first_cost: int = 0):
        self.policy = type("P", (), {"counters": {"forwards_grad": 0, "forwards_nograd": 0}})()
        self.cost, self.fail_at, self.it, self.first_cost = cost, fail_at, 0, first_cost or cost

    def step(self):
        if self.fail_at and self.it + 1 == self.fail_at:
            raise bench_quality.TrainingError("stopping: the weights are non-finite after the update\nmore")
        self.it += 1
        self.policy.counters["forwards_nograd"] += self.first_cost if self.it == 1 else self.cost
        return {"sample_backwards": 0}

    def evaluate(self):
        return {"eval/reward": 0.1 * self.it, "eval/guard/drift": 0.0}, None


def _fake_cell(variant: str, seed: int, cost: int, fail: int = 0, first_cost: int = 0):
    return bench_quality.Cell(variant, seed, None, _FakeTrainer(cost, fail, first_cost), overrides=[])


def test_the_budget_is_iterations_of_the_reference_even_when_its_first_iteration_costs_less():
    """nft's first iteration has no θ_old forwards (θ_old = θ): sized from it alone, a budget of 8 reference
    iterations was 8 × the cheap first one, and the reference ran fewer than 8."""
    cells = [_fake_cell("ref", 0, 10, first_cost=4), _fake_cell("ref", 1, 10, first_cost=4), _fake_cell("b", 0, 5)]
    budget = bench_quality.interleave(cells, "ref", iterations=8, evals=4, log=lambda *a: None)
    assert budget == 4 + 7 * 10 and all(c.done for c in cells)
    assert [c.iterations for c in cells] == [8, 8, 15]  # the reference exactly 8; b until its cost passes 74
    one = [_fake_cell("ref", 0, 10, first_cost=4)]
    assert bench_quality.interleave(one, "ref", iterations=1, evals=1, log=lambda *a: None) == 4
    assert one[0].iterations == 1


def test_a_variant_with_a_list_value_keeps_its_commas():
    from diffgrpo import RunConfig
    from diffgrpo.studies import engines as bench_engines

    name, ov = bench_quality.parse_variant("both=engine.name=nft,diversity.method=[diversegrpo, drift],loss.beta=0.3")
    assert (name, ov) == ("both", ["engine.name=nft", "diversity.method=[diversegrpo, drift]", "loss.beta=0.3"])
    assert RunConfig.from_overrides(ov).diversity.method == "diversegrpo,drift"
    assert bench_engines.parse_variant("nft:diversity.method=[gardo,drift],window=4")[1] == [
        "engine.name=nft", "diversity.method=[gardo,drift]", "engine.window=4"]
    assert bench_quality.parse_variant("plain=train.lr=1e-4,loss.beta=0")[1] == ["train.lr=1e-4", "loss.beta=0"]


def test_a_failing_cell_is_reported_and_the_other_cells_go_on():
    cells = [_fake_cell("ref", 0, 10), _fake_cell("ref", 1, 10), _fake_cell("cheap", 0, 5),
             _fake_cell("cheap", 1, 5, fail=3)]
    logged = []
    budget = bench_quality.interleave(cells, "ref", iterations=8, evals=4, log=logged.append)
    assert budget == 80 and all(c.done for c in cells)
    bad = cells[3]
    assert bad.failed == "stopping: the weights are non-finite after the update" and bad.iterations == 2
    assert cells[2].iterations == 16 and cells[0].iterations == 8  # the others spent the whole budget
    assert any("cheap" in line and "failed at iteration 3" in line for line in logged)
    progress = [line for line in logged if line.startswith("bench quality: every cell past mark")]
    assert [line.split("mark ")[1].split(" ")[0] for line in progress] == ["1/4", "2/4", "3/4"]  # a line per mark
    check = bench_quality.guard_check(guards.Thresholds())
    s = summarize(cells, "ref", metric="eval/reward", target_fraction=0.95, check=check)
    rows = {r["variant"]: r for r in s["rows"]}
    assert rows["cheap"]["failed"] == {"1": bad.failed} and rows["cheap"]["reached"] == 1
    assert rows["cheap"]["final_reward"] == pytest.approx(1.6)  # the failed cell's last evaluation is not an end
    assert len(rows["cheap"]["curve"]) == 5  # the mean curve is the surviving seed's, not cut at the failure
    meta = {"title": "t", "command": "c", "variants": {"ref": [], "cheap": []}, "seeds": [0, 1], "iterations": 8,
            "budget_cost": budget, "evals": 4, "eval_samples": 1, "total_seconds": 1.0, "load": "0"}
    assert "| cheap |" in to_markdown(meta, s) and "1/2 (1 failed)" in to_markdown(meta, s)


def test_out_must_be_new_empty_or_an_earlier_bench_output(tmp_path, capsys):
    from diffgrpo import RunConfig

    base = RunConfig.from_overrides(["log.progress=false"])
    mine = tmp_path / "project"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(bench_quality.ConfigError, match="--out: .* is not empty and is not a bench quality output"):
        bench_quality.run(base, {"a": []}, [0], out=mine, iterations=1, evals=2)
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"]  # nothing written before the refusal
    (tmp_path / "file").write_text("x")
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    for bad in (tmp_path / "file", dangling):
        with pytest.raises(bench_quality.ConfigError, match="exists and is not a directory"):
            bench_quality.run(base, {"a": []}, [0], out=bad, iterations=1, evals=2)
    assert not (tmp_path / "elsewhere").exists() and (tmp_path / "file").read_text() == "x"
    with pytest.raises(bench_quality.ConfigError, match="--eval-spacing"):
        bench_quality.run(base, {"a": []}, [0], out=tmp_path / "new", iterations=1, evals=2, eval_spacing="log")
    assert not (tmp_path / "new").exists()
    earlier = tmp_path / "earlier"
    bench_quality.claim_out(earlier)  # an earlier output (its marker) may be written into again
    (earlier / "table.md").write_text("old")
    bench_quality.claim_out(earlier)
    older = tmp_path / "older"  # an output from before the marker: nothing but the command's own files
    (older / "configs").mkdir(parents=True)
    (older / "summary.json").write_text("{}")
    bench_quality.claim_out(older)
    assert (older / bench_quality.MARKER).is_file()
    # bench engines' --out follows the same rule, before any model loads
    assert main(["bench", "engines", "--out", str(mine), "--repeats", "1"]) == 2
    assert "--out:" in capsys.readouterr().err and sorted(p.name for p in mine.iterdir()) == ["notes.txt"]


def test_an_interrupted_benchmark_reads_as_one_with_the_budget_every_cell_reached():
    cells = [_fake_cell("ref", 0, 10), _fake_cell("ref", 1, 10), _fake_cell("cheap", 0, 5), _fake_cell("cheap", 1, 5)]
    steps = iter(range(10_000))
    budget = bench_quality.interleave(cells, "ref", iterations=8, evals=4, stop=lambda: next(steps) >= 30,
                                      log=lambda *a: None)
    assert budget == 80 and not any(c.done for c in cells)  # stopped before the end: no cell is finished
    kept, cut = bench_quality.truncate(cells, budget, 4, "linear")
    assert (kept, cut) == (2, 40.0) and all(len(c.curve) == 3 for c in cells)  # start + the 2 marks all passed
    assert all(c.curve[-1]["cost"] >= 40 for c in cells)
    s = summarize(cells, "ref", metric="eval/reward", target_fraction=0.95,
                  check=bench_quality.guard_check(guards.Thresholds()), budget=cut)
    assert s["plateau"]["points"] == 2 and {r["variant"] for r in s["rows"]} == {"ref", "cheap"}


def test_sigterm_stops_a_benchmark_from_the_cli_with_its_outputs(tmp_path):
    """SIGTERM while the cells train: the current step ends, the outputs are written for the evaluation marks every
    cell passed, the command exits 143 (128 + SIGTERM), and the table says where it stopped. The progress lines reach
    the pipe as they are printed (no PYTHONUNBUFFERED), so the signal comes while the cells train."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "bq"
    tiny = ["train.task=digits", "model.image_size=8", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8",
            "model.text_dim=16", "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4",
            "train.prompts_per_batch=2", "train.group_size=2", "eval.seeds_per_prompt=1", "log.progress=false",
            "log.save_images=false"]
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "bench", "quality", *tiny, "--variant", "a=",
                          "--variant", "b=engine.name=single_step", "--seeds", "0", "1", "--iterations", "40",
                          "--evals", "8", "--out", str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    lines = []
    for line in p.stdout:
        lines.append(line)
        if "every cell past mark 2/8" in line:
            p.send_signal(signal.SIGTERM)
            break
    rest = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.SIGTERM, "".join(lines) + rest
    assert "summarised at mark 2/8" in rest
    s = json.loads((out / "summary.json").read_text(), parse_constant=_refuse)
    assert s["meta"]["interrupted"] == {"signal": int(signal.SIGTERM), "marks": 2}
    assert {len(c["evaluations"]) for c in s["cells"]} == {3}  # start + the two marks every cell passed
    assert "Stopped by signal 15: summarised at evaluation mark 2 of 8" in (out / "table.md").read_text()
    assert all(c["evaluations"][-1]["cost"] >= s["meta"]["budget_cost"] > 0 for c in s["cells"])  # mark 2's cost
