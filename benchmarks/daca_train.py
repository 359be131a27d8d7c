"""DACA-GRPO training study: base vs +DPS vs +SML vs +both on a dLLM task, over seeds, at equal steps.

For each base method, variant and seed: the cached pretrained tiny dLLM, ``--iterations`` GRPO iterations, then
greedy decoding on the held-out test split (``dllm.eval_size``). Forwards (grad and no-grad, training only)
are counted from the policy's counters (sequence-forwards, sampling included). Writes <out>/daca_train.{md,json}.

    OMP_NUM_THREADS=1 python benchmarks/daca_train.py --task arithmetic --methods diffu_grpo --seeds 0 1 2
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

VARIANTS = {"base": [], "+dps": ["daca.dps_score=entropy", "daca.dps_mix=0.5"],
            "+sml": ["daca.likelihood=sml", "daca.sml_strata=2"],
            "+both": ["daca.dps_score=entropy", "daca.dps_mix=0.5", "daca.likelihood=sml", "daca.sml_strata=2"]}


def run(method, variant, seed, args) -> dict:
    cfg = RunConfig.from_overrides([
        "model.name=tiny_mlm", f"dllm.task={args.task}", f"dllm.method={method}", f"seed={seed}",
        f"train.prompts_per_batch={args.prompts}", f"train.group_size={args.group}", f"train.lr={args.lr}",
        f"dllm.eval_size={args.eval_size}", "log.progress=false", "log.save_images=false",
        "pretrain.batch_size=64", "dllm.p_mask_prompt=0", *VARIANTS[variant], *args.overrides])
    t0 = time.perf_counter()
    tr = Trainer(cfg, log=lambda *a: None)
    start, _ = tr.evaluate()
    c0 = dict(tr.policy.counters)  # sampling + ℓ_old/ℓ_ref + training forwards (evaluation restores them)
    rewards = [tr.step()["reward"] for _ in range(args.iterations)]
    fw = tr.policy.counters["forwards_grad"] - c0["forwards_grad"]
    fn = tr.policy.counters["forwards_nograd"] - c0["forwards_nograd"]
    end, _ = tr.evaluate()
    r = {"method": method, "variant": variant, "seed": seed, "acc_start": start["eval/accuracy"],
         "acc_end": end["eval/accuracy"], "train_reward_first": rewards[0],
         "train_reward_last5": statistics.mean(rewards[-5:]), "forwards_grad": fw, "forwards_nograd": fn,
         "seconds": time.perf_counter() - t0}
    print(f"{method} {variant} seed {seed}: acc {r['acc_start']:.3f} -> {r['acc_end']:.3f} "
          f"({r['seconds']:.0f} s)", flush=True)
    return r


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--methods", nargs="+", default=["diffu_grpo"])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=15)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--eval-size", type=int, default=128)
    p.add_argument("--out", default="benchmarks/results/daca")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = [run(m, v, s, args) for m in args.methods for v in args.variants for s in args.seeds]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "OMP_NUM_THREADS=1 python benchmarks/daca_train.py " + " ".join(
        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
        for k, v in vars(args).items() if k not in ("overrides", "out")) + \
        (" " + " ".join(args.overrides) if args.overrides else "")
    lines = [f"# DACA-GRPO on the built-in tiny dLLM ({args.task})", "",
             f"{args.iterations} iterations, {args.prompts} prompts × {args.group} samples, lr {args.lr}; "
             f"held-out accuracy = greedy decoding on {args.eval_size or 'all'} test prompts. "
             f"DPS = entropy score, λ = 0.5; SML = K 2, random partition, leave_one_out.", "",
             "| method | variant | mean acc start | mean acc end | mean Δ | seeds improved | train reward first → last5 "
             "| forwards grad | forwards no-grad | seconds/run |", "|---|---|---|---|---|---|---|---|---|---|"]
    for m in args.methods:
        for v in args.variants:
            rs = [r for r in rows if r["method"] == m and r["variant"] == v]
            d = [r["acc_end"] - r["acc_start"] for r in rs]
            lines.append(f"| {m} | {v} | {statistics.mean(r['acc_start'] for r in rs):.4f} | "
                         f"{statistics.mean(r['acc_end'] for r in rs):.4f} | {statistics.mean(d):+.4f} | "
                         f"{sum(x > 0 for x in d)}/{len(d)} | "
                         f"{statistics.mean(r['train_reward_first'] for r in rs):.3f} → "
                         f"{statistics.mean(r['train_reward_last5'] for r in rs):.3f} | "
                         f"{statistics.mean(r['forwards_grad'] for r in rs):.0f} | "
                         f"{statistics.mean(r['forwards_nograd'] for r in rs):.0f} | "
                         f"{statistics.mean(r['seconds'] for r in rs):.0f} |")
    lines += ["", f"Command: `{cmd}`"]
    (out / "daca_train.md").write_text("\n".join(lines) + "\n")
    (out / "daca_train.json").write_text(json.dumps({"args": vars(args), "command": cmd, "rows": rows}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
