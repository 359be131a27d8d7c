"""``diffgrpo bench quality``: time to quality of config variants against a reference, inside start-anchored guards.

Every *cell* (variant × seed) is a :class:`~diffgrpo.trainer.Trainer` built from one base config plus the variant's
overrides and ``seed=<s>``; all cells live in one process and are stepped **interleaved**: the next iteration goes to
the unfinished cell with the least counted cost so far (ties: listing order), so the schedule does not depend on the
machine's load, and load noise hits every variant alike.

  cost        sample-forwards (rollout and training, with and without grad) + 2 × sample-backwards (the counters)
  budget      ``iterations`` of the reference variant, converted to counted cost (the reference seeds' mean cost per
              iteration × iterations, measured on their first iteration), the same for every cell; or a counted
              cost directly. Never seconds: a loaded machine cannot move the target.
  wall-clock  cumulative ``trainer.step()`` seconds of each cell (evaluation excluded), measured side by side
  evaluation  at the start and whenever a cell's cost passes a mark: budget·j/evals (j = 1 … evals; ``linear``) or
              budget·(j/evals)² (``quadratic``: denser early, so a variant several times faster than the reference is
              still resolved); ``trainer.evaluate()`` (fixed prompts and seeds), with the guards of
              :mod:`diffgrpo.guards` beside the reward
  failures    a cell whose training stops with a ``TrainingError`` (non-finite weights, repeated bad updates) is
              finished there and reported as failed (it never reaches the target); the other cells go on

Target: the start reward plus ``target_fraction`` × the reference's gain at its plateau (the mean of its seed-mean
curve over the last quarter of the budget, minus the start). The reference *plateaued* when the least-squares trend
across that last quarter is within twice the standard error of the seed mean (one seed: not judged). A cell reaches the target at its
first evaluation whose reward ≥ target while every guard is inside its limits relative to **that cell's own start**
(``guards.tripped`` with the ``train.guard_*`` thresholds); reaching it only outside the guards is reported as
hacking. Time to target, its speed-up over the reference (seeds paired) and their 95 % intervals come from a
percentile bootstrap over seeds (a seed that never reaches the target counts as infinitely slow).

Outputs (``out``): ``table.md``, ``summary.json`` (every cell's evaluation curve, the aggregate, intervals),
``curves.png`` (reward vs wall-clock and vs cost, guard metrics vs reward), ``configs/<variant>_seed<s>.yaml`` (one
resolved config per cell) and ``command.txt``; no per-iteration logs. Cost: the cells' training plus
(evals + 1) evaluations per cell.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import shlex
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import guards
from ..config import MODEL_FAMILIES, RunConfig
from ..errors import ConfigError, TrainingError
from ..fileio import atomic_write, claim_folder, run_root
from ..trainer import Trainer

METRIC = "eval/reward"
SPACINGS = ("linear", "quadratic")
PHASES = ("sample", "reward", "train")  # the trainer's time/<phase> keys; the rest of a step is "other"
MARKER = ".diffgrpo-bench-quality"


# ---------------------------------------------------------------------- pure functions
def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME=key=value,key=value`` (or a bare ``NAME``: no overrides) → (name, overrides)."""
    name, _, ov = spec.partition("=")
    if not name.strip():
        raise ConfigError(f"--variant: {spec!r} must be NAME or NAME=key=value[,key=value...]")
    return name.strip(), [o.strip() for o in ov.split(",") if o.strip()]


def eval_marks(budget: float, evals: int, spacing: str = "linear") -> list[float]:
    """The costs at which a cell is evaluated after its start: budget·j/evals (``linear``) or budget·(j/evals)²
    (``quadratic``), j = 1 … evals; ascending, the last one the budget."""
    if spacing not in SPACINGS:
        raise ConfigError(f"--eval-spacing: {spacing!r} is not one of {list(SPACINGS)}")
    power = 2 if spacing == "quadratic" else 1
    return [budget * (j / evals) ** power for j in range(1, evals + 1)]


