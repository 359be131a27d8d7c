"""Guards that cannot be computed, keep-best on a missing metric, damaged resume files, bench quality's names and
summaries, bounded YAML in the report, alias collisions on the command line, the stop agreement across ranks and
every rank's process group torn down at exit."""
from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from diffgrpo import guards, yamlio
from diffgrpo.config import RunConfig
from diffgrpo.errors import ConfigError, TrainingError
from tests.helpers.distributed import free_port, join_gloo, leave_gloo, subprocess_env

P = guards.PREFIX
TH = guards.Thresholds()


# ------------------------------------------------------------------------------------------ guards (M12, M13, M14)
def test_a_nan_guard_is_out_of_limits():
    start = {"eval/fid": 10.0, P + "drift": 0.0, P + "diversity": 1.0, P + "rewards/aesthetic/mean": 5.0}
    for key in ("eval/fid", P + "drift", P + "diversity", P + "rewards/aesthetic/mean"):
        out = guards.tripped(start, {**start, key: math.nan}, TH)
        assert len(out) == 1 and out[0].startswith(key) and "not a finite number" in out[0]
    missing = {k: v for k, v in start.items() if k != P + "diversity"}  # could not be computed at all
    assert any("missing" in o for o in guards.tripped(start, missing, TH))
    assert guards.tripped(start, dict(start), TH) == []  # a computed, unchanged row stays inside
    assert guards.tripped(start, {**start, "eval/fid": math.nan}, guards.Thresholds(max_fid_ratio=0)) == []  # off


def _watch(**train):
    t = RunConfig().train
    for k, v in train.items():
        setattr(t, k, v)
    msgs = []
    return guards.Watch(t, log=msgs.append), msgs


def test_a_nan_guard_stops_the_run_under_on_hacking_stop(tmp_path):
    w, _ = _watch(on_hacking="stop")
    start = {"iteration": 0, P + "drift": 0.0, P + "diversity": 1.0}
    w.judge(dict(start), run_dir=tmp_path, lead=True, weights=dict)
    row = {"iteration": 2, P + "drift": math.nan, P + "diversity": 1.0}
    w.judge(row, run_dir=tmp_path, lead=True, weights=dict)
    assert row[P + "ok"] == 0.0 and w.stop and "drift" in w.stop


def _features(d):
    return lambda samples: torch.randn(len(samples), d, generator=torch.Generator().manual_seed(len(samples)))


def test_a_base_of_another_feature_space_gives_a_nan_distance_that_is_judged(tmp_path):
    g = guards.EvalGuards(2, reward_fns={}, features=_features(4), log=lambda *a: None)
    g.set_base(guards.Base(torch.zeros(3, dtype=torch.float64), torch.eye(3, dtype=torch.float64), 8))
    ev = g.begin()
    ev.add(list(range(6)), g.chunk(["x"] * 6, ["p"] * 6, [{}] * 6))
    row = ev.result()
    assert math.isnan(row[P + "drift"])
    assert any(o.startswith(P + "drift") for o in guards.tripped({P + "drift": 0.0}, row, TH))


@pytest.mark.parametrize("content", ["garbage", "nan", "shape"])
def test_a_damaged_guard_base_is_one_line_on_resume(tmp_path, content):
    path = tmp_path / guards.BASE_FILE
    if content == "garbage":
        path.write_bytes(b"\x00not a safetensors file")
    else:
        mean = torch.full((3,), math.nan if content == "nan" else 0.0, dtype=torch.float64)
        cov = torch.eye(3 if content == "nan" else 2, dtype=torch.float64)
        save_file({"mean": mean, "cov": cov, "n": torch.tensor([8])}, str(path))
    g = guards.EvalGuards(2, reward_fns={}, features=_features(3), log=lambda *a: None)
    with pytest.raises(TrainingError) as e:
        g.load_base(tmp_path)
    assert "\n" not in str(e.value) and guards.BASE_FILE in str(e.value) and "delete it" in str(e.value)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"metric": "eval/reward", "value": "high"}',
                                  '{"metric": "eval/other", "value": 1.0, "iteration": 2}'])
def test_a_damaged_best_json_is_ignored_with_a_warning(tmp_path, text):
    (tmp_path / guards.BEST_DIR).mkdir()
    (tmp_path / guards.BEST_DIR / "best.json").write_text(text)
    w, msgs = _watch(keep_best="eval/reward")
    w.resume(None, tmp_path, guards.EvalGuards(2, reward_fns={}, features=None, log=lambda *a: None))
    assert w.best is None and any("best.json" in m and "ignored" in m for m in msgs)


def test_keep_best_naming_a_metric_no_evaluation_has_says_so_once(tmp_path):
    w, msgs = _watch(keep_best="eval/rewards/nothing/mean")
    for it in (0, 2):
        w.judge({"iteration": it, "eval/reward": 0.5}, run_dir=tmp_path, lead=True, weights=dict)
    said = [m for m in msgs if "train.keep_best" in m]
    assert len(said) == 1 and "eval/rewards/nothing/mean" in said[0] and "eval/reward" in said[0]
    assert not (tmp_path / guards.BEST_DIR).exists()


