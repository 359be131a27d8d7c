"""``diffgrpo bench quality --tune``: a small grid of settings per variant, run on tuning seeds, before the
measurement on fresh seeds.

  grid      per variant, the product of the values of each key (``key=v1,v2``; ``x0.5`` is a multiple of the
            variant's own resolved value, anything else a literal). Default: ``train.lr`` and ``loss.beta`` at
            ×0.5, ×1, ×2, and the strength of each diversity objective the variant uses (``diversity.method``:
            gardo → ``diversity.gardo_amplify``, diversegrpo → ``cluster_bonus``, drift → ``drift_shaping``) at
            ×0.5, ×1, ×2. Cells whose resolved settings coincide are run once.
  run       every grid cell × tuning seed as one ``bench quality`` (:func:`.quality.run`, the same budget, evaluation
            marks and guards) into ``<out>/tune/``; its reference is the reference variant's cell at ×1 everywhere
            (its own settings) when the grid holds it, else its first cell: it fixes the cost of an iteration and,
            without ``--target``, the target.
  choice    per variant, among the cells whose last evaluation is inside every guard in the most tuning seeds (a
            setting that touches the target and then leaves the guards is not kept), the cell with the least counted
            cost to the target inside the guards (mean over tuning seeds; a seed that misses counts as ∞); ties, and
            variants with no cell at the target: the highest *end reward inside the guards* (per seed, the reward at
            its last evaluation inside every guard; mean over seeds). Counted cost, not seconds: the choice does not
            depend on the machine's load.
  marks     the measurement adds evaluation marks around the tuned reference's crossing of the target (½ to 1½ of
            its cost to target on the tuning seeds), at most 20 iterations of the cheapest chosen variant apart
            (:func:`focus_window`), so that a crossing 20 iterations sooner is seen.
  outputs   ``tune/grid.md`` and ``tune/grid.json`` (every cell: settings, seeds, cost and time to target or not
            reached, end reward inside the guards, first guard out, the chosen ones), ``tuned.json`` (the chosen
            settings per variant and the tuning's cost); the measurement's ``table.md`` names the chosen settings.
  cost      (cells × tuning seeds) trainings of the budget, reported as counted cost and wall-clock seconds.

Tuning seeds must differ from the measuring seeds (a ConfigError otherwise): the measurement never sees the runs
its settings were chosen on.
"""
from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

from .. import guards, yamlio
from ..config import RunConfig
from ..console import emit
from ..errors import ConfigError
from ..fileio import atomic_write, read_utf8, run_root
from .quality_stats import METRIC, GuardCheck, mean

STRENGTH = {"gardo": "diversity.gardo_amplify", "diversegrpo": "diversity.cluster_bonus",
            "drift": "diversity.drift_shaping"}
DEFAULT = ("x0.5", "x1", "x2")
DEFAULT_GRID = {"train.lr": list(DEFAULT), "loss.beta": list(DEFAULT)}
EVERY = 20  # iterations between dense evaluation marks around the target crossing, for the cheapest variant


# ---------------------------------------------------------------------- pure functions
def parse_grid(specs: list[str]) -> dict[str, list[str]]:
    """``--tune-grid``: ``key=v1,v2`` words, or one YAML file mapping each key to its list of values → {key: values}
    ({}: the default grid)."""
    if len(specs) == 1 and "=" not in specs[0]:
        data = yamlio.load(read_utf8(Path(specs[0]), "--tune-grid"), f"--tune-grid: file {specs[0]!r}")
        if not isinstance(data, dict) or not all(isinstance(v, list) and v for v in data.values()):
            raise ConfigError(f"--tune-grid: file {specs[0]!r} must map each key to a non-empty list of values")
        return {str(k): [str(x) for x in v] for k, v in data.items()}
    grid = {}
    for spec in specs:
        key, _, vals = spec.partition("=")
        values = [v.strip() for v in vals.split(",") if v.strip()]
        if not key.strip() or not values:
            raise ConfigError(f"--tune-grid: {spec!r} must be key=value1,value2,... (or one YAML file)")
        grid[key.strip()] = values
    return grid


