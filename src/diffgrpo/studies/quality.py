"""``diffgrpo bench quality``: time to quality of config variants against a reference, inside start-anchored guards.

Every *cell* (variant × seed) is a :class:`~diffgrpo.trainer.Trainer` built from one base config plus the variant's
overrides and ``seed=<s>``; all cells live in one process and are stepped **interleaved**: the next iteration goes to
the unfinished cell with the least counted cost so far (ties: listing order), so the schedule does not depend on the
machine's load, and load noise hits every variant alike.

  cost        sample-forwards (rollout and training, with and without grad) + 2 × sample-backwards (the counters)
  budget      ``iterations`` of the reference variant, converted to counted cost (the reference seeds' mean cost of
              their first iteration + (iterations − 1) × that of their second: an engine's first iteration may
              cost less, as nft's, which has no θ_old forwards), the same for every cell; or a counted cost
              directly. Never seconds: a loaded machine cannot move the target.
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
``curves.png`` (reward vs wall-clock and vs cost, guard metrics vs reward), ``frontier.png`` (speed-up against diversity
at the target, per diversity objective), ``configs/<variant>_seed<s>.yaml`` (one
resolved config per cell) and ``command.txt``; no per-iteration logs. Cost: the cells' training plus
(evals + 1) evaluations per cell.

This module holds the schedule, the signals and the files; the statistics are :mod:`.quality_stats` (no torch),
the table and the figure :mod:`.quality_report`.
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import shlex
import signal
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .. import guards
from ..config import MODEL_FAMILIES, RunConfig
from ..configvalues import split_overrides
from ..console import emit, signal_note
from ..errors import ConfigError, TrainingError
from ..fileio import atomic_write, claim_folder, run_root
from ..trainer import Trainer
from . import quality_tune
from .quality_report import plot, plot_frontier, to_markdown
from .quality_stats import METRIC, PHASES, GuardCheck, summarize

SPACINGS = ("linear", "quadratic")
MARKER = ".diffgrpo-bench-quality"


# ---------------------------------------------------------------------- pure functions
def guard_check(th: guards.Thresholds) -> GuardCheck:
    """The start-anchored guards of ``th`` (:func:`guards.tripped`) as the statistics judge them."""
    return GuardCheck(dict(vars(th)), functools.partial(guards.tripped, th=th))


def parse_variant(spec: str) -> tuple[str, list[str]]:
    """``NAME=key=value,key=value`` (or a bare ``NAME``: no overrides; a list value in brackets keeps its commas)
    → (name, overrides)."""
    name, _, ov = spec.partition("=")
    if not name.strip():
        raise ConfigError(f"--variant: {spec!r} must be NAME or NAME=key=value[,key=value...]")
    return variant_name(name.strip()), split_overrides(ov)


def variant_name(name: str) -> str:
    """``name`` when it can name files under ``--out`` (letters, digits, ``_ - . +``, not starting with a dot);
    a one-line ConfigError otherwise (``..`` or ``/`` would leave ``--out``)."""
    if not re.fullmatch(r"[A-Za-z0-9_+\-][A-Za-z0-9_.+\-]{0,127}", name):
        raise ConfigError(f"--variant: name {name!r} is not allowed; use up to 128 letters, digits, _ - . + (not "
                          "starting with a dot): it names the variant's files under --out")
    return name


def eval_marks(budget: float, evals: int, spacing: str = "linear", focus=None) -> list[float]:
    """The costs at which a cell is evaluated after its start: budget·j/evals (``linear``) or budget·(j/evals)²
    (``quadratic``), j = 1 … evals; ``focus`` (lo, hi, n): also n marks evenly from budget·lo to budget·hi (dense
    where the target is crossed; the same costs for every cell, so the curves stay aligned). Ascending, the last
    one the budget."""
    if spacing not in SPACINGS:
        raise ConfigError(f"--eval-spacing: {spacing!r} is not one of {list(SPACINGS)}")
    power = 2 if spacing == "quadratic" else 1
    marks = [budget * (j / evals) ** power for j in range(1, evals + 1)]
    if focus:
        lo, hi, n = focus
        marks += [budget * (lo + (hi - lo) * i / max(n - 1, 1)) for i in range(int(n))]
    return sorted({m for m in marks if 0 < m <= budget})


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


def build_cells(base: RunConfig, variants: dict[str, list[str]], seeds: list[int], log=emit) -> list[Cell]:
    """Every (variant, seed) cell, configs validated before any model loads."""
    cfgs = [(v, s, RunConfig.from_overrides([*ov, f"seed={s}"], base=base)) for s in seeds
            for v, ov in variants.items()]
    return [Cell(v, s, cfg, Trainer(cfg, log=lambda *a: None), overrides=variants[v]) for v, s, cfg in cfgs]


def interleave(cells: list[Cell], reference: str, *, iterations: int = 0, budget_cost: float = 0.0, evals: int = 4,
               spacing: str = "linear", max_iterations: int = 0, stop=lambda: False, log=emit, focus=None) -> float:
    """Step the unfinished cell with the least cost until every cell has spent the budget (→ the budget in cost):
    ``budget_cost``, or ``iterations`` of the reference (its seeds' mean cost of one iteration × iterations).
    Each cell is evaluated at the start and when its cost passes each of :func:`eval_marks`. ``stop()`` true
    ends the stepping before the next step (the cells stay unfinished: see :func:`truncate`)."""
    for c in cells:
        c.evaluate()
    cap = max_iterations or 1_000_000
    if budget_cost <= 0:  # the reference seeds' first two iterations fix the cost of `iterations` of them
        budget_cost = reference_budget([c for c in cells if c.variant == reference], iterations)
    marks = eval_marks(budget_cost, evals, spacing, focus)
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


def reference_budget(refs: list[Cell], iterations: int) -> float:
    """The counted cost of ``iterations`` iterations of the reference: its seeds step once (twice when
    ``iterations`` ≥ 2) and the budget is the mean first iteration's cost + (iterations − 1) × the mean second's.
    An engine's first iteration can cost otherwise than the rest (nft's has no θ_old forwards: θ_old = θ), so
    sizing the budget from the first alone would give the reference a different number of iterations."""
    first, second = [], []
    for n, costs in ((1, first), (2, second)):
        if n > min(iterations, 2):
            break
        for c in refs:
            before = c.cost
            c.step()
            if c.failed:
                raise TrainingError(f"bench quality: the reference's iteration {n} failed: {c.failed}")
            costs.append(c.cost - before)
    steady = statistics.mean(second) if second else statistics.mean(first)
    return statistics.mean(first) + (iterations - 1) * steady


def truncate(cells: list[Cell], budget: float, evals: int, spacing: str, focus=None) -> tuple[int, float]:
    """After an interrupted :func:`interleave`: cut every cell's curve at the last mark all cells (but the failed
    ones) have passed, so the benchmark reads as one with that smaller budget. → (marks kept, their budget)."""
    marks = eval_marks(budget, evals, spacing, focus)
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


# ---------------------------------------------------------------------- the whole benchmark and its files
def claim_out(out: Path) -> None:
    """``--out`` must be new, empty, or an earlier ``bench quality`` output (its marker file): any other folder is
    refused before any model loads, so the benchmark never overwrites files it did not write."""
    claim_folder(out, MARKER, "--out", "bench quality",
                 outputs=("summary.json", "table.md", "curves.png", "frontier.png", "command.txt", "configs"))


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
        max_iterations: int = 0, tuning: dict | None = None, focus=None, guard_mean: int = 1, log=emit) -> dict:
    """The whole benchmark; writes the outputs under ``out`` and returns the summary (see the module docstring);
    ``tuning``: what :func:`.quality_tune.tune` chose, recorded in the outputs; ``focus``: dense marks
    (:func:`eval_marks`); ``guard_mean``: guards judged on the mean of that many neighbouring evaluations."""
    reference = reference or next(iter(variants))
    if reference not in variants:
        raise ConfigError(f"--reference: {reference!r} is not one of the variants {list(variants)}")
    for name in variants:
        variant_name(name)
    if (iterations > 0) == (budget_cost > 0):
        raise ConfigError("bench quality: give exactly one budget, --iterations (of the reference) or --budget-cost")
    if guard_mean < 1:
        raise ConfigError(f"--guard-mean: value {guard_mean} is out of range; must be >= 1 (evaluations averaged)")
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
    with _signals_stop() as stopped:
        cost = interleave(cells, reference, iterations=iterations, budget_cost=budget_cost, evals=evals,
                          spacing=eval_spacing, max_iterations=max_iterations, stop=lambda: bool(stopped), log=log,
                          focus=focus)
    interrupted = None
    if stopped:
        kept, cost = truncate(cells, cost, evals, eval_spacing, focus)
        if kept < 1:
            raise TrainingError(f"bench quality: stopped by signal {stopped[0]} before every cell reached its first "
                                "evaluation mark; nothing to summarise")
        interrupted = {"signal": stopped[0], "marks": kept}
        log(f"bench quality: stopped by signal {stopped[0]}; summarised at mark {kept}/{evals} (cost {cost:.0f})")
    th = guards.thresholds(base.train)
    s = summarize(cells, reference, metric=metric, target_fraction=target_fraction, check=guard_check(th),
                  target=target, budget=cost, guard_mean=guard_mean, patience=base.train.guard_patience)
    meta = {"title": title or f"{base.model.name} model, rewards {sorted(base.reward.weights)}", "command": command,
            "variants": variants, "seeds": seeds, "iterations": iterations, "budget_cost": cost, "evals": evals,
            "eval_spacing": eval_spacing, "interrupted": interrupted, "tuning": tuning, "focus": focus,
            "eval_samples": _eval_samples(cells[0]),
            "total_seconds": time.perf_counter() - t0, "load": f"{load:.2f}", "torch_threads": torch.get_num_threads()}
    cells_json = [{"variant": c.variant, "seed": c.seed, "iterations": c.iterations, "seconds": c.seconds,
                   "cost": c.cost, "failed": c.failed, "overrides": c.overrides, "phases": c.phases,
                   "evaluations": c.curve} for c in cells]
    md = _write(out, meta, s, cells_json, command)
    log(md)
    return {"meta": meta, **s, "cells": cells_json}


@contextlib.contextmanager
def _signals_stop():
    """Inside the block the first SIGINT / SIGTERM is noted in the yielded list (the benchmark finishes its current
    step, then writes the outputs for the marks every cell has passed); a second one interrupts at once. Outside the
    main thread nothing is installed."""
    stopped: list[int] = []

    def on_signal(signum, frame):
        if stopped:
            raise KeyboardInterrupt
        stopped.append(signum)
        signal_note(f"received signal {signum}: finishing the current step, then writing the outputs for the "
                    "evaluation marks every cell has passed (a second signal stops at once)")

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
        atomic_write(out / "frontier.png", lambda tmp: plot_frontier(s, tmp))
    return md


def resummarize(out: str | Path, *, target_fraction: float | None = None, target: float | None = None,
                metric: str | None = None, patience: int | None = None, command: str = "", log=emit) -> dict:
    """Summarise a finished benchmark's cells again (``diffgrpo bench quality --from DIR``): another target fraction,
    target or metric, without training anything. Rewrites ``table.md``, ``summary.json``, ``curves.png`` and
    ``frontier.png``;
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
    cells_json = [{k: v for k, v in c.items()} for c in old["cells"]]
    first = (out / "command.txt").read_text(encoding="utf-8").splitlines()[:1] if (out / "command.txt").is_file() else []
    try:  # (the table is made before any file is written)
        s = summarize(cells, old["reference"], metric=metric, target_fraction=frac, check=guard_check(th),
                      target=target, budget=float(old["meta"]["budget_cost"]), guard_mean=int(old.get("guard_mean", 1)),
                      patience=int(old.get("guard_patience", 1)) if patience is None else patience)
        md = _write(out, old["meta"], s, cells_json, "\n".join([*first, *([command] if command else [])]))
    except (KeyError, TypeError, ValueError) as e:  # e.g. a summary whose meta lacks "seeds"
        raise ConfigError(f"--from: {str(path)!r} cannot be read as a bench quality summary ({type(e).__name__}: "
                          f"{e})") from None
    log(md)
    return {"meta": old["meta"], **s, "cells": cells_json}


