"""The outputs a reader of ``diffgrpo bench quality`` sees: the Markdown table (``table.md``: the target, the guards,
time and cost to the target with their intervals, diversity there, where the speed-up comes from) and the figures
(``curves.png``: reward against wall-clock and counted cost, reward against each guard; ``frontier.png``: speed-up
against diversity at the target per diversity objective), all from a summary of
:func:`~diffgrpo.studies.quality_stats.summarize`."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from .quality_stats import PHASES


def _fmt(x, f="{:.1f}"):
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f.format(x)


def _ci(ci, f="{:.1f}"):
    lo, hi = ci
    return "" if not (math.isfinite(lo) or math.isfinite(hi)) else f" [{_fmt(lo, f)}, {_fmt(hi, f)}]"


def first_out_words(outs: list) -> str:
    """Per-seed :func:`~.quality_stats.first_out` results → '3/5: eval/guard/diversity at 31% (reward 0.884)', or 'none'."""
    hit = [o for o in outs if o]
    if not hit:
        return "none"
    names = [", ".join(o["guards"]) for o in hit]
    common = max(dict.fromkeys(names), key=names.count)
    return (f"{len(hit)}/{len(outs)}: {common} at {statistics.median(o['cost_fraction'] for o in hit):.0%} "
            f"(reward {statistics.median(o['reward'] for o in hit):.3f})")


def guard_words(g: dict, start: dict) -> str:
    """Seed-mean guard metrics at the end, FID and diversity as ratios to the start: 'fid 1.21×, drift 0.31, …'."""
    out = []
    for key, name, ratio in (("eval/fid", "fid", True), ("eval/guard/kid", "kid", False),
                             ("eval/guard/drift", "drift", False),
                             ("eval/guard/diversity", "div", True)):
        v, v0 = g.get(key), start.get(key)
        if v is None or not math.isfinite(v):
            continue
        out.append(f"{name} {v / v0:.2f}×" if ratio and v0 else f"{name} {v:.2f}")
    out += [f"{k.split('/')[-2]} {v:.3g}" for k, v in g.items() if k.startswith("eval/guard/rewards/")]
    return ", ".join(out) or "—"


def _tuning_lines(t: dict | None) -> list[str]:
    """The tuning stage's chosen settings and cost (``--tune``), or nothing."""
    if not t:
        return []
    chosen = "; ".join(f"{v}: " + ", ".join(f"{k}={x}" for k, x in st.items()) for v, st in t["chosen"].items())
    return [f"Settings tuned first (tune/grid.md): {t['cells']} grid cells × tuning seeds {t['seeds']} (not the "
            f"measuring seeds), {t['counted_cost']:.0f} counted cost units, {t['seconds']:.0f} s. Chosen: {chosen}.", ""]


def at_target(row: dict, s: dict) -> float:
    """A row's headline diversity at the target (× its start; NaN: no seed reached the target or no diversity)."""
    return (row.get("diversity_at_target") or {}).get(s.get("diversity_key") or "", math.nan)