def get_path(cfg, dotted: str):
    """The value of config key ``a.b.c`` (ConfigError naming ``--tune-grid`` when there is none)."""
    obj = cfg
    for part in dotted.split("."):
        if not hasattr(obj, part) or part.startswith("_"):
            raise ConfigError(f"--tune-grid: {dotted!r} is not a config key")
        obj = getattr(obj, part)
    return obj


def own_settings(cfg: RunConfig, keys) -> dict[str, str]:
    """The variant's own values of ``keys`` as grid cells write them (numbers as ``x1`` resolves them)."""
    return {k: resolve("x1", v) if isinstance(v, (int, float)) and not isinstance(v, bool) else str(v)
            for k in keys for v in [get_path(cfg, k)]}


def resolve(value: str, current) -> str:
    """A grid value: ``x<f>`` → f × the current value (as text), a number for a float key in the same form, anything
    else itself."""
    if value.startswith("x"):
        try:
            f = float(value[1:])
        except ValueError:
            return value
        if not isinstance(current, (int, float)) or isinstance(current, bool):
            raise ConfigError(f"--tune-grid: {value!r} multiplies a number, and the value here is {current!r}")
        return f"{f * current:.6g}"
    try:  # a literal number as a multiple writes it, so that equal settings are one cell
        return f"{float(value):.6g}" if isinstance(current, float) else value
    except ValueError:
        return value


def variant_grid(cfg: RunConfig, grid: dict[str, list[str]]) -> dict[str, list[str]]:
    """The grid of one variant (resolved config ``cfg``): ``grid`` (default :data:`DEFAULT_GRID`) plus, when no key
    of the grid is under ``diversity.``, each used diversity objective's strength at ×0.5, ×1, ×2."""
    out = dict(grid or DEFAULT_GRID)
    if not grid or not any(k.startswith("diversity.") for k in grid):
        methods = [m.strip() for m in str(cfg.diversity.method).split(",")]
        out.update({STRENGTH[m]: list(DEFAULT) for m in methods if m in STRENGTH})
    return out


def grid_settings(cfg: RunConfig, grid: dict[str, list[str]]) -> list[dict[str, str]]:
    """Every cell of ``grid`` on the variant's resolved config ``cfg`` as {key: value text}, duplicates dropped,
    in grid order."""
    keys = list(grid)
    for k in keys:
        get_path(cfg, k)
    cells, seen = [], set()
    for combo in itertools.product(*(grid[k] for k in keys)):
        s = {k: resolve(v, get_path(cfg, k)) for k, v in zip(keys, combo)}
        if tuple(s.items()) not in seen:
            seen.add(tuple(s.items()))
            cells.append(s)
    return cells


def end_inside(curve: list[dict], check: GuardCheck, metric: str = METRIC) -> float:
    """The reward at the last evaluation of a cell's curve inside every guard (the start is always inside)."""
    start = curve[0]["metrics"]
    inside = [p for p in curve if not check.out(start, p["metrics"])] or curve[:1]
    return inside[-1]["metrics"].get(metric, float("nan"))


def held(curve: list[dict], check: GuardCheck) -> bool:
    """Whether a cell's last evaluation is inside every guard (relative to its start)."""
    return not check.out(curve[0]["metrics"], curve[-1]["metrics"])


def choose(rows: list[dict]) -> dict[str, str]:
    """Grid rows (``variant``, ``cell``, ``held``, ``cost_to_target``, ``end_inside``) → {variant: chosen cell}: the
    cells that end inside every guard in the most tuning seeds (``held``, the fraction; a setting that touches the
    target and then hacks is not a setting a user keeps), among them the least cost to the target, ties (and no cell
    at the target) broken by the highest end reward inside the guards, then grid order."""
    best: dict[str, tuple] = {}
    for i, r in enumerate(rows):
        end = r["end_inside"] if math.isfinite(r["end_inside"]) else -math.inf
        key = (-r["held"], r["cost_to_target"], -end, i)
        if r["variant"] not in best or key < best[r["variant"]][0]:
            best[r["variant"]] = (key, r["cell"])
    return {v: b[1] for v, b in best.items()}


