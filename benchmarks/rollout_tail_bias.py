"""Reward bias of the cheap deterministic tail (``sampler.tail_solver`` / ``sampler.tail_steps``) on the built-in task.

For the built-in pretrained model, the same batches (prompts, initial noise, SDE noise) are sampled with the full
ODE tail and with each cheap tail; the stochastic part of every trajectory is identical, only the deterministic
carry from the last stochastic step to x₀ differs. Reported per tail: the mean reward, the bias (mean of cheap −
full, with its standard error over samples), the mean |cheap − full|, and the sample-forwards the tail saves.
Two rollout shapes: ``single_step`` (one SDE step per group, uniform over the high-noise half) and a MixGRPO window
(SDE on 3 consecutive steps starting at 0 … 6, ODE elsewhere).

    OMP_NUM_THREADS=1 python benchmarks/rollout_tail_bias.py --batches 8 --out benchmarks/results/time_to_quality
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.rewards import compute_rewards
from diffgrpo.samplers import savings
from diffgrpo.samplers.rollout import sample_trajectories

TAILS = [("euler", 1), ("euler", 2), ("heun", 1), ("heun", 2), ("euler", 4)]


def sde_masks(shape: str, B: int, T: int, G: int, g: torch.Generator) -> torch.Tensor:
    """(B, T) bool SDE steps: one step per group (single_step) or a 3-step window per batch (MixGRPO)."""
    sde = torch.zeros(B, T, dtype=torch.bool)
    if shape == "single_step":
        half = max(1, -(-(T - 1) // 2))
        ks = torch.randint(0, half, (B // G,), generator=g).repeat_interleave(G)
        sde[torch.arange(B), ks] = True
    else:
        start = int(torch.randint(0, T - 1 - 3 + 1, (1,), generator=g))
        sde[:, start:start + 3] = True
    return sde


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--out", default="benchmarks/results/time_to_quality")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = RunConfig.from_overrides(["train.prompts_per_batch=4", "train.group_size=8", "log.progress=false"])
    tr = Trainer(cfg, log=lambda *x: None)
    fam, pol = tr.family, tr.policy
    T, G = cfg.sampler.num_steps, cfg.train.group_size
    results = {}
    for shape in ("single_step", "window"):
        g = torch.Generator().manual_seed(0)
        diffs = {t: [] for t in TAILS}
        cheap_r = {t: [] for t in TAILS}
        saved = {t: 0 for t in TAILS}
        full_r, n_full = [], 0
        for b in range(a.batches):
            prompts, group_ids, meta = fam.sample_prompts()
            B = len(prompts)
            x0 = torch.randn(B, *pol.latent_shape, generator=g)
            sde = sde_masks(shape, B, T, G, g)
            cond = pol.encode(prompts)
            start = savings.tail_starts(T, sde, sde, stochastic_kernel=True, batch=B)
            with torch.no_grad():
                full = sample_trajectories(pol, cond, x0, fam.sigmas, kernel=fam.kernel, sde_mask=sde,
                                           generator=torch.Generator().manual_seed(1000 + b))
                r_full, _ = compute_rewards(cfg.reward.weights, pol.decode(full["xs"][:, -1]), prompts, meta)
                full_r += r_full.tolist()
                n_full += B * T
                for t in TAILS:
                    out = sample_trajectories(pol, cond, x0, fam.sigmas, kernel=fam.kernel, sde_mask=sde,
                                              generator=torch.Generator().manual_seed(1000 + b), tail_start=start,
                                              tail_solver=t[0], tail_steps=t[1])
                    r, _ = compute_rewards(cfg.reward.weights, pol.decode(out["xs"][:, -1]), prompts, meta)
                    cheap_r[t] += r.tolist()
                    diffs[t] += (r - r_full).tolist()
                    saved[t] += out["saved_forwards"]
        rows = []
        for t in TAILS:
            d = diffs[t]
            rows.append({"tail": f"{t[0]} × {t[1]}", "mean_reward": statistics.mean(cheap_r[t]),
                         "bias": statistics.mean(d), "bias_se": statistics.stdev(d) / len(d) ** 0.5,
                         "mean_abs_diff": statistics.mean(abs(x) for x in d),
                         "saved_forward_fraction": saved[t] / n_full})
        results[shape] = {"full_mean_reward": statistics.mean(full_r), "samples": len(full_r), "rows": rows}
    total = time.perf_counter() - t0
    cmd = "OMP_NUM_THREADS=1 python benchmarks/rollout_tail_bias.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines = ["# Cheap deterministic tail: reward bias against the full ODE tail (built-in pretrained model)", "",
             f"Command: `{cmd}` ({total:.0f} s). Same prompts, initial noise and SDE noise for every tail; "
             f"T = {T} steps; bias = mean(reward_cheap − reward_full) ± standard error.", ""]
    for shape, res in results.items():
        lines += [f"**{shape}** rollouts ({res['samples']} samples, full-tail mean reward {res['full_mean_reward']:.4f}):",
                  "", "| tail | saved forwards (share of B·T) | mean reward | bias | mean abs diff |", "|---|---|---|---|---|"]
        for r in res["rows"]:
            lines.append(f"| {r['tail']} | {r['saved_forward_fraction']:.1%} | {r['mean_reward']:.4f} | "
                         f"{r['bias']:+.4f} ± {r['bias_se']:.4f} | {r['mean_abs_diff']:.4f} |")
        lines.append("")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tail_bias.json").write_text(json.dumps({"command": cmd, "seconds": total, **results}, indent=2))
    (out / "tail_bias.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
