"""Which reference can plateau inside the guards? recompute on the built-in task at several learning rates and KL
weights, each run by ``diffgrpo bench quality`` (320 held-out images per evaluation, guards anchored to the start),
collated into one table: per variant the reward, FID and diversity (as ratios to the start) and drift at the end, the
first guard out (where, and the reward there), and whether the reward plateaued over the last quarter of the budget.

    python benchmarks/reference_choice.py benchmarks/results/bench_quality/reference_choice/*/ \
        --out benchmarks/results/bench_quality/reference_choice/table.md

Each folder's ``command.txt`` is the command that trained it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import yaml

from diffgrpo import guards
from diffgrpo.fileio import atomic_write
from diffgrpo.studies import quality as bench_quality
from diffgrpo.studies.quality_stats import first_out, mean_curve, plateau


def rows(folder: Path) -> list[dict]:
    s = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
    cells = bench_quality.load_cells(s)
    check = bench_quality.guard_check(guards.Thresholds(**s["thresholds"]))
    budget = float(s["meta"]["budget_cost"])
    out = []
    for v in dict.fromkeys(c.variant for c in cells):
        cs = [c for c in cells if c.variant == v]
        cfg = yaml.safe_load((folder / "configs" / f"{v}_seed{cs[0].seed}.yaml").read_text(encoding="utf-8"))
        curve = mean_curve(cs, "eval/reward")
        plat = plateau([p["cost"] for p in curve], [p["metrics"]["eval/reward"] for p in curve],
                       [p["reward_std"] for p in curve], len(cs))
        start, end = curve[0]["metrics"], curve[-1]["metrics"]
        outs = [first_out(c.curve, check, budget) for c in cs]
        hit = [o for o in outs if o]
        out.append({
            "folder": folder.name, "variant": v, "lr": cfg["train"]["lr"], "beta": cfg["loss"]["beta"],
            "seeds": len(cs), "iterations": cs[0].iterations, "start": start["eval/reward"],
            "end": end["eval/reward"], "end_sd": curve[-1]["reward_std"],
            "fid": end["eval/fid"] / start["eval/fid"], "div": end["eval/guard/diversity"] / start["eval/guard/diversity"],
            "drift": end["eval/guard/drift"], "plateau": plat,
            "out": (f"{len(hit)}/{len(cs)}: {', '.join(hit[0]['guards'])} at "
                    f"{statistics.median(o['cost_fraction'] for o in hit) * cs[0].iterations:.0f} it "
                    f"(reward {statistics.median(o['reward'] for o in hit):.3f})") if hit else "none"})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("folders", nargs="+", type=Path)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    table = [r for f in a.folders for r in rows(f)]
    table.sort(key=lambda r: (r["lr"], r["beta"]))
    lines = ["# Which reference plateaus inside the guards (recompute, built-in task)", "",
             "Command: `python benchmarks/reference_choice.py " + " ".join(sys.argv[1:] if argv is None else argv) + "`",
             "", "Guards (anchored to the start): FID ≤ 1.5×, drift ≤ 0.5, diversity ≥ 0.8×. 4 prompts × 8 samples per "
             "iteration, 320 held-out images per evaluation; each folder's `command.txt` trained it.", "",
             "| lr | KL β | seeds | iterations | reward start → end | FID ÷ start | diversity ÷ start | drift | first out of "
             "guards (seeds: guard at iteration, reward there) | plateaued (trend vs noise, last quarter) | folder |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        pl = r["plateau"]
        lines.append(f"| {r['lr']:g} | {r['beta']:g} | {r['seeds']} | {r['iterations']} | {r['start']:.3f} → "
                     f"{r['end']:.3f} ± {r['end_sd']:.3f} | {r['fid']:.2f} | {r['div']:.2f} | {r['drift']:.2f} | "
                     f"{r['out']} | {'yes' if pl['plateaued'] else 'no'} ({pl['trend']:+.4f} vs ±{pl['noise']:.4f}) | "
                     f"{r['folder']} |")
    md = "\n".join(lines) + "\n"
    if a.out:
        atomic_write(a.out, md)
    print(md)


if __name__ == "__main__":
    main()