def test_a_fid_ratio_below_one_is_refused_before_the_run():
    with pytest.raises(ConfigError, match="train.guard_max_fid_ratio"):
        RunConfig.from_overrides(["train.guard_max_fid_ratio=0.5"])
    RunConfig.from_overrides(["train.guard_max_fid_ratio=0"])  # off
    RunConfig.from_overrides(["train.guard_max_fid_ratio=1"])


# ------------------------------------------------------------------------------------------ bench quality (M15, M16)
@pytest.mark.parametrize("name", ["..", "../x", "a/b", ".hidden", "x" * 129])
def test_a_variant_name_cannot_leave_out(name, tmp_path):
    from diffgrpo.studies import quality

    with pytest.raises(ConfigError, match="--variant: name"):
        quality.parse_variant(f"{name}=train.lr=1e-4")
    with pytest.raises(ConfigError, match="--variant: name"):
        quality.run(RunConfig(), {name: []}, [0], out=tmp_path / "out")
    assert not (tmp_path / "out").exists()


def _finished(out: Path, meta: dict) -> None:
    from diffgrpo.studies import quality

    out.mkdir()
    (out / quality.MARKER).write_text("")
    curve = [{"seconds": s, "cost": 10.0 * s, "iteration": s, "metrics": {"eval/reward": 0.1 * s}} for s in range(3)]
    cells = [{"variant": v, "seed": 0, "iterations": 2, "seconds": 2.0, "cost": 20.0, "evaluations": curve}
             for v in ("a", "b")]
    (out / "summary.json").write_text(json.dumps({"meta": meta, "cells": cells, "reference": "a",
                                                  "metric": "eval/reward", "target_fraction": 0.9,
                                                  "thresholds": {}}))


META = {"title": "t", "command": "c", "variants": {"a": [], "b": []}, "seeds": [0], "iterations": 2,
        "budget_cost": 20.0, "evals": 2, "eval_samples": 4, "total_seconds": 5.0, "load": 0.0}


def test_from_a_summary_missing_meta_seeds_is_one_line(tmp_path):
    from diffgrpo.studies import quality

    _finished(tmp_path / "ok", META)
    assert quality.resummarize(tmp_path / "ok", log=lambda *a: None)["reference"] == "a"  # the fixture is whole
    _finished(tmp_path / "bad", {k: v for k, v in META.items() if k != "seeds"})
    with pytest.raises(ConfigError, match="cannot be read as a bench quality summary.*seeds"):
        quality.resummarize(tmp_path / "bad", log=lambda *a: None)


def test_from_with_another_out_is_refused(tmp_path):
    from diffgrpo.studies import quality

    _finished(tmp_path / "done", META)
    args = SimpleNamespace(variant=[], iterations=0, budget_cost=0, reference="", config="", overrides=[],
                           from_dir=str(tmp_path / "done"), out=str(tmp_path / "other"), target_fraction=None,
                           target=None, metric="")
    with pytest.raises(ConfigError, match="--out"):
        quality.again_from_args(args)


