"""Retain's peak memory against the rollout wave size, and the largest wave that fits a memory budget.

Retain keeps the activations of every selected step of every in-flight trajectory, so its peak grows with
the wave (complete groups rolled out and trained together). For each wave size (groups per wave) one
iteration's rollout + first-update backward runs through the retain engine's ``collect`` on the pretrained
built-in model and its peak memory is measured (CUDA: max allocated; CPU: peak live saved-for-backward
bytes, the activation memory the engines trade). ``recompute`` and ``reweight`` on the whole batch are
measured the same way for reference. (That waves leave the gradient unchanged is asserted in
tests/test_lean.py; waves draw the step noise in a different order, so their samples differ here.)

    DIFFGRPO_CACHE=/tmp/dgcache python benchmarks/retain_memory.py --budget-mib 128 --out benchmarks/results/retain_memory
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from diffgrpo import RunConfig, Trainer
from diffgrpo.metering import MemoryMeter


def measure(trainer: Trainer, state: dict, seed: int) -> tuple[int, float]:
    """Peak memory (bytes) of one rollout (in the engine's waves) + first-update backward (the engine's own meter
    covers its backward, which a surrounding CPU meter cannot see), and the gradient-buffer bytes (reweight)."""
    trainer.policy.load_state_dict(state)
    trainer.family.gen_prompts.manual_seed(seed)
    trainer.family.gen_noise.manual_seed(seed + 1)
    trainer.family.gen_steps.manual_seed(seed + 2)
    trainer.optimizer.zero_grad(set_to_none=True)
    with MemoryMeter(trainer.device) as mem:
        ro, stats = trainer.family.collect()
        stats = stats if stats is not None else trainer.family.backward(ro, 0)
    return max(mem.peak, stats.peak_memory_bytes), stats.metrics.get("grad_buffer_bytes", 0.0)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget-mib", type=float, default=128.0, help="memory budget for the largest-wave answer")
    ap.add_argument("--out", default="benchmarks/results/retain_memory")
    ap.add_argument("overrides", nargs="*", help="config overrides key=value")
    args = ap.parse_args(argv)
    base = RunConfig.from_overrides(["log.progress=false", *args.overrides])
    groups = base.train.prompts_per_batch
    ref = Trainer(RunConfig.from_overrides(["engine.name=recompute"], base=base))
    state = {k: v.clone() for k, v in ref.policy.state_dict().items()}
    seed = base.seed + 1000
    rows = []
    for name in ("recompute", "reweight"):
        t = Trainer(RunConfig.from_overrides([f"engine.name={name}"], base=base), policy=ref.policy)
        peak, buf = measure(t, state, seed)
        rows.append({"engine": name, "groups_per_wave": groups, "peak_bytes": peak, "grad_buffer_bytes": buf})
    sizes = sorted({s for s in (1, 2, 4, 8, 16, 32, groups) if s <= groups})
    for s in sizes:
        t = Trainer(RunConfig.from_overrides(["engine.name=retain", f"engine.wave_size={s}"], base=base),
                    policy=ref.policy)
        peak, buf = measure(t, state, seed)
        rows.append({"engine": "retain", "groups_per_wave": s, "peak_bytes": peak, "grad_buffer_bytes": buf})
    rec_peak = rows[0]["peak_bytes"]
    budget = args.budget_mib * 2**20
    fits = [r["groups_per_wave"] for r in rows if r["engine"] == "retain" and r["peak_bytes"] <= budget]
    report = {"config": base.to_dict(), "group_size": base.train.group_size, "num_steps": base.sampler.num_steps,
              "device": str(ref.device), "budget_mib": args.budget_mib,
              "largest_wave_within_budget": max(fits) if fits else 0, "rows": rows}
    lines = [f"Retain peak memory vs wave size ({ref.device}; batch {groups}×{base.train.group_size}, "
             f"T = {base.sampler.num_steps}; CPU figures are peak live saved activations).", "",
             "| engine | groups/wave | samples/wave | peak MiB | × recompute | grad buffers MiB |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['engine']} | {r['groups_per_wave']} | {r['groups_per_wave'] * base.train.group_size} | "
                     f"{r['peak_bytes'] / 2**20:.2f} | {r['peak_bytes'] / max(rec_peak, 1):.2f} | "
                     f"{r['grad_buffer_bytes'] / 2**20:.1f} |")
    lines += ["", f"Largest retain wave within {args.budget_mib:g} MiB: "
                  f"{report['largest_wave_within_budget']} group(s) per wave."]
    md = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "retain_memory.json").write_text(json.dumps(report, indent=2))
    (out / "retain_memory.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
