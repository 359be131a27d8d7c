"""Per-prompt diversity of shapes samples from the checker's own detections (:func:`rewards.shapes.detect_batch`):
no feature extractor, every number a distance between object layouts.

A sample's *layout* is its detections, each a label (shape, colour; an unrecognised blob keeps its colour) and a
point (centroid x / W, centroid y / H, √area / W): where an object is and how big, in image-side units. The
distance of two layouts is a symmetric chamfer distance:

    d(A, B) = ½ (mean over a ∈ A of min over b ∈ B with a's label ‖a − b‖,  and the same from B to A),

each term capped at 1, and 1 for an object with no object of its label in the other layout (so a different set of
objects is as far as objects can be); two empty layouts are at 0. The diversity of a prompt's samples is the mean
of d over their pairs (0 when every sample has the same layout; independent of their order); a run reports the
mean over prompts with two samples or more.
"""
from __future__ import annotations

from collections.abc import Mapping
from itertools import combinations

import numpy as np
import torch

from .shapes import Detection, detect_batch

Layout = tuple[tuple[tuple, ...], np.ndarray]  # (labels (n,), points (n, 3))


def layout(dets: list[Detection], height: int, width: int) -> Layout:
    """One sample's detections → (labels, points (n, 3): x / W, y / H, √area / W)."""
    labels = tuple((d.kind, d.color) for d in dets)
    points = np.array([(d.centroid[0] / width, d.centroid[1] / height, np.sqrt(d.area) / width) for d in dets],
                      dtype=np.float64).reshape(-1, 3)
    return labels, points


def layouts(images: torch.Tensor) -> list[Layout]:
    """Images (B, C, H, W) in [0, 1] → each one's layout."""
    H, W = images.shape[-2:]
    return [layout(d, H, W) for d in detect_batch(images)]


def _one_way(a: Layout, b: Layout) -> float:
    """Mean over a's objects of the capped distance to the nearest object of its label in b (1 when none)."""
    (la, pa), (lb, pb) = a, b
    if not la:
        return 0.0
    costs = []
    for label, p in zip(la, pa):
        near = [q for lq, q in zip(lb, pb) if lq == label]
        costs.append(min(1.0, min(float(np.linalg.norm(p - q)) for q in near)) if near else 1.0)
    return float(np.mean(costs))


def layout_distance(a: Layout, b: Layout) -> float:
    """The symmetric chamfer distance of two layouts (module doc), in [0, 1]."""
    if not a[0] and not b[0]:
        return 0.0
    return 0.5 * (_one_way(a, b) + _one_way(b, a))


def prompt_diversity(group: list[Layout]) -> float:
    """Mean pairwise layout distance of one prompt's samples (NaN below two samples)."""
    pairs = list(combinations(group, 2))
    return float(np.mean([layout_distance(a, b) for a, b in pairs])) if pairs else float("nan")


def detection_diversity(by_index: Mapping[int, Layout], group: int) -> float:
    """The mean over prompts of :func:`prompt_diversity`; sample ``i`` belongs to prompt ``i // group`` (an
    evaluation's consecutive seeds). NaN when no prompt has two samples."""
    prompts: dict[int, list[Layout]] = {}
    for i in sorted(by_index):
        prompts.setdefault(i // group, []).append(by_index[i])
    values = [prompt_diversity(g) for g in prompts.values() if len(g) >= 2]
    return float(np.mean(values)) if values else float("nan")


def color_free(meta: Mapping) -> bool:
    """Whether a prompt record names no colour ("a triangle", "two squares"): its samples may take any colour."""
    return bool(meta.get("include")) and not any(e.get("color") for e in meta["include"])


def color_diversity(by_index: Mapping[int, Layout], free: set[int], group: int) -> float:
    """Over the prompts that name no colour (samples in ``free``; sample ``i`` of prompt ``i // group``), the mean
    Gini–Simpson spread of the colours of their samples' detected objects, 1 − Σ_c p_c² (the chance that two objects
    drawn for the prompt differ in colour: 0.75 for the four colours used evenly, 0 when every object has one
    colour; objects of no palette colour are left out). NaN when no such prompt has a coloured object. Layout
    diversity compares labels and positions within a prompt and barely moves when every sample of a colour-free
    prompt turns one colour; this does."""
    colors: dict[int, list[str]] = {}
    for i in sorted(free & set(by_index)):
        colors.setdefault(i // group, []).extend(c for _, c in by_index[i][0] if c is not None)  # palette colours
    values = []
    for cs in colors.values():
        if cs:
            _, counts = np.unique(cs, return_counts=True)
            values.append(1.0 - float(((counts / counts.sum()) ** 2).sum()))
    return float(np.mean(values)) if values else float("nan")


__all__ = ["Layout", "color_diversity", "color_free", "detection_diversity", "layout", "layout_distance", "layouts",
           "prompt_diversity"]