# ------------------------------------------------------------------------------------------ YAML (M18)
def _bomb(levels: int) -> str:
    lines = ['l0: &l0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    lines += [f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_the_report_reads_a_run_config_with_bounded_aliases():
    from diffgrpo.cli.report import changed_keys

    bomb = _bomb(7)  # 9^7 ≈ 4.8 million nodes from 300 bytes
    with pytest.raises(yamlio.TooLarge, match="aliases expand"):
        yamlio.safe_load(bomb)
    assert changed_keys(bomb) is None  # shown as text, never expanded
    with pytest.raises(yamlio.TooLarge, match="nested too deep"):
        yamlio.safe_load("[" * 50_000 + "]" * 50_000)
    assert changed_keys("train:\n  lr: 0.5\n") == [("train.lr", RunConfig().train.lr, 0.5)]
    with pytest.raises(ConfigError, match="nested too deep"):
        yamlio.load("[" * 50_000 + "]" * 50_000, "--config")


def test_a_value_nested_past_the_depth_bound_is_one_line_whatever_the_stack_depth():
    """A nest that parses on a shallow stack used to overflow the walk that echoes it in an error when the call
    came from deep in the stack (a RecursionError, not a ConfigError): nests past yamlio.MAX_DEPTH are refused
    before they are built, and one at the bound is echoed from a deep stack."""
    def deep(frames: int, fn):
        return fn() if frames == 0 else deep(frames - 1, fn)

    too_deep = "[" * (yamlio.MAX_DEPTH + 1) + "]" * (yamlio.MAX_DEPTH + 1)
    with pytest.raises(ConfigError, match=rf"^log.output_dir: it is nested {yamlio.MAX_DEPTH + 1} levels deep"):
        RunConfig.from_overrides([f"log.output_dir={too_deep}"])
    at_bound = "[" * yamlio.MAX_DEPTH + "]" * yamlio.MAX_DEPTH
    with pytest.raises(ConfigError, match="is not a valid str"):
        deep(600, lambda: RunConfig.from_overrides([f"log.output_dir={at_bound}"]))
    assert yamlio.load("a: [[1]]") == {"a": [[1]]}
    with pytest.raises(ConfigError, match="^log.output_dir: it contains itself"):  # a list inside itself
        RunConfig.from_overrides(["log.output_dir=&a [*a]"])
    assert yamlio.load("a: &x [1]\nb: *x") == {"a": [1], "b": [1]}  # an alias elsewhere is fine


# ------------------------------------------------------------------------------------------ flags (M19)
@pytest.mark.parametrize("items", [["learning_rate=1e-5", "train.lr=2e-5"], ["train.lr=2e-5", "learning_rate=1e-5"],
                                   ["lr=1e-5", "learning_rate=2e-5"]])
def test_an_alias_and_its_key_both_given_are_refused(items):
    from diffgrpo.cli import flags

    notes = []
    with pytest.raises(ConfigError, match="train.lr is given twice"):
        flags.translate(items, log=notes.append)
    assert flags.translate(["train.lr=1e-5", "train.lr=2e-5"]) == ["train.lr=1e-5", "train.lr=2e-5"]  # as before
    with pytest.raises(ConfigError, match="set twice"):
        flags.translate_mapping({"lr": 1e-5, "learning_rate": 2e-5}, log=notes.append)


def test_train_batch_size_points_at_the_batch_keys():
    from diffgrpo.cli import flags

    for key in ("train_batch_size", "train.batch_size"):
        with pytest.raises(ConfigError) as e:
            flags.translate([f"{key}=8"], log=lambda m: None)
        assert "train.prompts_per_batch" in str(e.value) and "pretrain" not in str(e.value)


# ------------------------------------------------------------------------------------------ two ranks (M20, M21)
class _Trainer:
    """The loop's view of a trainer: steps count, checkpoints are recorded."""

    def __init__(self, cfg, rank):
        self.cfg, self.iteration, self.saves, self.bad_updates = cfg, 0, [], 0
        self.world = SimpleNamespace(rank=rank, world_size=2)
        self.family = SimpleNamespace(guards=guards.EvalGuards(2, reward_fns={}, features=None, log=lambda *a: None))

    def log(self, *a):
        pass

    def step(self):
        self.iteration += 1
        return {"iteration": self.iteration, "reward": 0.0}

    def save_checkpoint(self):
        self.saves.append(self.iteration)


def _late_signal_worker(rank: int, port: int, out: str) -> None:

    from diffgrpo import distributed
    from diffgrpo.run import job as job_mod

    join_gloo(rank, 2, port)
    cfg = RunConfig.from_overrides(["train.num_iterations=4", "eval.every=0", "train.save_every=0",
                                    "log.progress=false"])
    tr = _Trainer(cfg, rank)
    job = job_mod.Job(tr)
    agree = distributed.first_set

    def first_set(value):  # a SIGTERM reaching rank 1 just after the ranks agreed after iteration 1
        agreed = agree(value)
        if rank == 1 and tr.iteration == 1:
            job._on_signal(signal.SIGTERM, None)
        return agreed

    job_mod.distributed.first_set = first_set
    run = Path(out) / f"run{rank}"  # one directory per rank: a shared metrics file raced (one rank read it truncated)
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"iteration": 0, "eval/reward": 0.0}) + "\n")
    result = job._loop(run, True, job_mod._NullWriter())
    Path(out, f"rank{rank}.json").write_text(json.dumps({"saves": tr.saves, "stopped": tr.iteration,
                                                         "interrupted": result.get("interrupted")}))
    leave_gloo()


def test_a_signal_after_the_stop_agreement_waits_for_the_next_one(tmp_path):
    import torch.multiprocessing as mp

    mp.start_processes(_late_signal_worker, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0] == got[1] == {"saves": [2], "stopped": 2, "interrupted": int(signal.SIGTERM)}


def test_every_rank_destroys_its_process_group_at_exit(tmp_path):
    """The launcher's two ranks end a run without destroying their group themselves: the exit does it, before
    the interpreter's teardown (where a live gloo group can abort the process)."""
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import atexit, os, sys
        import torch, torch.distributed as dist
        atexit.register(lambda: print(f"rank {os.environ['RANK']} group alive at exit: {dist.is_initialized()}",
                                      flush=True))
        from diffgrpo import distributed
        distributed.init_from_env("gloo", timeout=60)
        distributed.all_reduce_sum(torch.ones(1))
    """))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), str(script)]
    p = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout + p.stderr
    for r in (0, 1):
        assert f"rank {r} group alive at exit: False" in p.stdout, p.stdout


# ------------------------------------------------------------------------------------------ arguments a command ignored
@pytest.mark.parametrize("argv", [["configs", "list", "extra"], ["print-config", "--docs", "--changed"],
                                  ["print-config", "--docs", "train.lr=1e-4"]])
def test_an_argument_a_command_does_not_use_is_refused(argv, capsys):
    from diffgrpo.cli import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and ("extra" in err[0] or "--docs" in err[0])
