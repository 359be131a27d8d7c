"""Does JAGG's free routing score predict where JAGG is inaccurate?

For one rollout of the pretrained built-in model, every (trajectory, window) with interior steps gets
  * its routing scores from the rollout velocities: λ = mean interior cos(v_k − v_a, v_b − v_a) (the score the
    engine routes by) and the relative residual of v_k against the σ-interpolation of v_a, v_b;
  * its exact gradient Σ_k J_kᵀ g_k (``recompute_pairs`` on that window alone) and its JAGG gradient
    J_aᵀ G_a + J_bᵀ G_b (the engine's joint forward/backward on that window alone);
  * the window's error ‖g_jagg − g_exact‖, relative to ‖g_exact‖ and absolute.
Reported: Spearman rank correlations score↔error, and, because gradients add up over windows, the full-batch
gradient cosine vs recompute when the top ⌈f·n⌉ windows by score use JAGG (what ``jagg_frac = f`` does) against
routing the same number of windows at random (mean over 200 draws) and against an oracle that routes the
lowest-error windows.

    DIFFGRPO_CACHE=/tmp/dgcache python benchmarks/jagg_routing.py --out benchmarks/results/jagg_routing
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.engines._graph import recompute_pairs
from diffgrpo.engines.base import StatsAccumulator
from diffgrpo.engines.jagg import JaggEngine
from diffgrpo.types import EngineStats


def flat_grad(params) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).detach().flatten().double()
                      for p in params])


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    ra = a.argsort().argsort().double()
    rb = b.argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()).clamp(min=1e-30))


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=0))


def window_gradients(tr: Trainer, ro, eng: JaggEngine):
    """Per-window exact and JAGG flat gradients for every window of ``eng`` on rollout ``ro``."""
    rows = []
    for w in eng.windows(ro):
        mask = torch.zeros_like(ro.selected)
        mask[w.traj, w.steps] = True
        tr.optimizer.zero_grad(set_to_none=True)
        recompute_pairs(tr.family.ctx, ro, EngineStats(), StatsAccumulator(), mask)
        exact = flat_grad(tr.params).float()
        if len(w.steps) > 2:
            tr.optimizer.zero_grad(set_to_none=True)
            eng._jagg_chunk(tr.family.ctx, ro, [w], 0, EngineStats(), StatsAccumulator(), final=True)
            approx = flat_grad(tr.params).float()
        else:
            approx = exact
        rows.append({"window": w, "exact": exact, "jagg": approx})
    return rows


def analyse(rows, fracs=(0.25, 0.5, 0.75, 1.0), draws=200, seed=0):
    scored = [r for r in rows if len(r["window"].steps) > 2]
    score = torch.tensor([r["window"].score for r in scored], dtype=torch.float64)
    resid = torch.tensor([r["window"].residual for r in scored], dtype=torch.float64)
    err_abs = torch.tensor([float((r["jagg"] - r["exact"]).double().norm()) for r in scored])
    err_rel = torch.tensor([float((r["jagg"] - r["exact"]).double().norm() / r["exact"].double().norm().clamp(min=1e-30))
                            for r in scored])
    exact_total = sum(r["exact"].double() for r in rows)
    delta = torch.stack([(r["jagg"] - r["exact"]).double() for r in scored])  # (n, P)
    n = len(scored)
    g = torch.Generator().manual_seed(seed)

    def total_cos(chosen: torch.Tensor) -> float:
        return cosine(exact_total + delta[chosen].sum(0), exact_total)

    by_score = score.argsort(descending=True)
    by_error = err_abs.argsort()
    frac_rows = []
    for f in fracs:
        m = min(n, math.ceil(f * n - 1e-9))
        rand = [total_cos(torch.randperm(n, generator=g)[:m]) for _ in range(draws)]
        frac_rows.append({"jagg_frac": f, "windows_routed": m, "cos_score_routing": total_cos(by_score[:m]),
                          "cos_random_routing_mean": sum(rand) / len(rand),
                          "cos_oracle_routing": total_cos(by_error[:m])})
    return {
        "windows_scored": n,
        "score_mean": float(score.mean()), "score_min": float(score.min()), "score_max": float(score.max()),
        "err_rel_mean": float(err_rel.mean()), "err_rel_median": float(err_rel.median()),
        "spearman_score_vs_err_rel": spearman(score, err_rel), "spearman_score_vs_err_abs": spearman(score, err_abs),
        "spearman_resid_vs_err_rel": spearman(resid, err_rel), "spearman_resid_vs_err_abs": spearman(resid, err_abs),
        "routing": frac_rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", default="3,4,5", help="window lengths W")
    ap.add_argument("--out", default="benchmarks/results/jagg_routing")
    ap.add_argument("--random-init", action="store_true", help="random-init model instead of the pretrained one")
    ap.add_argument("overrides", nargs="*", help="config overrides (default: pretrained model, 4×4 batch, T=10)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    cfg = RunConfig.from_overrides(["log.progress=false", "train.prompts_per_batch=4", "train.group_size=4",
                                    *args.overrides])
    policy = None
    if args.random_init:
        from diffgrpo.models.tiny import build_tiny_policy
        policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    tr = Trainer(cfg, policy=policy, log=lambda *a: None)
    t0 = time.perf_counter()
    ro = tr.rollout()
    results = {}
    for W in [int(x) for x in args.windows.split(",")]:
        eng = JaggEngine(RunConfig.from_overrides([f"engine.window={W}"], base=cfg).engine)
        results[W] = analyse(window_gradients(tr, ro, eng))
    report = {"overrides": args.overrides, "batch": ro.batch_size, "num_steps": ro.traj.num_steps,
              "sde_type": cfg.sampler.sde_type, "seconds": time.perf_counter() - t0,
              "results": {str(k): v for k, v in results.items()}}
    lines = ["# JAGG routing score vs per-window gradient error",
             "", f"{'Random-init' if args.random_init else 'Pretrained'} built-in model, one rollout of {ro.batch_size} trajectories, T = {ro.traj.num_steps}, "
             f"{cfg.sampler.sde_type}, all trainable steps selected. Command: "
             f"`python benchmarks/jagg_routing.py --windows {args.windows} {'--random-init ' if args.random_init else ''}"
             f"{' '.join(args.overrides)}`.",
             "", "Score λ = mean interior cos(v_k − v_a, v_b − v_a) (higher = more linear); residual = mean interior "
             "‖v_k − interp‖/‖v_b − v_a‖. Error of a window = ‖g_jagg − g_exact‖ (abs) or that over ‖g_exact‖ (rel). "
             "A useful score has a NEGATIVE rank correlation with the error (a useful residual a positive one).", "",
             "| W | windows | λ mean (min–max) | rel err mean / median | ρ(λ, rel) | ρ(λ, abs) | ρ(res, rel) | ρ(res, abs) |",
             "|---|---|---|---|---|---|---|---|"]
    for W, r in results.items():
        lines.append(f"| {W} | {r['windows_scored']} | {r['score_mean']:.3f} ({r['score_min']:.3f}–{r['score_max']:.3f}) | "
                     f"{r['err_rel_mean']:.3f} / {r['err_rel_median']:.3f} | {r['spearman_score_vs_err_rel']:+.2f} | "
                     f"{r['spearman_score_vs_err_abs']:+.2f} | {r['spearman_resid_vs_err_rel']:+.2f} | "
                     f"{r['spearman_resid_vs_err_abs']:+.2f} |")
    lines += ["", "Full-batch gradient cosine vs recompute when ⌈f·n⌉ windows use JAGG (others exact):", "",
              "| W | f | routed | by score | random (mean of 200) | oracle (lowest error) |", "|---|---|---|---|---|---|"]
    for W, r in results.items():
        for fr in r["routing"]:
            lines.append(f"| {W} | {fr['jagg_frac']} | {fr['windows_routed']} | {fr['cos_score_routing']:.5f} | "
                         f"{fr['cos_random_routing_mean']:.5f} | {fr['cos_oracle_routing']:.5f} |")
    md = "\n".join(lines) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "routing.json").write_text(json.dumps(report, indent=2))
    (out / "routing.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
