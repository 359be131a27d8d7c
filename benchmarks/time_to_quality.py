"""Time to quality on the built-in task: held-out reward against wall-clock and counted cost, with guards.

Every variant is a list of config overrides (``--variant NAME=key=value,key=value`` adds one, e.g. a later
``engine.name=nft``) trained from the same built-in pretrained model on the default digit_alignment task, for every
seed. All runs live in one process on one thread (``OMP_NUM_THREADS=1``, ``torch.set_num_threads(1)``) and are
stepped **interleaved**: the next iteration always goes to the unfinished run with the least training wall-clock,
so machine noise (a shared CPU) hits every variant alike and every run gets the same training-time budget
(``--budget-seconds``, or ``--max-iterations``, whichever comes first).

Recorded per run, at start and whenever its training clock passes each of ``--evals`` equally spaced marks (and at
the end): the held-out reward (``trainer.evaluate()``: fixed prompts and seeds, ODE sampling), the fidelity
``eval/fid`` (Fréchet distance of the digit classifier's penultimate features against the digits test split) and
the per-prompt diversity ``eval/diversity`` (``diffgrpo.quality``), against

  wall-clock  cumulative ``trainer.step()`` seconds (rollout + rewards + update; evaluation excluded)
  cost        sample-forwards (rollout and training, with and without grad) + 2 × sample-backwards

Target (default): the mean over seeds of the held-out reward ``recompute`` reaches at the end of its run here. A
variant *reaches* the target at the first evaluation where its seed-mean reward ≥ target while its seed-mean FID is
at most ``(1 + fid_margin)`` × recompute's final FID and its seed-mean diversity at least ``(1 − div_margin)`` ×
recompute's final diversity; a variant whose reward reaches the target only outside those margins is marked as
hacking. Outputs under ``--out``: ``table.md``, ``summary.json`` (aggregate), ``curves.png``, ``configs/<variant>
_seed<s>.yaml`` (the resolved config of every cell) and ``command.txt``. No per-iteration logs.

    OMP_NUM_THREADS=1 python benchmarks/time_to_quality.py --seeds 0 1 2 --budget-seconds 60 --evals 6
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import yaml

from diffgrpo import RunConfig, Trainer
from diffgrpo.config import to_dict

VARIANTS: dict[str, list[str]] = {
    "recompute": ["engine.name=recompute"],
    "jagg_w4": ["engine.name=jagg", "engine.window=4"],
    "jagg_w4_retain": ["engine.name=jagg", "engine.window=4", "engine.evaluation=retain"],
    "retain": ["engine.name=retain"],
    "single_step": ["engine.name=single_step"],
    "single_step_prefix": ["engine.name=single_step", "sampler.shared_prefix=true"],
    "sliding_window": ["engine.name=recompute", "steps.mode=window", "steps.window_start=0", "steps.window_size=3",
                       "steps.window_shift_every=2", "steps.ode_outside=true"],
    "sliding_window_fast": ["engine.name=recompute", "steps.mode=window", "steps.window_start=0",
                            "steps.window_size=3", "steps.window_shift_every=2", "steps.ode_outside=true",
                            "sampler.shared_prefix=true", "sampler.tail_solver=heun", "sampler.tail_steps=2"],
}
BASE = ["train.prompts_per_batch=4", "train.group_size=8", "train.lr=3e-4", "log.progress=false",
        "log.save_images=false", "eval.every=0", "eval.seeds_per_prompt=8"]
REWARD_KEY = "eval/rewards/digit_alignment/mean"


# ---------------------------------------------------------------------- one run, stepped from outside
class Run:
    """One (variant, seed) cell: a Trainer plus its clocks, cost counter and evaluation curve."""

    def __init__(self, variant: str, overrides: list[str], seed: int, base: list[str]):
        self.variant, self.seed = variant, seed
        self.cfg = RunConfig.from_overrides([*base, *overrides, f"seed={seed}"])
        self.trainer = Trainer(self.cfg, log=lambda *a: None)
        self.seconds = 0.0
        self.cost = 0.0
        self.saved = 0
        self.iterations = 0
        self.curve: list[dict] = []
        self.done = False

    def evaluate(self) -> None:
        row, _ = self.trainer.evaluate()
        self.curve.append({"iteration": self.iterations, "seconds": self.seconds, "cost": self.cost,
                           "reward": row.get(REWARD_KEY, row["eval/reward"]), "fid": row.get("eval/fid", float("nan")),
                           "diversity": row.get("eval/diversity", float("nan"))})

    def step(self) -> None:
        c = self.trainer.policy.counters
        f0, s0 = c["forwards_grad"] + c["forwards_nograd"], c.get("forwards_saved", 0)
        t0 = time.perf_counter()
        row = self.trainer.step()
        self.seconds += time.perf_counter() - t0
        self.cost += (c["forwards_grad"] + c["forwards_nograd"] - f0) + 2 * row["sample_backwards"]
        self.saved += c.get("forwards_saved", 0) - s0
        self.iterations += 1


def interleave(runs: list[Run], budget: float, max_iterations: int, evals: int, log=print) -> None:
    """Step the unfinished run with the least training seconds until every run has spent ``budget`` seconds or
    ``max_iterations`` iterations; evaluate each run when its clock passes budget·j/evals (j = 1 … evals)."""
    for r in runs:
        r.evaluate()
    marks = [budget * j / evals for j in range(1, evals + 1)]
    while True:
        live = [r for r in runs if not r.done]
        if not live:
            return
        r = min(live, key=lambda q: (q.seconds, q.iterations))
        r.step()
        passed = sum(1 for m in marks if r.seconds >= m)
        finished = r.seconds >= budget or r.iterations >= max_iterations
        if len(r.curve) - 1 < passed or finished:
            r.evaluate()
            while len(r.curve) - 1 < (evals if finished else passed):  # marks passed in one step share a point
                r.curve.insert(-1 if not finished else len(r.curve) - 1, dict(r.curve[-1]))
        if finished:
            r.done = True
            last = r.curve[-1]
            log(f"  {r.variant:20s} seed {r.seed}: {r.iterations} it, {r.seconds:.1f}s, cost {r.cost:.0f}, "
                f"reward {r.curve[0]['reward']:.4f} -> {last['reward']:.4f}, fid {last['fid']:.2f}, "
                f"div {last['diversity']:.3f}", flush=True)


# ---------------------------------------------------------------------- aggregation
def _mean(xs):
    return statistics.mean(xs) if xs else float("nan")


def _std(xs):
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_curve(runs: list[Run]) -> list[dict]:
    """Seed-mean curve, evaluation by evaluation (the j-th evaluation of each seed; cut at the shortest)."""
    n = min(len(r.curve) for r in runs)
    out = []
    for j in range(n):
        pts = [r.curve[j] for r in runs]
        out.append({k: _mean([p[k] for p in pts]) for k in ("seconds", "cost", "iteration", "reward", "fid",
                                                              "diversity")}
                   | {"reward_std": _std([p["reward"] for p in pts])})
    return out


def reach(curve: list[dict], target: float, fid_max: float, div_min: float) -> dict:
    """First evaluation of a seed-mean curve at the target reward: within the guards, and regardless of them."""
    hit = next((p for p in curve if p["reward"] >= target and p["fid"] <= fid_max and p["diversity"] >= div_min), None)
    raw = next((p for p in curve if p["reward"] >= target), None)
    hacked = [p for p in curve if p["reward"] >= target and not (p["fid"] <= fid_max and p["diversity"] >= div_min)]
    return {"seconds": hit["seconds"] if hit else None, "cost": hit["cost"] if hit else None,
            "iteration": hit["iteration"] if hit else None,
            "raw_seconds": raw["seconds"] if raw else None, "hacks": bool(hacked)}


def summarize(runs: list[Run], variants: list[str], target: float | None, fid_margin: float,
              div_margin: float) -> dict:
    by = {v: [r for r in runs if r.variant == v] for v in variants}
    curves = {v: mean_curve(rs) for v, rs in by.items() if rs}
    ref = curves["recompute"][-1] if "recompute" in curves else None
    if target is None:
        target = ref["reward"] if ref else float("nan")
    fid_max = ref["fid"] * (1 + fid_margin) if ref else float("inf")
    div_min = ref["diversity"] * (1 - div_margin) if ref else -float("inf")
    rows = []
    for v, rs in by.items():
        if not rs:
            continue
        finals = [r.curve[-1] for r in rs]
        rch = reach(curves[v], target, fid_max, div_min)
        out_of_margin = _mean([f["fid"] for f in finals]) > fid_max or _mean([f["diversity"] for f in finals]) < div_min
        rows.append({"variant": v, "overrides": VARIANTS.get(v, []),
                     "iterations": _mean([r.iterations for r in rs]),
                     "seconds_per_iteration": _mean([r.seconds / max(r.iterations, 1) for r in rs]),
                     "cost_per_iteration": _mean([r.cost / max(r.iterations, 1) for r in rs]),
                     "saved_forwards_per_iteration": _mean([r.saved / max(r.iterations, 1) for r in rs]),
                     "final_reward": _mean([f["reward"] for f in finals]), "final_reward_std": _std([f["reward"] for f in finals]),
                     "final_fid": _mean([f["fid"] for f in finals]), "final_diversity": _mean([f["diversity"] for f in finals]),
                     "start_reward": _mean([r.curve[0]["reward"] for r in rs]),
                     "start_fid": _mean([r.curve[0]["fid"] for r in rs]),
                     "start_diversity": _mean([r.curve[0]["diversity"] for r in rs]),
                     "time_to_target": rch["seconds"], "cost_to_target": rch["cost"],
                     "time_to_target_ignoring_guards": rch["raw_seconds"],
                     "hacks": rch["hacks"], "final_out_of_margin": out_of_margin,
                     "final_guards": _guards(_mean([f["fid"] for f in finals]), _mean([f["diversity"] for f in finals]),
                                             fid_max, div_min),
                     "curve": curves[v]})
    return {"target": target, "fid_max": fid_max, "div_min": div_min, "fid_margin": fid_margin,
            "div_margin": div_margin, "rows": rows}


def _guards(fid: float, div: float, fid_max: float, div_min: float) -> str:
    bad = (["FID high"] if fid > fid_max else []) + (["diversity low"] if div < div_min else [])
    return ", ".join(bad) or "ok"


def _fmt(x, f="{:.1f}"):
    return "—" if x is None else f.format(x)


def to_markdown(meta: dict, summ: dict) -> str:
    ref = next((r for r in summ["rows"] if r["variant"] == "recompute"), None)
    lines = [
        "# Time to quality (built-in task: tiny pretrained flow model, digit_alignment)", "",
        f"Command: `{meta['command']}`", "",
        f"Settings: {', '.join(meta['base'])}; seeds {meta['seeds']}; training budget {meta['budget_seconds']:.0f} s "
        f"of `trainer.step()` wall-clock per run (max {meta['max_iterations']} iterations), {meta['evals']} evaluations "
        f"per run after the start one ({meta['eval_images']} held-out images, ODE); runs interleaved on one thread "
        f"(least training time first). Total benchmark time {meta['total_seconds']:.0f} s.", "",
        f"Target: held-out reward {summ['target']:.4f} (recompute's seed-mean final reward in this benchmark). "
        f"Guards: FID ≤ {summ['fid_max']:.2f} (recompute's final × {1 + summ['fid_margin']:.2f}), diversity ≥ "
        f"{summ['div_min']:.3f} (recompute's final × {1 - summ['div_margin']:.2f}).", "",
        "| variant | s / it | cost / it | saved fwd / it | iterations | time to target (s) | cost to target | "
        "speed-up vs recompute (time) | final reward | final FID | final diversity | guards at end | hacks |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in summ["rows"]:
        sp = None
        if ref and ref["time_to_target"] and r["time_to_target"]:
            sp = ref["time_to_target"] / r["time_to_target"]
        lines.append(
            f"| {r['variant']} | {r['seconds_per_iteration']:.2f} | {r['cost_per_iteration']:.0f} | "
            f"{r['saved_forwards_per_iteration']:.0f} | {r['iterations']:.1f} | {_fmt(r['time_to_target'])} | "
            f"{_fmt(r['cost_to_target'], '{:.0f}')} | {_fmt(sp, '{:.2f}×')} | {r['final_reward']:.4f} ± "
            f"{r['final_reward_std']:.4f} | {r['final_fid']:.2f} | {r['final_diversity']:.3f} | "
            f"{r['final_guards']} | {'yes' if r['hacks'] else 'no'} |")
    if summ["rows"]:
        s0 = summ["rows"][0]
        lines += ["", f"Start (every variant): reward {s0['start_reward']:.4f}, FID {s0['start_fid']:.2f}, diversity "
                      f"{s0['start_diversity']:.3f}. 'time to target' is the training wall-clock at the first "
                      "evaluation whose seed-mean reward reaches the target inside the guards (— : not within the "
                      "budget); 'hacks': at some evaluation the seed-mean reward was at or above the target while a "
                      "guard was out of margin; 'guards at end': the final seed-mean FID / diversity against the margins."]
    return "\n".join(lines) + "\n"


def plot(summ: dict, runs: list[Run], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for i, row in enumerate(summ["rows"]):
        c = row["curve"]
        col = f"C{i % 10}"
        xs = [p["seconds"] for p in c]
        ys = [p["reward"] for p in c]
        sd = [p["reward_std"] for p in c]
        axes[0].plot(xs, ys, marker="o", ms=3, color=col, label=row["variant"])
        axes[0].fill_between(xs, [y - s for y, s in zip(ys, sd)], [y + s for y, s in zip(ys, sd)], color=col, alpha=0.12)
        axes[1].plot([p["cost"] for p in c], ys, marker="o", ms=3, color=col, label=row["variant"])
        axes[2].plot([p["fid"] for p in c], ys, marker="o", ms=3, color=col, label=row["variant"])
    for ax in axes:
        ax.axhline(summ["target"], color="k", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
        ax.set_ylabel("held-out digit_alignment (seed mean)")
    axes[2].axvline(summ["fid_max"], color="r", ls=":", lw=0.8)
    axes[0].set_xlabel("training wall-clock, s (one thread, shared CPU); band: ± std over seeds")
    axes[1].set_xlabel("counted cost (sample-forwards + 2 × sample-backwards)")
    axes[2].set_xlabel("FID of classifier features vs digits test split (guard: red)")
    axes[0].legend(fontsize=7)
    fig.suptitle("Time to quality: reward vs wall-clock / cost / fidelity (dashed: target)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def parse_variant(spec: str) -> tuple[str, list[str]]:
    name, _, ov = spec.partition("=")
    if not name or not ov:
        raise SystemExit(f"--variant: {spec!r} must be NAME=key=value[,key=value...]")
    return name, [o for o in ov.split(",") if o]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--budget-seconds", type=float, default=60.0, help="training wall-clock per run")
    p.add_argument("--max-iterations", type=int, default=1000)
    p.add_argument("--evals", type=int, default=6, help="evaluations per run after the start one")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="names from the built-in list")
    p.add_argument("--variant", action="append", default=[], help="extra variant NAME=key=value,key=value")
    p.add_argument("--target", type=float, default=None, help="held-out reward target (default: recompute's final)")
    p.add_argument("--fid-margin", type=float, default=0.25, help="allowed relative FID increase over recompute")
    p.add_argument("--div-margin", type=float, default=0.25, help="allowed relative diversity drop from recompute")
    p.add_argument("--out", default="benchmarks/results/time_to_quality")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every variant")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    for spec in a.variant:
        name, ov = parse_variant(spec)
        VARIANTS[name] = ov
        a.variants.append(name)
    base = [*BASE, *a.overrides]
    out = Path(a.out)
    (out / "configs").mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    runs = [Run(v, VARIANTS[v], s, base) for s in a.seeds for v in a.variants]
    for r in runs:
        (out / "configs" / f"{r.variant}_seed{r.seed}.yaml").write_text(yaml.safe_dump(to_dict(r.cfg), sort_keys=False))
    interleave(runs, a.budget_seconds, a.max_iterations, a.evals)
    total = time.perf_counter() - t0
    summ = summarize(runs, a.variants, a.target, a.fid_margin, a.div_margin)
    command = "OMP_NUM_THREADS=1 python benchmarks/time_to_quality.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    meta = {"command": command, "base": base, "seeds": a.seeds, "budget_seconds": a.budget_seconds,
            "max_iterations": a.max_iterations, "evals": a.evals, "total_seconds": total,
            "eval_images": 10 * runs[0].cfg.eval.seeds_per_prompt, "torch_threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS", ""), "variants": {v: VARIANTS[v] for v in a.variants}}
    cells = [{"variant": r.variant, "seed": r.seed, "iterations": r.iterations, "seconds": r.seconds, "cost": r.cost,
              "saved_forwards": r.saved, "evaluations": r.curve} for r in runs]
    (out / "summary.json").write_text(json.dumps({"meta": meta, **summ, "cells": cells}, indent=2))
    (out / "command.txt").write_text(command + "\n")
    md = to_markdown(meta, summ)
    (out / "table.md").write_text(md)
    plot(summ, runs, out / "curves.png")
    print(md)


if __name__ == "__main__":
    main()
