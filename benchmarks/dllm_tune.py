"""Choose GRPO hyperparameters for the built-in tiny dLLM without touching the test split.

Runs GRPO for ``--iterations`` and reports only training-split quantities: the sampled training reward (first
vs last 20 iterations) and greedy accuracy on a fixed set of training prompts before and after. The held-out
test split is never decoded, so choices made here do not leak into benchmarks/dllm_train.py's numbers.

    OMP_NUM_THREADS=1 python benchmarks/dllm_tune.py --task sudoku --iterations 150 train.num_inner_epochs=4 ...
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from diffgrpo import RunConfig, Trainer


def train_split_accuracy(tr: Trainer, n: int, samples: int = 4) -> dict[str, float]:
    """Greedy accuracy and T = 1 sampled accuracy (``samples`` per prompt) on n fixed training prompts."""
    fam = tr.family
    ex = fam.task.instances("train")
    ex = [ex[i] for i in torch.randperm(len(ex), generator=torch.Generator().manual_seed(7))[:n].tolist()]
    return {"greedy": fam.score(ex, temperature=0.0, seed=7)["eval/accuracy"],
            "sampled": fam.score(ex, temperature=1.0, samples=samples, seed=7)["eval/accuracy"]}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--task", default="arithmetic")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iterations", type=int, default=150, help="0: probe the base model only")
    p.add_argument("--n", type=int, default=256, help="training prompts decoded greedily before/after")
    p.add_argument("--out", default="/tmp/dllm_tune")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    tag = "-".join([a.task, f"s{a.seed}", f"it{a.iterations}", *[o.split(".")[-1] for o in a.overrides]])
    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", f"dllm.task={a.task}", f"seed={a.seed}",
                                    f"train.num_iterations={a.iterations}", "log.progress=false",
                                    "log.save_images=false", "eval.every=0", "dllm.eval_size=1",
                                    f"log.output_dir={a.out}/{tag}", *a.overrides])
    tr = Trainer(cfg, log=lambda *x: None)
    before = train_split_accuracy(tr, a.n)
    print(json.dumps({"tag": tag, "base": before}), flush=True)
    if a.iterations == 0:
        return
    t0 = time.perf_counter()
    tr.train()
    after = train_split_accuracy(tr, a.n)
    rows = [json.loads(line) for line in open(f"{a.out}/{tag}/metrics.jsonl")]
    r = [x["reward"] for x in rows if "reward" in x]
    res = {"tag": tag, "overrides": a.overrides, "iterations": a.iterations, "seconds": time.perf_counter() - t0,
           "train_reward_first20": statistics.mean(r[:20]), "train_reward_last20": statistics.mean(r[-20:]),
           "train_acc_before": before, "train_acc_after": after}
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
