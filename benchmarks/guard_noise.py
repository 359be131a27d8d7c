"""The guards' noise at their edge: one model (the built-in model's start model on ``--task`` digits or shapes,
untrained by GRPO) evaluated with ``--repeats`` disjoint evaluation seeds, at each ``--eval-seeds-per-prompt``
(default: 4 and 32 on digits, the task's default 4 on shapes: 72 held-out rows × 4 = 288 samples).

For every size it reports the spread of ``eval/fid`` and ``eval/guard/kid`` over the repeats (standard deviation and
range, FID relative to its mean) and the guards' *false-alarm rate*: over every ordered pair (i, j) of repeats, i ≠ j,
the fraction in which evaluation j is out of limits relative to evaluation i taken as the start (``guards.tripped``),
with the distance guard alone (FID ratio ≤ ``train.guard_max_fid_ratio``, or KID ≤ start + ``train.guard_max_kid``)
and with every guard (diversity included). The model never changes, so every alarm is noise.

    OMP_NUM_THREADS=1 python benchmarks/guard_noise.py --out benchmarks/results/guard_noise
    OMP_NUM_THREADS=1 python benchmarks/guard_noise.py --task shapes --out benchmarks/results/guard_noise_shapes
"""
from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, guards
from diffgrpo.trainer import Trainer

BASE = ["train.prompts_per_batch=4", "train.group_size=8", "log.progress=false", "log.save_images=false", "eval.every=0"]
SIZES = {"digits": [4, 32], "shapes": [4]}  # eval.seeds_per_prompt measured by default


def alarms(rows: list[dict], th: guards.Thresholds, only: str = "") -> float:
    """Fraction of ordered pairs (start i, evaluation j ≠ i) with a guard out (``only``: guards whose phrase starts
    with it)."""
    pairs = list(itertools.permutations(range(len(rows)), 2))
    hit = sum(1 for i, j in pairs if any(g.startswith(only) for g in guards.tripped(rows[i], rows[j], th)))
    return hit / len(pairs)


def neighbour_means(rows: list[dict]) -> list[dict]:
    """Consecutive pairs of evaluations averaged key by key (the guard judged on the mean of two neighbouring
    evaluations)."""
    return [{k: (a[k] + b[k]) / 2 for k in a if k in b} for a, b in zip(rows[0::2], rows[1::2])]


def spread(xs: list[float]) -> dict:
    m = statistics.mean(xs)
    return {"mean": m, "std": statistics.stdev(xs), "min": min(xs), "max": max(xs), "rel_std": statistics.stdev(xs) / abs(m),
            "max_over_min": max(xs) / min(xs) if min(xs) > 0 else float("nan")}


def measure(size: int, repeats: int, overrides: list[str], task: str = "digits") -> dict:
    cfg = RunConfig.from_overrides([f"train.task={task}", *BASE, f"eval.seeds_per_prompt={size}", *overrides])
    tr = Trainer(cfg, log=lambda *a: None)
    rows, t0 = [], time.perf_counter()
    for k in range(repeats):
        tr.cfg.eval.seed = cfg.eval.seed + 10_000 * k  # disjoint noise seeds (a sample's seed is eval.seed + j)
        row, _ = tr.evaluate()
        rows.append({k2: float(v) for k2, v in row.items() if k2.startswith("eval/")})
    fid, kid = [r["eval/fid"] for r in rows], [r["eval/guard/kid"] for r in rows]
    th_fid = guards.thresholds(cfg.train)
    th_kid = guards.Thresholds(**{**vars(th_fid), "distance": "kid"})
    return {"task": task, "seeds_per_prompt": size, "samples": len(tr.family.eval_prompts()[0]), "repeats": repeats,
            "fid": spread(fid), "kid": spread(kid), "reward": spread([r["eval/reward"] for r in rows]),
            "false_alarms": {"fid_ratio": alarms(rows, th_fid, "eval/fid"), "kid": alarms(rows, th_kid, "eval/guard/kid"),
                             "all_guards_fid": alarms(rows, th_fid), "all_guards_kid": alarms(rows, th_kid),
                             "fid_ratio_mean_of_2": alarms(neighbour_means(rows), th_fid, "eval/fid"),
                             "kid_mean_of_2": alarms(neighbour_means(rows), th_kid, "eval/guard/kid")},
            "thresholds": {"max_fid_ratio": th_fid.max_fid_ratio, "max_kid": th_kid.max_kid,
                           "min_diversity_ratio": th_fid.min_diversity_ratio},
            "seconds": time.perf_counter() - t0, "rows": rows}


def table(results: list[dict], command: str) -> str:
    task = results[0].get("task", "digits")
    lines = [f"# Guard noise: one model, disjoint evaluation seeds ({task} task)", "", f"Command: `{command}`", "",
             f"The built-in model's start model on the {task} task (no GRPO step) evaluated with disjoint evaluation seeds; every guard "
             "alarm between two of these evaluations is noise (the model is the same). FID relative: std ÷ mean; "
             "false alarms: ordered pairs (start i, evaluation j ≠ i) with the guard out; mean of 2: the same with start and "
             "evaluation each the mean of two neighbouring evaluations (half as many of them).", "",
             "| samples / eval | repeats | FID mean | FID std (rel) | FID max ÷ min | KID mean | KID std | KID range | "
             "false alarms: FID ≤ 1.5× | KID ≤ start + max | every guard (FID) | every guard (KID) | FID, mean of 2 | "
             "KID, mean of 2 |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        f, k, a = r["fid"], r["kid"], r["false_alarms"]
        lines.append(f"| {r['samples']} | {r['repeats']} | {f['mean']:.3f} | {f['std']:.3f} ({f['rel_std']:.1%}) | "
                     f"{f['max_over_min']:.2f} | {k['mean']:.4f} | {k['std']:.4f} | [{k['min']:.4f}, {k['max']:.4f}] | "
                     f"{a['fid_ratio']:.0%} | {a['kid']:.0%} (max_kid {r['thresholds']['max_kid']:g}) | "
                     f"{a['all_guards_fid']:.0%} | {a['all_guards_kid']:.0%} | {a['fid_ratio_mean_of_2']:.0%} | "
                     f"{a['kid_mean_of_2']:.0%} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--task", choices=sorted(SIZES), default="digits")
    p.add_argument("--eval-seeds-per-prompt", type=int, nargs="+", default=None, help="default: 4 32 (digits), 4 (shapes)")
    p.add_argument("--out", default="benchmarks/results/guard_noise")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    results = [measure(n, a.repeats, a.overrides, a.task) for n in a.eval_seeds_per_prompt or SIZES[a.task]]
    command = "OMP_NUM_THREADS=1 python benchmarks/guard_noise.py " + " ".join(
        shlex.quote(w) for w in (argv if argv is not None else sys.argv[1:]))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"command": command, "results": results}, indent=1))
    md = table(results, command)
    (out / "table.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
