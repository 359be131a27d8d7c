"""``diffgrpo report <run_dir>``: one self-contained HTML page (images inlined as base64) that a person reads.

Top to bottom: the headline — the held-out reward start → end (a ``shapes_correct`` run's accuracy first) and the
guards (inside every guard, the FID and diversity ratios beside their limits) — a header (run date, diffgrpo
version, the code's git commit, training wall time, device and threads), every held-out metric start → end, one
figure per metric family — reward, fidelity (FID), diversity, guards, optimisation — with one axis per metric (so a
reward's rise is not flattened beside an FID of ~90, nor ``kl`` beside ``grad_norm``) and integer iteration ticks, a
series equal to one already plotted or constant throughout given as a one-line note instead of a panel, the
labelled start and end samples, the masked-LM completions at the start and the end, the time per phase, and the
config keys that differ from the defaults (the full resolved config folded below). Every figure has a caption.

Whatever the run directory holds, the page is written or a one-line error given: rows that are not objects, a
non-numeric iteration and non-finite values are left out of the plots and tables, a config that is not UTF-8 is
shown with replacement characters, and a ``config.yaml``, ``samples_*.png`` or sample table that is a symbolic
link is not followed (its content could be any file of the user's); a ``metrics.jsonl`` that is a link is refused.
"""
from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import os
import platform
import stat
import statistics
import subprocess
from pathlib import Path

import yaml

from .. import yamlio
from .._version import __version__
from ..config import TASK_DEFAULTS, RunConfig
from ..errors import ConfigError, TrainingError
from ..fileio import atomic_write
from ..guards import PREFIX as GUARD_PREFIX
from ..run.runlog import read_metrics
from .configdoc import task_defaults

# metric family → (title, caption, keys or key prefixes); a key belongs to the first family that claims it
FAMILIES = (
    ("Reward", "Training-batch reward and its components (left), held-out reward on fixed prompts and seeds "
               "(right of them); higher is better.",
     ("reward", "rewards/", "eval/reward", "eval/rewards/", "eval/accuracy")),
    ("Fidelity", "Fréchet distance of the held-out samples' features to the reference set (lower is closer to "
                 "the data); a rise while the reward climbs is the sign of reward hacking.", ("eval/fid",)),
    ("Diversity", "Mean pairwise feature distance among one prompt's held-out samples; a fall means the policy "
                  "collapses onto fewer outputs.", ("eval/diversity",)),
    ("Guards", "Held-out guard rewards (never trained on), the distance of the samples to the base model's own "
               "samples on the same prompts and seeds, per-prompt diversity; eval/guard/ok is 1 inside every "
               "start-anchored limit.", (GUARD_PREFIX,)),
    ("Optimisation", "Per update: KL to the reference, fraction of clipped ratios, fraction of groups with equal "
                     "rewards, gradient norm and loss, each on its own axis.",
     ("kl", "clip_ratio", "frac_reward_zero_std", "grad_norm", "loss", "learning_rate")),
    ("Consistency", "Rollout against first update at θ_old: mean and max |Δ log p| of the recomputed units, that "
                    "mean over the clip range (train.max_inconsistency judges it) and the fraction outside the clip "
                    "range; 0 on an exact configuration.",
     ("consistency/abs_dlogp_mean", "consistency/abs_dlogp_max", "consistency/dlogp_over_clip",
      "consistency/out_of_clip_frac")),
)


