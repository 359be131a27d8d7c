"""GRPO on the built-in tiny masked diffusion LM: held-out accuracy before and after training, over seeds.

For each task, base method, variant and seed: the cached pretrained tiny dLLM (``diffgrpo pretrain --task <task>``; the
same base model for every seed and method), ``--iterations`` GRPO iterations, then the WHOLE held-out test
split decoded twice: greedy (temperature 0) and sampled (temperature 1, ``--eval-samples`` completions per
prompt; the policy GRPO optimises). Writes <out>/dllm_train.{json,md} and one run directory per run.

Variants (``--variants``) add DACA-GRPO's plug-ins at equal steps: +dps (Denoising Progress Scores), +sml
(Stratified Masking Likelihood, K = 2, random partition, leave-one-out), +both; +sml_chain = SML with the
decode-order partition in chain mode (the half decoded first is scored with the whole completion masked, the
rest with that half visible: the contexts the sampler decided them in). Forwards are the policy's
sequence-forwards over the run (sampling, ℓ_old and training; evaluation excluded).

The configuration was fixed from training-split quantities only (benchmarks/dllm_tune.py); the test split is
decoded only here.

    OMP_NUM_THREADS=1 python benchmarks/dllm_train.py --tasks arithmetic sudoku --seeds 0 1 2
    OMP_NUM_THREADS=1 python benchmarks/dllm_train.py --tasks sudoku --variants base +dps +sml +both
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, Trainer

SML_LOO = ["daca.likelihood=sml", "daca.sml_strata=2", "daca.sml_partition=random", "daca.sml_mode=leave_one_out"]
VARIANTS = {"base": [], "+dps": ["daca.dps_score=entropy", "daca.dps_mix=0.5"],
            "+sml": SML_LOO,
            "+both": ["daca.dps_score=entropy", "daca.dps_mix=0.5", *SML_LOO],
            "+sml_chain": ["daca.likelihood=sml", "daca.sml_strata=2", "daca.sml_partition=decode_order",
                           "daca.sml_mode=chain"]}


def heldout(tr: Trainer, samples: int) -> dict[str, float]:
    fam = tr.family
    test = fam.task.instances("test")
    return {"greedy": fam.score(test, temperature=0.0, seed=1234)["eval/accuracy"],
            "sampled": fam.score(test, temperature=1.0, samples=samples, seed=1234)["eval/accuracy"]}


def run(task: str, method: str, variant: str, seed: int, args) -> dict:
    cfg = RunConfig.from_overrides([
        "model.name=tiny_mlm", f"dllm.task={task}", f"dllm.method={method}", f"seed={seed}",
        f"train.num_iterations={args.iterations}", f"train.prompts_per_batch={args.prompts}",
        f"train.group_size={args.group}", f"train.lr={args.lr}", f"loss.beta={args.beta}",
        "dllm.eval_size=1", "log.progress=false", "log.save_images=false", "eval.every=0",
        f"log.output_dir={args.out}/runs/{task}-{method}{'' if variant == 'base' else '-' + variant[1:]}-s{seed}",
        *VARIANTS[variant],
        *args.overrides])
    t0 = time.perf_counter()
    tr = Trainer(cfg, log=lambda *a: None)
    start = heldout(tr, args.eval_samples)
    tr.train()
    end = heldout(tr, args.eval_samples)
    c = tr.policy.counters
    row = {"task": task, "method": method, "variant": variant, "seed": seed, "greedy_start": start["greedy"],
           "greedy_end": end["greedy"], "sampled_start": start["sampled"], "sampled_end": end["sampled"],
           "forwards_grad": c.get("forwards_grad", 0), "forwards_nograd": c.get("forwards_nograd", 0),
           "n_test": len(tr.family.task.instances("test")), "seconds": time.perf_counter() - t0}
    print(json.dumps(row), flush=True)
    return row


def ms(xs: list[float]) -> str:
    return f"{statistics.mean(xs):+.4f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.4f}"


def tables(rows: list[dict], head: str) -> list[str]:
    """Markdown: one row per run, then per (task, method, variant) means ± std over seeds."""
    lines = ["# GRPO on the built-in tiny dLLM: held-out accuracy", "", head, "",
             "| task | method | variant | seed | greedy start → end | sampled start → end | forwards (grad / no grad) "
             "| s |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['method']} | {r['variant']} | {r['seed']} | {r['greedy_start']:.4f} → "
                     f"{r['greedy_end']:.4f} | {r['sampled_start']:.4f} → {r['sampled_end']:.4f} | "
                     f"{r['forwards_grad']} / {r['forwards_nograd']} | {r['seconds']:.0f} |")
    lines += ["", "| task | method | variant | greedy end (mean ± std) | Δ greedy | seeds up | sampled end | "
              "Δ sampled | seeds up | forwards grad / no grad per run |", "|---|---|---|---|---|---|---|---|---|---|"]
    keys = list(dict.fromkeys((r["task"], r["method"], r["variant"]) for r in rows))
    for t, m, v in keys:
        sel = [r for r in rows if (r["task"], r["method"], r["variant"]) == (t, m, v)]
        dg = [r["greedy_end"] - r["greedy_start"] for r in sel]
        dsm = [r["sampled_end"] - r["sampled_start"] for r in sel]
        lines.append(f"| {t} | {m} | {v} | {ms([r['greedy_end'] for r in sel])[1:]} | {ms(dg)} | "
                     f"{sum(x > 0 for x in dg)}/{len(dg)} | {ms([r['sampled_end'] for r in sel])[1:]} | "
                     f"{ms(dsm)} | {sum(x > 0 for x in dsm)}/{len(dsm)} | "
                     f"{sel[0]['forwards_grad']} / {sel[0]['forwards_nograd']} |")
    return lines


def command(a: dict) -> str:
    """The command line that reproduces a run from its recorded arguments."""
    return (f"OMP_NUM_THREADS=1 python benchmarks/dllm_train.py --tasks {' '.join(a['tasks'])} --methods "
            f"{' '.join(a['methods'])} --variants {' '.join(a.get('variants', ['base']))} --seeds "
            f"{' '.join(map(str, a['seeds']))} --iterations {a['iterations']} --lr {a['lr']} --eval-samples "
            f"{a['eval_samples']} --out {a['out']} {' '.join(a['overrides'])}")


def load_runs(paths) -> tuple[list[dict], list[str]]:
    """Rows of earlier dllm_train.json files, each tagged with its run's ``iterations`` and ``eval_samples``
    (variant defaults to base; a repeated task/method/variant/seed keeps the first file's row), and one
    "- `file`: `command`" line per file."""
    rows, seen, cmds = [], set(), []
    for path in map(Path, paths):
        d = json.loads(path.read_text())
        a = d["args"]
        cmds.append(f"- `{path}`: `{command(a)}`" + (f" ({d['note']})" if d.get("note") else ""))
        for r in d["rows"]:
            r = {"variant": "base", **r, "iterations": a["iterations"], "eval_samples": a["eval_samples"]}
            key = (r["task"], r["method"], r["variant"], r["seed"])
            if key not in seen:
                seen.add(key)
                rows.append(r)
    return rows, cmds


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", nargs="+", default=["arithmetic", "sudoku"])
    p.add_argument("--methods", nargs="+", default=["diffu_grpo", "coupled_grpo", "random_mask"])
    p.add_argument("--variants", nargs="+", default=["base"], choices=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=300)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/dllm")
    p.add_argument("--from-json", nargs="+", default=[],
                   help="only merge the rows of earlier dllm_train.json files into <out>/dllm_train.md")
    p.add_argument("overrides", nargs="*", default=["dllm.p_mask_prompt=0"])
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        rows, cmds = load_runs(args.from_json)
        head = "Merged from:\n\n" + "\n".join(cmds)
        head += ("\n\nHeld-out = the whole test split: greedy decoding, and sampled at temperature 1 "
                 f"({rows[0]['eval_samples']} completions per prompt).")
        (out / "dllm_train.md").write_text("\n".join(tables(rows, head)) + "\n")
        print("\n".join(tables(rows, head)))
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = [run(t, m, v, s, args) for t in args.tasks for m in args.methods for v in args.variants
            for s in args.seeds]
    cmd = command(vars(args))
    head = (f"{args.iterations} iterations, {args.prompts} prompts × {args.group} samples, lr {args.lr}, beta "
            f"{args.beta}, overrides {' '.join(args.overrides) or '(none)'}. Held-out = the whole test split: "
            f"greedy decoding, and sampled at temperature 1 with {args.eval_samples} completions per prompt.\n\n"
            f"Command: `{cmd}`")
    lines = tables(rows, head)
    (out / "dllm_train.md").write_text("\n".join(lines) + "\n")
    (out / "dllm_train.json").write_text(json.dumps({"args": vars(args), "command": cmd, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
