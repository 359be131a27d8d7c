"""Merge the DACA-GRPO training study into one table: benchmarks/results/daca/train/daca_train.{md,json}.

Reads every ``<dir>/dllm_train.json`` written by benchmarks/dllm_train.py under benchmarks/results/daca/train/,
plus the base rows of benchmarks/results/dllm/slip_base/{arithmetic,sudoku} (the issue-7 runs, same protocol).
A (task, method, variant) cell is listed only when all of ``--seeds`` finished; the coverage grid shows which
cells of tasks × methods × variants are complete. ``findings.md`` in the study directory, if present, is
appended verbatim (the hand-written reading of the table).

    python benchmarks/daca_table.py
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from dllm_train import load_runs, tables  # noqa: E402

TASKS = ("arithmetic", "sudoku", "countdown", "json_schema")
METHODS = ("diffu_grpo", "coupled_grpo", "random_mask")
VARIANTS = ("base", "+dps", "+sml", "+both", "+sml_chain")
ITERATIONS = {"arithmetic": 300, "sudoku": 300, "countdown": 150, "json_schema": 150}

HEAD = """Same protocol as `../../dllm/slip_base/` (slip bases, `pretrain.answer_noise=0.4`; 16 prompts × 8, lr 1e-4, β 0,
`dllm.p_mask_prompt=0`; seeds 0 1 2; whole test split, greedy and T = 1 sampled with 4 completions per prompt),
equal iterations within a task: 300 for arithmetic and sudoku, 150 for countdown and json_schema. Variants:
+dps = Denoising Progress Scores (entropy at commit, λ = 0.5, clip [0.2, 5]); +sml = Stratified Masking
Likelihood (K = 2, random partition, leave_one_out); +both; +sml_chain = SML with K = 2 in chain mode over the
decode-order partition (the library default since this study). Forwards are sequence-forwards per run (sampling,
ℓ_old and training; evaluation excluded). Only (task, method, variant) cells with all seeds are listed.
Rebuilt by `python benchmarks/daca_table.py` from the files below (each run's directory is under `<dir>/runs/`)."""


def complete(rows: list[dict], seeds: list[int]) -> tuple[list[dict], dict]:
    """Rows of cells with every seed, in task/method/variant/seed order; coverage[(t, m, v)] = seeds done."""
    cov: dict[tuple, set] = {}
    for r in rows:
        cov.setdefault((r["task"], r["method"], r["variant"]), set()).add(r["seed"])
    order = {k: i for i, k in enumerate((t, m, v) for t in TASKS for m in METHODS for v in VARIANTS)}
    keep = [r for r in rows if set(seeds) <= cov[(r["task"], r["method"], r["variant"])] and r["seed"] in seeds]
    keep.sort(key=lambda r: (order.get((r["task"], r["method"], r["variant"]), 1 << 30), r["seed"]))
    return keep, cov


def coverage_grid(cov: dict, seeds: list[int]) -> list[str]:
    lines = ["## Coverage (seeds finished per cell)", "",
             "| task | method | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for t in TASKS:
        for m in METHODS:
            cells = [f"{len(cov.get((t, m, v), ()))}/{len(seeds)}" for v in VARIANTS]
            lines.append(f"| {t} | {m} | " + " | ".join(cells) + " |")
    return lines + [""]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", default="benchmarks/results/daca/train")
    p.add_argument("--base", nargs="*", default=["benchmarks/results/dllm/slip_base/arithmetic/dllm_train.json",
                                                 "benchmarks/results/dllm/slip_base/sudoku/dllm_train.json"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = p.parse_args()
    root = Path(args.dir)
    paths = [Path(b) for b in args.base] + sorted(root.glob("*/dllm_train.json"))
    rows, cmds = load_runs(paths)
    rows = [r for r in rows if r["iterations"] == ITERATIONS[r["task"]]]  # the study's equal-steps protocol
    keep, cov = complete(rows, args.seeds)
    head = HEAD + "\n\n" + "\n".join(cmds)
    lines = tables(keep, head)
    lines[0] = "# DACA-GRPO training study on the built-in tiny dLLMs (equal steps)"
    lines += [""] + coverage_grid(cov, args.seeds)
    findings = root / "findings.md"
    if findings.exists():
        lines += [findings.read_text().rstrip(), ""]
    (root / "daca_train.md").write_text("\n".join(lines) + "\n")
    incomplete = sorted(k for k, s in cov.items() if not set(args.seeds) <= s)
    (root / "daca_train.json").write_text(json.dumps({"sources": [str(p) for p in paths], "rows": keep,
                                                      "incomplete_left_out": incomplete}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
