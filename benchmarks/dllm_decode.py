"""Rollout decoding of the built-in tiny dLLM: forwards per completion token, wall-clock per rollout and held-out
accuracy of the same checkpoint decoded each way; then one short GRPO run per decoder.

Decoders (``--decoders``, each a name from DECODERS): ``schedule`` is LLaDA's sampler at one token per step
(steps = gen_length, the project's default and the baseline); ``thr<τ>`` the confidence-threshold decoder at
threshold τ; ``+prefix`` / ``+dual`` add the key/value cache (rebuilt at each block's first step, as Fast-dLLM).
``--block-length`` sets semi-autoregressive blocks for every decoder (0 = one block, the tasks' default).

Per task and decoder, on the cached pretrained tiny dLLM of the task (``diffgrpo pretrain --task <task>``):
  fwd/tok     sequence-forwards per completion token while sampling (rows × model calls / (B · L))
  cost/tok    positions computed per completion token, in full forwards (a cached step counts its window / N)
  sample s    wall-clock of sampling one training batch (prompts × group at dllm.temperature = 1), median
  rollout s   wall-clock of the whole rollout (sampling + reward + ℓ_old of diffu_grpo), median
  greedy      held-out accuracy at T = 0 (first --eval-size test prompts); sampled: at T = 1
  agree       fraction of greedy held-out completions identical to the baseline decoder's
Then ``--iterations`` GRPO iterations (diffu_grpo, same seed, same base checkpoint) with the baseline and with
``--fast``; reward curve (means over --curve-every iterations), time, held-out greedy accuracy after training
decoded by both decoders. One thread (the machine's load is recorded). Writes <out>/dllm_decode.{md,json}.

    OMP_NUM_THREADS=1 python benchmarks/dllm_decode.py --tasks arithmetic countdown sudoku json_schema
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

from diffgrpo import RunConfig, Trainer
from diffgrpo.models.kv_cache import KVCache

DECODERS = ("schedule", "schedule+prefix", "schedule+dual", "thr0.5", "thr0.7", "thr0.9", "thr0.95", "thr0.99",
            "thr0.999", "thr0.7+prefix", "thr0.9+prefix", "thr0.7+dual", "thr0.9+dual", "thr0.95+dual",
            "thr0.99+dual")


def options(name: str) -> list[str]:
    """The dllm.* overrides of a decoder name."""
    dec, _, cache = name.partition("+")
    out = [] if dec == "schedule" else ["dllm.decode=threshold", f"dllm.decode_threshold={float(dec[3:])}"]
    return out + ([f"dllm.kv_cache={cache}"] if cache else [])


def use(fam, name: str) -> None:
    """Switch the family's decoder in place (the same weights, no reload)."""
    dec, _, cache = name.partition("+")
    fam.d.decode = "schedule" if dec == "schedule" else "threshold"
    fam.d.decode_threshold = 0.9 if dec == "schedule" else float(dec[3:])
    fam.d.kv_cache = cache or "none"
    fam.kv_cache = KVCache(fam.policy, cache, prompt_length=fam.prompt_length, gen_length=fam.gen_length) \
        if cache else None


def decode_all(fam, examples, *, temperature: float, samples: int = 1, seed: int = 1234) -> dict:
    """Decode ``samples`` completions per example in batches of 256 → accuracy, texts, forwards, seconds."""
    ex = [e for e in examples for _ in range(samples)]
    g = torch.Generator().manual_seed(seed)
    texts, fwd, q, t = [], 0, 0, 0.0
    for i in range(0, len(ex), 256):
        t0 = time.perf_counter()
        smp = fam.generate(ex[i:i + 256], temperature=temperature, generator=g)
        t += time.perf_counter() - t0
        texts += [fam.vocab.decode(c) for c in smp.completions]
        fwd, q = fwd + smp.forwards, q + smp.query_tokens
    acc = float(fam.rewards(texts, ex)["correct"].mean())
    n_tok = len(ex) * fam.gen_length
    N = fam.prompt_length + fam.gen_length
    return {"accuracy": acc, "texts": texts, "fwd_per_tok": fwd / n_tok, "cost_per_tok": q / N / n_tok,
            "seconds": t}


