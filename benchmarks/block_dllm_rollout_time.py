"""Wall-clock per rollout of the built-in block-diffusion LM (``tiny_block``, exact cache of finished blocks) against
the built-in masked LM (``tiny_mlm``, ``dllm.kv_cache`` none / prefix / dual, blocks of 4), side by side in one
process on one thread.

A rollout is one training batch decoded: ``--batch`` held-out prompts (the same prompts for every decoder), one
completion each at T = ``--temperature`` from a generator seeded alike, the decoder of a training run
(``DLLMFamily.generate``: tiny_block block by block, stopping after the block with <eos>; tiny_mlm every block).
Every decoder is warmed up ``--warmup`` times, then ``--repeats`` rounds run each decoder once in turn (the order
rotated every round, so a load change on a shared machine hits every decoder alike); reported: the median seconds
per rollout with its min and max, the median per completion token (B · gen_length tokens), and the counted
sequence-forwards and positions computed per completion token (rows × model calls, rows × query length).
Pretrained bases come from the cache (``--pretrain-steps`` as the study's, so the same cached models).

Writes <out>/rollout_time.md and <out>/rollout_time.json.

    OMP_NUM_THREADS=1 python benchmarks/block_dllm_rollout_time.py --task arithmetic --batch 32 --repeats 15
    OMP_NUM_THREADS=1 python benchmarks/block_dllm_rollout_time.py --repeats 2 --warmup 1 --pretrain-steps 20 \\
        --out /tmp/rollout_smoke      # smoke test
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

DECODERS = {"tiny_block exact": ["model.name=tiny_block"],
            "tiny_mlm none": ["model.name=tiny_mlm", "dllm.kv_cache=none", "dllm.block_length=4"],
            "tiny_mlm prefix": ["model.name=tiny_mlm", "dllm.kv_cache=prefix", "dllm.block_length=4"],
            "tiny_mlm dual": ["model.name=tiny_mlm", "dllm.kv_cache=dual", "dllm.block_length=4"]}


def family(args, extra: list[str]):
    from diffgrpo import RunConfig, Trainer

    cfg = RunConfig.from_overrides([
        f"dllm.task={args.task}", "seed=0", f"pretrain.steps={args.pretrain_steps}", "log.progress=false",
        "log.save_images=false", "eval.every=0", f"log.output_dir={args.out / 'runs'}", *extra, *args.overrides])
    return Trainer(cfg, log=lambda *a: None).family


def rollout(fam, examples, args) -> tuple[float, object]:
    """One timed rollout → (seconds, the sample)."""
    g = torch.Generator(device=fam.device).manual_seed(args.seed)
    t0 = time.perf_counter()
    with torch.no_grad():
        s = fam.generate(examples, temperature=args.temperature, generator=g)
    return time.perf_counter() - t0, s


def measure(args) -> list[dict]:
    fams = {name: family(args, extra) for name, extra in DECODERS.items()}
    first = next(iter(fams.values()))
    examples = first.eval_pool[: args.batch]
    samples = {}
    for name, fam in fams.items():
        for _ in range(args.warmup):
            _, samples[name] = rollout(fam, examples, args)
    times: dict[str, list[float]] = {name: [] for name in fams}
    names = list(fams)
    for r in range(args.repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotated order
            dt, samples[name] = rollout(fams[name], examples, args)
            times[name].append(dt)
    rows = []
    for name in names:
        s, t = samples[name], times[name]
        tokens = s.completions.numel()
        med = statistics.median(t)
        rows.append({"decoder": name, "seconds_median": med, "seconds_min": min(t), "seconds_max": max(t),
                     "ms_per_token": 1000 * med / tokens, "forwards_per_token": s.forwards / tokens,
                     "positions_per_token": s.query_tokens / tokens, "tokens": tokens, "times": t})
    return rows


def table(rows: list[dict], args) -> str:
    lines = [f"## Wall-clock per rollout ({args.batch} prompts × {rows[0]['tokens'] // args.batch} tokens, "
             f"T = {args.temperature}, one thread, median of {args.repeats} after {args.warmup} warm-up)", "",
             "| decoder | ms / rollout, median [min, max] | ms / token | sequence-forwards / token | "
             "positions / token |", "|---|---|---|---|---|"]
    lines += [f"| {r['decoder']} | {1000 * r['seconds_median']:.1f} [{1000 * r['seconds_min']:.1f}, "
              f"{1000 * r['seconds_max']:.1f}] | {r['ms_per_token']:.3f} | {r['forwards_per_token']:.3f} | "
              f"{r['positions_per_token']:.2f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument("--batch", type=int, default=32, help="prompts per rollout (the study's 4 prompts × 8 samples)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pretrain-steps", type=int, default=3000)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/block_dllm"))
    ap.add_argument("overrides", nargs="*", help="config overrides for every decoder")
    args = ap.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = measure(args)
    (args.out / "rollout_time.json").write_text(json.dumps({"rows": rows, "args": vars(args),
                                                            "threads": torch.get_num_threads()}, indent=2,
                                                           default=str))
    command = "OMP_NUM_THREADS=1 python " + " ".join(sys.argv)
    (args.out / "rollout_time.md").write_text(f"```\n{command}\n```\n\n" + table(rows, args))
    print(table(rows, args))


if __name__ == "__main__":
    main()
