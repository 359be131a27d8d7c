"""Every dLLM base method ± DACA on the built-in tasks at EQUAL GRAD-FORWARDS: held-out greedy and sampled accuracy.

The base methods spend different numbers of sequence-forwards with grad per completion and update (M: diffu_grpo
and wd1 1, coupled_grpo paper 2, released 3, random_mask m = 2, spg num_t = 2; × K = 2 with SML), so equal
iterations would favour the expensive estimators. Every run here gets the same budget of grad-forwards
(``--budget``, sequence-forwards with grad over the run, as the policy counts them): iterations =
round(budget / (prompts · group · M)). The cheaper estimators therefore also see more rollouts.

Cells: method ∈ {diffu_grpo, coupled_paper, coupled_released, random_mask, spg, wd1} × variant ∈ {base, +daca},
DACA = Denoising Progress Scores (entropy at commit, λ = 0.5) + Stratified Masking Likelihood (the library
default: K = 2, chain over the decode order); for spg, DACA = DPS only (SML is refused: see dllm/spg.py). Each run
starts from the cached pretrained tiny dLLM of its task (``diffgrpo pretrain --task``; same base for every method
and seed), and is scored on the whole held-out test split, greedy (T = 0) and sampled (T = 1, ``--eval-samples``
completions per prompt). The start accuracy is the base model's (identical for every run of a task; computed
once). Held-out = the first ``--eval-size`` test prompts. Runs go to ``--jobs`` worker processes; each result is appended to <out>/runs.jsonl as it finishes, so an
interrupted study keeps what it measured (``--from-jsonl`` rebuilds the tables).

Writes <out>/study.md (tables), <out>/study.json (aggregate), <out>/configs/<task>-<method>-<variant>.yaml (the
resolved configuration of each cell, seed 0).

    OMP_NUM_THREADS=1 python benchmarks/dllm_study.py --budget 768 --prompts 4 --group 8 --jobs 2 --max-minutes 38
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

METHODS = {"diffu_grpo": ["dllm.method=diffu_grpo"],
           "coupled_paper": ["dllm.method=coupled_grpo", "dllm.coupled_form=paper"],
           "coupled_released": ["dllm.method=coupled_grpo", "dllm.coupled_form=released"],
           "random_mask": ["dllm.method=random_mask"],
           "spg": ["dllm.method=spg"],
           "wd1": ["dllm.method=wd1"]}
DPS = ["daca.dps_score=entropy", "daca.dps_mix=0.5"]
SML = ["daca.likelihood=sml", "daca.sml_strata=2", "daca.sml_partition=decode_order", "daca.sml_mode=chain"]
TASKS = ("arithmetic", "sudoku", "countdown", "json_schema", "code_toy")
# per-task sampler settings of this study (json_schema decodes 2 tokens per step: 16 steps for its 32 tokens, which
# halves its rollout and evaluation cost, the study's largest)
TASK_OVERRIDES = {"json_schema": ["dllm.diffusion_steps=16"]}


def variant_overrides(method: str, variant: str) -> list[str]:
    if variant == "base":
        return []
    return DPS if method == "spg" else DPS + SML


def overrides(task, method, variant, seed, args, iterations, out_dir) -> list[str]:
    return ["model.name=tiny_mlm", f"dllm.task={task}", *TASK_OVERRIDES.get(task, []), *METHODS[method],
            *variant_overrides(method, variant),
            f"seed={seed}", f"train.num_iterations={iterations}", f"train.prompts_per_batch={args.prompts}",
            f"train.group_size={args.group}", f"train.lr={args.lr}", "loss.beta=0.0", "dllm.eval_size=1",
            "log.progress=false", "log.save_images=false", "eval.every=0", f"log.output_dir={out_dir}",
            *args.overrides]


def plan(task, method, variant, args) -> int:
    """Iterations that spend ``args.budget`` grad-forwards."""
    from diffgrpo import RunConfig
    from diffgrpo.dllm.grpo import forwards_per_estimate

    cfg = RunConfig.from_overrides(overrides(task, method, variant, 0, args, 1, "/tmp/unused"))
    m = forwards_per_estimate(cfg.dllm, cfg.daca)
    return max(1, round(args.budget / (args.prompts * args.group * m))), m


def heldout(tr, samples: int, size: int = 0) -> dict[str, float]:
    """Accuracy on the first ``size`` test prompts (0 = all): greedy, and sampled at T = 1."""
    fam = tr.family
    test = fam.task.instances("test")
    test = test[:size] if size else test
    return {"greedy": fam.score(test, temperature=0.0, seed=1234)["eval/accuracy"],
            "sampled": fam.score(test, temperature=1.0, samples=samples, seed=1234)["eval/accuracy"]}


def run_one(job: dict) -> dict:
    import torch

    from diffgrpo import RunConfig, Trainer

    torch.set_num_threads(1)
    a = argparse.Namespace(**job["args"])
    cfg = RunConfig.from_overrides(overrides(job["task"], job["method"], job["variant"], job["seed"], a,
                                             job["iterations"], job["run_dir"]))
    t0 = time.perf_counter()
    tr = Trainer(cfg, log=lambda *x: None)
    if job.get("start_only"):
        n = len(tr.family.task.instances("test"))
        return {"task": job["task"], **{f"{k}_start": v for k, v in heldout(tr, a.eval_samples, a.eval_size).items()},
                "n_test": min(n, a.eval_size) if a.eval_size else n}
    tr.train()
    end = heldout(tr, a.eval_samples, a.eval_size)
    c = tr.policy.counters
    return {"task": job["task"], "method": job["method"], "variant": job["variant"], "seed": job["seed"],
            "iterations": job["iterations"], "forwards_per_estimate": job["m"],
            "greedy_end": end["greedy"], "sampled_end": end["sampled"],
            "forwards_grad": c.get("forwards_grad", 0), "forwards_nograd": c.get("forwards_nograd", 0),
            "seconds": time.perf_counter() - t0}


def ms(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def aggregate(rows, starts):
    """Per (task, method, variant): mean ± std over seeds of the end accuracies and their change from the start."""
    cells = {}
    for r in rows:
        cells.setdefault((r["task"], r["method"], r["variant"]), []).append(r)
    out = []
    for (t, m, v), sel in cells.items():
        st = starts[t]
        g = [r["greedy_end"] for r in sel]
        s = [r["sampled_end"] for r in sel]
        out.append({"task": t, "method": m, "variant": v, "seeds": sorted(r["seed"] for r in sel),
                    "greedy_start": st["greedy_start"], "sampled_start": st["sampled_start"],
                    "greedy_end": ms(g), "sampled_end": ms(s),
                    "d_greedy": ms([x - st["greedy_start"] for x in g]),
                    "d_sampled": ms([x - st["sampled_start"] for x in s]),
                    "iterations": sel[0]["iterations"], "forwards_per_estimate": sel[0]["forwards_per_estimate"],
                    "forwards_grad": sel[0]["forwards_grad"], "forwards_nograd": sel[0]["forwards_nograd"],
                    "seconds": statistics.mean(r["seconds"] for r in sel)})
    return out


def tables(cells, starts, head, complete=None) -> list[str]:
    """Markdown tables; the mean over tasks uses only ``complete`` tasks (every cell with every seed; None = all)."""
    lines = ["# dLLM base methods ± DACA at equal grad-forwards", "", head, ""]
    for t in [t for t in TASKS if t in starts]:
        st = starts[t]
        lines += [(f"## {t} (start: greedy {st['greedy_start']:.4f}, sampled {st['sampled_start']:.4f}; "
                   f"{st['n_test']} test prompts)"), "",
                  ("| method | variant | M | iterations | grad / no-grad forwards | greedy end | Δ greedy | "
                   "sampled end | Δ sampled | seeds | s/run |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
        for c in sorted((c for c in cells if c["task"] == t), key=lambda c: (list(METHODS).index(c["method"]),
                                                                              c["variant"] != "base")):
            lines.append(f"| {c['method']} | {c['variant']} | {c['forwards_per_estimate']} | {c['iterations']} | "
                         f"{c['forwards_grad']} / {c['forwards_nograd']} | {c['greedy_end'][0]:.4f} ± "
                         f"{c['greedy_end'][1]:.4f} | {c['d_greedy'][0]:+.4f} | {c['sampled_end'][0]:.4f} ± "
                         f"{c['sampled_end'][1]:.4f} | {c['d_sampled'][0]:+.4f} | {len(c['seeds'])} | "
                         f"{c['seconds']:.0f} |")
        lines.append("")
    # overall: mean change over the complete tasks
    done = [t for t in TASKS if t in starts and (complete is None or t in complete)]
    keys = list(dict.fromkeys((c["method"], c["variant"]) for c in cells if c["task"] in done))
    lines += [f"## Mean change over the complete tasks ({', '.join(done)})", "",
              "| method | variant | tasks | mean Δ greedy | mean Δ sampled |", "|---|---|---|---|---|"]
    for m, v in sorted(keys, key=lambda k: (list(METHODS).index(k[0]), k[1] != "base")):
        sel = [c for c in cells if (c["method"], c["variant"]) == (m, v) and c["task"] in done]
        lines.append(f"| {m} | {v} | {len(sel)} | {statistics.mean(c['d_greedy'][0] for c in sel):+.4f} | "
                     f"{statistics.mean(c['d_sampled'][0] for c in sel):+.4f} |")
    return lines


def command(a) -> str:
    return (f"OMP_NUM_THREADS=1 python benchmarks/dllm_study.py --tasks {' '.join(a.tasks)} --methods "
            f"{' '.join(a.methods)} --variants {' '.join(a.variants)} --seeds {' '.join(map(str, a.seeds))} "
            f"--budget {a.budget} --prompts {a.prompts} --group {a.group} --lr {a.lr} --eval-samples "
            f"{a.eval_samples} --eval-size {a.eval_size} --jobs {a.jobs} --max-minutes {a.max_minutes} --out {a.out}"
            f"{' --run-root ' + a.run_root if a.run_root else ''} {' '.join(a.overrides)}").rstrip()


def write(out: Path, args, rows, starts, note=""):
    cells = aggregate(rows, starts)
    have = {(r["task"], r["method"], r["variant"], r["seed"]) for r in rows}
    missing = [(t, m, v, sd) for t in args.tasks for m in args.methods for v in args.variants for sd in args.seeds
               if (t, m, v, sd) not in have]
    if missing and not note:
        note = (f"\n\n{len(missing)} of the planned runs did not run (tasks "
                f"{', '.join(sorted({x[0] for x in missing}))}; --max-minutes {args.max_minutes}); the cells list the "
                f"seeds they have, and the mean over tasks uses only the tasks with every seed of every cell.")
    head = (f"Budget {args.budget} grad-forwards per run (sequence-forwards with grad; iterations = budget / "
            f"(prompts × group × M), M = forwards per estimate), {args.prompts} prompts × {args.group} samples, lr "
            f"{args.lr}, β 0, overrides {' '.join(args.overrides) or '(none)'}; seeds "
            f"{' '.join(map(str, args.seeds))}. Held-out = the first {args.eval_size or 'all'} prompts of each test "
            f"split (fewer where the split is smaller): greedy, and sampled at T = 1 with {args.eval_samples} completion(s) "
            f"per prompt; ± = std over seeds. Per-task sampler settings: {TASK_OVERRIDES}. +daca = DPS (entropy, "
            f"λ 0.5) + SML (K 2, chain, decode order); spg's +daca is DPS only.\n\nCommand: `{command(args)}`" + note)
    n_cells = len(args.methods) * len(args.variants)
    complete = {t for t in starts if sum(1 for c in cells if c["task"] == t and len(c["seeds"]) == len(args.seeds))
                == n_cells}
    lines = tables(cells, starts, head, complete)
    findings = out / "findings.md"  # the hand-written reading of the tables, kept across rebuilds
    if findings.exists():
        lines += ["", findings.read_text().rstrip()]
    (out / "study.md").write_text("\n".join(lines) + "\n")
    (out / "study.json").write_text(json.dumps({"args": vars(args), "command": command(args), "starts": starts,
                                                "complete_tasks": sorted(complete), "cells": cells, "rows": rows},
                                               indent=2))
    print("\n".join(lines))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=TASKS)
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    p.add_argument("--variants", nargs="+", default=["base", "+daca"], choices=["base", "+daca"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--budget", type=int, default=768, help="grad-forwards per run")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--eval-samples", type=int, default=1)
    p.add_argument("--eval-size", type=int, default=128, help="held-out prompts: the first N of the test split (0 = all)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--out", default="benchmarks/results/dllm_study")
    p.add_argument("--run-root", default="", help="run directories (default <out>/runs)")
    p.add_argument("--max-minutes", type=float, default=0, help="start no new run after this many minutes (0 = no "
                   "limit); the tables then hold the runs that finished")
    p.add_argument("--from-jsonl", action="store_true", help="only rebuild the tables from <out>/runs.jsonl")
    p.add_argument("overrides", nargs="*", default=["dllm.p_mask_prompt=0"])
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "runs.jsonl"
    saved = out / "study_args.json"  # the arguments of the run that wrote runs.jsonl
    if args.from_jsonl:
        if saved.exists():
            args = argparse.Namespace(**{**vars(args), **json.loads(saved.read_text()), "from_jsonl": True})
        recs = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
        starts = {r["task"]: r for r in recs if "greedy_start" in r}
        rows = [r for r in recs if "greedy_end" in r]
        write(out, args, rows, starts)
        return
    saved.write_text(json.dumps(vars(args), indent=2))
    root = Path(args.run_root or out / "runs")
    (out / "configs").mkdir(exist_ok=True)
    from diffgrpo import RunConfig

    jobs = []
    for t in args.tasks:
        jobs.append({"task": t, "method": "diffu_grpo", "variant": "base", "seed": 0, "iterations": 1, "m": 1,
                     "start_only": True, "run_dir": str(root / f"{t}-start"), "args": vars(args)})
        for m in args.methods:
            for v in args.variants:
                its, M = plan(t, m, v, args)
                cell = f"{t}-{m}-{'base' if v == 'base' else 'daca'}"
                cfg = RunConfig.from_overrides(overrides(t, m, v, 0, args, its, str(root / f"{cell}-s0")))
                (out / "configs" / f"{cell}.yaml").write_text(cfg.to_yaml())
                for s in args.seeds:
                    jobs.append({"task": t, "method": m, "variant": v, "seed": s, "iterations": its, "m": M,
                                 "run_dir": str(root / f"{cell}-s{s}"), "args": vars(args)})
    # task-major in --tasks order (a study cut short by --max-minutes keeps whole tasks), then seed-major, the
    # start evaluation first and the longest runs first within a seed
    jobs.sort(key=lambda j: (args.tasks.index(j["task"]), not j.get("start_only"), j["seed"], -j["iterations"]))
    rows, starts, t0, pending = [], {}, time.time(), list(jobs)
    with ProcessPoolExecutor(max_workers=args.jobs) as ex, log.open("a") as fh:
        running = {ex.submit(run_one, pending.pop(0)) for _ in range(min(args.jobs, len(pending)))}
        while running:
            f = next(as_completed(running))
            running.remove(f)
            r = f.result()
            fh.write(json.dumps(r) + "\n")
            fh.flush()
            print(json.dumps(r), flush=True)
            (starts.__setitem__(r["task"], r) if "greedy_start" in r else rows.append(r))
            if pending and (not args.max_minutes or time.time() - t0 < 60 * args.max_minutes):
                running.add(ex.submit(run_one, pending.pop(0)))
    note = ""
    if pending:
        left = sorted({f"{j['task']}" for j in pending})
        note = (f"\n\nStopped by the {args.max_minutes}-minute limit: {len(pending)} runs not started (tasks "
                f"{', '.join(left)}); the cells list the seeds they have, and the mean over tasks uses only the "
                f"tasks with every seed of every cell.")
    write(out, args, rows, starts, note)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
