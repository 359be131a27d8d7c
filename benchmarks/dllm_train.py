"""GRPO on the built-in tiny masked diffusion LM: held-out accuracy before and after training, over seeds.

For each task and seed: the cached pretrained tiny dLLM (``diffgrpo pretrain --task <task>``, same base model
for every seed), ``--iterations`` GRPO iterations with the chosen base method, then greedy decoding on the
whole held-out test split. Writes benchmarks/results/dllm/dllm_train.{json,md}.

    OMP_NUM_THREADS=1 python benchmarks/dllm_train.py --tasks arithmetic sudoku --seeds 0 1 2 --iterations 60 pretrain.batch_size=64 dllm.p_mask_prompt=0
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


def run(task: str, seed: int, args) -> dict:
    cfg = RunConfig.from_overrides([
        "model.name=tiny_mlm", f"dllm.task={task}", f"dllm.method={args.method}", f"seed={seed}",
        f"train.num_iterations={args.iterations}", f"train.prompts_per_batch={args.prompts}",
        f"train.group_size={args.group}", f"train.lr={args.lr}", f"loss.beta={args.beta}",
        "dllm.eval_size=0", "log.progress=false", "log.save_images=false", "eval.every=0",
        f"log.output_dir={args.out}/runs/{task}-{args.method}-s{seed}", *args.overrides])
    t0 = time.perf_counter()
    summary = Trainer(cfg, log=lambda *a: None).train()
    print(f"{task} seed {seed}: held-out accuracy {summary['start']['eval/accuracy']:.4f} -> "
          f"{summary['end']['eval/accuracy']:.4f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return {"task": task, "seed": seed, "method": args.method, "acc_start": summary["start"]["eval/accuracy"],
            "acc_end": summary["end"]["eval/accuracy"], "reward_start": summary["start"]["eval/reward"],
            "reward_end": summary["end"]["eval/reward"], "seconds": time.perf_counter() - t0}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", nargs="+", default=["arithmetic", "sudoku"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--method", default="diffu_grpo")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--beta", type=float, default=0.0)
    p.add_argument("--out", default="benchmarks/results/dllm")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = [run(t, s, args) for t in args.tasks for s in args.seeds]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    lines = [f"# GRPO on the built-in tiny dLLM ({args.method})", "",
             f"{args.iterations} iterations, {args.prompts} prompts × {args.group} samples, lr {args.lr}, "
             f"beta {args.beta}; held-out accuracy = greedy decoding on the whole test split.", "",
             "| task | seed | acc start | acc end | Δ | reward start | reward end | seconds |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['seed']} | {r['acc_start']:.4f} | {r['acc_end']:.4f} | "
                     f"{r['acc_end'] - r['acc_start']:+.4f} | {r['reward_start']:.4f} | {r['reward_end']:.4f} | "
                     f"{r['seconds']:.0f} |")
    lines += ["", "| task | mean Δ accuracy | seeds improved |", "|---|---|---|"]
    for t in args.tasks:
        d = [r["acc_end"] - r["acc_start"] for r in rows if r["task"] == t]
        lines.append(f"| {t} | {statistics.mean(d):+.4f} | {sum(x > 0 for x in d)}/{len(d)} |")
    cmd = "OMP_NUM_THREADS=1 python benchmarks/dllm_train.py " + " ".join(
        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in vars(args).items()
        if k not in ("overrides", "out")) + (" " + " ".join(args.overrides) if args.overrides else "")
    lines += ["", f"Command: `{cmd}`"]
    (out / "dllm_train.md").write_text("\n".join(lines) + "\n")
    (out / "dllm_train.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
