"""train.task=shapes end to end: one ``diffgrpo train train.task=shapes`` run (first-time pretraining included when
the cache is empty), its wall time, its end lines, the held-out GenEval correctness (``shapes_correct``) by category
at the start (the base model) and at the end, and its labelled start / end sample grid; written as table.md (with
the commands), results.json and samples_start_end.png.

    OMP_NUM_THREADS=1 python benchmarks/shapes_task.py --out benchmarks/results/shapes_task [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from diffgrpo.tasks import shapes


def run(out: Path, overrides: list[str]) -> tuple[float, list[str]]:
    """``diffgrpo train train.task=shapes`` into ``out`` → (wall seconds, the lines it printed)."""
    cmd = [sys.executable, "-m", "diffgrpo.cli", "train", "train.task=shapes", f"log.output_dir={out}",
           "log.progress=false", *overrides]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, done.stdout.splitlines()


def by_category(table: Path) -> dict[str, float]:
    """Mean ``shapes_correct`` of an evaluation's sample table per GenEval category, and over categories."""
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    cats: dict[str, list[float]] = {}
    for r in rows:
        cats.setdefault(r["metadata"]["tag"], []).append(r["rewards"]["shapes_correct"])
    out = {c: sum(v) / len(v) for c, v in sorted(cats.items(), key=lambda kv: shapes.CATEGORIES.index(kv[0]))}
    out["mean of categories"] = sum(out.values()) / len(out)
    out["mean of samples"] = sum(sum(v) for v in cats.values()) / len(rows)
    return out


def write(out: Path, result: dict, command: str) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    start, end = result["start"], result["end"]
    lines = ["# train.task=shapes end to end", "", "```", command, "```", "",
             f"wall time {result['wall_s']:.0f} s on one thread (first-time pretraining "
             f"{'included' if result['pretrained'] else 'cached'})", "",
             "| held-out `shapes_correct` | start (base model) | end |", "|---|---|---|"]
    lines += [f"| {k} | {start[k]:.3f} | {end[k]:.3f} |" for k in start]
    lines += ["", "End lines:", "", "```", *result["end_lines"], "```", ""]
    (out / "table.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/shapes_task"))
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    run_dir = a.out / "runs" / "seed0"  # git keeps its config.yaml and summary.json (.gitignore)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    wall, printed = run(run_dir, a.overrides)
    tables = sorted((run_dir / "samples").glob("eval_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))
    result = {"overrides": ["train.task=shapes", *a.overrides], "wall_s": wall,
              "pretrained": any("pretraining it" in line for line in printed),
              "start": by_category(tables[0]), "end": by_category(tables[-1]),
              "end_lines": [line for line in printed if line.startswith(("finished", "train reward", "eval/"))]}
    shutil.copy(run_dir / "samples_start_end.png", a.out / "samples_start_end.png")
    command = "OMP_NUM_THREADS=1 python benchmarks/shapes_task.py --out " + " ".join([str(a.out), *a.overrides])
    write(a.out, result, command)
    print((a.out / "table.md").read_text())


if __name__ == "__main__":
    main()
