"""``reweight``'s per-sample gradient accumulation before and after the fused path, side by side in one process.

The fused path (``engines/_per_sample.py``: a Linear layer's per-sample weight gradients added into the
per-trajectory buffers by one batched GEMM) replaces an einsum into an (n, out, in) temporary followed by a second
pass adding it into the buffers; the gradient is the same within float rounding
(``tests/test_lean.py::test_fused_per_sample_accumulation_keeps_reweights_gradient``). Each repeat runs
``bench_engines`` (the code of ``diffgrpo bench engines``) once with the old path and once with the new one,
alternating, so both see the same load; medians over the repeats. Writes <out>/floor.{md,json}.

    OMP_NUM_THREADS=1 python benchmarks/engines_floor.py --repeats 3 --out benchmarks/results/engines_floor/reweight
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
from pathlib import Path

import torch

from diffgrpo import RunConfig
from diffgrpo.engines import _per_sample
from diffgrpo.studies.engines import bench_engines


def run(variants: list[str], repeats: int, overrides: list[str]) -> dict:
    cfg = RunConfig.from_overrides(["log.progress=false", *overrides])
    rows: dict[tuple[str, bool], list[dict]] = {}
    for _ in range(repeats):
        for fused in (False, True):
            _per_sample._FUSED = fused
            rep = bench_engines(cfg, variants, repeats=1, log=lambda *a: None)
            for r in rep["rows"]:
                rows.setdefault((r["variant"], fused), []).append(r)
    _per_sample._FUSED = True
    out = []
    for v in variants:
        for fused in (False, True):
            rs = rows[(v, fused)]
            out.append({"variant": v, "fused": fused, "train_s": statistics.median(r["train_s"] for r in rs),
                        "iteration_s": statistics.median(r["iteration_s"] for r in rs),
                        "train_speedup": statistics.median(r["train_speedup"] for r in rs),
                        "ideal_train_speedup": rs[0]["ideal_train_speedup"],
                        "grad_relerr_vs_recompute": rs[0]["grad_relerr_vs_recompute"],
                        "train_s_all": [r["train_s"] for r in rs]})
    return {"rows": out}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--variants", default="recompute;reweight")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="benchmarks/results/engines_floor/reweight")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    load0 = os.getloadavg()[0]
    rep = run(a.variants.split(";"), a.repeats, a.overrides)
    cmd = "OMP_NUM_THREADS=1 python " + " ".join(shlex.quote(x) for x in sys.argv)
    rep.update(command=cmd, load=(load0, os.getloadavg()[0]), repeats=a.repeats)
    lines = [f"Command: `{cmd}`", "", f"One thread; load average {rep['load'][0]:.1f} at the start, "
             f"{rep['load'][1]:.1f} at the end; median of {a.repeats} alternating repeats (each a bench_engines "
             "call with one warm-up and one timed iteration).", "",
             "| variant | per-sample path | train s | train × recompute | ideal × | eff | rel err vs recompute |",
             "|---|---|---|---|---|---|---|"]
    for r in rep["rows"]:
        lines.append(f"| {r['variant']} | {'fused' if r['fused'] else 'einsum + add'} | {r['train_s']:.3f} | "
                     f"{r['train_speedup']:.2f} | {r['ideal_train_speedup']:.2f} | "
                     f"{r['train_speedup'] / r['ideal_train_speedup']:.2f} | {r['grad_relerr_vs_recompute']:.1e} |")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "floor.md").write_text("\n".join(lines) + "\n")
    (out / "floor.json").write_text(json.dumps(rep, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