def objective(row: dict) -> str:
    """The diversity objective a variant's overrides choose (``diversity.method=…``; 'off' without one)."""
    for o in row.get("overrides") or []:
        key, _, value = o.partition("=")
        if key.strip() == "diversity.method":
            return value.strip().strip("[]").replace(" ", "") or "off"
    return "off"


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points (x, y) no other point beats in both x and y (higher is better in both), sorted by x."""
    keep = [p for p in points if not any(q[0] >= p[0] and q[1] >= p[1] and q != p for q in points)]
    return sorted(set(keep))


def _legend(s: dict) -> str:
    """The words under the table: what each column means (summary ``s``: the diversity key, the guard patience)."""
    return ("'time to target': training wall-clock (mean over seeds) at each seed's first evaluation at the target "
            "inside its guards (— : some seed never did within the budget); 'diversity at target': "
            f"{s.get('diversity_key') or 'per-prompt diversity'} at each seed's first evaluation at the target "
            "inside its guards ÷ that seed's start, mean over the seeds that reached it; 'stop + keep_best': "
            "what a user running train.on_hacking=stop with train.keep_best on the metric ends with: the best "
            "evaluation inside the guards before the run stops at "
            + ("its first evaluation out" if s.get("guard_patience", 1) == 1 else
               f"{s['guard_patience']} evaluations in a row out (train.guard_patience)") +
            " (each judged alone, the start included), seed mean, and how many runs the guards stopped; "
            "'hacks': some seed was at the target "
            "with a guard out of limits; 'guards at end': seed means at the last evaluation (FID and diversity "
            "as ratios to the start); 'first out of guards': seeds with a guard out at some evaluation, the guard "
            "out first in most of them, and the median fraction of the budget and reward there; intervals: "
            "percentile bootstrap over seeds (speed-up: seeds paired).")


def to_markdown(meta: dict, s: dict) -> str:
    """``table.md``: the cells and budget (``meta``), the target, the guards, one row per variant, and where each
    speed-up comes from (summary ``s``)."""
    p = s["plateau"]
    plat = ("not judged (one seed)" if p["plateaued"] is None else
            ("yes" if p["plateaued"] else "**no**") + f" (trend {p['trend']:+.4f} vs noise ±{p['noise']:.4f} over the "
            f"last quarter of its budget, {p['points']} evaluations)")
    th = s["thresholds"]
    budget_words = (f" (= {meta['iterations']} iterations of {s['reference']})"
                    if meta["iterations"] and not meta.get("interrupted") else "")
    lines = [
        f"# Time to quality: {meta['title']}", "", f"Command: `{meta['command']}`", "",
        (f"Cells: {len(meta['variants'])} variants × seeds {meta['seeds']}, stepped interleaved in one process (least "
        f"counted cost first). Budget: {meta['budget_cost']:.0f} counted cost units per cell"
        f"{budget_words}"
        f"; {meta['evals']} evaluations per cell after the start one, {meta.get('eval_spacing', 'linear')} in cost "
        + (f"plus {meta['focus'][2]} from {meta['focus'][0]:.0%} to {meta['focus'][1]:.0%} of the budget (dense "
           "around the tuned reference's crossing) " if meta.get("focus") else "") +
        f"({meta['eval_samples']} held-out samples each). "
        f"Total benchmark time {meta['total_seconds']:.0f} s; machine load at start {meta['load']}."
        + (f" **Stopped by signal {meta['interrupted']['signal']}: summarised at evaluation mark "
           f"{meta['interrupted']['marks']} of {meta['evals']}, so the budget above is that mark's cost.**"
           if meta.get("interrupted") else "")), "",
        f"Target: {s['metric']} ≥ {s['target']:.4f}"
        + (f", given with --target (start {s['start']:.4f}; the reference's level over the last quarter of its budget "
           f"{p['level']:.4f})" if s.get("target_given") else
           f" = start {s['start']:.4f} + {s['target_fraction']:g} × the reference's gain at its plateau (level "
           f"{p['level']:.4f})")
        + f". Reference plateaued: {plat}."
        + (" **The reference gained nothing within the budget: the target is not a gain; raise the budget.**"
           if s["reference_gain"] <= 0 else ""), "",
        ("Guards, each relative to the cell's own start: "
        + (f"eval/guard/kid ≤ start + {th.get('max_kid', 0):g} (built-in task), " if th.get("distance") == "kid"
           else f"eval/fid ≤ {th['max_fid_ratio']:g}× (built-in task), ") +
        f"eval/guard/drift ≤ {th['max_drift']:g}, diversity ≥ {th['min_diversity_ratio']:g}×, guard rewards ≥ start − "
        f"{th['max_reward_drop']:g}×|start| (0 = off)"
        + (f"; each evaluation's guards judged on its mean with the next {s['guard_mean'] - 1}" if s.get("guard_mean", 1) > 1
           else "") + "."), "",
        *_tuning_lines(meta.get("tuning")),
        ("| variant | s / it | cost / it | iterations | reached | time to target (s) [95% CI] | cost to target | "
        "speed-up vs reference (time) [95% CI] | speed-up in cost [95% CI] | diversity at target | final reward | "
        "stop + keep_best: reward kept (runs stopped) | guards at end | out of guards at end | first out of guards | "
        "hacks |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        failed = f" ({len(r['failed'])} failed)" if r.get("failed") else ""
        lines.append(
            f"| {r['variant']} | {r['seconds_per_iteration']:.2f} | {r['cost_per_iteration']:.0f} | "
            f"{r['iterations']:.1f} | {r['reached']}/{len(r['seeds'])}{failed} | {_fmt(r['time_to_target'])}"
            f"{_ci(r['time_to_target_ci'])} | {_fmt(r['cost_to_target'], '{:.0f}')} | {_fmt(r['speedup'], '{:.2f}×')}"
            f"{_ci(r['speedup_ci'], '{:.2f}')} | {_fmt(r.get('cost_speedup'), '{:.2f}×')}"
            f"{_ci(r.get('cost_speedup_ci', (math.nan, math.nan)), '{:.2f}')} | "
            f"{_fmt(at_target(r, s), '{:.2f}×')} | "
            f"{r['final_reward']:.4f} ± {r['final_reward_std']:.4f} | "
            + (f"{r['kept_reward']:.4f} ± {r['kept_reward_std']:.4f} ({r['kept_stopped']}/{len(r['kept'])}) | "
               if "kept" in r else "— | ") +
            f"{guard_words(r['final_guards'], s['start_guards'])} | "
            f"{', '.join(r['final_out_of_guards']) or 'none'} | {first_out_words(r['first_out_of_guards'])} | "
            f"{'yes' if r['hacks'] else 'no'} |")
    lines += ["", _legend(s), "",
              ("Where the speed-up comes from: a time speed-up is about the product of the iteration's speed-up (the "
              "reference's s / it ÷ the variant's) and the ratio of the iterations (rollouts) each needs to the "
              "target; and where each variant's training wall-clock goes (all seeds):"), "",
              ("| variant | iteration speed-up | iterations to target | iterations ratio | sampling | reward | train "
              "| other |"), "|---|---|---|---|---|---|---|---|"]
    ref_row = next(r for r in s["rows"] if r["variant"] == s["reference"])
    for r in s["rows"]:
        sh = r.get("time_shares") or {}
        its, ref_its = r.get("iterations_to_target", math.nan), ref_row.get("iterations_to_target", math.nan)
        spi = r["seconds_per_iteration"]
        lines.append(f"| {r['variant']} | {_fmt(ref_row['seconds_per_iteration'] / spi if spi else math.nan, '{:.2f}×')} | "
                     f"{_fmt(its)} | {_fmt(ref_its / its if its and math.isfinite(its) else math.nan, '{:.2f}×')} | "
                     + " | ".join(f"{sh[k]:.0%}" if k in sh else "—" for k in (*PHASES, "other")) + " |")
    return "\n".join(lines) + "\n"


def plot(s: dict, path: Path) -> None:
    """Top: the seed-mean reward against training wall-clock and against counted cost (band: ± std over seeds when
    few variants are drawn). Bottom: the reward against each guard, FID and diversity as ratios to the start, with
    the guard's limit dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metric, th, start = s["metric"], s["thresholds"], s.get("start_guards") or {}
    limits = {"eval/fid": (True, th["max_fid_ratio"]), "eval/guard/drift": (False, th["max_drift"]),
              "eval/guard/diversity": (True, th["min_diversity_ratio"])}
    gkeys = [k for k in limits if any(k in p["metrics"] for r in s["rows"] for p in r["curve"])]
    many = len(s["rows"]) > 10
    cmap = plt.get_cmap("tab20" if many else "tab10")
    ncol = max(2, len(gkeys))
    fig, axes = plt.subplots(2 if gkeys else 1, ncol, figsize=(5.4 * ncol, 4.2 * (2 if gkeys else 1) + 0.9),
                             squeeze=False)
    for i, row in enumerate(s["rows"]):
        c, col, ls = row["curve"], cmap(i % cmap.N), ("-" if i % 2 == 0 or not many else "--")
        ys = [p["metrics"].get(metric, float("nan")) for p in c]
        sd = [p["reward_std"] for p in c]
        for ax, x in ((axes[0][0], "seconds"), (axes[0][1], "cost")):
            xs = [p[x] for p in c]
            ax.plot(xs, ys, marker="o", ms=2.5, lw=1.2, ls=ls, color=col, label=row["variant"])
            if len(s["rows"]) <= 6:
                ax.fill_between(xs, [y - d for y, d in zip(ys, sd)], [y + d for y, d in zip(ys, sd)], color=col,
                                alpha=0.12)
        for ax, k in zip(axes[1] if gkeys else [], gkeys):
            ratio, v0 = limits[k][0], start.get(k)
            gx = [p["metrics"].get(k, float("nan")) / (v0 if ratio and v0 else 1.0) for p in c]
            ax.plot(gx, ys, marker="o", ms=2.5, lw=1.0, ls=ls, color=col)
    spare = list(axes[0][2:])  # top-row panels without a curve: the legend goes there
    for ax in axes.flat:
        if ax in spare:
            ax.axis("off")
            continue
        ax.axhline(s["target"], color="k", ls="--", lw=0.8)
        ax.grid(alpha=0.3)
        ax.set_ylabel(f"{metric} (seed mean)")
    axes[0][0].set_xlabel("training wall-clock, s")
    axes[0][1].set_xlabel("counted cost (sample-forwards + 2 × sample-backwards)")
    for ax, k in zip(axes[1] if gkeys else [], gkeys):
        ratio, lim = limits[k]
        ax.set_xlabel(f"{k}" + (" ÷ its start value" if ratio and start.get(k) else "") + " (dashed: the limit)")
        if lim:
            ax.axvline(lim, color="r", ls="--", lw=0.8)
    handles = axes[0][0].get_legend_handles_labels()
    if spare:
        spare[0].legend(*handles, loc="center", ncol=2 if len(s["rows"]) > 8 else 1, fontsize=8, frameon=False)
        rect = (0, 0, 1, 1)
    else:
        fig.legend(*handles, loc="lower center", ncol=min(len(s["rows"]), 6), fontsize=7, frameon=False)
        rect = (0, 0.04 + 0.018 * math.ceil(len(s["rows"]) / 6), 1, 1)
    fig.suptitle("Time to quality (black dashed: the target)")
    fig.tight_layout(rect=rect)
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


