"""What diversity the KL-regularised optimum keeps at each reward on the built-in task, beside the study's runs.

Draws ``--samples`` base-model samples per held-out prompt (the study's evaluation: its prompts, ODE sampling from
fixed seeds), scores them with the study's reward and the guards' features, and reports the base policy tilted by
its reward (:mod:`diffgrpo.studies.tilt`: the policy nearest the base in KL among those with that mean reward) at each
target: its diversity ÷ the base's, its KL and its effective samples per prompt. It is the line a method that only
trades reward against KL to the base moves along at best; a method with a diversity term of its own can lie above
it. With ``--study DIR`` (a finished
``bench quality`` output on the same task) the figure shows every evaluation of every cell (reward, diversity ÷ its
start) over the tilted curve, and the table each variant's mean point at the study's target.

    OMP_NUM_THREADS=1 python benchmarks/kl_optimal_diversity.py --study benchmarks/results/bench_quality/study_nft_objectives \
        --out benchmarks/results/bench_quality/kl_optimal_diversity
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, guards
from diffgrpo.feature_stats import per_prompt_diversity
from diffgrpo.studies import tilt
from diffgrpo.studies.quality_stats import DIVERSITY_KEYS
from diffgrpo.trainer import Trainer


def study_base() -> list[str]:
    """The study's base overrides (``benchmarks/time_to_quality.py``'s ``BASE``), read beside this file."""
    spec = importlib.util.spec_from_file_location("time_to_quality", Path(__file__).with_name("time_to_quality.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.BASE)


def base_samples(n: int, overrides: list[str], chunk: int = 512):
    """The base model's evaluation samples, ``n`` seeds per prompt → (features (N, D), rewards (N,), prompts)."""
    cfg = RunConfig.from_overrides([*study_base(), *overrides, f"eval.seeds_per_prompt={n}"])
    trainer = Trainer(cfg, log=lambda *a: None)
    fam = trainer.family
    features = guards.image_feature_fn(cfg, trainer.device)
    prompts, seeds, metadata = fam.eval_prompts()
    g = fam._eval_generator()
    feats, rewards = [], []
    with torch.no_grad():
        for lo in range(0, len(prompts), chunk):
            sl = slice(lo, lo + chunk)
            images, r, _ = fam._eval_chunk(prompts[sl], seeds[sl], metadata[sl], g)  # ODE: each seed's own noise
            feats.append(features(images).double().cpu())
            rewards.append(r.double().cpu())
    return torch.cat(feats), torch.cat(rewards), prompts


def study_points(study: Path) -> tuple[dict, dict, float]:
    """A bench quality output → ({variant: [(reward, diversity ÷ start) at every evaluation]}, {variant: (its
    diversity at the target inside the guards, seeds that reached it)} from its summary, the study's target)."""
    s = json.loads((study / "summary.json").read_text())
    key = s.get("diversity_key") or DIVERSITY_KEYS[-1]
    curves: dict[str, list] = {}
    for c in s["cells"]:
        ev = [e["metrics"] for e in c["evaluations"]]
        if ev and key in ev[0]:
            curves.setdefault(c["variant"], []).extend((m["eval/reward"], m[key] / ev[0][key]) for m in ev)
    means = {r["variant"]: (r["diversity_at_target"][key], r["reached"]) for r in s["rows"]
             if key in (r.get("diversity_at_target") or {})}
    return curves, means, float(s["target"])


def plot(out: Path, curve: list[dict], curves: dict, base_reward: float, target: float | None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for i, (v, pts) in enumerate(sorted(curves.items())):
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=9, alpha=0.5, label=v, color=f"C{i % 10}")
    ok = [p for p in curve if p["inv_beta"] is not None]
    ax.plot([p["reward"] for p in ok], [p["diversity_ratio"] for p in ok], "k-", lw=2,
            label="the base tilted by its reward (KL-optimal)")
    ax.axvline(base_reward, color="grey", ls="--", lw=0.8)
    if target is not None:
        ax.axvline(target, color="grey", ls=":", lw=1)
        ax.plot([target], [0.95], marker="*", ms=12, color="gold", mec="k", ls="none", label="goal (≥ 0.95× at the target)")
    ax.set_xlabel("held-out reward")
    ax.set_ylabel("diversity ÷ start")
    ax.legend(fontsize=7, loc="lower left")
    ax.set_title("every evaluation of the study, and the KL-optimal policy", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "frontier.png", dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=1024, help="base samples per held-out prompt")
    p.add_argument("--targets", type=float, nargs="+", default=[])
    p.add_argument("--study", default="", help="a finished bench quality output on the same task")
    p.add_argument("--out", default="benchmarks/results/bench_quality/kl_optimal_diversity")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides (the study's)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    feats, rewards, prompts = base_samples(a.samples, a.overrides)
    curves, means, study_target = study_points(Path(a.study)) if a.study else ({}, {}, None)
    base_reward = float(rewards.mean())
    grid = sorted({*a.targets, *([study_target] if study_target is not None else []),
                   *(round(base_reward + k * 0.02, 4) for k in range(16))})
    curve = [tilt.tilted_point(feats, rewards, prompts, t) for t in grid]
    summary = {"samples_per_prompt": a.samples, "prompts": len(set(prompts)), "base_reward": base_reward,
               "base_diversity": per_prompt_diversity(feats, prompts), "curve": curve, "study": a.study or None,
               "study_target": study_target, "study_at_target": means, "seconds": time.perf_counter() - t0}
    command = "OMP_NUM_THREADS=1 python benchmarks/kl_optimal_diversity.py " + " ".join(
        shlex.quote(w) for w in (argv if argv is not None else sys.argv[1:]))
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "command.txt").write_text(command + "\n")
    lines = [f"# The KL-optimal policy's diversity at each reward ({a.samples} base samples per prompt)", "",
             f"Command: `{command}`", "",
             f"Base: reward {base_reward:.4f}, per-prompt diversity {summary['base_diversity']:.4f} "
             f"({len(set(prompts))} prompts; {summary['seconds']:.0f} s).", "",
             "| target reward | 1/β | diversity ÷ base | KL (nats / prompt) | effective samples per prompt (min, mean) |",
             "|---|---|---|---|---|"]
    for c in curve:
        mark = " (the study's target)" if study_target is not None and c["target"] == study_target else ""
        lines.append(f"| {c['target']:.4f}{mark} | " + ("out of the samples' reach | — | — | — |" if c["inv_beta"] is None
                     else f"{c['inv_beta']:.2f} | {c['diversity_ratio']:.3f}× | {c['kl']:.3f} | "
                          f"{c['ess_min']:.0f}, {c['ess_mean']:.0f} |"))
    if means:
        lines += ["", f"Each variant of `{a.study}` at its first evaluation at the target ({study_target:.4f}) inside "
                  "the guards, mean over the seeds that reached it (the study's 'diversity at target'):", "",
                  "| variant | seeds at the target | diversity ÷ start |", "|---|---|---|"]
        lines += [f"| {v} | {n} | {d:.3f}× |" for v, (d, n) in sorted(means.items())]
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(out, curve, curves, base_reward, study_target)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
