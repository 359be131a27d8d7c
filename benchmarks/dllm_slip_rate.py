"""What GRPO changed on held-out prompts: the share of completions that are the base's systematic slip
(``Task.slip``, the habit ``pretrain.answer_noise`` put into the built-in base) and the share of other wrong
answers, before (the base) and after training, for every run directory of benchmarks/dllm_train.py.

Greedy decoding and T = 1 sampling (4 completions per prompt) on the whole test split; the final weights are
the run's ``weights.safetensors``.

    OMP_NUM_THREADS=1 python benchmarks/dllm_slip_rate.py benchmarks/results/dllm/slip_base/*/runs/*
"""
from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from diffgrpo import RunConfig, Trainer


@torch.no_grad()
def rates(fam, temperature: float, samples: int) -> dict[str, float]:
    test = fam.task.instances("test")
    ex = [e for e in test for _ in range(samples)]
    g = torch.Generator().manual_seed(1234)
    outs = []
    for i in range(0, len(ex), 256):
        smp = fam.generate(ex[i:i + 256], temperature=temperature, generator=g)
        outs += [fam.vocab.decode(c) for c in smp.completions]
    correct = fam.task.rewards(outs, ex)["correct"]
    slip = torch.tensor([o.strip() == fam.task.slip(e) for o, e in zip(outs, ex)], dtype=torch.float32)
    return {"correct": float(correct.mean()), "slip": float(slip.mean()), "other_wrong": float((1 - correct - slip).mean())}


def main():
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rows = []
    for d in map(Path, sys.argv[1:]):
        cfg = RunConfig.from_yaml(d / "config.yaml", ["log.progress=false"])
        tr = Trainer(cfg, log=lambda *a: None)
        row = {"run": d.name, "task": cfg.dllm.task, "method": cfg.dllm.method}
        for stage in ("base", "trained"):
            if stage == "trained":
                tr.policy.load_state_dict(load_file(str(d / "weights.safetensors")))
            for name, temp, k in (("greedy", 0.0, 1), ("sampled", 1.0, 4)):
                for key, v in rates(tr.family, temp, k).items():
                    row[f"{stage}/{name}/{key}"] = v
        print(json.dumps(row), flush=True)
        rows.append(row)
    lines = ["| task | method | decoding | correct base → trained | slip base → trained | other wrong base → trained |",
             "|---|---|---|---|---|---|"]
    for t, m in dict.fromkeys((r["task"], r["method"]) for r in rows):
        sel = [r for r in rows if (r["task"], r["method"]) == (t, m)]
        for dec in ("greedy", "sampled"):
            cell = lambda k: " → ".join(f"{statistics.mean(r[f'{s}/{dec}/{k}'] for r in sel):.3f}"  # noqa: E731
                                        for s in ("base", "trained"))
            lines.append(f"| {t} | {m} | {dec} | {cell('correct')} | {cell('slip')} | {cell('other_wrong')} |")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