def plot_frontier(s: dict, path: Path) -> None:
    """``frontier.png``, one colour per diversity objective (``diversity.method``): left, each variant's speed-up to
    the target inside the guards (vs the reference; bars: 95 % interval) against its diversity there ÷ the start,
    the objective's Pareto frontier joined, the goal (≥ 5× at ≥ 0.95×) and the guard's limit marked; right, the
    end of the budget: final reward against final diversity ÷ the start. Variants no seed of which reached the target
    are named under the left panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    key, th, start = s.get("diversity_key"), s["thresholds"], s.get("start_guards") or {}
    objectives = list(dict.fromkeys(objective(r) for r in s["rows"]))
    cmap = plt.get_cmap("tab10")
    colour = {o: cmap(i % cmap.N) for i, o in enumerate(objectives)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 5.2))
    missed = []
    for o in objectives:
        rows = [r for r in s["rows"] if objective(r) == o]
        pts = []
        for r in rows:
            x, y = at_target(r, s), r["speedup"]
            if not (math.isfinite(x) and math.isfinite(y) and y > 0):
                missed.append(f"{r['variant']} ({r['reached']}/{len(r['seeds'])} seeds)")
                continue
            lo, hi = r["speedup_ci"]
            lo = lo if math.isfinite(lo) and lo > 0 else y
            hi = hi if math.isfinite(hi) else y
            left.errorbar([x], [y], yerr=[[max(y - lo, 0)], [max(hi - y, 0)]], fmt="o", color=colour[o], ms=5,
                          capsize=2, lw=0.8)
            left.annotate(r["variant"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
            pts.append((x, y))
        front = pareto(pts)
        if front:
            left.plot([p[0] for p in front], [p[1] for p in front], color=colour[o], lw=1.2, label=o)
        fx = [r["final_guards"].get(key, math.nan) / start[key] if key and start.get(key) else math.nan for r in rows]
        fy = [r["final_reward"] for r in rows]
        right.scatter(fx, fy, color=colour[o], s=22, label=o)
        for r, x, y in zip(rows, fx, fy):
            right.annotate(r["variant"], (x, y), fontsize=6, xytext=(3, 3), textcoords="offset points")
    left.set_yscale("log")
    left.yaxis.set_major_locator(matplotlib.ticker.LogLocator(base=10, subs=(1.0, 2.0, 3.0, 5.0)))
    left.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}×"))
    left.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    left.axhline(1.0, color="k", lw=0.6)
    left.axhline(5.0, color="g", ls=":", lw=0.9)
    for ax in (left, right):
        ax.axvline(th["min_diversity_ratio"], color="r", ls="--", lw=0.8)
        ax.axvline(0.95, color="g", ls=":", lw=0.9)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(title="diversity.method", fontsize=7, title_fontsize=7, frameon=False)
    right.axhline(s["target"], color="k", ls="--", lw=0.8)
    left.set_xlabel("diversity at the target ÷ start")
    left.set_ylabel(f"speed-up to the target vs {s['reference']} (time)")
    right.set_xlabel("diversity at the end ÷ start")
    right.set_ylabel("reward at the end (seed mean; dashed: the target)")
    left.set_title("at the target, inside the guards (seeds that all reached it)", fontsize=10)
    right.set_title("at the end of the budget", fontsize=10)
    fig.suptitle(f"reward {s['metric']}, diversity {key or '—'}; red dashed: the guard's limit, green dotted: the "
                 "goal (≥ 5× sooner at ≥ 0.95× diversity)", fontsize=9)
    if missed:
        fig.text(0.01, 0.01, "not at the target inside the guards in every seed: " + ", ".join(missed), fontsize=7)
    fig.tight_layout(rect=(0, 0.04 if missed else 0, 1, 1))
    fig.savefig(path, dpi=100, format="png")
    plt.close(fig)


__all__ = ["at_target", "first_out_words", "guard_words", "objective", "pareto", "plot", "plot_frontier",
           "to_markdown"]
