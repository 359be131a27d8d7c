"""Per-reward group normalisation (``advantage.per_reward_norm``, GDPO-style) against the summed reward's, on two rewards
of very different spread: the built-in task's ``digit_alignment`` (within-group std ≈ 0.28 on the base model) and
``jpeg_compressibility`` (−kB at quality 95; within-group std ≈ 0.006), weights 1 : 1.

Normalising the weighted sum lets the reward with the larger spread decide every advantage's sign, so the second
reward's weight is nominal; normalising each reward in its group first gives each its weight. The question measured:
how much each reward moves (held-out, start → end, seeds paired) with each normalisation, inside the guards.

Runs through :mod:`diffgrpo.studies.quality` (both variants × seeds interleaved in one process, budget in counted
cost), with the study's base config and KL term (benchmarks/time_to_quality.py), then tabulates each reward's gain
with a percentile-bootstrap 95 % interval over seeds:

    OMP_NUM_THREADS=1 python benchmarks/per_reward_norm.py --out benchmarks/results/bench_quality/per_reward_norm
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

import numpy as np
import torch

from diffgrpo import RunConfig
from diffgrpo.fileio import atomic_write, run_root
from diffgrpo.studies import quality as bench_quality
from diffgrpo.studies.quality_report import guard_words
from diffgrpo.studies.quality_stats import bootstrap_ci

sys.path.insert(0, str(Path(__file__).resolve().parent))
from time_to_quality import BASE, KL

REWARDS = ("digit_alignment", "jpeg_compressibility")
WEIGHTS = "reward.weights={digit_alignment: 1.0, jpeg_compressibility: 1.0}"
VARIANTS = {"summed": ["advantage.per_reward_norm=false"], "per_reward": ["advantage.per_reward_norm=true"]}


def gains(summary: dict) -> dict:
    """Per variant and reward: the per-seed gain (last evaluation − start) of the held-out mean."""
    out: dict = {}
    for c in summary["cells"]:
        ev = c["evaluations"]
        for r in REWARDS:
            key = f"eval/rewards/{r}/mean"
            out.setdefault(c["variant"], {}).setdefault(r, {})[c["seed"]] = ev[-1]["metrics"][key] - ev[0]["metrics"][key]
    return out


def table(summary: dict, command: str) -> str:
    g = gains(summary)
    rows = {r["variant"]: r for r in summary["rows"]}
    seeds = sorted(g["summed"][REWARDS[0]])
    lines = ["# Per-reward group normalisation (GDPO-style) on two rewards of different spread", "",
             f"Command: `{command}`", "",
             (f"Base: the time-to-quality study's config with `{KL}`, `{WEIGHTS}`; seeds {seeds}; budget "
             f"{summary['meta']['budget_cost']:.0f} counted cost units per cell "
             f"(= {summary['meta']['iterations']} iterations); {summary['meta']['eval_samples']} held-out samples "
             f"per evaluation. Gains: last evaluation − start, mean over seeds [95 % bootstrap interval]."), "",
             "| variant | " + " | ".join(f"{r} gain" for r in REWARDS) + " | guards at end | out of guards at end |",
             "|---|" + "---|" * len(REWARDS) + "---|---|"]
    for v in VARIANTS:
        cells = []
        for r in REWARDS:
            x = np.array([g[v][r][s] for s in seeds])
            lo, hi = bootstrap_ci(x, np.mean)
            cells.append(f"{x.mean():+.4f} [{lo:+.4f}, {hi:+.4f}]")
        row = rows[v]
        lines.append(f"| {v} | " + " | ".join(cells) + f" | {guard_words(row['final_guards'], summary['start_guards'])} "
                     f"| {', '.join(row['final_out_of_guards']) or 'none'} |")
    lines += ["", "Difference per_reward − summed, seeds paired:", ""]
    for r in REWARDS:
        d = np.array([g["per_reward"][r][s] - g["summed"][r][s] for s in seeds])
        lo, hi = bootstrap_ci(d, np.mean)
        lines.append(f"- {r}: {d.mean():+.4f} [{lo:+.4f}, {hi:+.4f}]")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--evals", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/bench_quality/per_reward_norm")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "OMP_NUM_THREADS=1 python benchmarks/per_reward_norm.py " + " ".join(
        shlex.quote(w) for w in (argv if argv is not None else sys.argv[1:]))
    base = RunConfig.from_overrides([*BASE, KL, WEIGHTS, *a.overrides])
    s = bench_quality.run(base, VARIANTS, a.seeds, out=a.out, reference="summed", iterations=a.iterations,
                          evals=a.evals, command=command, title="two rewards, summed vs per-reward normalisation")
    md = table(s, command)
    with run_root(a.out):
        atomic_write(Path(a.out) / "gains.md", md)
        atomic_write(Path(a.out) / "gains.json", json.dumps(gains(s), indent=1))
    print(md)


if __name__ == "__main__":
    main()
