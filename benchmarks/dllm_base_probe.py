"""Probe a built-in dLLM base model pretrained for a given number of steps: held-out greedy accuracy, train-split
greedy accuracy, T = 1 sample reward and the share of reward groups with variance (is there anything for GRPO
to learn?). Usage: OMP_NUM_THREADS=1 python benchmarks/dllm_base_probe.py <task> <pretrain.steps>
"""
import sys
import time

import torch

torch.set_num_threads(1)
from diffgrpo import RunConfig, Trainer  # noqa: E402 (after the thread count is set)

task, steps = sys.argv[1], int(sys.argv[2])
cfg = RunConfig.from_overrides(["model.name=tiny_mlm", f"dllm.task={task}", "dllm.eval_size=0", "log.progress=false",
    "log.save_images=false", f"pretrain.steps={steps}", "pretrain.batch_size=64", "dllm.p_mask_prompt=0",
    f"log.output_dir=/tmp/wb/probe-{task}-{steps}"])
t0 = time.time()
tr = Trainer(cfg, log=lambda *a: None)
t1 = time.time()
row, _ = tr.evaluate()
# train-split greedy accuracy and T=1 sample reward on train split
f = tr.family
pool = f.task.instances("train")
g = torch.Generator().manual_seed(0)
idx = torch.randperm(len(pool), generator=g)[:512].tolist()
ex = [pool[i] for i in idx]
smp = f.generate(ex, temperature=0.0, generator=g)
sc = f.task.rewards([f.vocab.decode(c) for c in smp.completions], ex)
ex8 = [e for e in ex[:64] for _ in range(8)]
smp = f.generate(ex8, temperature=1.0, generator=g)
sc1 = f.task.rewards([f.vocab.decode(c) for c in smp.completions], ex8)
r = sc1["reward"].view(64, 8)
print(f"{task} steps={steps} pretrain {t1-t0:.0f}s test_acc={row['eval/accuracy']:.4f} test_reward={row['eval/reward']:.4f} "
      f"ntest={len(f.task.instances('test'))} train_greedy_acc={float(sc['correct'].mean()):.4f} "
      f"train_T1_reward={float(r.mean()):.4f} frac_groups_var>0={float((r.std(1)>0).float().mean()):.3f}", flush=True)
