"""Time to quality on the built-in task: the study's variants through ``diffgrpo bench quality``.

A thin wrapper around :mod:`diffgrpo.studies.quality` (interleaved cells, budget in iterations of the reference as
counted cost, target = 95 % of the reference's gain at its plateau, guards anchored to each cell's start, bootstrap
intervals over seeds): it holds the built-in study's base config and variant list. ``--variants`` picks some of them,
``--variant NAME=key=value,...`` adds one.

The reference is ``recompute_kl``: recompute with a KL term to the base model (``loss.beta=0.3``). Without one,
recompute's reward on this task keeps rising by gaming the classifier (FID 9× the start's, diversity 0.6× at its
plateau), so a target taken from its plateau can only be reached outside the guards; with β = 0.3 it plateaus inside
them (docs/time_to_quality.md). Every engine runs with that KL term and without it. The full study (hours on one
CPU thread; see docs/time_to_quality.md):

    OMP_NUM_THREADS=1 python benchmarks/time_to_quality.py --out benchmarks/results/bench_quality/study
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import torch

from diffgrpo import RunConfig
from diffgrpo.studies import quality as bench_quality
from diffgrpo.studies import quality_tune

KL = "loss.beta=0.3"
_WINDOW = ["engine.name=recompute", "steps.mode=window", "steps.window_start=0", "steps.window_size=3",
           "steps.window_shift_every=2", "steps.ode_outside=true"]
ENGINES: dict[str, list[str]] = {
    "recompute": ["engine.name=recompute"],
    "retain": ["engine.name=retain"],
    "jagg_w4": ["engine.name=jagg", "engine.window=4"],
    "jagg_w4_retain": ["engine.name=jagg", "engine.window=4", "engine.evaluation=retain"],
    "single_step": ["engine.name=single_step"],
    "single_step_prefix": ["engine.name=single_step", "sampler.shared_prefix=true"],
    "sliding_window": _WINDOW,
    "nft": ["engine.name=nft"],
    "awm": ["engine.name=awm"],
    # rollout reuse: each rollout feeds several clipped updates
    "reuse_2": ["engine.name=recompute", "train.num_inner_epochs=2", "loss.clip_range=1e-4"],
    "reuse_4": ["engine.name=recompute", "train.num_inner_epochs=4", "loss.clip_range=1e-4"],
}
VARIANTS: dict[str, list[str]] = {f"{k}_kl": [*v, KL] for k, v in ENGINES.items()}
VARIANTS.update(ENGINES)
REFERENCE = "recompute_kl"
BASE = ["train.prompts_per_batch=4", "train.group_size=8", "train.lr=3e-4", "log.progress=false",
        "log.save_images=false", "eval.every=0", "eval.seeds_per_prompt=32"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--iterations", type=int, default=200, help="budget: iterations of the reference, as counted cost")
    p.add_argument("--evals", type=int, default=16, help="evaluations per cell after the start one")
    p.add_argument("--eval-spacing", default="quadratic", choices=bench_quality.SPACINGS)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), help="names from the built-in list")
    p.add_argument("--variant", action="append", default=[], help="extra variant NAME=key=value,key=value")
    p.add_argument("--reference", default=REFERENCE)
    p.add_argument("--target-fraction", type=float, default=0.95)
    p.add_argument("--tune", action="store_true", help="choose each variant's settings on a grid first (--tune-seeds)")
    p.add_argument("--tune-seeds", type=int, nargs="+", default=[100, 101])
    p.add_argument("--tune-grid", nargs="+", default=[], help="key=v1,v2 ... or one YAML file (default: lr, beta, "
                                                              "a diversity objective's strength at x0.5, x1, x2)")
    p.add_argument("--out", default="benchmarks/results/bench_quality/study")
    p.add_argument("overrides", nargs="*", help="extra key=value config overrides for every variant")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    unknown = [v for v in [a.reference, *a.variants] if v not in VARIANTS]
    if unknown:
        p.error(f"--variants/--reference: unknown {', '.join(unknown)}; allowed: {', '.join(VARIANTS)}")
    variants = {v: VARIANTS[v] for v in dict.fromkeys([a.reference, *a.variants])}
    variants.update(dict(bench_quality.parse_variant(s) for s in a.variant))
    base = RunConfig.from_overrides([*BASE, *a.overrides])
    command = "OMP_NUM_THREADS=1 python benchmarks/time_to_quality.py " + " ".join(
        shlex.quote(w) for w in (argv if argv is not None else sys.argv[1:]))
    bench = dict(iterations=a.iterations, evals=a.evals, eval_spacing=a.eval_spacing,
                 target_fraction=a.target_fraction, title="built-in task (tiny pretrained flow model, digit_alignment)")
    tuning = None
    if a.tune:
        bench_quality.claim_out(Path(a.out))
        variants, tuning = quality_tune.tuned(base, variants, a.tune_seeds, a.seeds, out=Path(a.out),
                                              reference=a.reference, grid=quality_tune.parse_grid(a.tune_grid),
                                              run=bench_quality.run, command=command + "  (tuning stage)", **bench)
    bench_quality.run(base, variants, a.seeds, out=a.out, reference=a.reference, command=command, tuning=tuning,
                      focus=(tuning or {}).get("focus"), **bench)


if __name__ == "__main__":
    main()
