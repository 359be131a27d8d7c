"""Compare held-out reward curves of finished runs (e.g. an engine against recompute over several seeds).

    # the runs themselves (one per engine and seed):
    OMP_NUM_THREADS=1 diffgrpo train seed=S log.output_dir=runs/recompute_sS
    OMP_NUM_THREADS=1 diffgrpo train seed=S engine.name=jagg engine.window=4 log.output_dir=runs/jagg_sS
    # then:
    python benchmarks/compare_runs.py --group recompute runs/recompute_s* --group "jagg W=4" runs/jagg_s* \
        --out benchmarks/results/jagg_training
    # later, without the run directories (their metrics.jsonl logs are not kept in git):
    python benchmarks/compare_runs.py --from-json benchmarks/results/jagg_training/curves.json

Writes ``curves.png`` (mean ± min/max over seeds per group), ``table.md`` (the command, then the final
held-out reward per seed, mean ± std) and ``curves.json`` (the command and the held-out rows the table and
plot read: iteration and ``--key`` of each run's evaluations), from which ``--from-json`` rebuilds the other
two byte for byte. Speed is measured side by side by ``diffgrpo bench engines``, not here.
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path


def load(run: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]


def write(data: dict, out: Path) -> list[str]:
    """curves.png and table.md from ``data`` (the contents of curves.json); returns the table's lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    lines = [f"Command: `{data['command']}`", "", f"Held-out `{data['key']}` (ODE, fixed prompts and seeds).", "",
             "| group | seeds | start | final per seed | final mean ± std |", "|---|---|---|---|---|"]
    for g in data["groups"]:
        name, curves = g["name"], [[tuple(p) for p in c] for c in g["runs"].values()]
        its = [i for i, _ in curves[0]]
        vals = [[dict(c)[i] for c in curves] for i in its]
        ax.plot(its, [statistics.mean(v) for v in vals], marker="o", label=f"{name} (n={len(curves)})")
        ax.fill_between(its, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2)
        finals = [c[-1][1] for c in curves]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        lines.append(f"| {name} | {len(curves)} | {curves[0][0][1]:.4f} | {' / '.join(f'{f:.4f}' for f in finals)} | "
                     f"{statistics.mean(finals):.4f} ± {sd:.4f} |")
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", nargs="+", action="append", metavar=("NAME", "RUN_DIR"),
                    help="a label followed by its run directories (one per seed)")
    ap.add_argument("--key", default="eval/rewards/digit_alignment/mean")
    ap.add_argument("--out", help="output directory (with --from-json: the json's directory by default)")
    ap.add_argument("--from-json", help="rebuild table.md and curves.png from an earlier curves.json")
    args = ap.parse_args()
    if args.from_json:
        data = json.loads(Path(args.from_json).read_text())
        out = Path(args.out or Path(args.from_json).parent)
    else:
        if not args.group or not args.out:
            ap.error("--group and --out are required unless --from-json is given")
        out = Path(args.out)
        data = {"command": "python benchmarks/compare_runs.py " + shlex.join(sys.argv[1:]), "key": args.key,
                "groups": [{"name": name, "runs": {r: load(Path(r), args.key) for r in runs}}
                           for name, *runs in args.group]}
        out.mkdir(parents=True, exist_ok=True)
        groups = ",\n".join(
            f'    {{"name": {json.dumps(g["name"])}, "runs": {{\n'
            + ",\n".join(f"      {json.dumps(r)}: {json.dumps(c)}" for r, c in g["runs"].items()) + "}}"
            for g in data["groups"])
        (out / "curves.json").write_text(f'{{\n  "command": {json.dumps(data["command"])},\n  "key": '
                                         f'{json.dumps(data["key"])},\n  "groups": [\n{groups}\n  ]\n}}\n')
    print("\n".join(write(data, out)))


if __name__ == "__main__":
    main()
