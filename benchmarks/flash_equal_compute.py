"""Equal-compute study of Flash-GRPO single-step training on the default task.

Claim tested (DESIGN §6): at equal training compute, single-step training reaches higher reward than
full-trajectory training. Every run starts from the same built-in pretrained model (digit_alignment reward)
and trains until its counted cost reaches a fixed budget; the held-out reward (``trainer.evaluate()``,
fixed prompts and seeds, ODE sampling) is recorded at budget checkpoints.

Variants
  single_step          Flash-GRPO: iso-temporal step per group, ODE-but-one rollout, rectified loss
  single_step_norect   the same without temporal gradient rectification
  recompute_all        FlowGRPO baseline: full SDE rollout, every trainable step trained
  recompute_random1    full SDE rollout, one random step per sample (steps.mode=random), no iso-temporal grouping

Cost (sample-forward units, backward ≈ 2 forwards): forwards with and without grad (rollout + training) +
2·sample_backwards, from the policy counters and the engine stats; evaluation is not counted. Wall time is the
cumulative rollout + update seconds (evaluation excluded) on a shared 2-core CPU: noisy, reported for shape.

    python benchmarks/flash_equal_compute.py --seeds 0 1 2 --budget-iters 10 --out benchmarks/results/flash
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

VARIANTS = {
    "single_step": ["engine.name=single_step", "engine.rectify=true"],
    "single_step_norect": ["engine.name=single_step", "engine.rectify=false"],
    "recompute_all": ["engine.name=recompute", "steps.mode=all"],
    "recompute_random1": ["engine.name=recompute", "steps.mode=random", "steps.fraction=0.1"],
}
EVAL_KEY = "eval/rewards/digit_alignment/mean"


def iteration_cost(cfg: RunConfig, variant: str) -> int:
    """Counted cost of one iteration (rollout + one update) from the cost model, for sizing the budget."""
    B = cfg.train.prompts_per_batch * cfg.train.group_size
    T = cfg.sampler.num_steps
    K = T - 1 if variant == "recompute_all" else 1
    return B * (T + 3 * K)


def run_one(base: list[str], variant: str, seed: int, budget: float, checkpoints: list[float], log,
            verbose: bool = False) -> dict:
    cfg = RunConfig.from_overrides([*base, *VARIANTS[variant], f"seed={seed}"])
    tr = Trainer(cfg, log=lambda *a: None)
    pol = tr.policy
    cost, seconds, train_seconds, it = 0.0, 0.0, 0.0, 0
    curve = []

    def record():
        row, _ = tr.evaluate()
        curve.append({"iteration": it, "cost": cost, "seconds": seconds, "train_seconds": train_seconds,
                      "eval": row.get(EVAL_KEY, row["eval/reward"])})

    record()
    pending = [c for c in checkpoints if c > 0]
    train_rewards = []
    while pending:
        f0 = pol.counters["forwards_grad"] + pol.counters["forwards_nograd"]
        row = tr.step()
        it += 1
        f1 = pol.counters["forwards_grad"] + pol.counters["forwards_nograd"]
        cost += (f1 - f0) + 2 * row["sample_backwards"]
        seconds += row["time/iteration"]
        train_seconds += row["time/train"]
        train_rewards.append(row["reward"])
        if verbose:
            log(f"    {variant} seed {seed} it {it}: cost {cost:.0f}/{budget:.0f}, {row['time/iteration']:.1f}s")
        while pending and cost >= pending[0] - 1e-9:
            pending.pop(0)
            record()
    log(f"  {variant:20s} seed {seed}: {it} iterations, cost {cost:.0f}, {seconds:.1f}s, "
        f"eval {curve[0]['eval']:.4f} -> {curve[-1]['eval']:.4f}")
    return {"variant": variant, "seed": seed, "iterations": it, "curve": curve, "train_rewards": train_rewards}


def summarize(runs: list[dict], fractions: list[float]) -> list[dict]:
    rows = []
    for variant in VARIANTS:
        vr = [r for r in runs if r["variant"] == variant]
        if not vr:
            continue
        for j, f in enumerate(fractions):
            pts = [r["curve"][j] for r in vr]
            ev = [p["eval"] for p in pts]
            gains = [p["eval"] - r["curve"][0]["eval"] for p, r in zip(pts, vr)]
            rows.append({"variant": variant, "budget_fraction": f, "cost_mean": statistics.mean(p["cost"] for p in pts),
                         "seconds_mean": statistics.mean(p["seconds"] for p in pts),
                         "iterations_mean": statistics.mean(p["iteration"] for p in pts),
                         "eval_mean": statistics.mean(ev), "eval_std": statistics.stdev(ev) if len(ev) > 1 else 0.0,
                         "gain_mean": statistics.mean(gains),
                         "gain_std": statistics.stdev(gains) if len(gains) > 1 else 0.0})
    return rows


def to_markdown(meta: dict, rows: list[dict]) -> str:
    lines = [
        "# Flash-GRPO equal-compute study (default task: built-in pretrained model, digit_alignment)", "",
        f"Command: `{meta['command']}`", "",
        f"Settings: {', '.join(meta['base'])}; seeds {meta['seeds']}; budget {meta['budget']:.0f} cost units "
        f"(= {meta['budget_iters']} recompute_all iterations); checkpoints at {meta['fractions']} of the budget. "
        f"Cost = sample-forwards (rollout + training, with and without grad) + 2·sample-backwards; evaluation "
        f"({meta['eval_images']} held-out images, ODE) not counted. Seconds: cumulative rollout + update wall time "
        f"on a shared 2-core CPU (noisy). Total study time {meta['total_seconds']:.0f} s.", "",
        "Held-out reward (mean ± std over seeds) and its gain over the start, per budget checkpoint:", "",
        "| variant | budget | cost | iterations | seconds | eval reward | gain vs start |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['budget_fraction']:.2f} | {r['cost_mean']:.0f} | {r['iterations_mean']:.1f} | "
                     f"{r['seconds_mean']:.1f} | {r['eval_mean']:.4f} ± {r['eval_std']:.4f} | "
                     f"{r['gain_mean']:+.4f} ± {r['gain_std']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(rows_runs: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"single_step": "C0", "single_step_norect": "C1", "recompute_all": "C2", "recompute_random1": "C3"}
    for variant in VARIANTS:
        vr = [r for r in rows_runs if r["variant"] == variant]
        if not vr:
            continue
        n = min(len(r["curve"]) for r in vr)
        for ax, key in zip(axes, ("cost", "seconds")):
            xs = [statistics.mean(r["curve"][j][key] for r in vr) for j in range(n)]
            ys = [statistics.mean(r["curve"][j]["eval"] for r in vr) for j in range(n)]
            sd = [statistics.stdev([r["curve"][j]["eval"] for r in vr]) if len(vr) > 1 else 0 for j in range(n)]
            ax.errorbar(xs, ys, yerr=sd, marker="o", capsize=3, label=variant, color=colors[variant])
    axes[0].set_xlabel("counted cost (sample-forwards + 2·sample-backwards)")
    axes[1].set_xlabel("cumulative rollout + update seconds (shared 2-core CPU)")
    for ax in axes:
        ax.set_ylabel("held-out digit_alignment (mean over seeds)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("Flash-GRPO equal-compute study (mean ± std over seeds)")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget-iters", type=float, default=10,
                   help="budget in units of one recompute_all iteration's counted cost")
    p.add_argument("--fractions", type=float, nargs="+", default=[0.0, 0.25, 0.5, 0.75, 1.0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS))
    p.add_argument("--out", default="benchmarks/results/flash")
    p.add_argument("--verbose", action="store_true", help="one line per training iteration")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    base = ["train.prompts_per_batch=4", "train.group_size=8", "train.lr=3e-4", "log.progress=false",
            "log.save_images=false", "eval.every=0", "eval.seeds_per_prompt=4", *a.overrides]
    cfg = RunConfig.from_overrides(base)
    budget = a.budget_iters * iteration_cost(cfg, "recompute_all")
    checkpoints = [f * budget for f in a.fractions]
    t0 = time.perf_counter()
    runs = []
    for seed in a.seeds:
        for variant in a.variants:
            runs.append(run_one(base, variant, seed, budget, checkpoints, print, a.verbose))
    total = time.perf_counter() - t0
    rows = summarize(runs, a.fractions)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/flash_equal_compute.py " + " ".join(argv if argv is not None else
                                                                             __import__("sys").argv[1:]),
            "base": base, "seeds": a.seeds, "budget": budget, "budget_iters": a.budget_iters,
            "fractions": a.fractions, "eval_images": 10 * cfg.eval.seeds_per_prompt, "total_seconds": total,
            "torch_threads": torch.get_num_threads()}
    (out / "flash_equal_compute.json").write_text(json.dumps({"meta": meta, "rows": rows, "runs": runs}, indent=2))
    md = to_markdown(meta, rows)
    (out / "flash_equal_compute.md").write_text(md)
    plot(runs, out / "flash_equal_compute.png")
    print(md)


if __name__ == "__main__":
    main()
