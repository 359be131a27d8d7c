"""Forward-process engines (``nft``, ``awm``) against ``recompute`` on the built-in default task, side by side.

Every variant starts from the same built-in pretrained model with the default config (``diffgrpo train`` with no
arguments) and only ``engine.name`` changed, seed 0; the variants take their iterations interleaved (alternating
order) in one process on one thread, so machine noise hits all alike. Recorded per variant: the held-out reward
(``trainer.evaluate()``: fixed prompts and seeds, ODE sampling; not timed) every ``--eval-every`` iterations and at
the end, cumulative wall time of the iterations (rollout + update), the counted cost (sample-forwards with and
without grad, rollout included, + 2 × sample-backwards), and a per-prompt diversity guard: the mean pairwise RMS
pixel distance between the evaluation images of one prompt (its ``eval.seeds_per_prompt`` seeds), averaged over
prompts — a variant that buys reward by collapsing every seed onto one digit image shows it falling.

    python benchmarks/forward_engines.py --iters 40 --out benchmarks/results/forward_engines
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, Trainer

VARIANTS = {"recompute": ["engine.name=recompute"], "nft": ["engine.name=nft"], "awm": ["engine.name=awm"]}
EVAL_KEY = "eval/reward"


def prompt_diversity(images: torch.Tensor, per_prompt: int) -> float:
    """Mean over prompts of the mean pairwise RMS distance between that prompt's images. images (P·S, C, H, W)."""
    x = images.flatten(1).double().reshape(-1, per_prompt, images[0].numel())  # (P, S, D)
    d = torch.cdist(x, x) / x.shape[-1] ** 0.5  # (P, S, S) RMS distances
    S = per_prompt
    return float(d.sum((1, 2)).mean() / (S * (S - 1)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--set", nargs="*", default=[], help="extra overrides for every variant")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)
    trainers, runs = {}, {}
    for name in a.variants:
        cfg = RunConfig.from_overrides([*VARIANTS[name], f"seed={a.seed}", "log.progress=false", *a.set])
        torch.manual_seed(a.seed)
        trainers[name] = Trainer(cfg, log=lambda *x: None)
        runs[name] = {"seconds": 0.0, "cost": 0.0, "curve": []}

    def record(name: str, it: int) -> None:
        row, images = trainers[name].evaluate()
        r = runs[name]
        div = prompt_diversity(images, trainers[name].cfg.eval.seeds_per_prompt)
        r["curve"].append({"iteration": it, "seconds": r["seconds"], "cost": r["cost"], "reward": row[EVAL_KEY],
                           "diversity": div})
        print(f"{name:10s} it={it:3d} eval_reward={row[EVAL_KEY]:.4f} diversity={div:.4f} seconds={r['seconds']:.1f} "
              f"cost={r['cost']:.0f}", flush=True)

    for name in trainers:
        record(name, 0)
    for it in range(1, a.iters + 1):
        order = list(trainers) if it % 2 else list(reversed(trainers))
        for name in order:
            tr, r = trainers[name], runs[name]
            c0 = dict(tr.policy.counters)
            t0 = time.perf_counter()
            row = tr.step()
            r["seconds"] += time.perf_counter() - t0
            c = {k: tr.policy.counters[k] - c0[k] for k in c0}  # rollout + training forwards
            r["cost"] += c["forwards_grad"] + c["forwards_nograd"] + 2 * row["sample_backwards"]
            r.setdefault("train_reward", []).append(row["reward"])
            if it % a.eval_every == 0 or it == a.iters:
                record(name, it)
    base = runs.get("recompute")
    lines = ["| variant | final held-out reward | start | per-prompt diversity (start → end) | wall s (iterations) | "
             "counted cost | s / iteration |", "|---|---|---|---|---|---|---|"]
    for name, r in runs.items():
        c0, c1 = r["curve"][0], r["curve"][-1]
        lines.append(f"| {name} | {c1['reward']:.4f} | {c0['reward']:.4f} | {c0['diversity']:.4f} → "
                     f"{c1['diversity']:.4f} | {r['seconds']:.1f} | {r['cost']:.0f} | {r['seconds'] / a.iters:.2f} |")
    if base:
        lines.append("")
        for name, r in runs.items():
            lines.append(f"- {name}: wall {r['seconds'] / base['seconds']:.2f}× recompute's, "
                         f"cost {r['cost'] / base['cost']:.2f}× recompute's")
    md = "\n".join(lines)
    print(md)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "forward_engines.json").write_text(json.dumps({"args": vars(a), "runs": runs}, indent=2))
        (out / "forward_engines.md").write_text(md + "\n")


if __name__ == "__main__":
    main()