def bootstrap_ci(samples: np.ndarray, stat, n: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of ``stat(samples[idx])`` over ``n`` resamples of the rows (seeds) with replacement.
    samples (S, ...) → (lo, hi); NaN when S < 2."""
    S = samples.shape[0]
    if S < 2:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    vals = np.array([stat(samples[rng.integers(0, S, S)]) for _ in range(n)], dtype=float)
    a = (1 - level) / 2
    q = np.quantile(vals, [a, 1 - a], method="inverted_cdf")  # no interpolation: an infinite draw stays infinite
    return float(q[0]), float(q[1])


def plateau(xs: list[float], means: list[float], sds: list[float], seeds: int) -> dict:
    """Did a seed-mean curve plateau? Its points in the last quarter of its x range (x ≥ x₀ + ¾·(x_last − x₀); at
    least 2 points): level (mean), trend (least-squares slope × span) and noise (2 × mean std over seeds / √seeds);
    plateaued when |trend| ≤ noise (None with one seed)."""
    cut = xs[0] + 0.75 * (xs[-1] - xs[0])
    k = max(2, sum(1 for x in xs if x >= cut))
    x, y = np.asarray(xs[-k:], float), np.asarray(means[-k:], float)
    slope = float(np.polyfit(x, y, 1)[0]) if len(x) > 1 and np.ptp(x) > 0 else 0.0
    trend = slope * float(np.ptp(x))
    noise = 2 * float(np.mean(sds[-k:])) / math.sqrt(seeds) if seeds > 1 else float("nan")
    return {"level": float(y.mean()), "trend": trend, "noise": noise, "points": k,
            "plateaued": None if seeds < 2 else bool(abs(trend) <= noise)}


def first_out(curve: list[dict], th: guards.Thresholds, budget: float, metric: str = METRIC) -> dict | None:
    """The first evaluation after the start of one cell's curve with a guard out of its start-anchored limits: the
    guards out, the cost there as a fraction of the budget, and the reward there (None: never out)."""
    start = curve[0]["metrics"]
    for p in curve[1:]:
        out = guards.tripped(start, p["metrics"], th)
        if out:
            return {"guards": sorted({g.split()[0] for g in out}), "cost_fraction": p["cost"] / budget,
                    "reward": p["metrics"].get(metric, float("nan"))}
    return None


def first_reach(curve: list[dict], target: float, metric: str, th: guards.Thresholds) -> dict:
    """First evaluation after the start of one cell's curve at the target: inside its start-anchored guards, and
    regardless of them."""
    start = curve[0]["metrics"]
    hit = raw = None
    hacked = False
    for p in curve[1:]:
        v = p["metrics"].get(metric, float("nan"))
        if not v >= target:
            continue
        inside = not guards.tripped(start, p["metrics"], th)
        raw = raw or p
        hit = hit or (p if inside else None)
        hacked = hacked or not inside
    return {"seconds": hit["seconds"] if hit else math.inf, "cost": hit["cost"] if hit else math.inf,
            "iteration": hit["iteration"] if hit else None, "raw_seconds": raw["seconds"] if raw else math.inf,
            "hacks": hacked}


# ---------------------------------------------------------------------- one cell, stepped from outside
@dataclass
class Cell:
    variant: str
    seed: int
    cfg: RunConfig
    trainer: Trainer
    overrides: list = field(default_factory=list)
    seconds: float = 0.0
    cost: float = 0.0
    iterations: int = 0
    curve: list = field(default_factory=list)
    done: bool = False
    failed: str = ""  # the TrainingError that ended the cell early, if any
    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))  # seconds of each phase of its steps

    def evaluate(self) -> None:
        row, _ = self.trainer.evaluate()
        self.curve.append({"iteration": self.iterations, "seconds": self.seconds, "cost": self.cost,
                           "metrics": {k: float(v) for k, v in row.items() if k.startswith("eval/")}})

    def step(self) -> None:
        """One training iteration; a ``TrainingError`` finishes the cell as failed (its weights are not evaluated
        again)."""
        c = self.trainer.policy.counters
        f0 = c["forwards_grad"] + c["forwards_nograd"]
        t0 = time.perf_counter()
        try:
            row = self.trainer.step()
        except TrainingError as e:
            self.seconds += time.perf_counter() - t0
            self.failed, self.done = str(e).splitlines()[0], True
            return
        self.seconds += time.perf_counter() - t0
        self.cost += (c["forwards_grad"] + c["forwards_nograd"] - f0) + 2 * row["sample_backwards"]
        self.iterations += 1
        for k in PHASES:
            self.phases[k] += float(row.get(f"time/{k}", 0.0))


def build_cells(base: RunConfig, variants: dict[str, list[str]], seeds: list[int], log=print) -> list[Cell]:
    """Every (variant, seed) cell, configs validated before any model loads."""
    cfgs = [(v, s, RunConfig.from_overrides([*ov, f"seed={s}"], base=base)) for s in seeds
            for v, ov in variants.items()]
    return [Cell(v, s, cfg, Trainer(cfg, log=lambda *a: None), overrides=variants[v]) for v, s, cfg in cfgs]


def interleave(cells: list[Cell], reference: str, *, iterations: int = 0, budget_cost: float = 0.0, evals: int = 4,
               spacing: str = "linear", max_iterations: int = 0, stop=lambda: False, log=print) -> float:
    """Step the unfinished cell with the least cost until every cell has spent the budget (→ the budget in cost):
    ``budget_cost``, or ``iterations`` of the reference (its seeds' mean cost of one iteration × iterations).
    Each cell is evaluated at the start and when its cost passes each of :func:`eval_marks`. ``stop()`` true
    ends the stepping before the next step (the cells stay unfinished: see :func:`truncate`)."""
    for c in cells:
        c.evaluate()
    cap = max_iterations or 1_000_000
    if budget_cost <= 0:  # one iteration of every reference seed fixes the cost of a reference iteration
        refs = [c for c in cells if c.variant == reference]
        for c in refs:
            c.step()
        if any(c.failed for c in refs):
            raise TrainingError(f"bench quality: the reference's first iteration failed: "
                                f"{next(c.failed for c in refs if c.failed)}")
        budget_cost = statistics.mean(c.cost for c in refs) * iterations
    marks = eval_marks(budget_cost, evals, spacing)
    for c in cells:
        if c.iterations:
            _at_marks(c, marks, cap, log)
    t0, shown = time.perf_counter(), 0
    while True:
        live = [c for c in cells if not c.done]
        if not live:
            return budget_cost
        if stop():
            return budget_cost
        c = min(live, key=lambda q: q.cost)  # min keeps the listing order on ties
        passed = sum(1 for m in marks if c.cost >= m)  # every live cell has passed these marks
        if passed > shown:
            shown = passed
            log(f"bench quality: every cell past mark {passed}/{len(marks)} (cost {marks[passed - 1]:.0f} of "
                f"{budget_cost:.0f}), {time.perf_counter() - t0:.0f} s")
        c.step()
        _at_marks(c, marks, cap, log)


def truncate(cells: list[Cell], budget: float, evals: int, spacing: str) -> tuple[int, float]:
    """After an interrupted :func:`interleave`: cut every cell's curve at the last mark all cells (but the failed
    ones) have passed, so the benchmark reads as one with that smaller budget. → (marks kept, their budget)."""
    marks = eval_marks(budget, evals, spacing)
    kept = min(len(c.curve) - 1 for c in (cells if all(c.failed for c in cells) else [c for c in cells if not c.failed]))
    for c in cells:
        del c.curve[kept + 1:]
    return kept, (marks[kept - 1] if kept else 0.0)


def _at_marks(c: Cell, marks: list[float], cap: int, log) -> None:
    """After a step: evaluate ``c`` when its cost passed the next mark; finish it at the budget (the last mark)."""
    if c.failed:
        log(f"  {c.variant:20s} seed {c.seed}: failed at iteration {c.iterations + 1}: {c.failed}")
        return
    finished = c.cost >= marks[-1] or c.iterations >= cap
    passed = sum(1 for m in marks if c.cost >= m)
    if len(c.curve) - 1 < passed or finished:
        c.evaluate()
        while len(c.curve) - 1 < (len(marks) if finished else passed):  # marks passed in one step share a point
            c.curve.insert(len(c.curve) - 1, dict(c.curve[-1]))
    if finished:
        c.done = True
        first, last = c.curve[0]["metrics"], c.curve[-1]["metrics"]
        log(f"  {c.variant:20s} seed {c.seed}: {c.iterations} it, {c.seconds:.1f}s, cost {c.cost:.0f}, "
            f"{METRIC} {first.get(METRIC, float('nan')):.4f} -> {last.get(METRIC, float('nan')):.4f}")


# ---------------------------------------------------------------------- aggregation
def _mean(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.mean(xs) if xs else float("nan")


def _std(xs):
    xs = [x for x in xs if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_curve(cells: list[Cell], metric: str) -> list[dict]:
    """Seed-mean curve, evaluation by evaluation (the j-th evaluation of each seed; cut at the shortest), over the
    cells that did not fail (all of them when every one failed)."""
    cells = [c for c in cells if not c.failed] or cells
    n = min(len(c.curve) for c in cells)
    out = []
    for j in range(n):
        pts = [c.curve[j] for c in cells]
        keys = sorted({k for p in pts for k in p["metrics"]})
        out.append({"seconds": _mean([p["seconds"] for p in pts]), "cost": _mean([p["cost"] for p in pts]),
                    "iteration": _mean([p["iteration"] for p in pts]),
                    "metrics": {k: _mean([p["metrics"].get(k) for p in pts]) for k in keys},
                    "reward_std": _std([p["metrics"].get(metric) for p in pts])})
    return out


def summarize(cells: list[Cell], reference: str, *, metric: str, target_fraction: float,
              th: guards.Thresholds, target: float | None = None, budget: float = 0.0) -> dict:
    """The aggregate of every variant against ``reference`` (see the module docstring); ``budget``: the counted cost
    per cell (default: the reference cells' mean final cost)."""
    variants = list(dict.fromkeys(c.variant for c in cells))
    by = {v: sorted((c for c in cells if c.variant == v), key=lambda c: c.seed) for v in variants}
    curves = {v: mean_curve(cs, metric) for v, cs in by.items()}
    ref = curves[reference]
    start = ref[0]["metrics"].get(metric, float("nan"))
    plat = plateau([p["cost"] for p in ref], [p["metrics"].get(metric, float("nan")) for p in ref],
                   [p["reward_std"] for p in ref], len(by[reference]))
    given = target is not None
    if target is None:
        target = start + target_fraction * (plat["level"] - start)
    reach = {v: [first_reach(c.curve, target, metric, th) for c in cs] for v, cs in by.items()}
    ref_t = np.array([r["seconds"] for r in reach[reference]])
    ref_k = np.array([r["cost"] for r in reach[reference]])
    budget = budget or _mean([c.cost for c in by[reference]])
    rows = []
    for v, cs in by.items():
        t = np.array([r["seconds"] for r in reach[v]])
        k = np.array([r["cost"] for r in reach[v]])
        ok = [c for c in cs if not c.failed] or cs  # a failed cell's last evaluation is not its end
        finals = [c.curve[-1]["metrics"] for c in ok]
        last = curves[v][-1]["metrics"]
        paired = np.stack([ref_t, t], 1) if len(t) == len(ref_t) else None
        paired_k = np.stack([ref_k, k], 1) if len(k) == len(ref_k) else None
        rows.append({
            "variant": v, "overrides": cs[0].overrides,
            "seeds": [c.seed for c in cs], "iterations": _mean([c.iterations for c in cs]),
            "seconds_per_iteration": _mean([c.seconds / max(c.iterations, 1) for c in cs]),
            "cost_per_iteration": _mean([c.cost / max(c.iterations, 1) for c in cs]),
            "seconds_total": _mean([c.seconds for c in cs]),
            "final_reward": _mean([f.get(metric) for f in finals]), "final_reward_std": _std([f.get(metric) for f in finals]),
            "final_guards": {k: last[k] for k in last if k.startswith(("eval/guard/", "eval/fid", "eval/diversity"))},
            "final_out_of_guards": sorted({g.split()[0] for c in ok for g in guards.tripped(c.curve[0]["metrics"],
                                                                                         c.curve[-1]["metrics"], th)}),
            "reached": int(np.isfinite(t).sum()), "failed": {str(c.seed): c.failed for c in cs if c.failed},
            "time_to_target": float(np.mean(t)), "time_to_target_ci": bootstrap_ci(t, np.mean),
            "cost_to_target": float(np.mean(k)), "cost_to_target_ci": bootstrap_ci(k, np.mean),
            "time_to_target_ignoring_guards": float(np.mean([r["raw_seconds"] for r in reach[v]])),
            "speedup": _speedup(paired) if paired is not None else float("nan"),
            "speedup_ci": bootstrap_ci(paired, _speedup) if paired is not None else (float("nan"), float("nan")),
            "cost_speedup": _speedup(paired_k) if paired_k is not None else float("nan"),
            "cost_speedup_ci": bootstrap_ci(paired_k, _speedup) if paired_k is not None else (float("nan"),
                                                                                             float("nan")),
            "first_out_of_guards": [first_out(c.curve, th, budget, metric) for c in cs],
            "time_shares": _shares(ok),
            "iterations_to_target": float(np.mean([math.inf if r["iteration"] is None else r["iteration"]
                                                    for r in reach[v]])),
            "hacks": any(r["hacks"] for r in reach[v]), "per_seed": reach[v], "curve": curves[v]})
    start_guards = {k: v for k, v in ref[0]["metrics"].items() if k.startswith(("eval/guard/", "eval/fid",
                                                                                   "eval/diversity"))}
    return {"metric": metric, "reference": reference, "start": start, "start_guards": start_guards, "target": target,
            "target_given": given, "reference_gain": plat["level"] - start,
            "target_fraction": target_fraction, "plateau": plat, "thresholds": th.__dict__, "rows": rows}


def _shares(cells: list[Cell]) -> dict[str, float]:
    """Fractions of the cells' training wall-clock in each phase (sampling, reward, train, other)."""
    total = sum(c.seconds for c in cells)
    if total <= 0:
        return {}
    sh = {k: sum(c.phases[k] for c in cells) / total for k in PHASES}
    return {**sh, "other": max(0.0, 1 - sum(sh.values()))}


def _speedup(m: np.ndarray) -> float:
    """m (S, 2): per seed (reference's, variant's) time to target → mean ÷ mean (0 where the variant misses the
    target in some seed and the reference reaches it in every one; ∞ the other way round; NaN where both miss)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.mean(m[:, 0]) / np.mean(m[:, 1]))


# ---------------------------------------------------------------------- outputs
def _fmt(x, f="{:.1f}"):
    return "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f.format(x)


def _ci(ci, f="{:.1f}"):
    lo, hi = ci
    return "" if not (math.isfinite(lo) or math.isfinite(hi)) else f" [{_fmt(lo, f)}, {_fmt(hi, f)}]"


def _first_out_words(outs: list) -> str:
    """Per-seed :func:`first_out` results → '3/5: eval/guard/diversity at 31% (reward 0.884)', or 'none'."""
    hit = [o for o in outs if o]
    if not hit:
        return "none"
    names = [", ".join(o["guards"]) for o in hit]
    common = max(dict.fromkeys(names), key=names.count)
    return (f"{len(hit)}/{len(outs)}: {common} at {statistics.median(o['cost_fraction'] for o in hit):.0%} "
            f"(reward {statistics.median(o['reward'] for o in hit):.3f})")


def _guard_words(g: dict, start: dict) -> str:
    """Seed-mean guard metrics at the end, FID and diversity as ratios to the start: 'fid 1.21×, drift 0.31, …'."""
    out = []
    for key, name, ratio in (("eval/fid", "fid", True), ("eval/guard/drift", "drift", False),
                             ("eval/guard/diversity", "div", True)):
        v, v0 = g.get(key), start.get(key)
        if v is None or not math.isfinite(v):
            continue
        out.append(f"{name} {v / v0:.2f}×" if ratio and v0 else f"{name} {v:.2f}")
    out += [f"{k.split('/')[-2]} {v:.3g}" for k, v in g.items() if k.startswith("eval/guard/rewards/")]
    return ", ".join(out) or "—"


def to_markdown(meta: dict, s: dict) -> str:
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
        (f"Guards, each relative to the cell's own start: eval/fid ≤ {th['max_fid_ratio']:g}× (built-in task), "
        f"eval/guard/drift ≤ {th['max_drift']:g}, diversity ≥ {th['min_diversity_ratio']:g}×, guard rewards ≥ start − "
        f"{th['max_reward_drop']:g}×|start| (0 = off)."), "",
        ("| variant | s / it | cost / it | iterations | reached | time to target (s) [95% CI] | cost to target | "
        "speed-up vs reference (time) [95% CI] | speed-up in cost [95% CI] | final reward | guards at end | out of guards at end | first out of "
        "guards | hacks |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in s["rows"]:
        failed = f" ({len(r['failed'])} failed)" if r.get("failed") else ""
        lines.append(
            f"| {r['variant']} | {r['seconds_per_iteration']:.2f} | {r['cost_per_iteration']:.0f} | "
            f"{r['iterations']:.1f} | {r['reached']}/{len(r['seeds'])}{failed} | {_fmt(r['time_to_target'])}"
            f"{_ci(r['time_to_target_ci'])} | {_fmt(r['cost_to_target'], '{:.0f}')} | {_fmt(r['speedup'], '{:.2f}×')}"
            f"{_ci(r['speedup_ci'], '{:.2f}')} | {_fmt(r.get('cost_speedup'), '{:.2f}×')}"
            f"{_ci(r.get('cost_speedup_ci', (math.nan, math.nan)), '{:.2f}')} | "
            f"{r['final_reward']:.4f} ± {r['final_reward_std']:.4f} | "
            f"{_guard_words(r['final_guards'], s['start_guards'])} | "
            f"{', '.join(r['final_out_of_guards']) or 'none'} | {_first_out_words(r['first_out_of_guards'])} | "
            f"{'yes' if r['hacks'] else 'no'} |")
    lines += ["", ("'time to target': training wall-clock (mean over seeds) at each seed's first evaluation at the target "
                  "inside its guards (— : some seed never did within the budget); 'hacks': some seed was at the target "
                  "with a guard out of limits; 'guards at end': seed means at the last evaluation (FID and diversity "
                  "as ratios to the start); 'first out of guards': seeds with a guard out at some evaluation, the guard "
                  "out first in most of them, and the median fraction of the budget and reward there; intervals: "
                  "percentile bootstrap over seeds (speed-up: seeds paired)."), "",
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


def claim_out(out: Path) -> None:
    """``--out`` must be new, empty, or an earlier ``bench quality`` output (its marker file): any other folder is
    refused before any model loads, so the benchmark never overwrites files it did not write."""
    claim_folder(out, MARKER, "--out", "bench quality",
                 outputs=("summary.json", "table.md", "curves.png", "command.txt", "configs"))


def _eval_samples(c: Cell) -> int:
    """Samples of one evaluation of cell ``c``."""
    fam, cfg = c.trainer.family, c.cfg
    if MODEL_FAMILIES[cfg.model.name] == "flow":
        return len(fam.eval_prompts()[0])
    d = cfg.dllm
    return len(fam.eval_pool[: d.eval_size] if d.eval_size else fam.eval_pool) * d.eval_samples


def run(base: RunConfig, variants: dict[str, list[str]], seeds: list[int], *, out: str | Path, reference: str = "",
        iterations: int = 0, budget_cost: float = 0.0, evals: int = 4, eval_spacing: str = "linear",
        target_fraction: float = 0.95,
        target: float | None = None, metric: str = METRIC, title: str = "", command: str = "",
        max_iterations: int = 0, log=print) -> dict:
    """The whole benchmark; writes the outputs under ``out`` and returns the summary (see the module docstring)."""
    reference = reference or next(iter(variants))
    if reference not in variants:
        raise ConfigError(f"--reference: {reference!r} is not one of the variants {list(variants)}")
    if (iterations > 0) == (budget_cost > 0):
        raise ConfigError("bench quality: give exactly one budget, --iterations (of the reference) or --budget-cost")
    if evals < 2 or not seeds or not 0 < target_fraction <= 1:
        raise ConfigError("bench quality: --evals must be >= 2, --seeds non-empty, --target-fraction in (0, 1]")
    eval_marks(1.0, evals, eval_spacing)  # a bad spacing fails here, before any model loads
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    out = Path(out)
    claim_out(out)
    t0 = time.perf_counter()
    cells = build_cells(base, variants, seeds, log=log)
    with run_root(out):
        for c in cells:
            atomic_write(out / "configs" / f"{c.variant}_seed{c.seed}.yaml", c.cfg.to_yaml())
    with _signals_stop(log) as stopped:
        cost = interleave(cells, reference, iterations=iterations, budget_cost=budget_cost, evals=evals,
                          spacing=eval_spacing, max_iterations=max_iterations, stop=lambda: bool(stopped), log=log)
    interrupted = None
    if stopped:
        kept, cost = truncate(cells, cost, evals, eval_spacing)
        if kept < 1:
            raise TrainingError(f"bench quality: stopped by signal {stopped[0]} before every cell reached its first "
                                "evaluation mark; nothing to summarise")
        interrupted = {"signal": stopped[0], "marks": kept}
        log(f"bench quality: stopped by signal {stopped[0]}; summarised at mark {kept}/{evals} (cost {cost:.0f})")
    th = guards.Thresholds(base.train.guard_max_fid_ratio, base.train.guard_max_drift,
                           base.train.guard_min_diversity_ratio, base.train.guard_max_reward_drop)
    s = summarize(cells, reference, metric=metric, target_fraction=target_fraction, th=th, target=target,
                  budget=cost)
    meta = {"title": title or f"{base.model.name} model, rewards {sorted(base.reward.weights)}", "command": command,
            "variants": variants, "seeds": seeds, "iterations": iterations, "budget_cost": cost, "evals": evals,
            "eval_spacing": eval_spacing, "interrupted": interrupted,
            "eval_samples": _eval_samples(cells[0]),
            "total_seconds": time.perf_counter() - t0, "load": f"{load:.2f}", "torch_threads": torch.get_num_threads()}
    cells_json = [{"variant": c.variant, "seed": c.seed, "iterations": c.iterations, "seconds": c.seconds,
                   "cost": c.cost, "failed": c.failed, "overrides": c.overrides, "phases": c.phases,
                   "evaluations": c.curve} for c in cells]
    md = _write(out, meta, s, cells_json, command)
    log(md)
    return {"meta": meta, **s, "cells": cells_json}


@contextlib.contextmanager
def _signals_stop(log):
    """Inside the block the first SIGINT / SIGTERM is noted in the yielded list (the benchmark finishes its current
    step, then writes the outputs for the marks every cell has passed); a second one interrupts at once. Outside the
    main thread nothing is installed."""
    stopped: list[int] = []

    def on_signal(signum, frame):
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)
        log(f"received signal {signum}: finishing the current step, then writing the outputs for the evaluation marks "
            "every cell has passed (a second signal stops at once)")

    if threading.current_thread() is not threading.main_thread():
        yield stopped
        return
    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


def _strict(x):
    """``x`` with every non-finite float (an unreached target's ∞, a failed reward's NaN) as None: strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _strict(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_strict(v) for v in x]
    return x


def load_cells(summary: dict) -> list[Cell]:
    """The finished cells of a ``summary.json`` (no trainer), as :func:`summarize` reads them."""
    nan = float("nan")
    cells = []
    for c in summary["cells"]:
        curve = [{**p, "metrics": {k: nan if v is None else float(v) for k, v in p["metrics"].items()}}
                 for p in c["evaluations"]]
        cells.append(Cell(c["variant"], int(c["seed"]), None, None, overrides=list(c.get("overrides") or []),
                          seconds=float(c["seconds"]), cost=float(c["cost"]), iterations=int(c["iterations"]),
                          curve=curve, done=True, failed=c.get("failed") or "",
                          phases={**dict.fromkeys(PHASES, 0.0), **(c.get("phases") or {})}))
    return cells


def _write(out: Path, meta: dict, s: dict, cells_json: list, command: str) -> str:
    md = to_markdown(meta, s)
    with run_root(out):
        atomic_write(out / "summary.json", json.dumps(_strict({"meta": meta, **s, "cells": cells_json}), indent=1,
                                                      default=str, allow_nan=False))
        atomic_write(out / "command.txt", command + "\n")
        atomic_write(out / "table.md", md)
        atomic_write(out / "curves.png", lambda tmp: plot(s, tmp))  # never through a link at curves.png
    return md


def resummarize(out: str | Path, *, target_fraction: float | None = None, target: float | None = None,
                metric: str | None = None, command: str = "", log=print) -> dict:
    """Summarise a finished benchmark's cells again (``diffgrpo bench quality --from DIR``): another target fraction,
    target or metric, without training anything. Rewrites ``table.md``, ``summary.json`` and ``curves.png``;
    ``command.txt`` keeps the command that trained the cells and gains this one."""
    out = Path(out)
    path = out / "summary.json"
    if not (out / MARKER).is_file() or path.is_symlink() or not path.is_file():
        raise ConfigError(f"--from: {str(out)!r} is not a finished bench quality output (no {MARKER} or summary.json)")
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
        cells = load_cells(old)
        th = guards.Thresholds(**old["thresholds"])
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--from: {str(path)!r} cannot be read as a bench quality summary ({e})") from None
    metric = metric or old["metric"]
    frac = old["target_fraction"] if target_fraction is None else target_fraction
    if not 0 < frac <= 1:
        raise ConfigError("bench quality: --target-fraction must be in (0, 1]")
    s = summarize(cells, old["reference"], metric=metric, target_fraction=frac, th=th, target=target,
                  budget=float(old["meta"]["budget_cost"]))
    cells_json = [{k: v for k, v in c.items()} for c in old["cells"]]
    first = (out / "command.txt").read_text(encoding="utf-8").splitlines()[:1] if (out / "command.txt").is_file() else []
    md = _write(out, old["meta"], s, cells_json, "\n".join([*first, *([command] if command else [])]))
    log(md)
    return {"meta": old["meta"], **s, "cells": cells_json}


def from_args(base: RunConfig, args) -> dict:
    """``diffgrpo bench quality`` (``cli.build_parser``'s options) on the resolved base config."""
    frac = 0.95 if args.target_fraction is None else args.target_fraction
    metric = args.metric or METRIC
    if not args.variant:
        raise ConfigError("bench quality: give the variants (--variant NAME=key=value,...), or --from DIR to "
                          "summarise a finished benchmark again")
    variants: dict[str, list[str]] = {}
    for spec in args.variant:
        name, ov = parse_variant(spec)
        if name in variants:
            raise ConfigError(f"--variant: {name!r} is given twice")
        variants[name] = ov
    words = (["--config", args.config] if args.config else []) + [w for v in args.variant for w in ("--variant", v)]
    words += ["--seeds", *map(str, args.seeds), "--evals", str(args.evals), "--eval-spacing", args.eval_spacing,
              "--target-fraction",
              str(frac), "--metric", metric, "--out", args.out]
    words += (["--iterations", str(args.iterations)] if args.iterations else []) + (
        ["--budget-cost", str(args.budget_cost)] if args.budget_cost else [])
    words += (["--reference", args.reference] if args.reference else []) + (
        ["--target", str(args.target)] if args.target is not None else []) + list(args.overrides)
    command = "diffgrpo bench quality " + " ".join(shlex.quote(w) for w in words)
    return run(base, variants, args.seeds, out=args.out, reference=args.reference, iterations=args.iterations,
               budget_cost=args.budget_cost, evals=args.evals, eval_spacing=args.eval_spacing,
               target_fraction=frac, target=args.target, metric=metric, command=command)


def again_from_args(args) -> dict:
    """``diffgrpo bench quality --from DIR [--target-fraction F | --target T] [--metric M]``: :func:`resummarize`."""
    given = [f for f, v in (("--variant", args.variant), ("--iterations", args.iterations),
                            ("--budget-cost", args.budget_cost), ("--reference", args.reference),
                            ("--config", args.config), ("key=value overrides", args.overrides)) if v]
    if given:
        raise ConfigError(f"--from: {', '.join(given)} cannot change a finished benchmark's cells; only "
                          "--target-fraction, --target and --metric apply")
    words = ["--from", args.from_dir] + (["--target-fraction", str(args.target_fraction)]
                                         if args.target_fraction is not None else []) + (
        ["--target", str(args.target)] if args.target is not None else []) + (
        ["--metric", args.metric] if args.metric else [])
    return resummarize(args.from_dir, target_fraction=args.target_fraction, target=args.target, metric=args.metric,
                       command="summarised again: diffgrpo bench quality " + " ".join(shlex.quote(w) for w in words))


__all__ = ["Cell", "again_from_args", "bootstrap_ci", "eval_marks", "first_reach", "from_args", "interleave",
           "load_cells", "parse_variant", "plateau", "resummarize", "run", "summarize"]