def rollout_times(fam, repeats: int) -> dict:
    """Median seconds of sampling one training batch and of the whole rollout, and the batch's forwards/token."""
    samp, roll, fwd = [], [], []
    for _ in range(repeats):
        before = fam.policy.counters["forwards_nograd"]
        ro = fam.rollout()
        samp.append(ro.timings["sample"])
        roll.append(ro.timings["rollout"])
        fwd.append(fam.policy.counters["forwards_nograd"] - before)
    return {"sample_s": statistics.median(samp), "rollout_s": statistics.median(roll),
            "rollout_forwards": statistics.median(fwd)}


def base_config(task: str, args, out: str, extra=()) -> RunConfig:
    return RunConfig.from_overrides([
        "model.name=tiny_mlm", f"dllm.task={task}", f"seed={args.seed}", "log.progress=false",
        "log.save_images=false", "eval.every=0", f"log.output_dir={out}", f"train.prompts_per_batch={args.prompts}",
        f"train.group_size={args.group}", f"train.lr={args.lr}", "dllm.p_mask_prompt=0",
        f"dllm.block_length={args.block_length}", f"train.num_iterations={max(args.iterations, 1)}",
        "dllm.eval_size=0", *extra])


def measure_task(task: str, args, tmp: str) -> dict:
    tr = Trainer(base_config(task, args, f"{tmp}/{task}-measure"), log=lambda *a: None)
    fam = tr.family
    test = fam.task.instances("test")[: args.eval_size or None]
    rows, ref_texts = [], None
    for name in args.decoders:
        use(fam, name)
        greedy = decode_all(fam, test, temperature=0.0)
        sampled = decode_all(fam, test, temperature=1.0, samples=args.eval_samples)
        if ref_texts is None:
            ref_texts = greedy["texts"]
        agree = sum(a == b for a, b in zip(greedy["texts"], ref_texts)) / len(ref_texts)
        times = rollout_times(fam, args.repeats)
        row = {"task": task, "decoder": name, "greedy": greedy["accuracy"], "sampled": sampled["accuracy"],
               "agree": agree, "fwd_per_tok": sampled["fwd_per_tok"], "cost_per_tok": sampled["cost_per_tok"],
               "greedy_fwd_per_tok": greedy["fwd_per_tok"], "greedy_cost_per_tok": greedy["cost_per_tok"],
               "eval_s": greedy["seconds"] + sampled["seconds"], **times,
               "n_test": len(test), "gen_length": fam.gen_length, "block_length": fam.block_length}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


def grpo_task(task: str, args, tmp: str) -> list[dict]:
    """One GRPO run per decoder (baseline, --fast) from the same checkpoint and seed."""
    runs = []
    for name in (args.decoders[0], args.fast):
        tr = Trainer(base_config(task, args, f"{tmp}/{task}-grpo-{name}", options(name)), log=lambda *a: None)
        fam = tr.family
        test = fam.task.instances("test")[: args.eval_size or None]
        t0 = time.perf_counter()
        rewards, t_roll, t_iter = [], 0.0, 0.0
        for _ in range(args.iterations):
            m = tr.step()
            rewards.append(m["reward"])
            t_roll += m["time/rollout"]
            t_iter += m["time/iteration"]
        seconds = time.perf_counter() - t0
        after = {}
        for dec in (args.decoders[0], args.fast):
            use(fam, dec)
            after[dec] = decode_all(fam, test, temperature=0.0)["accuracy"]
        k = args.curve_every
        curve = [statistics.mean(rewards[i:i + k]) for i in range(0, len(rewards), k)]
        row = {"task": task, "decoder": name, "iterations": args.iterations, "seconds": seconds,
               "rollout_s": t_roll, "iteration_s": t_iter, "reward_curve": curve,
               "greedy_after": after, "forwards_nograd": tr.policy.counters["forwards_nograd"],
               "forwards_grad": tr.policy.counters["forwards_grad"]}
        print(json.dumps(row), flush=True)
        runs.append(row)
    return runs