def _read_own(path: Path) -> bytes | None:
    """The bytes of a regular file of the run directory; None when absent, a link or not a regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        with os.fdopen(fd, "rb") as f:
            fd = -1
            return f.read()
    finally:
        if fd >= 0:
            os.close(fd)


def _png_b64(path: Path) -> str | None:
    data = _read_own(path)
    return base64.b64encode(data).decode() if data is not None else None


def _num(v) -> bool:
    """A finite real number (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _claims(prefixes: tuple[str, ...], key: str) -> bool:
    return any(key == p or (p.endswith("/") and key.startswith(p)) for p in prefixes)


def family_keys(rows: list[dict]) -> list[tuple[str, str, list[str]]]:
    """(title, caption, keys present in ``rows``) per metric family, in FAMILIES order; ``.../std`` keys and keys
    without one finite value are left out."""
    present = sorted({k for r in rows for k, v in r.items() if isinstance(k, str) and _num(v)})
    out, taken = [], set()
    for title, caption, prefixes in FAMILIES:
        keys = [k for k in present if k not in taken and _claims(prefixes, k) and not k.endswith("/std")]
        order = {p: i for i, p in enumerate(prefixes)}
        keys.sort(key=lambda k: (min(i for p, i in order.items() if _claims((p,), k)), k))
        taken.update(keys)
        if keys:
            out.append((title, caption, keys))
    return out


def _series(rows: list[dict], key: str) -> list[tuple[float, float]]:
    """(iteration, value) of ``key`` in the rows where both are finite numbers."""
    return [(r["iteration"], r[key]) for r in rows if _num(r.get(key)) and _num(r.get("iteration"))]


def _same(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    """Two series with the same iterations and values equal to rounding (e.g. a sole reward and its component)."""
    return len(a) == len(b) and all(i == j and math.isclose(u, v, rel_tol=1e-9, abs_tol=1e-12)
                                    for (i, u), (j, v) in zip(a, b))


def plan_panels(rows: list[dict]) -> list[tuple[str, str, list[str], list[str]]]:
    """(title, caption, keys to plot, notes) per metric family (:func:`family_keys`): a series with one value
    throughout is noted as constant at that value instead of drawn as a flat line, and a series identical to one
    before it (in any family) is not plotted again but noted as the same as it."""
    shown: list[tuple[str, list]] = []
    out = []
    for title, caption, keys in family_keys(rows):
        plot, notes = [], []
        for k in keys:
            pts = _series(rows, k)
            twin = next((name for name, other in shown if _same(pts, other)), None)
            values = {v for _, v in pts}
            if len(values) == 1:
                notes.append(f"{k}: constant at {values.pop():.6g}")
            elif twin is not None:
                notes.append(f"{k}: the same series as {twin}")
            else:
                plot.append(k)
            shown.append((k, pts))
        out.append((title, caption, plot, notes))
    return out


def _figure_b64(rows: list[dict], keys: list[str], title: str) -> str | None:
    """Small multiples: one axis per key against iteration, integer ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    series = [(k, pts) for k in keys if (pts := _series(rows, k))]
    if not series:
        return None
    cols = min(3, len(series))
    nrows = math.ceil(len(series) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(3.3 * cols, 2.5 * nrows), squeeze=False)
    for ax, (k, pts) in zip(axes.flat, series):
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, markersize=3)
        ax.set_title(k, fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.set_xlabel("iteration", fontsize=7)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and not prefix and k not in ("weights", "options"):
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def changed_keys(config_text: str) -> list[tuple[str, object, object]] | None:
    """(key, default, value) for every key of a saved ``config.yaml`` whose value differs from the default; None
    when the text is not a YAML mapping."""
    try:
        data = yamlio.safe_load(config_text)  # aliases bounded
    except (yaml.YAMLError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    model, train = (data.get(k) if isinstance(data.get(k), dict) else {} for k in ("model", "train"))
    task = train.get("task", "digits")  # a config saved before train.task existed trained the digits task
    default = _flat((task_defaults(str(model.get("name", "tiny")), task) if str(task) in TASK_DEFAULTS else
                     RunConfig()).to_dict())  # the keys the run's task sets count as defaults
    ran = _flat({k: v for k, v in data.items() if isinstance(k, str)})
    return [(k, default.get(k), v) for k, v in ran.items() if default.get(k, object()) != v]


def _commit() -> str:
    """The git commit of the code writing the report (a checkout), or a note that it is installed."""
    here = Path(__file__).resolve().parent
    try:
        r = subprocess.run(["git", "-C", str(here), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0 and r.stdout.strip():
            dirty = subprocess.run(["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return r.stdout.strip() + (" (with local changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return "not a git checkout (an installed package)"


def _completions(run: Path, rows: list[dict], limit: int = 8) -> list[tuple[str, list[dict]]]:
    """(label, sample-table rows with a completion) of the first and the last evaluation of a masked-LM run."""
    its = sorted({int(r["iteration"]) for r in rows if _num(r.get("iteration"))
                  and any(isinstance(k, str) and k.startswith("eval/") for k in r)})
    picks = ([("start", its[0])] + ([("end", its[-1])] if len(its) > 1 else [])) if its else []
    out = []
    for label, it in picks:
        data = _read_own(run / "samples" / f"eval_{it:06d}.jsonl")
        if data is None:
            continue
        got = []
        for line in data.decode("utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError):
                continue
            if isinstance(rec, dict) and isinstance(rec.get("completion"), str):
                got.append(rec)
        if got:
            out.append((f"{label} (iteration {it})", got[:limit]))
    return out


def _cell(v) -> str:
    text = v if isinstance(v, str) else json.dumps(v, default=str)
    return html.escape(text if len(text) <= 200 else text[:199] + "…")


def _summary(run: Path) -> dict:
    """The run's summary.json (empty when absent or unreadable)."""
    path = run / "summary.json"
    if not path.is_file() or path.is_symlink():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) else {}


_STYLE = ("<style>body{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}"
          "pre{background:#f6f6f6;padding:1em;overflow:auto;font-size:12px}"
          "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:3px 8px;"
          "text-align:left;font-size:13px;vertical-align:top}td.n{text-align:right}"
          "figure{margin:1em 0}figcaption{font-size:13px;color:#555;margin-top:.3em}"
          "img{max-width:100%;image-rendering:pixelated}img.samples{image-rendering:auto}"
          "ul.notes{font-size:13px;color:#555}table.headline td,table.headline th{font-size:15px}"
          "</style></head><body>")


def _saved_config(run: Path) -> tuple[bytes | None, str, dict]:
    """The run's ``config.yaml``: its bytes (None when absent), its text and its parsed mapping ({} if none)."""
    raw = _read_own(run / "config.yaml")
    config = raw.decode("utf-8", errors="replace") if raw is not None else "(no config.yaml)"
    try:
        saved = yamlio.safe_load(config) if raw is not None else None  # aliases bounded
    except (yaml.YAMLError, RecursionError):
        saved = None
    return raw, config, saved if isinstance(saved, dict) else {}


def _header_section(run: Path, train: list[dict], saved: dict) -> list[str]:
    """The header table: run, date, version, commit, wall time, model, device."""
    model = saved.get("model") if isinstance(saved.get("model"), dict) else {}
    wall = sum(r["time/iteration"] for r in train if _num(r.get("time/iteration")))
    stamp = datetime.datetime.fromtimestamp((run / "metrics.jsonl").stat().st_mtime).astimezone()
    header = [("run", run.name), ("last written", stamp.strftime("%Y-%m-%d %H:%M %Z")),
              ("diffgrpo", __version__), ("code commit", _commit()),
              ("training wall time", f"{wall / 60:.1f} min ({wall:.0f} s over {len(train)} iterations; "
                                     "evaluations not included)"),
              ("model", f"{model.get('name', '?')} {model.get('pretrained') or ''}".strip()),
              ("device", f"{model.get('device', '?')} (from the run's config; report written on "
                         f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPU cores)")]
    parts = ["<table>"]
    parts += [f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in header]
    parts.append("</table>")
    return parts


def _summary_section(run: Path) -> list[str]:
    """A guard's stop and the best weights inside the guards, from ``summary.json``."""
    summary, parts = _summary(run), []
    if summary.get("stopped"):
        parts.append(f"<p><b>Stopped by a guard (train.on_hacking=stop):</b> {html.escape(summary['stopped'])}</p>")
    if summary.get("inconsistent"):
        parts.append("<p><b>Stopped: rollout and update disagree (train.on_inconsistency=stop):</b> "
                     f"{html.escape(summary['inconsistent'])}</p>")
    if summary.get("best"):
        b = summary["best"]
        parts.append(f"<p>Best weights inside the guards: {html.escape(str(b['metric']))} = {b['value']:.4f} at "
                     f"iteration {b['iteration']} (<code>best/weights.safetensors</code>).</p>")
    return parts


# a shapes_correct run's accuracy leads: GenEval's overall (the mean of its categories), then over samples
HEADLINE = ("eval/rewards/shapes_correct/mean_of_tags", "eval/rewards/shapes_correct/mean", "eval/reward")


def _ratio(first: dict, last: dict, key: str) -> float | None:
    a, b = first.get(key), last.get(key)
    return b / a if _num(a) and _num(b) and a > 0 else None


def headline(evals: list[dict], saved: dict) -> list[tuple[str, str, str, str]]:
    """The report's first table, (metric, start, end, change or limit): the held-out reward (a ``shapes_correct``
    run's accuracy first), whether the end evaluation is inside every guard, and the end / start ratios of the FID
    and the diversity that the guards judge, beside their limits from the run's config."""
    if not evals:
        return []
    first, last = evals[0], evals[-1]
    train = saved.get("train") if isinstance(saved.get("train"), dict) else {}
    out = [(k, f"{first[k]:.4f}", f"{last[k]:.4f}", f"{last[k] - first[k]:+.4f}") for k in HEADLINE
           if _num(first.get(k)) and _num(last.get(k))]
    ok = last.get(GUARD_PREFIX + "ok")
    if _num(ok):
        start = first.get(GUARD_PREFIX + "ok")
        out.append((GUARD_PREFIX + "ok", f"{start:g}" if _num(start) else "n/a", f"{ok:g}",
                    "inside every guard" if ok == 1 else "outside a guard"))
    ratios = [("FID ratio", "eval/fid", "guard_max_fid_ratio", "≤")]
    ratios += [("diversity ratio", k, "guard_min_diversity_ratio", "≥")
               for k in (GUARD_PREFIX + "diversity", "eval/diversity", GUARD_PREFIX + "detection_diversity")]
    for name, key, limit, sign in ratios:
        r = _ratio(first, last, key)
        if r is not None and not (name == "diversity ratio" and any(n.startswith(name) for n, *_ in out)):
            bound = f"limit {sign} {train[limit]:g}" if _num(train.get(limit)) and train[limit] > 0 else ""
            out.append((f"{name} ({key})", f"{first[key]:.4g}", f"{last[key]:.4g} (× {r:.3f})", bound))
    return out


def _headline_section(evals: list[dict], saved: dict) -> list[str]:
    """The held-out reward and the guards, start → end: the first table of the page."""
    rows = headline(evals, saved)
    if not rows:
        return ["<p><b>No held-out evaluation in this run.</b></p>"]
    parts = ["<h2>Held-out reward and guards, start → end</h2><table class=headline><tr><th>metric</th>"
             "<th>start</th><th>end</th><th>change / limit</th></tr>"]
    parts += [f"<tr><td>{html.escape(m)}</td><td class=n>{html.escape(a)}</td><td class=n>{html.escape(b)}</td>"
              f"<td>{html.escape(c)}</td></tr>" for m, a, b, c in rows]
    parts.append("</table>")
    return parts


def _eval_section(evals: list[dict]) -> list[str]:
    """The held-out metrics at the first and the last evaluation, with their change."""
    if not evals:
        return []
    eval_keys = sorted({k for r in evals for k in r if isinstance(k, str) and k.startswith("eval/")})
    first, last = evals[0], evals[-1]
    parts = ["<h2>Held-out evaluation, start → end: every metric</h2><table><tr><th>metric</th><th>start</th>"
             "<th>end</th><th>change</th></tr>"]
    for k in eval_keys:
        if _num(first.get(k)) and _num(last.get(k)):
            parts.append(f"<tr><td>{html.escape(k)}</td><td class=n>{first[k]:.4f}</td><td class=n>"
                         f"{last[k]:.4f}</td><td class=n>{last[k] - first[k]:+.4f}</td></tr>")
    parts.append("</table>")
    return parts


def _figures_section(rows: list[dict]) -> list[str]:
    """One captioned figure per metric family present in the run (:func:`plan_panels`), its duplicate and
    constant series listed below it, one line each."""
    parts = []
    for title, caption, keys, notes in plan_panels(rows):
        b64 = _figure_b64(rows, keys, title) if keys else None
        parts.append(f"<h2>{html.escape(title)}</h2>")
        if b64:
            parts.append(f"<figure><img alt='{html.escape(title)}' src='data:image/png;base64,{b64}'><figcaption>"
                         f"{html.escape(caption)}</figcaption></figure>")
        if notes:
            parts.append("<ul class=notes>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes) + "</ul>")
    return parts


def _samples_section(run: Path) -> list[str]:
    """The start and end samples: the pair when the run wrote it, else each grid on its own."""
    pair = _png_b64(run / "samples_start_end.png")
    if pair:
        return ["<h2>Samples, start and end</h2><figure><img class=samples alt='samples start and end' "
                f"src='data:image/png;base64,{pair}'><figcaption>Held-out samples at the start (the base model, "
                "top half) and at the end (bottom half), each half labelled: the same prompts and seeds, so each "
                "tile pairs with the one at its place in the other half. Under each tile: the checker's verdict "
                "(✓ correct / ✗ wrong) or the sample's reward, then its prompt.</figcaption></figure>"]
    parts = []
    for tag in ("start", "end"):
        b64 = _png_b64(run / f"samples_{tag}.png")
        if b64:
            parts.append(f"<h2>Samples at the {tag}</h2><figure><img class=samples alt='samples {tag}' "
                         f"src='data:image/png;base64,{b64}'><figcaption>Held-out samples at the {tag} (fixed "
                         "prompts and seeds).</figcaption></figure>")
    return parts


def _completions_section(run: Path, rows: list[dict]) -> list[str]:
    """A masked-LM run's completions at the first and the last evaluation, with reference and reward."""
    completions = _completions(run, rows)
    if not completions:
        return []
    parts = ["<h2>Completions, start and end</h2>"]
    for label, recs in completions:
        parts.append(f"<h3>{html.escape(label)}</h3><table><tr><th>prompt</th><th>completion</th>"
                     "<th>reference</th><th>reward</th></tr>")
        for rec in recs:
            meta = rec.get("metadata") if isinstance(rec.get("metadata"), dict) else {}
            reward = rec.get("reward")
            parts.append(f"<tr><td>{_cell(rec.get('prompt', ''))}</td><td>{_cell(rec['completion'])}</td>"
                         f"<td>{_cell(meta.get('answer', ''))}</td><td class=n>"
                         f"{f'{reward:.3f}' if _num(reward) else 'n/a'}</td></tr>")
        parts.append("</table>")
    parts.append("<p style='font-size:13px;color:#555'>The first evaluation prompts with their decoded "
                 "completions, the reference answer and the reward.</p>")
    return parts


def _timing_section(train: list[dict]) -> list[str]:
    """The mean seconds per iteration of every ``time/`` phase."""
    timing_keys = sorted({k for r in train for k in r if isinstance(k, str) and k.startswith("time/")})
    timing = [(k, statistics.mean(r[k] for r in train if _num(r.get(k)))) for k in timing_keys
              if any(_num(r.get(k)) for r in train)]
    if not timing:
        return []
    parts = ["<h2>Time per phase (mean seconds per iteration)</h2><table><tr><th>phase</th><th>s</th></tr>"]
    parts += [f"<tr><td>{html.escape(k)}</td><td class=n>{v:.3f}</td></tr>" for k, v in timing]
    parts.append("</table>")
    return parts


def _config_section(raw: bytes | None, config: str) -> list[str]:
    """The keys the run changed from the defaults, then the whole resolved config folded; closes the page."""
    changed = changed_keys(config) if raw is not None else None
    parts = ["<h2>Config: the keys this run changed</h2>"]
    if changed:
        parts.append("<table><tr><th>key</th><th>default</th><th>this run</th></tr>")
        parts += [f"<tr><td>{html.escape(k)}</td><td>{_cell(d)}</td><td>{_cell(v)}</td></tr>" for k, d, v in changed]
        parts.append("</table>")
    else:
        parts.append("<p>Every key at its default.</p>" if changed == [] else "<p>(no readable config.yaml)</p>")
    parts.append(f"<details><summary>Resolved config</summary><pre>{html.escape(config)}</pre></details>"
                 "</body></html>")
    return parts


def write_report(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write ``report.html`` (or ``out``) for a run directory; returns its path. A ``metrics.jsonl`` that is a
    symbolic link is refused (ConfigError), and JSON or YAML nested too deep to read is a one-line TrainingError."""
    run = Path(run_dir)
    if (run / "metrics.jsonl").is_symlink():
        raise ConfigError(f"report: {str(run / 'metrics.jsonl')!r} is a symbolic link; nothing is read through a "
                          "link (copy the file into the run directory)")
    if not (run / "metrics.jsonl").is_file():
        raise FileNotFoundError(f"{run} has no metrics.jsonl: not a diffgrpo run directory")
    try:
        return _write(run, out)
    except RecursionError:  # a value nested too deep for the parsers or the encoder, wherever it is
        raise TrainingError(f"report: {str(run)!r} holds JSON or YAML nested too deep to read") from None


def _write(run: Path, out: str | Path | None) -> Path:
    rows = [r for r in read_metrics(run / "metrics.jsonl") if isinstance(r, dict)]
    train = [r for r in rows if "reward" in r]
    evals = [r for r in rows if any(isinstance(k, str) and k.startswith("eval/") for k in r)]
    raw, config, saved = _saved_config(run)
    head = ["<!doctype html><html><head><meta charset='utf-8'><title>diffgrpo run report</title>", _STYLE,
            f"<h1>Run report: {html.escape(run.name)}</h1>"]
    parts = (head + _headline_section(evals, saved) + _summary_section(run) + _header_section(run, train, saved)
             + _eval_section(evals)
             + _figures_section(rows) + _samples_section(run) + _completions_section(run, rows)
             + _timing_section(train) + _config_section(raw, config))
    dest = Path(out) if out else run / "report.html"
    atomic_write(dest, "\n".join(parts))  # never through a symlink planted at the destination
    return dest