def from_args(base: RunConfig, args) -> dict:
    """``diffgrpo bench quality`` (``cli.build_parser``'s options) on the resolved base config."""
    frac = 0.95 if args.target_fraction is None else args.target_fraction
    metric = args.metric or METRIC
    if not args.variant:
        raise ConfigError("bench quality: give the variants (--variant NAME=key=value,...), or --from DIR to "
                          "summarise a finished benchmark again")
    if getattr(args, "guard_patience", None) is not None:
        raise ConfigError("--guard-patience: only with --from; a new benchmark reads train.guard_patience=N")
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
    words += ["--tune", "--tune-seeds", *map(str, args.tune_seeds)] + (
        ["--tune-grid", *args.tune_grid] if args.tune_grid else []) if args.tune else []
    command = "diffgrpo bench quality " + " ".join(shlex.quote(w) for w in words)
    words += ["--guard-mean", str(args.guard_mean)] if args.guard_mean > 1 else []
    bench = dict(iterations=args.iterations, budget_cost=args.budget_cost, evals=args.evals,
                 eval_spacing=args.eval_spacing, target_fraction=frac, target=args.target, metric=metric,
                 guard_mean=args.guard_mean)
    tuning = None
    if args.tune:
        claim_out(Path(args.out))  # a foreign folder is refused before the grid trains
        variants, tuning = quality_tune.tuned(base, variants, args.tune_seeds, args.seeds, out=Path(args.out),
                                              reference=args.reference or next(iter(variants)),
                                              grid=quality_tune.parse_grid(args.tune_grid), run=run,
                                              command=command + "  (tuning stage)", **bench)
    return run(base, variants, args.seeds, out=args.out, reference=args.reference, command=command, tuning=tuning,
               focus=(tuning or {}).get("focus"), **bench)


