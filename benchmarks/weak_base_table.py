"""Check the weak-base study tables (benchmarks/results/dllm/clean_base/*_weak_base/weak_base.md) against the
aggregates kept in git, since the runs' per-iteration ``metrics.jsonl`` logs are not.

Per study directory: ``base_probe.json`` (the pretraining-budget probe), ``weak_base_summary.json`` (one row per
run: held-out greedy accuracy and reward at start and end, sampled training reward of the first and last 20
iterations) and ``train_reward.json`` (each run's per-iteration sampled training reward, the ``reward`` column of
its metrics.jsonl). Configuration A's runs are under ``runs/``, B's under ``runs_lr2e-4/``, C's under
``runs_long/``, each with its resolved ``config.yaml`` and ``summary.json``.

The script renders the probe table and each configuration's table and mean line from these files and checks
that they appear verbatim in weak_base.md, that the summary's first/last-20 training rewards are the means of
train_reward.json, and that its start/end accuracy and reward are those of each run's summary.json. It exits
with status 1 on any mismatch. ``--from-runs`` first rewrites train_reward.json from the run directories'
metrics.jsonl (after a rerun of the study, when they exist).

    python benchmarks/weak_base_table.py benchmarks/results/dllm/clean_base/arithmetic_weak_base \\
        benchmarks/results/dllm/clean_base/sudoku_weak_base
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

RUN_DIRS = {"A": "runs", "B": "runs_lr2e-4", "C": "runs_long"}
TRAIN_REWARD_SOURCE = ("the `reward` column of each run's metrics.jsonl (sampled training reward, mean over the "
                       "iteration's completions), iterations 1, 2, ... in order")


def run_name(row: dict, config: str) -> str:
    return f"{RUN_DIRS[config]}/{row['task']}-{row['method']}-s{row['seed']}"


def write_train_reward(d: Path, summary: dict) -> None:
    """train_reward.json from the run directories' metrics.jsonl, one run per line."""
    runs = {}
    for c, cfg in summary["configs"].items():
        for r in cfg["rows"]:
            name = run_name(r, c)
            lines = (d / name / "metrics.jsonl").read_text().splitlines()
            runs[name] = [row["reward"] for row in map(json.loads, filter(str.strip, lines)) if "reward" in row]
    body = ",\n".join(f"    {json.dumps(k)}: {json.dumps(v)}" for k, v in runs.items())
    (d / "train_reward.json").write_text(f'{{\n  "source": {json.dumps(TRAIN_REWARD_SOURCE)},\n  "runs": {{\n'
                                         f"{body}\n  }}\n}}\n")


def probe_table(probe: dict) -> list[str]:
    lines = ["| pretrain.steps | test greedy acc | test greedy reward | train greedy acc (512) | train reward at T=1 "
             "(64×8) | groups with reward variance |", "|---|---|---|---|---|---|"]
    for r in probe["rows"]:
        lines.append(f"| {r['pretrain_steps']} | {r['test_greedy_acc']:.4f} | {r['test_greedy_reward']:.4f} | "
                     f"{r['train_greedy_acc_512']:.4f} | {r['train_T1_reward_64x8']:.4f} | "
                     f"{r['frac_groups_reward_var_gt0']:.2f} |")
    return lines


def config_table(cfg: dict, n_test: int) -> list[str]:
    lines = ["| seed | acc start | acc end | Δ acc (test prompts) | greedy reward start → end | train reward, first 20 "
             "it → last 20 it |", "|---|---|---|---|---|---|"]
    for r in cfg["rows"]:
        d = r["acc_end"] - r["acc_start"]
        lines.append(f"| {r['seed']} | {r['acc_start']:.4f} | {r['acc_end']:.4f} | {d:+.4f} ({round(d * n_test):+d}) | "
                     f"{r['reward_start']:.4f} → {r['reward_end']:.4f} | {r['train_reward_first20']:.3f} → "
                     f"{r['train_reward_last20']:.3f} |")
    return lines + ["", f"Mean Δ accuracy {cfg['mean_delta_acc']:+.4f}; seeds improved {cfg['seeds_improved']}/"
                        f"{len(cfg['rows'])}."]


def check(d: Path) -> list[str]:
    """Mismatches between d/weak_base.md, its aggregates and the runs' summary.json (empty: all consistent)."""
    summary = json.loads((d / "weak_base_summary.json").read_text())
    probe = json.loads((d / "base_probe.json").read_text())
    rewards = json.loads((d / "train_reward.json").read_text())["runs"]
    md = (d / "weak_base.md").read_text()
    n_test = {r["n_test"] for r in probe["rows"] if r["pretrain_steps"] == summary["pretrain_steps"]}.pop()
    errors = []
    blocks = {"base probe": probe_table(probe)}
    for c, cfg in summary["configs"].items():
        blocks[f"configuration {c}"] = config_table(cfg, n_test)
        deltas = [r["acc_end"] - r["acc_start"] for r in cfg["rows"]]
        if statistics.mean(deltas) != cfg["mean_delta_acc"] or sum(x > 0 for x in deltas) != cfg["seeds_improved"]:
            errors.append(f"{c}: mean_delta_acc / seeds_improved do not follow from the rows")
        for r in cfg["rows"]:
            name = run_name(r, c)
            rw = rewards[name]
            if len(rw) != cfg["iterations"]:
                errors.append(f"{name}: {len(rw)} training rewards for {cfg['iterations']} iterations")
            if (statistics.mean(rw[:20]), statistics.mean(rw[-20:])) != (r["train_reward_first20"],
                                                                       r["train_reward_last20"]):
                errors.append(f"{name}: train_reward_first20/last20 differ from train_reward.json")
            s = json.loads((d / name / "summary.json").read_text())
            if (s["start"]["eval/accuracy"], s["end"]["eval/accuracy"], s["start"]["eval/reward"],
                    s["end"]["eval/reward"]) != (r["acc_start"], r["acc_end"], r["reward_start"], r["reward_end"]):
                errors.append(f"{name}: start/end accuracy or reward differ from its summary.json")
    for what, lines in blocks.items():
        if "\n".join(lines) + "\n" not in md:
            errors.append(f"{what}: the table rendered from the aggregates is not in weak_base.md:\n" + "\n".join(lines))
    return errors


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="weak-base study directories")
    p.add_argument("--from-runs", action="store_true",
                   help="rewrite train_reward.json from the run directories' metrics.jsonl first")
    args = p.parse_args()
    failed = False
    for d in args.dirs:
        if args.from_runs:
            write_train_reward(d, json.loads((d / "weak_base_summary.json").read_text()))
        errors = check(d)
        print(f"{d}: " + ("tables and aggregates consistent" if not errors else f"{len(errors)} mismatch(es)"))
        for e in errors:
            print("  " + e)
        failed |= bool(errors)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
