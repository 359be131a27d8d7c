"""Two runs of the same ``bench quality`` study side by side: does the ranking hold?

For each variant: time to target and the speed-up over the reference with their intervals in each run, its rank
by time to target (a variant that misses the target in some seed ranks after every one that does not, ordered by
seeds reached, then by final reward), and whether its held-out evaluations are identical in both runs (the schedule
is counted cost, so on one machine only the wall-clock may differ). Rank agreement: Spearman's ρ and the variants
whose rank moved.

    python benchmarks/compare_quality_runs.py benchmarks/results/bench_quality/study \
        benchmarks/results/bench_quality/study_repeat --out benchmarks/results/bench_quality/repeat.md
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from diffgrpo.fileio import atomic_write


def _num(x) -> float:
    return math.inf if x is None else float(x)


def ranking(s: dict) -> list[str]:
    """Variants by time to target (all seeds reached) first, then by seeds reached and final reward."""
    def key(r):
        t = _num(r["time_to_target"])
        return (0, t, 0.0) if math.isfinite(t) else (1, -r["reached"], -r["final_reward"])
    return [r["variant"] for r in sorted(s["rows"], key=key)]


def spearman(a: list[str], b: list[str]) -> float:
    n = len(a)
    pos = {v: i for i, v in enumerate(b)}
    d2 = sum((i - pos[v]) ** 2 for i, v in enumerate(a))
    return 1 - 6 * d2 / (n * (n * n - 1)) if n > 1 else 1.0


def _ci(x, ci, f):
    lo, hi = (_num(v) for v in ci)
    x = _num(x)
    if not math.isfinite(x):
        return "—"
    return f.format(x) + (f" [{f.format(lo) if math.isfinite(lo) else '—'}, {f.format(hi) if math.isfinite(hi) else '—'}]"
                          if math.isfinite(lo) or math.isfinite(hi) else "")


def compare(a: dict, b: dict) -> dict:
    ra, rb = ranking(a), ranking(b)
    ca = {(c["variant"], c["seed"]): c["evaluations"] for c in a["cells"]}
    cb = {(c["variant"], c["seed"]): c["evaluations"] for c in b["cells"]}
    same = {}
    for v in ra:
        keys = [k for k in ca if k[0] == v]
        same[v] = all(k in cb and [p["metrics"] for p in ca[k]] == [p["metrics"] for p in cb[k]] for k in keys)
    return {"rank_a": ra, "rank_b": rb, "spearman": spearman(ra, rb), "identical_evaluations": same,
            "moved": [v for v in ra if ra.index(v) != rb.index(v)]}


def table(a: dict, b: dict, cmp: dict, names: tuple[str, str], command: str) -> str:
    rows_a = {r["variant"]: r for r in a["rows"]}
    rows_b = {r["variant"]: r for r in b["rows"]}
    lines = [f"# The same study twice: {names[0]} and {names[1]}", "", f"Command: `{command}`", "",
             (f"Targets: {a['target']:.4f} and {b['target']:.4f} (reference {a['reference']}); total benchmark time "
             f"{a['meta']['total_seconds'] / 3600:.2f} h and {b['meta']['total_seconds'] / 3600:.2f} h. Rank agreement "
             f"(by time to target): Spearman ρ = {cmp['spearman']:.3f}; variants whose rank differs: "
             f"{', '.join(cmp['moved']) or 'none'}. Held-out evaluations identical in both runs for "
             f"{sum(cmp['identical_evaluations'].values())} of {len(cmp['identical_evaluations'])} variants."), "",
             (f"| variant | rank {names[0]} | rank {names[1]} | time to target (s) {names[0]} | {names[1]} | "
             f"speed-up {names[0]} | {names[1]} | evaluations identical |"),
             "|---|---|---|---|---|---|---|---|"]
    for v in cmp["rank_a"]:
        x, y = rows_a[v], rows_b[v]
        lines.append(f"| {v} | {cmp['rank_a'].index(v) + 1} | {cmp['rank_b'].index(v) + 1} | "
                     f"{_ci(x['time_to_target'], x['time_to_target_ci'], '{:.1f}')} | "
                     f"{_ci(y['time_to_target'], y['time_to_target_ci'], '{:.1f}')} | "
                     f"{_ci(x['speedup'], x['speedup_ci'], '{:.2f}')} | {_ci(y['speedup'], y['speedup_ci'], '{:.2f}')} | "
                     f"{'yes' if cmp['identical_evaluations'][v] else 'no'} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    a, b = (json.loads((d / "summary.json").read_text(encoding="utf-8")) for d in (args.a, args.b))
    cmp = compare(a, b)
    command = "python benchmarks/compare_quality_runs.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = table(a, b, cmp, (args.a.name, args.b.name), command)
    if args.out:
        atomic_write(args.out, md)
        atomic_write(args.out.with_suffix(".json"), json.dumps(cmp, indent=1))
    print(md)


if __name__ == "__main__":
    main()