def again_from_args(args) -> dict:
    """``diffgrpo bench quality --from DIR [--target-fraction F | --target T] [--metric M]``: :func:`resummarize`."""
    given = [f for f, v in (("--variant", args.variant), ("--iterations", args.iterations),
                            ("--budget-cost", args.budget_cost), ("--reference", args.reference),
                            ("--config", args.config), ("key=value overrides", args.overrides)) if v]
    if given:
        raise ConfigError(f"--from: {', '.join(given)} cannot change a finished benchmark's cells; only "
                          "--target-fraction, --target, --metric and --guard-patience apply")
    if args.out != str(Path("runs") / "bench_quality") and Path(args.out).absolute() != Path(args.from_dir).absolute():
        raise ConfigError(f"--from: the summary of {args.from_dir!r} is rewritten in place; --out {args.out!r} does not "
                          "apply (copy the folder first to keep both)")
    words = ["--from", args.from_dir] + (["--target-fraction", str(args.target_fraction)]
                                         if args.target_fraction is not None else []) + (
        ["--target", str(args.target)] if args.target is not None else []) + (
        ["--metric", args.metric] if args.metric else []) + (
        ["--guard-patience", str(args.guard_patience)] if args.guard_patience is not None else [])
    if args.guard_patience is not None and args.guard_patience < 1:
        raise ConfigError(f"--guard-patience: value {args.guard_patience} is out of range; must be >= 1")
    return resummarize(args.from_dir, target_fraction=args.target_fraction, target=args.target, metric=args.metric,
                       patience=args.guard_patience, command="summarised again: diffgrpo bench quality " + " ".join(shlex.quote(w) for w in words))


__all__ = ["Cell", "MARKER", "SPACINGS", "again_from_args", "build_cells", "claim_out", "eval_marks", "from_args",
           "guard_check", "interleave", "load_cells", "parse_variant", "resummarize", "run", "truncate"]
