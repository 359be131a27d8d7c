"""Statistics of ``diffgrpo bench quality``: the reference's plateau and the target it gives, each cell's first
evaluation at the target inside its start-anchored guards, paired percentile-bootstrap intervals over seeds, the
speed-up and where it comes from (iterations, phase shares), and the first guard out.

Pure functions over evaluation curves (lists of ``{"iteration", "seconds", "cost", "metrics"}``) and cells (anything
with ``variant``, ``seed``, ``overrides``, ``seconds``, ``cost``, ``iterations``, ``curve``, ``failed``, ``phases``);
the guards are judged by a :class:`GuardCheck` handed in. Numpy and the standard library only: no model, no torch.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

METRIC = "eval/reward"
PHASES = ("sample", "reward", "train")  # the trainer's time/<phase> keys; the rest of a step is "other"
GUARD_KEYS = ("eval/guard/", "eval/fid", "eval/diversity")  # the metrics reported beside the reward
# per-prompt diversity, as ratios to the cell's start where it reaches the target; the first one a run reports is the
# headline (the shapes checker's detections, else the guards' feature-space diversity)
DIVERSITY_KEYS = ("eval/guard/detection_diversity", "eval/guard/diversity", "eval/diversity")


@dataclass(frozen=True)
class GuardCheck:
    """The start-anchored guards: ``out(start metrics, metrics)`` → the guards out of their limits, each a phrase
    starting with the metric's name (empty: inside every guard); ``limits``: the thresholds, as recorded."""
    limits: dict
    out: Callable[[dict, dict], list]


# ---------------------------------------------------------------------- one curve
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
    x, y = np.asarray(xs[-k:], float), np.asarray(means[-k:], float)  # (k,), (k,)
    slope = float(np.polyfit(x, y, 1)[0]) if len(x) > 1 and np.ptp(x) > 0 else 0.0
    trend = slope * float(np.ptp(x))
    noise = 2 * float(np.mean(sds[-k:])) / math.sqrt(seeds) if seeds > 1 else float("nan")
    return {"level": float(y.mean()), "trend": trend, "noise": noise, "points": k,
            "plateaued": None if seeds < 2 else bool(abs(trend) <= noise)}


def first_out(curve: list[dict], check: GuardCheck, budget: float, metric: str = METRIC) -> dict | None:
    """The first evaluation after the start of one cell's curve with a guard out of its start-anchored limits: the
    guards out, the cost there as a fraction of the budget, and the reward there (None: never out)."""
    start = curve[0]["metrics"]
    for p in curve[1:]:
        out = check.out(start, p["metrics"])
        if out:
            return {"guards": sorted({g.split()[0] for g in out}), "cost_fraction": p["cost"] / budget,
                    "reward": p["metrics"].get(metric, float("nan"))}
    return None


def first_reach(curve: list[dict], target: float, metric: str, check: GuardCheck) -> dict:
    """First evaluation after the start of one cell's curve at the target: inside its start-anchored guards, and
    regardless of them."""
    start = curve[0]["metrics"]
    hit = raw = None
    hacked = False
    for p in curve[1:]:
        v = p["metrics"].get(metric, float("nan"))
        if not v >= target:
            continue
        inside = not check.out(start, p["metrics"])
        raw = raw or p
        hit = hit or (p if inside else None)
        hacked = hacked or not inside
    return {"seconds": hit["seconds"] if hit else math.inf, "cost": hit["cost"] if hit else math.inf,
            "iteration": hit["iteration"] if hit else None, "raw_seconds": raw["seconds"] if raw else math.inf,
            "hacks": hacked, "diversity": diversity_ratios(start, hit["metrics"]) if hit else {}}


def kept(curve: list[dict], check: GuardCheck, metric: str = METRIC, patience: int = 1) -> dict:
    """What a user running ``train.on_hacking=stop`` with ``train.keep_best=<metric>`` ends with on one cell's curve:
    the run stops at its ``patience``-th evaluation in a row out of the start-anchored guards
    (``train.guard_patience``; each evaluation judged alone, as the trainer judges it), and ``best/`` holds the
    evaluation with the highest ``metric`` among those inside the guards up to there (the start included).
    → the reward kept, the iteration and seconds it comes from, the seconds the run took (to the stop or the end),
    whether it stopped, and the diversity ratios at the kept evaluation."""
    start = curve[0]["metrics"]
    best, end, stopped, streak = curve[0], curve[-1], False, 0
    for p in curve[1:]:
        if check.out(start, p["metrics"]):
            streak += 1
            if streak >= patience:
                end, stopped = p, True
                break
            continue
        streak = 0
        v = p["metrics"].get(metric)
        if _finite(v) and not v <= best["metrics"].get(metric, -math.inf):
            best = p
    return {"reward": best["metrics"].get(metric, float("nan")), "iteration": best["iteration"],
            "seconds": best["seconds"], "run_seconds": end["seconds"], "stopped": stopped,
            "diversity": diversity_ratios(start, best["metrics"])}


