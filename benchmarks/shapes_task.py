"""The shapes task's job beside the digits task's: ``diffgrpo train train.task=shapes`` at the task's defaults
(DiffusionNFT on a rank-16 LoRA, strict correctness, 60 iterations; :data:`RECIPE` adds nothing unless the caller
does) for three seeds, the first with first-time pretraining (an empty model cache), and ``diffgrpo train
train.task=digits`` with its own first-time pretraining, run one after the other in one invocation so their wall
times compare.
Per run: wall time, the end lines, held-out GenEval correctness (``shapes_correct``) per category at the start (the
base model) and at the end; written as table.md (with the command), results.json and the first seed's
samples_start_end.png.

    OMP_NUM_THREADS=1 python benchmarks/shapes_task.py --out benchmarks/results/shapes_task [key=value ...]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from diffgrpo.tasks import shapes

RECIPE: list[str] = []  # before the caller's overrides: the task's own defaults


def run(out: Path, cache: Path, args: list[str]) -> tuple[float, list[str]]:
    """``diffgrpo train <args>`` into ``out`` with the model cache ``cache`` → (wall seconds, its printed lines)."""
    cmd = [sys.executable, "-m", "diffgrpo.cli", "train", f"log.output_dir={out}", "log.progress=false", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", DIFFGRPO_CACHE=str(cache))
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"the run failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return wall, done.stdout.splitlines()


def by_category(table: Path) -> dict[str, float]:
    """Mean ``shapes_correct`` of an evaluation's sample table per GenEval category, their mean (GenEval's overall)
    and the mean over samples."""
    rows = [json.loads(line) for line in table.read_text().splitlines()]
    cats: dict[str, list[float]] = {}
    for r in rows:
        cats.setdefault(r["metadata"]["tag"], []).append(r["rewards"]["shapes_correct"])
    out = {c: sum(v) / len(v) for c, v in sorted(cats.items(), key=lambda kv: shapes.CATEGORIES.index(kv[0]))}
    out["mean of categories"] = sum(out.values()) / len(out)
    out["mean of samples"] = sum(sum(v) for v in cats.values()) / len(rows)
    return out


def evals(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "samples").glob("eval_*.jsonl"), key=lambda p: int(p.stem.split("_")[1]))


def end_lines(printed: list[str]) -> list[str]:
    return [line for line in printed if line.startswith(("finished", "train reward", "eval/"))]


def write(out: Path, result: dict, command: str) -> None:
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    shapes_runs, digits = result["shapes"], result["digits"]
    cats = list(shapes_runs[0]["start"])
    lines = ["# train.task=shapes (" + (" ".join(RECIPE) or "its defaults") + ") beside train.task=digits", "", "```",
             command, "```", "",
             "| held-out `shapes_correct` | " + " | ".join(f"seed {r['seed']} start → end" for r in shapes_runs)
             + " | mean start → end |", "|---|" + "---|" * (len(shapes_runs) + 1)]
    for c in cats:
        cells = [f"{r['start'][c]:.3f} → {r['end'][c]:.3f}" for r in shapes_runs]
        s = statistics.mean(r["start"][c] for r in shapes_runs)
        e = statistics.mean(r["end"][c] for r in shapes_runs)
        lines.append(f"| {c} | " + " | ".join(cells) + f" | {s:.3f} → {e:.3f} |")
    lines += ["", "| job | wall time | first-time pretraining |", "|---|---|---|"]
    lines += [f"| shapes, seed {r['seed']} | {r['wall_s']:.0f} s | {'included' if r['pretrained'] else 'cached'} |"
              for r in shapes_runs]
    lines += [f"| digits, seed 0 | {digits['wall_s']:.0f} s | "
              f"{'included' if digits['pretrained'] else 'cached'} |", ""]
    for r in shapes_runs:
        lines += [f"End lines, shapes seed {r['seed']}:", "", "```", *r["end_lines"], "```", ""]
    lines += ["End lines, digits:", "", "```", *digits["end_lines"], "```", ""]
    (out / "table.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/shapes_task"))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("overrides", nargs="*")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    result: dict = {"overrides": a.overrides, "seeds": a.seeds, "shapes": []}
    with tempfile.TemporaryDirectory() as shapes_cache, tempfile.TemporaryDirectory() as digits_cache:
        for i, seed in enumerate(a.seeds):
            run_dir = a.out / "runs" / f"shapes_seed{seed}"  # git keeps config.yaml and summary.json (.gitignore)
            shutil.rmtree(run_dir, ignore_errors=True)
            wall, printed = run(run_dir, Path(shapes_cache), ["train.task=shapes", f"seed={seed}", *RECIPE, *a.overrides])
            tables = evals(run_dir)
            result["shapes"].append({"seed": seed, "wall_s": wall, "pretrained": any("pretraining it" in x for x in printed),
                                     "start": by_category(tables[0]), "end": by_category(tables[-1]),
                                     "end_lines": end_lines(printed)})
            if i == 0:
                shutil.copy(run_dir / "samples_start_end.png", a.out / "samples_start_end.png")
                run_dir = a.out / "runs" / "digits_seed0"
                shutil.rmtree(run_dir, ignore_errors=True)
                wall, printed = run(run_dir, Path(digits_cache), ["train.task=digits"])
                result["digits"] = {"wall_s": wall, "pretrained": any("pretraining it" in x for x in printed),
                                    "end_lines": end_lines(printed)}
    command = "OMP_NUM_THREADS=1 python benchmarks/shapes_task.py --out " + " ".join([str(a.out), *a.overrides])
    write(a.out, result, command)
    print((a.out / "table.md").read_text())


if __name__ == "__main__":
    main()
