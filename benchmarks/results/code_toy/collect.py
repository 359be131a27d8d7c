"""Collect the held-out pass rates of `diffgrpo train ... dllm.task=code_toy` run directories into grpo_cli.{json,md}.

    python benchmarks/results/code_toy/collect.py <label>=<run dir> ... (label: the setting, e.g. lr1e-4_it40_s0)
"""
import json
import sys
from pathlib import Path

rows = []
for arg in sys.argv[1:]:
    label, _, run = arg.partition("=")
    s = json.loads((Path(run) / "summary.json").read_text())
    rows.append({"run": label, "start": s["start"]["eval/accuracy"], "end": s["end"]["eval/accuracy"],
                 "start_reward": s["start"]["eval/reward"], "end_reward": s["end"]["eval/reward"],
                 "iterations": s["end"]["iteration"]})
out = Path(__file__).parent
(out / "grpo_cli.json").write_text(json.dumps(rows, indent=2) + "\n")
lines = ["| run | iterations | held-out pass rate start → end | Δ | reward start → end |", "|---|---|---|---|---|"]
lines += [f"| {r['run']} | {r['iterations']} | {r['start']:.4f} → {r['end']:.4f} | {r['end'] - r['start']:+.4f} | "
          f"{r['start_reward']:.4f} → {r['end_reward']:.4f} |" for r in rows]
print("\n".join(lines))
