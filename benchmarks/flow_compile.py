"""model.compile on the built-in tiny flow transformer (CPU): seconds per GRPO iteration eager vs compiled.

For each engine (``--engines``) and each setting (eager; model.compile with each ``--backends``): a fresh trainer
on the tiny SD3 transformer at random init (same seed: same rollouts up to rounding), one warm-up iteration
(compilation included: reported as ``first s``), then ``--iterations`` timed iterations: median seconds per
iteration, of its rollout and of its train phase, and the speed ratio eager / compiled. The reward is
jpeg_incompressibility (no classifier to pretrain). Writes <out>/flow_compile.{md,json}.

    OMP_NUM_THREADS=1 python benchmarks/flow_compile.py --engines recompute nft --backends inductor
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch._dynamo

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.tiny import build_tiny_policy


def run(engine: str, backend: str, args, tmp: str) -> dict:
    extra = [] if backend == "eager" else ["model.compile=true", f"model.compile_backend={backend}"]
    cfg = RunConfig.from_overrides([
        f"engine.name={engine}", f"model.image_size={args.image_size}", f"model.num_layers={args.layers}",
        f"sampler.num_steps={args.steps}", f"train.prompts_per_batch={args.prompts}", f"train.group_size={args.group}",
        "reward.weights={jpeg_incompressibility: 1.0}", "log.progress=false", "log.save_images=false",
        f"log.output_dir={tmp}/{engine}-{backend}", "seed=0", *extra])
    torch._dynamo.reset()
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    tr = Trainer(cfg, policy=policy, log=lambda *a: None)
    t0 = time.perf_counter()
    first = tr.step()
    first_s = time.perf_counter() - t0
    its = [tr.step() for _ in range(args.iterations)]
    med = {k: statistics.median(m[k] for m in its) for k in ("time/iteration", "time/rollout", "time/train")}
    row = {"engine": engine, "backend": backend, "first_s": first_s, "iteration_s": med["time/iteration"],
           "rollout_s": med["time/rollout"], "train_s": med["time/train"], "reward_first": first["reward"],
           "reward_last": its[-1]["reward"] if its else first["reward"]}
    print(json.dumps(row), flush=True)
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--engines", nargs="+", default=["recompute"])
    p.add_argument("--backends", nargs="+", default=["inductor"], choices=["inductor", "aot_eager"])
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--out", default="benchmarks/results/rollout")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load0 = os.getloadavg()[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for engine in args.engines:
            for backend in ("eager", *args.backends):
                rows.append(run(engine, backend, args, tmp))
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(shlex.quote(a) for a in sys.argv)
    load = (load0, os.getloadavg()[0])
    lines = ["# model.compile on the tiny flow transformer (CPU, one thread)", "", f"Command: `{cmd}`", "",
             f"Load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (a shared 2-core machine). "
             f"{args.prompts} prompts × {args.group}, {args.steps} steps, {args.image_size}² images, {args.layers} "
             f"blocks; medians of {args.iterations} iterations after one warm-up (first s: compilation included). "
             "speed = eager / compiled.", "",
             "| engine | backend | first s | iteration s | rollout s | train s | speed (iteration) | speed (rollout) "
             "| speed (train) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e = next(x for x in rows if x["engine"] == r["engine"] and x["backend"] == "eager")
        lines.append(f"| {r['engine']} | {r['backend']} | {r['first_s']:.1f} | {r['iteration_s']:.3f} | "
                     f"{r['rollout_s']:.3f} | {r['train_s']:.3f} | {e['iteration_s'] / r['iteration_s']:.2f} | "
                     f"{e['rollout_s'] / r['rollout_s']:.2f} | {e['train_s'] / max(r['train_s'], 1e-9):.2f} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "flow_compile.md").write_text("\n".join(lines) + "\n")
    (out / "flow_compile.json").write_text(json.dumps({"args": vars(args), "command": cmd, "load": load,
                                                      "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
