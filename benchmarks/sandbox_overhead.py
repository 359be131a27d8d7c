"""Sandbox overhead per completion: wall-clock ms of one trivial program (``x = 1``, one test) run sequentially,
median and quartiles over ``--runs`` runs, for each backend that starts here, beside a bare interpreter start
(``python -I -S -c pass``, what any process-per-completion runner pays) and the confined harness without its
confinement steps.

    OMP_NUM_THREADS=1 python benchmarks/sandbox_overhead.py --runs 50 --out benchmarks/results/sandbox
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import diffgrpo.sandbox as sb
import diffgrpo.sandbox.process as sb_process
from diffgrpo.sandbox import BwrapBackend, Limits, LocalBackend, Program


def timed(fn, runs: int) -> dict:
    ms = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        ms.append(1000 * (time.perf_counter() - t0))
    q = statistics.quantiles(ms, n=4)
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "runs": runs}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=50)
    p.add_argument("--out", default="benchmarks/results/sandbox")
    args = p.parse_args()
    prog, lim = Program("x = 1", ["assert x == 1"]), Limits()

    def unconfined():
        job = sb_process.make_job(prog, lim, confine=False)
        with sb_process.PrivateDir() as d:
            d.write_job(job)
            sb_process.run_process([sys.executable, "-I", "-S", "-c", sb.HARNESS_SOURCE, d.job_path], job, lim,
                                   cwd=d.work, env=sb_process.scrubbed_env(d.work), job_path=d.job_path)

    rows = {"bare interpreter start": timed(lambda: subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], check=True),
                                            args.runs),
            "harness, no confinement": timed(unconfined, args.runs)}
    backends = [LocalBackend()] + ([BwrapBackend()] if sb.find_bwrap() else [])
    for b in backends:
        r = b.run(prog, lim)
        assert r.all_passed, r
        rows[f"{b.name} ({', '.join(r.confined)})"] = timed(lambda b=b: b.run(prog, lim), args.runs)
    load = os.getloadavg()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = "OMP_NUM_THREADS=1 python benchmarks/sandbox_overhead.py " + " ".join(sys.argv[1:])
    (out / "overhead.json").write_text(json.dumps({"command": cmd, "loadavg": load, "cpus": os.cpu_count(),
                                                   "rows": rows}, indent=2) + "\n")
    machine = (f"Machine: {os.cpu_count()} CPUs, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} "
               "(1 / 5 / 15 min) during the run.")
    lines = ["# Sandbox overhead per completion", "", f"Command: `{cmd}`", "", machine, "",
             "| what runs | median ms | quartiles ms |", "|---|---|---|"]
    lines += [f"| {k} | {v['median_ms']:.0f} | {v['q1_ms']:.0f} – {v['q3_ms']:.0f} |" for k, v in rows.items()]
    (out / "overhead.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
