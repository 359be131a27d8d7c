"""Compare held-out reward curves of finished runs (e.g. an engine against recompute over several seeds).

    # the runs themselves (one per engine and seed):
    OMP_NUM_THREADS=1 diffgrpo train seed=S log.output_dir=runs/recompute_sS
    OMP_NUM_THREADS=1 diffgrpo train seed=S engine.name=jagg engine.window=4 log.output_dir=runs/jagg_sS
    # then:
    python benchmarks/compare_runs.py --group recompute runs/recompute_s* --group "jagg W=4" runs/jagg_s* \
        --out benchmarks/results/jagg_training

Writes ``curves.png`` (mean ± min/max over seeds per group) and ``table.md`` (final held-out reward per seed,
mean ± std). Speed is measured side by side by ``diffgrpo bench engines``, not here.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def load(run: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [(r["iteration"], r[key]) for r in rows if r.get(key) is not None]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--group", nargs="+", action="append", required=True, metavar=("NAME", "RUN_DIR"),
                    help="a label followed by its run directories (one per seed)")
    ap.add_argument("--key", default="eval/rewards/digit_alignment/mean")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    lines = [f"Held-out `{args.key}` (ODE, fixed prompts and seeds).", "",
             "| group | seeds | start | final per seed | final mean ± std |", "|---|---|---|---|---|"]
    for name, *runs in args.group:
        curves = [load(Path(r), args.key) for r in runs]
        its = [i for i, _ in curves[0]]
        vals = [[dict(c)[i] for c in curves] for i in its]
        ax.plot(its, [statistics.mean(v) for v in vals], marker="o", label=f"{name} (n={len(runs)})")
        ax.fill_between(its, [min(v) for v in vals], [max(v) for v in vals], alpha=0.2)
        finals = [c[-1][1] for c in curves]
        sd = statistics.stdev(finals) if len(finals) > 1 else 0.0
        lines.append(f"| {name} | {len(runs)} | {curves[0][0][1]:.4f} | {' / '.join(f'{f:.4f}' for f in finals)} | "
                     f"{statistics.mean(finals):.4f} ± {sd:.4f} |")
    ax.set_xlabel("iteration")
    ax.set_ylabel("held-out reward")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