def tables(rows: list[dict], runs: list[dict], head: str) -> list[str]:
    lines = ["# Rollout decoding of the built-in tiny dLLM", "", head, "",
             "| task | decoder | fwd/tok | cost/tok | sample s | × | rollout s | × | greedy | Δ | sampled | Δ | agree |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b = next(x for x in rows if x["task"] == r["task"])
        lines.append(f"| {r['task']} | {r['decoder']} | {r['fwd_per_tok']:.3f} | {r['cost_per_tok']:.3f} | "
                     f"{r['sample_s']:.3f} | {b['sample_s'] / r['sample_s']:.2f} | {r['rollout_s']:.3f} | "
                     f"{b['rollout_s'] / r['rollout_s']:.2f} | {r['greedy']:.3f} | {r['greedy'] - b['greedy']:+.3f} | "
                     f"{r['sampled']:.3f} | {r['sampled'] - b['sampled']:+.3f} | {r['agree']:.3f} |")
    if runs:
        lines += ["", "GRPO (diffu_grpo), same seed and checkpoint; reward = batch mean per block of iterations.", "",
                  "| task | decoder | iterations | s | rollout s | reward curve | greedy after (decoded by each) |",
                  "|---|---|---|---|---|---|---|"]
        for r in runs:
            after = ", ".join(f"{k}: {v:.3f}" for k, v in r["greedy_after"].items())
            curve = " ".join(f"{c:.2f}" for c in r["reward_curve"])
            lines.append(f"| {r['task']} | {r['decoder']} | {r['iterations']} | {r['seconds']:.0f} | "
                         f"{r['rollout_s']:.0f} | {curve} | {after} |")
    return lines


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--tasks", nargs="+", default=["arithmetic", "countdown", "sudoku", "json_schema"])
    p.add_argument("--decoders", nargs="+", default=list(DECODERS), choices=DECODERS,
                   help="the first is the baseline")
    p.add_argument("--fast", default="thr0.9+dual", choices=DECODERS, help="the GRPO run's fast decoder")
    p.add_argument("--block-length", type=int, default=0)
    p.add_argument("--eval-size", type=int, default=256, help="held-out prompts (0 = the whole test split)")
    p.add_argument("--eval-samples", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=0, help="GRPO iterations per decoder (0 = no GRPO runs)")
    p.add_argument("--curve-every", type=int, default=10)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="benchmarks/results/rollout")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()[0]
    rows, runs = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for task in args.tasks:
            rows += measure_task(task, args, tmp)["rows"]
            if args.iterations:
                runs += grpo_task(task, args, tmp)
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(shlex.quote(a) for a in sys.argv)
    load = (load0, os.getloadavg()[0])
    head = (f"Command: `{cmd}`\n\nOne thread; load average {load[0]:.1f} at the start, {load[1]:.1f} at the end (a "
            f"shared 2-core machine: wall-clock ratios are noisier than forward counts). Held-out: "
            f"{f'the first {args.eval_size}' if args.eval_size else 'all'} test prompts; rollout batch {args.prompts} × {args.group} at T = 1; block "
            f"length {args.block_length or 'gen_length'}; × = baseline time / this time; agree = greedy completions "
            f"identical to the baseline's.")
    lines = tables(rows, runs, head)
    name = "dllm_decode" if not args.block_length else f"dllm_decode_block{args.block_length}"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps({"args": vars(args), "command": cmd, "load": load, "rows": rows,
                                                  "grpo": runs}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
