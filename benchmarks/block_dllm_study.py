"""The built-in block-diffusion LM (``model.name=tiny_block``) under each objective at EQUAL GRAD-FORWARDS, and the
cost of its exact block cache against the masked LM's approximate cache.

Training: objective ∈ {trace_rl, diffu_grpo, coupled_grpo, random_mask, trace_rl+value (``dllm.trace_value=on``:
its value network's forwards count in the budget)} × ``--seeds`` seeds on ``--task``, each run from the same cached
pretrained base (``--objectives`` reruns some and keeps the others' rows of ``<out>/block_study.json``). The objectives spend different numbers of sequence-forwards with grad per
iteration (trace_rl one per decoding step, the block estimators one per block and mask sample), so each run gets the
same budget ``--budget`` of grad-forwards (as the policy counts them): one calibration iteration per objective
measures its grad-forwards per iteration c, and the run trains round(budget / c) iterations (at least 1). Scored:
held-out greedy accuracy (T = 0, the first ``--eval-size`` test prompts) before → after.

Cost: the held-out prompts decoded greedily by tiny_block with its exact cache (keys/values of the prompt and
finished blocks) and by tiny_mlm with ``dllm.kv_cache`` none / prefix / dual (prefix and dual approximate): sequence-
forwards per completion token (rows × model calls / (B · L)) and positions computed per completion token.

Writes <out>/block_study.md and <out>/block_study.json.

    OMP_NUM_THREADS=1 python benchmarks/block_dllm_study.py --task arithmetic --budget 2000 --seeds 0 1 2
    OMP_NUM_THREADS=1 python benchmarks/block_dllm_study.py --budget 60 --seeds 0 --eval-size 4 \\
        --pretrain-steps 20 --out /tmp/block_smoke      # smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

OBJECTIVES = {"trace_rl": ["dllm.method=trace_rl"], "diffu_grpo": ["dllm.method=diffu_grpo"],
              "coupled_grpo": ["dllm.method=coupled_grpo"], "random_mask": ["dllm.method=random_mask"],
              "trace_rl+value": ["dllm.method=trace_rl", "dllm.trace_value=on"]}
CACHES = {"tiny_block exact": ["model.name=tiny_block"],
          "tiny_mlm none": ["model.name=tiny_mlm", "dllm.kv_cache=none", "dllm.block_length=4"],
          "tiny_mlm prefix": ["model.name=tiny_mlm", "dllm.kv_cache=prefix", "dllm.block_length=4"],
          "tiny_mlm dual": ["model.name=tiny_mlm", "dllm.kv_cache=dual", "dllm.block_length=4"]}


def trainer(args, extra: list[str], seed: int = 0):
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides([
        f"dllm.task={args.task}", f"seed={seed}", f"train.prompts_per_batch={args.prompts}",
        f"train.group_size={args.group}", f"train.lr={args.lr}", "dllm.temperature=1.0", "loss.beta=0.0",
        f"dllm.eval_size={args.eval_size}", f"pretrain.steps={args.pretrain_steps}", "log.progress=false",
        "log.save_images=false", "eval.every=0", f"log.output_dir={args.out / 'runs'}", *extra, *args.overrides])
    return Trainer(cfg, log=lambda *a: None)


def grad_forwards_per_iteration(args, objective: str) -> int:
    tr = trainer(args, ["model.name=tiny_block", *OBJECTIVES[objective]])
    before = tr.policy.counters["forwards_grad"]
    tr.step()
    return tr.policy.counters["forwards_grad"] - before


def train_cell(args, objective: str, seed: int, iterations: int) -> dict:
    tr = trainer(args, ["model.name=tiny_block", *OBJECTIVES[objective]], seed)
    start = tr.evaluate()[0]["eval/accuracy"]
    before = tr.policy.counters["forwards_grad"]
    for _ in range(iterations):
        tr.step()
    return {"objective": objective, "seed": seed, "iterations": iterations, "start": start,
            "end": tr.evaluate()[0]["eval/accuracy"], "grad_forwards": tr.policy.counters["forwards_grad"] - before}


def cost_cell(args, name: str) -> dict:
    tr = trainer(args, CACHES[name])
    fam = tr.family
    s = fam.generate(fam.eval_pool[: args.eval_size], temperature=0.0)
    tokens = s.completions.numel()
    return {"decoder": name, "forwards_per_token": s.forwards / tokens, "positions_per_token": s.query_tokens / tokens}


def table(train: list[dict], cost: list[dict], budget: int) -> str:
    lines = [f"## Held-out greedy accuracy, before → after, {budget} grad-forwards per run", "",
             "| objective | iterations | before | after (mean) | per seed |", "|---|---|---|---|---|"]
    for obj in OBJECTIVES:
        rows = [r for r in train if r["objective"] == obj]
        if rows:
            per = ", ".join(f"{r['start']:.3f}→{r['end']:.3f}" for r in rows)
            lines.append(f"| {obj} | {rows[0]['iterations']} | {statistics.mean(r['start'] for r in rows):.3f} | "
                         f"{statistics.mean(r['end'] for r in rows):.3f} | {per} |")
    lines += ["", "## Decoding cost per completion token (greedy, held-out prompts)", "",
              "| decoder | sequence-forwards / token | positions computed / token |", "|---|---|---|"]
    lines += [f"| {c['decoder']} | {c['forwards_per_token']:.3f} | {c['positions_per_token']:.2f} |" for c in cost]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--budget", type=int, default=2000, help="grad-forwards per training run")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--pretrain-steps", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/block_dllm"))
    ap.add_argument("--objectives", nargs="+", default=list(OBJECTIVES), choices=list(OBJECTIVES),
                    help="objectives to (re)run; the others' rows are kept from <out>/block_study.json")
    ap.add_argument("overrides", nargs="*", help="config overrides for every run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    old = json.loads((args.out / "block_study.json").read_text()) if (args.out / "block_study.json").is_file() else {}
    per_iter = {k: v for k, v in old.get("grad_forwards_per_iteration", {}).items() if k not in args.objectives}
    per_iter.update({obj: grad_forwards_per_iteration(args, obj) for obj in args.objectives})
    train = [r for r in old.get("train", []) if r["objective"] not in args.objectives]
    train += [train_cell(args, obj, seed, max(1, round(args.budget / per_iter[obj])))
              for obj in args.objectives for seed in args.seeds]
    cost = [cost_cell(args, name) for name in CACHES]
    (args.out / "block_study.json").write_text(json.dumps({"grad_forwards_per_iteration": per_iter, "train": train,
                                                           "cost": cost, "args": vars(args)}, indent=2, default=str))
    command = "OMP_NUM_THREADS=1 python " + " ".join(sys.argv)
    (args.out / "block_study.md").write_text(f"```\n{command}\n```\n\n" + table(train, cost, args.budget))
    print(table(train, cost, args.budget))


if __name__ == "__main__":
    main()
