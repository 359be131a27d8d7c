"""A feature vector for shapes samples from the checker's own detections (:func:`rewards.shapes.detect_batch`): the
space the diversity objectives measure samples in on the shapes tasks. No learned extractor; deterministic.

Labels: each (shape, colour) of :data:`tasks.shapes.SHAPES` × the palette (circle–red, circle–green, …, in that
order), then *unrecognised* (every detection with ``kind`` None, whatever its colour). Per label, four dimensions:

    count,  mean centroid x / W,  mean centroid y / H,  mean √area / W

over that label's detections (all four 0 when the label is absent); the last dimension is 1 for a scene with no
detection at all, else 0 (so a blank sample is a fixed non-zero vector, at cosine distance 0 from another blank one
and 1 from every scene with objects). D = 4 · (3 · 4 + 1) + 1 = 53.

Two samples with the same objects in the same places have the same vector; moving an object moves only its label's
position dimensions (by the shift over the image side, to the checker's centroid precision), adding one changes
its label's count, recolouring one moves its count to the other label. Video (B, 3, F, H, W): each frame's vector,
then the mean over the F frames. Cost: one checker pass per sample (per frame), batched; O(D) per sample after it.
"""
from __future__ import annotations

import numpy as np
import torch

from ..tasks.shapes import SHAPES
from .shapes import PALETTE, Detection, detect_batch
from .shapes_diversity import layout

UNRECOGNISED = (None, None)
LABELS: tuple[tuple[str | None, str | None], ...] = (*((k, c) for k in SHAPES for c in PALETTE), UNRECOGNISED)
INDEX = {label: i for i, label in enumerate(LABELS)}
PER_LABEL = 4  # count, x / W, y / H, √area / W
DIM = PER_LABEL * len(LABELS) + 1  # + the empty-scene dimension


def scene_vector(dets: list[Detection], height: int, width: int) -> np.ndarray:
    """One image's detections → (DIM,) float64 (module doc); the points are the layout diversity's."""
    labels, points = layout(dets, height, width)  # (n,), (n, 3): x / W, y / H, √area / W
    idx = np.array([INDEX.get(label, INDEX[UNRECOGNISED]) for label in labels], dtype=int)  # (n,)
    v = np.zeros(DIM)
    for j in np.unique(idx):
        mine = points[idx == j]  # (m, 3)
        v[PER_LABEL * j] = len(mine)
        v[PER_LABEL * j + 1:PER_LABEL * (j + 1)] = mine.mean(0)
    v[-1] = float(not dets)
    return v


def detection_features(images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) or video (B, 3, F, H, W) in [0, 1] → (B, DIM) float32 on the CPU (video: the mean of
    the per-frame vectors)."""
    if images.dim() not in (4, 5):
        raise ValueError(f"expected images (B, C, H, W) or video (B, C, F, H, W), got shape {tuple(images.shape)}")
    B, F = images.shape[0], images.shape[2] if images.dim() == 5 else 1
    H, W = images.shape[-2:]
    frames = images if images.dim() == 4 else images.permute(0, 2, 1, 3, 4).reshape(B * F, images.shape[1], H, W)
    rows = [scene_vector(d, H, W) for d in detect_batch(frames)]  # B·F × (DIM,)
    v = torch.from_numpy(np.stack(rows)) if rows else torch.zeros(0, DIM, dtype=torch.float64)  # (B·F, DIM)
    return v.view(B, F, DIM).mean(1).float()  # (B, DIM)


__all__ = ["DIM", "LABELS", "UNRECOGNISED", "detection_features", "scene_vector"]