def diversity_ratios(start: dict, metrics: dict) -> dict:
    """Each of :data:`DIVERSITY_KEYS` in ``metrics`` as a ratio to its value in ``start`` (where both are finite and
    the start positive)."""
    out = {}
    for k in DIVERSITY_KEYS:
        v, v0 = metrics.get(k), start.get(k)
        if _finite(v) and _finite(v0) and v0 > 0:
            out[k] = float(v) / float(v0)
    return out


def diversity_key(metrics: dict) -> str | None:
    """The headline diversity metric of a run: the first of :data:`DIVERSITY_KEYS` it reports (finite)."""
    return next((k for k in DIVERSITY_KEYS if _finite(metrics.get(k))), None)


def guard_means(curve: list[dict], width: int) -> list[dict]:
    """One cell's curve with every guard metric (:data:`GUARD_KEYS`) at evaluation j ≥ 1 replaced by its mean over
    evaluations j … j + width − 1 (fewer at the end; the start stays as it is), the rest unchanged: the guards judged
    on neighbouring evaluations, whose noise is smaller (benchmarks/guard_noise.py). width 1: the curve itself."""
    if width <= 1:
        return curve
    out = [curve[0]]
    for j in range(1, len(curve)):
        near = [p["metrics"] for p in curve[j:j + width]]
        out.append({**curve[j], "metrics": {k: (mean([m.get(k) for m in near]) if k.startswith(GUARD_KEYS) else v)
                                            for k, v in curve[j]["metrics"].items()}})
    return out


def speedup(m: np.ndarray) -> float:
    """m (S, 2): per seed (reference's, variant's) time to target → mean ÷ mean (0 where the variant misses the
    target in some seed and the reference reaches it in every one; ∞ the other way round; NaN where both miss)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.mean(m[:, 0]) / np.mean(m[:, 1]))


# ---------------------------------------------------------------------- over seeds
def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def mean(xs) -> float:
    """Mean of the finite numbers in ``xs`` (NaN: none)."""
    xs = [x for x in xs if _finite(x)]
    return statistics.mean(xs) if xs else float("nan")


def std(xs) -> float:
    """Sample standard deviation of the finite numbers in ``xs`` (0: fewer than two)."""
    xs = [x for x in xs if _finite(x)]
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def mean_curve(cells: list, metric: str) -> list[dict]:
    """Seed-mean curve, evaluation by evaluation (the j-th evaluation of each seed; cut at the shortest), over the
    cells that did not fail (all of them when every one failed)."""
    cells = [c for c in cells if not c.failed] or cells
    n = min(len(c.curve) for c in cells)
    out = []
    for j in range(n):
        pts = [c.curve[j] for c in cells]
        keys = sorted({k for p in pts for k in p["metrics"]})
        out.append({"seconds": mean([p["seconds"] for p in pts]), "cost": mean([p["cost"] for p in pts]),
                    "iteration": mean([p["iteration"] for p in pts]),
                    "metrics": {k: mean([p["metrics"].get(k) for p in pts]) for k in keys},
                    "reward_std": std([p["metrics"].get(metric) for p in pts])})
    return out


def time_shares(cells: list) -> dict[str, float]:
    """Fractions of the cells' training wall-clock in each phase (sampling, reward, train, other)."""
    total = sum(c.seconds for c in cells)
    if total <= 0:
        return {}
    sh = {k: sum(c.phases[k] for c in cells) / total for k in PHASES}
    return {**sh, "other": max(0.0, 1 - sum(sh.values()))}


def _paired(ref: np.ndarray, x: np.ndarray, key: str) -> dict:
    """``key`` and ``key_ci``: the speed-up of ``x`` over ``ref`` (both (S,), seeds paired) and its interval."""
    if len(x) != len(ref):
        return {key: float("nan"), f"{key}_ci": (float("nan"), float("nan"))}
    m = np.stack([ref, x], 1)  # (S, 2)
    return {key: speedup(m), f"{key}_ci": bootstrap_ci(m, speedup)}


