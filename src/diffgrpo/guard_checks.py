"""Checks of the guards' inputs (:mod:`diffgrpo.guards` judges the values):

  uncomputed(start, row, th)  the guards with a limit on that an evaluation reports as NaN/inf, or lacks while the
                              start evaluation had them finite: a guard that cannot be computed is out of limits
  base_tensors(path)          ``guard_base.safetensors`` read back on resume: (mean (D,), cov (D, D), n), float64,
                              or a one-line TrainingError when it is damaged (unreadable, shapes that do not fit,
                              non-finite values)
  read_best(path, metric)     ``best/best.json`` read back on resume, or None with a warning when it is damaged or
                              of another metric
  improves(value, best)       whether a keep-best value beats the best so far
  out_streak(rows)            evaluations in a row, up to the last, out of the guards (train.guard_patience on resume)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import TrainingError

PREFIX = "eval/guard/"  # the guards' metrics (guards.PREFIX)
_BASE_ONLY = (PREFIX + "fd_base", PREFIX + "drift")  # absent when the base statistics are unknown (warned)


def improves(value, best) -> bool:
    """Whether a finite ``value`` of the keep-best metric beats ``best`` (None: no best yet); higher is better."""
    return isinstance(value, (int, float)) and math.isfinite(value) and (best is None or value > best)


def out_streak(rows) -> int:
    """How many evaluation rows in a row, up to the last, were out of the guards (``eval/guard/ok`` 0)."""
    n = 0
    for r in rows:
        n = n + 1 if r.get(PREFIX + "ok") == 0.0 else 0
    return n


def finite(v) -> bool:
    """Whether ``v`` is a finite int or float (not a bool)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def uncomputed(start: dict, row: dict, th) -> list[str]:
    """The guards of ``row`` that cannot be computed, each as a short phrase; ``th``: the guards' Thresholds (a
    limit of 0 is off, and that guard is not judged)."""
    distance = getattr(th, "distance", "fid")
    limits = (("eval/fid", th.max_fid_ratio * (distance == "fid")),
              (PREFIX + "kid", getattr(th, "max_kid", 0.0) * (distance == "kid")),
              (PREFIX + "fd_base", th.max_drift), (PREFIX + "drift", th.max_drift),
              ("eval/diversity", th.min_diversity_ratio), (PREFIX + "diversity", th.min_diversity_ratio),
              (PREFIX + "detection_diversity", th.min_diversity_ratio), (PREFIX + "color_diversity", th.min_diversity_ratio))
    keys = [k for k, on in limits if on > 0]
    if th.max_reward_drop > 0:
        keys += sorted(k for k in {*start, *row} if isinstance(k, str) and k.startswith(PREFIX + "rewards/"))
    out = []
    for k in keys:
        if k in row and not finite(row[k]):
            out.append(f"{k} is {row[k]!r}, not a finite number (the guard cannot be computed)")
        elif k not in row and finite(start.get(k)) and k not in _BASE_ONLY:
            out.append(f"{k} is missing (the guard cannot be computed; it was {start[k]:.4g} at the start)")
    return out


def base_tensors(path: Path) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(mean (D,), cov (D, D) float64, n ≥ 2) of a base-statistics file; a damaged one is a one-line TrainingError."""
    try:
        t = load_file(str(path))
        mean, cov, n = t["mean"].double(), t["cov"].double(), t["n"].reshape(-1)
    except Exception as e:  # noqa: BLE001 - a safetensors error of a damaged file, on one line
        raise _damaged(path, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}") from None
    d = mean.shape[0] if mean.dim() == 1 else -1
    if d < 1 or tuple(cov.shape) != (d, d) or n.numel() != 1 or int(n[0]) < 2:
        raise _damaged(path, f"mean {tuple(mean.shape)}, cov {tuple(cov.shape)}, n {n.tolist()[:4]}; expected (D,), "
                             "(D, D) and one count >= 2")
    if not (torch.isfinite(mean).all() and torch.isfinite(cov).all()):
        raise _damaged(path, "its mean or covariance is not finite")
    return mean, cov, int(n[0])


def _damaged(path: Path, why: str) -> TrainingError:
    return TrainingError(f"{path} is damaged ({why}); delete it to resume without {PREFIX}fd_base / drift")


def read_best(path: Path, metric: str, log=print) -> dict | None:
    """``best/best.json`` of a resumed run: {"iteration", "metric", "value"}, or None (with a warning) when it is
    damaged or names another metric; the next evaluation inside the guards then becomes the best."""
    try:
        best = json.loads(path.read_text())
        ok = isinstance(best, dict) and best.get("metric") == metric and finite(best.get("value"))
    except (OSError, ValueError, RecursionError):
        ok = False
    if not ok:
        log(f"warning: {path} is damaged or not of train.keep_best={metric}; it is ignored (the next evaluation "
            "inside the guards replaces best/)")
        return None
    return best


__all__ = ["PREFIX", "base_tensors", "finite", "improves", "out_streak", "read_best", "uncomputed"]