def grid_markdown(rows: list[dict], chosen: dict[str, str], cost: dict) -> str:
    """``tune/grid.md``: every grid cell, the chosen ones in bold, and what the tuning cost."""
    lines = ["# Tuning grid", "", f"Cost of the tuning: {cost['cells']} grid cells × seeds {cost['seeds']}, "
             f"{cost['counted_cost']:.0f} counted cost units, {cost['seconds']:.0f} s wall-clock (training and "
             "evaluation). Chosen per variant: among the cells ending inside every guard in the most tuning seeds, "
             "the least cost to the target inside the guards (mean over the tuning seeds), ties and none at the "
             "target: the highest end reward inside the guards.", "",
             "| variant | cell | settings | seeds | ends inside guards | cost to target | time to target (s) | "
             "end reward inside guards | first guard out | chosen |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mark = "**yes**" if chosen.get(r["variant"]) == r["cell"] else ""
        lines.append(f"| {r['variant']} | {r['cell']} | {', '.join(f'{k}={v}' for k, v in r['settings'].items())} | "
                     f"{r['seeds']} | {r['held']:.0%} | {_reached(r['cost_to_target'], '{:.0f}')} | {_reached(r['time_to_target'], '{:.1f}')} | "
                     f"{r['end_inside']:.4f} | {r['first_out'] or 'none'} | {mark} |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- the tuning stage
def plan(base: RunConfig, variants: dict[str, list[str]], grid: dict[str, list[str]]) -> dict[str, dict]:
    """{cell name: {"variant", "settings", "overrides"}} of every variant's grid, validated before any model
    loads; a cell's name is ``<variant>.t<i>``."""
    cells = {}
    for v, ov in variants.items():
        cfg = RunConfig.from_overrides(ov, base=base)
        for i, s in enumerate(grid_settings(cfg, variant_grid(cfg, grid))):
            over = [*ov, *(f"{k}={x}" for k, x in s.items())]
            RunConfig.from_overrides(over, base=base)
            cells[f"{v}.t{i}"] = {"variant": v, "settings": s, "overrides": over}
    return cells


def tune(base: RunConfig, variants: dict[str, list[str]], tune_seeds: list[int], seeds: list[int], *, out: Path,
         reference: str, grid: dict[str, list[str]], run, log=emit, **bench) -> dict:
    """Run every variant's grid on ``tune_seeds`` with ``run`` (:func:`.quality.run`; ``bench``: its budget, marks
    and target options) into ``out/tune`` and choose per variant. → {"chosen": {variant: {"cell", "settings",
    "overrides"}}, "cost": ..., "rows": grid rows}."""
    if not tune_seeds or set(tune_seeds) & set(seeds):
        raise ConfigError(f"--tune-seeds: {tune_seeds} must be non-empty and share no seed with --seeds {seeds}")
    cells = plan(base, variants, grid)
    ref_cfg = RunConfig.from_overrides(variants[reference], base=base)
    mine = [c for c, d in cells.items() if d["variant"] == reference]
    ref = next((c for c in mine if cells[c]["settings"] == own_settings(ref_cfg, cells[c]["settings"])), mine[0])
    log(f"bench quality --tune: {len(cells)} grid cells × tuning seeds {tune_seeds}, reference cell {ref}")
    s = run(base, {c: d["overrides"] for c, d in cells.items()}, tune_seeds, out=Path(out) / "tune", reference=ref,
            log=log, **bench)
    check = GuardCheck(s["thresholds"], lambda a, b: guards.tripped(a, b, guards.Thresholds(**s["thresholds"])))
    metric = s["metric"]
    by_row = {r["variant"]: r for r in s["rows"]}
    rows = []
    for c, d in cells.items():
        r = by_row[c]
        curves = [x["evaluations"] for x in s["cells"] if x["variant"] == c]
        outs = [o for o in r["first_out_of_guards"] if o]
        rows.append({"variant": d["variant"], "cell": c, "settings": d["settings"], "seeds": list(tune_seeds),
                     "cost_to_target": r["cost_to_target"], "time_to_target": r["time_to_target"],
                     "end_inside": mean([end_inside(_nan(cv), check, metric) for cv in curves]),
                     "held": mean([float(held(_nan(cv), check)) for cv in curves]),
                     "first_out": ", ".join(outs[0]["guards"]) if outs else ""})
    chosen = choose(rows)
    cost = {"cells": len(cells), "seeds": list(tune_seeds), "seconds": s["meta"]["total_seconds"],
            "counted_cost": sum(x["cost"] for x in s["cells"]), "reference_cell": ref, "target": s["target"]}
    budget = float(s["meta"]["budget_cost"])
    focus = focus_window(by_row[chosen[reference]]["cost_to_target"] / budget,
                         min(by_row[c]["cost_per_iteration"] for c in chosen.values()) / budget)
    result = {"chosen": {v: {"cell": c, **{k: cells[c][k] for k in ("settings", "overrides")}}
                         for v, c in chosen.items()}, "cost": cost, "rows": rows, "focus": focus}
    with run_root(out):
        atomic_write(Path(out) / "tune" / "grid.md", grid_markdown(rows, chosen, cost))
        atomic_write(Path(out) / "tune" / "grid.json", json.dumps(_finite(rows), indent=1))
        atomic_write(Path(out) / "tuned.json", json.dumps(_finite({k: result[k] for k in ("chosen", "cost")}),
                                                          indent=1))
    log(grid_markdown(rows, chosen, cost))
    return result


def tuned(base: RunConfig, variants: dict[str, list[str]], tune_seeds: list[int], seeds: list[int], *, out: Path,
          reference: str, grid: dict[str, list[str]], run, **bench) -> tuple[dict[str, list[str]], dict]:
    """:func:`tune`, then → (each variant's overrides with its chosen settings, the record of the tuning for the
    measurement's outputs)."""
    t = tune(base, variants, tune_seeds, seeds, out=out, reference=reference, grid=grid, run=run, **bench)
    return ({v: t["chosen"][v]["overrides"] for v in variants},
            {"chosen": {v: c["settings"] for v, c in t["chosen"].items()}, **t["cost"], "focus": t["focus"]})


def focus_window(crossing: float, min_cost_per_iteration: float, every: int = EVERY, cap: int = 40):
    """Dense evaluation marks around the reference's crossing of the target (a fraction of the budget, from the
    tuning): (lo, hi, n) over [½, 1½] × crossing with marks at most ``every`` iterations of the cheapest variant
    apart (at most ``cap`` marks); None when the reference never crossed."""
    if not 0 < crossing < math.inf or min_cost_per_iteration <= 0:
        return None
    lo, hi = 0.5 * crossing, min(1.0, 1.5 * crossing)
    step = every * min_cost_per_iteration  # as a fraction of the budget
    return lo, hi, int(min(cap, max(2, math.ceil((hi - lo) / step) + 1)))


def _reached(x: float, f: str) -> str:
    return f.format(x) if math.isfinite(x) else "not reached"


def _nan(curve: list[dict]) -> list[dict]:
    """A curve read from strict JSON (None for NaN) with floats again."""
    return [{**p, "metrics": {k: math.nan if v is None else v for k, v in p["metrics"].items()}} for p in curve]


def _finite(x):
    """Strict JSON: every non-finite float as None."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_finite(v) for v in x]
    return x


__all__ = ["DEFAULT_GRID", "STRENGTH", "choose", "end_inside", "get_path", "grid_markdown", "grid_settings", "held",
           "focus_window", "own_settings", "parse_grid", "plan", "resolve", "tune", "tuned", "variant_grid"]
