"""``diffgrpo report <run_dir>``: one self-contained HTML page (images inlined as base64) with the resolved
config, reward / loss-side curves, timing per phase and the start/end sample grids."""
from __future__ import annotations

import base64
import html
import json
import statistics
from pathlib import Path

from . import guards
from .fileio import atomic_write
from .runlog import curve_png, read_metrics


def _png_b64(path: Path) -> str | None:
    return base64.b64encode(path.read_bytes()).decode() if path.is_file() else None


def _plot_b64(rows: list[dict], keys: list[str], title: str) -> str | None:
    png = curve_png(rows, keys, title, size=(6, 3.2), dpi=100, fontsize=7)
    return base64.b64encode(png).decode() if png is not None else None

def _summary(run: Path) -> dict:
    """The run's summary.json (empty when absent or unreadable)."""
    path = run / "summary.json"
    if not path.is_file() or path.is_symlink():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` (or ``out``) for a run directory; returns its path."""
    run = Path(run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run} has no metrics.jsonl: not a diffgrpo run directory")
    rows = read_metrics(run / "metrics.jsonl")
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    config = (run / "config.yaml").read_text() if (run / "config.yaml").is_file() else "(no config.yaml)"
    eval_keys = sorted({k for r in evals for k in r if k.startswith("eval/")})
    guard_keys = [k for k in eval_keys if k.startswith(guards.PREFIX) or k in ("eval/fid", "eval/diversity")]
    reward_keys = ["reward"] + sorted({k for r in train for k in r if k.startswith("rewards/")})
    plots = [
        ("Reward (training batches)", _plot_b64(train, reward_keys, "reward")),
        ("Held-out evaluation", _plot_b64(evals, [k for k in eval_keys if k not in guard_keys],
                                          "held-out (fixed prompts and seeds)")),
        ("Guards (held-out guard rewards, distance to the base samples, diversity)",
         _plot_b64(evals, guard_keys, "guards; eval/guard/ok = 1 inside every start-anchored limit")),
        ("Policy statistics", _plot_b64(train, ["kl", "clip_ratio", "frac_reward_zero_std", "grad_norm"],
                                        "kl / clip ratio / zero-std groups / grad norm")),
    ]
    timing_keys = sorted({k for r in train for k in r if k.startswith("time/")})
    timing = [(k, statistics.mean(r[k] for r in train if isinstance(r.get(k), (int, float)))) for k in timing_keys
              if any(isinstance(r.get(k), (int, float)) for r in train)]
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>diffgrpo run report</title>",
             "<style>body{font-family:sans-serif;max-width:960px;margin:2em auto;color:#222}"
             "pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:12px}"
             "table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
             "img{max-width:100%;image-rendering:pixelated}</style></head><body>",
             f"<h1>Run report: {html.escape(run.name)}</h1>",
             f"<p>{len(train)} training iterations, {len(evals)} evaluations.</p>"]
    summary = _summary(run)
    if summary.get("stopped"):
        parts.append(f"<p><b>Stopped by a guard (train.on_hacking=stop):</b> {html.escape(summary['stopped'])}</p>")
    if summary.get("best"):
        b = summary["best"]
        parts.append(f"<p>Best weights inside the guards: {html.escape(str(b['metric']))} = {b['value']:.4f} at "
                     f"iteration {b['iteration']} (<code>best/weights.safetensors</code>).</p>")
    if evals:
        first, last = evals[0], evals[-1]
        parts.append("<h2>Held-out evaluation, start → end</h2><table><tr><th>metric</th><th>start</th>"
                     "<th>end</th><th>change</th></tr>")
        for k in eval_keys:
            if isinstance(first.get(k), (int, float)) and isinstance(last.get(k), (int, float)):
                parts.append(f"<tr><td>{html.escape(k)}</td><td>{first[k]:.4f}</td><td>{last[k]:.4f}</td>"
                             f"<td>{last[k] - first[k]:+.4f}</td></tr>")
        parts.append("</table>")
    for title, b64 in plots:
        if b64:
            parts.append(f"<h2>{title}</h2><img alt='{html.escape(title)}' src='data:image/png;base64,{b64}'>")
    if timing:
        parts.append("<h2>Time per phase (mean seconds per iteration)</h2><table><tr><th>phase</th><th>s</th></tr>")
        parts += [f"<tr><td>{html.escape(k)}</td><td>{v:.3f}</td></tr>" for k, v in timing]
        parts.append("</table>")
    for tag in ("start", "end"):
        b64 = _png_b64(run / f"samples_{tag}.png")
        if b64:
            parts.append(f"<h2>Samples at the {tag}</h2><img alt='samples {tag}' src='data:image/png;base64,{b64}'>")
    parts.append(f"<h2>Resolved config</h2><pre>{html.escape(config)}</pre></body></html>")
    dest = Path(out) if out else run / "report.html"
    atomic_write(dest, "\n".join(parts))  # never through a symlink planted at the destination
    return dest
