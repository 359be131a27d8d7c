"""The shapes_video task's checker: the shapes checker on every frame plus each object's motion, read from the
centroids of its detections across frames, and the two rewards built on them, ``shapes_video_correct`` (0/1)
and ``shapes_video_score`` (the fraction of constraints met). No learned judge.

For a clip (3, F, H, W) in [0, 1] and a record of :mod:`diffgrpo.tasks.shapes_video`:

- per frame, the shapes task's constraints (``rewards.shapes.constraints_met``: each entry's count and colour, a
  clean scene); each is counted as the fraction of frames that meet it;
- per entry with a ``motion``, its track is met when the entry's object (its class and colour) is detected once in
  every frame and its centroid moves in the named direction by at least :data:`MIN_STEP` pixels at every frame step
  (monotone, with a margin), while off that axis it stays within ``max(MIN_DRIFT, DRIFT × the distance moved)``
  of where it started. Pixels scale by H / 32.

``shapes_video_correct`` is 1 when every frame meets every constraint and every track is met; ``shapes_video_score``
the mean over constraints (1 exactly when correct). Both are NaN for a sample whose metadata has no ``include``.
Cost: one batched detection over all B·F frames.
"""
from __future__ import annotations

import numpy as np
import torch

from ..tasks.shapes_video import DIRECTIONS
from .shapes import Detection, constraints_met, detect_batch

MIN_STEP = 1.0  # pixels (at 32 × 32) the centroid must move each frame along the named direction
MIN_DRIFT = 1.5  # pixels (at 32 × 32) off the axis always allowed
DRIFT = 0.25  # off-axis drift allowed, as a fraction of the distance moved along the axis


def track_met(frames: list[list[Detection]], req: dict, scale: float = 1.0) -> bool:
    """Whether an entry's object (once per frame) moves in ``req["motion"]``: monotone steps of at least
    MIN_STEP · scale along the axis, off-axis drift within max(MIN_DRIFT · scale, DRIFT × the distance moved)."""
    path = []
    for dets in frames:
        own = [d for d in dets if d.kind == req["class"] and d.color == req.get("color", d.color)]
        if len(own) != 1:
            return False
        path.append(own[0].centroid)
    xy = np.asarray(path)  # (F, 2)
    dx, dy = DIRECTIONS[req["motion"]]
    along = xy @ np.asarray([dx, dy], dtype=float)  # (F,) position along the direction
    across = xy @ np.asarray([dy, dx], dtype=float)  # (F,) position off its axis (sign irrelevant)
    moved = along[-1] - along[0]
    if len(xy) < 2 or not (np.diff(along) >= MIN_STEP * scale).all():
        return False
    return bool(np.abs(across - across[0]).max() <= max(MIN_DRIFT * scale, DRIFT * moved))


def clip_constraints(frames: list[list[Detection]], meta: dict, scale: float = 1.0) -> list[float]:
    """Each constraint of a record (module doc): the per-frame ones as the fraction of frames meeting them, then one
    0/1 per entry with a motion."""
    per_frame = np.asarray([constraints_met(dets, meta) for dets in frames], dtype=float)  # (F, K)
    tracks = [float(track_met(frames, r, scale)) for r in meta["include"] if "motion" in r]
    return [*per_frame.mean(0).tolist(), *tracks]


def _scores(videos: torch.Tensor, metadata: list[dict] | None, strict: bool) -> torch.Tensor:
    if videos.dim() != 5:
        raise ValueError(f"expected video (B, C, F, H, W), got shape {tuple(videos.shape)}")
    B, C, F, H, W = videos.shape
    metadata = list(metadata) if metadata is not None else [{}] * B
    out = torch.full((B,), float("nan"))
    todo = [i for i, m in enumerate(metadata) if (m or {}).get("include")]
    if not todo:
        return out
    frames = videos[todo].permute(0, 2, 1, 3, 4).reshape(len(todo) * F, C, H, W)  # (b·F, C, H, W)
    dets = detect_batch(frames)
    for j, i in enumerate(todo):
        met = clip_constraints(dets[j * F:(j + 1) * F], metadata[i], H / 32)
        out[i] = float(all(m == 1.0 for m in met)) if strict else sum(met) / len(met)
    return out


def shapes_video_correct(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                         ) -> torch.Tensor:
    """1 when every frame meets its prompt's constraints and every object moves as named, else 0:
    (B, 3, F, H, W) → (B,)."""
    return _scores(images, metadata, strict=True)


def shapes_video_score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None
                       ) -> torch.Tensor:
    """The fraction of the clip's constraints met (per-frame ones averaged over frames, one per motion):
    (B, 3, F, H, W) → (B,) in [0, 1]."""
    return _scores(images, metadata, strict=False)


__all__ = ["clip_constraints", "shapes_video_correct", "shapes_video_score", "track_met"]