def variant_row(cells: list, reach: list[dict], ref_reach: list[dict], curve: list[dict], *, metric: str,
                check: GuardCheck, budget: float, guard_mean: int = 1, patience: int = 1) -> dict:
    """One variant's row of the summary: its cells (seeds), each one's :func:`first_reach`, the reference's, and
    its seed-mean curve."""
    t = np.array([r["seconds"] for r in reach])  # (S,)
    k = np.array([r["cost"] for r in reach])  # (S,)
    ok = [c for c in cells if not c.failed] or cells  # a failed cell's last evaluation is not its end
    finals = [c.curve[-1]["metrics"] for c in ok]
    keeps = [kept(c.curve, check, metric, patience) for c in ok]
    last = curve[-1]["metrics"]
    return {
        "variant": cells[0].variant, "overrides": cells[0].overrides,
        "seeds": [c.seed for c in cells], "iterations": mean([c.iterations for c in cells]),
        "seconds_per_iteration": mean([c.seconds / max(c.iterations, 1) for c in cells]),
        "cost_per_iteration": mean([c.cost / max(c.iterations, 1) for c in cells]),
        "seconds_total": mean([c.seconds for c in cells]),
        "final_reward": mean([f.get(metric) for f in finals]), "final_reward_std": std([f.get(metric) for f in finals]),
        "final_guards": {key: last[key] for key in last if key.startswith(GUARD_KEYS)},
        "final_out_of_guards": sorted({g.split()[0] for c in ok
                                       for g in check.out(c.curve[0]["metrics"], c.curve[-1]["metrics"])}),
        "reached": int(np.isfinite(t).sum()), "failed": {str(c.seed): c.failed for c in cells if c.failed},
        "time_to_target": float(np.mean(t)), "time_to_target_ci": bootstrap_ci(t, np.mean),
        "cost_to_target": float(np.mean(k)), "cost_to_target_ci": bootstrap_ci(k, np.mean),
        "time_to_target_ignoring_guards": float(np.mean([r["raw_seconds"] for r in reach])),
        **_paired(np.array([r["seconds"] for r in ref_reach]), t, "speedup"),
        **_paired(np.array([r["cost"] for r in ref_reach]), k, "cost_speedup"),
        "first_out_of_guards": [first_out(guard_means(c.curve, guard_mean), check, budget, metric) for c in cells],
        "time_shares": time_shares(ok),
        "iterations_to_target": float(np.mean([math.inf if r["iteration"] is None else r["iteration"]
                                                for r in reach])),
        "hacks": any(r["hacks"] for r in reach), "per_seed": reach, "curve": curve,
        # a user's run with train.on_hacking=stop and train.keep_best=<metric> (:func:`kept`), per seed and in mean
        "kept": keeps,
        "kept_reward": mean([x["reward"] for x in keeps]), "kept_reward_std": std([x["reward"] for x in keeps]),
        "kept_stopped": sum(x["stopped"] for x in keeps),
        # seed means over the seeds at the target (inside the guards) of their diversity there ÷ at their start
        "diversity_at_target": {k: mean([r["diversity"].get(k) for r in reach if r["diversity"]])
                                for k in DIVERSITY_KEYS if any(k in r["diversity"] for r in reach)}}


def summarize(cells: list, reference: str, *, metric: str, target_fraction: float, check: GuardCheck,
              target: float | None = None, budget: float = 0.0, guard_mean: int = 1, patience: int = 1) -> dict:
    """The aggregate of every variant against ``reference``: the target (given, or the start plus
    ``target_fraction`` × the reference's gain at its plateau), then one :func:`variant_row` per variant;
    ``budget``: the counted cost per cell (default: the reference cells' mean final cost); ``guard_mean``: the guards
    judged on the mean of that many neighbouring evaluations (:func:`guard_means`); ``patience``: the base config's
    ``train.guard_patience``, for what a user's stopped run keeps (:func:`kept`)."""
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
    reach = {v: [first_reach(guard_means(c.curve, guard_mean), target, metric, check) for c in cs]
             for v, cs in by.items()}
    budget = budget or mean([c.cost for c in by[reference]])
    rows = [variant_row(cs, reach[v], reach[reference], curves[v], metric=metric, check=check, budget=budget,
                        guard_mean=guard_mean, patience=patience)
            for v, cs in by.items()]
    start_guards = {k: v for k, v in ref[0]["metrics"].items() if k.startswith(GUARD_KEYS)}
    return {"metric": metric, "reference": reference, "start": start, "start_guards": start_guards, "target": target,
            "diversity_key": diversity_key(ref[0]["metrics"]),
            "target_given": given, "reference_gain": plat["level"] - start,
            "target_fraction": target_fraction, "plateau": plat, "thresholds": dict(check.limits), "rows": rows,
            "guard_mean": guard_mean, "guard_patience": patience}


__all__ = ["DIVERSITY_KEYS", "GUARD_KEYS", "GuardCheck", "METRIC", "PHASES", "bootstrap_ci", "diversity_key",
           "diversity_ratios", "first_out", "first_reach", "guard_means", "kept", "mean",
           "mean_curve", "plateau", "speedup", "std", "summarize", "time_shares", "variant_row"]
