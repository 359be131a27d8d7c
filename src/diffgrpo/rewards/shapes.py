"""The shapes task's checker: closed-form detections of coloured shapes and the two rewards built on them,
``shapes_correct`` (GenEval's per-prompt correctness, 0/1) and ``shapes_score`` (the fraction of the prompt's
constraints met). No learned judge.

Detection (:func:`detect`, :func:`detect_batch`), for images (3, H, W) in [0, 1] of :mod:`diffgrpo.tasks.shapes`:

1. colour segmentation by unmixing: each pixel is read as ``background + α · (palette colour − background)``;
   it belongs to a colour when ``α ≥ 0.55`` and its distance to that colour's line is under ``RESIDUAL``;
   a pixel far from the background that no colour explains (at any α) is *unexplained*;
2. connected components (4-neighbour) of each colour and of the unexplained pixels;
3. components below ``MIN_AREA`` (scaled by (H / 32)²) are specks and ignored;
4. the rest are classified by geometric moments of the component: fill ratio of the bounding box (square ≈ 1,
   circle ≈ π / 4, triangle ≈ 1 / 2), the centroid's vertical offset in the box (an upright triangle's sits
   1 / 6 below the centre), the box's aspect ratio, its side (at most ``MAX_SIDE`` × H) and solidity (the mean α
   of its pixels ≥ ``MIN_SOLID``: a blurred smear is not an object). A component that fits no shape, and every
   unexplained component, is *unrecognised* (``Detection.kind is None``).

Constraints of a record's ``include`` (GenEval's format), each met or not:

- per entry, count: exactly ``count`` objects of its class (no extra objects of a named class);
- per entry with a colour: its class's objects all have that colour (and there is one);
- per entry with a position ``[relation, j]``: every pair of its objects (of its colour, when it names one) and
  entry ``j``'s satisfies the relation as GenEval computes it on boxes (:func:`rewards.geneval.relative_position`);
- the scene is clean: nothing unrecognised (no smear, blob or unexplained colour).

``shapes_correct`` is 1 when every constraint is met, ``shapes_score`` the fraction met (1 exactly when correct);
both are NaN for a sample whose metadata has no ``include``. Video (B, C, F, H, W) is scored per frame and averaged.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..tasks.shapes import BACKGROUND, COLORS
from .geneval import relative_position
from .loading import per_frame

PALETTE = tuple(COLORS)
RESIDUAL = 0.22  # distance of a pixel to a colour's unmixing line (RGB units)
MIN_ALPHA = 0.55  # a pixel belongs to a colour from this share of it on
UNEXPLAINED = 0.35  # distance to the background above which a pixel no colour explains is unexplained
MIN_AREA = 10  # pixels at 32 × 32 (scaled by area): smaller components are specks
MAX_SIDE = 0.5  # the largest object side as a fraction of the image side
MIN_SOLID = 0.8  # the mean α of an object's pixels


@dataclass(frozen=True)
class Detection:
    """One component: ``kind`` a shape name or None (unrecognised), ``color`` a palette name or None
    (unexplained), box (x0, y0, x1, y1) in pixels (x1, y1 exclusive), centroid (x, y), area in pixels."""
    kind: str | None
    color: str | None
    box: tuple[float, float, float, float]
    centroid: tuple[float, float]
    area: int


def segment(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, 3, H, W) in [0, 1] → (classes (B, H, W): 0 none, 1..K palette colour k − 1, K + 1 unexplained;
    α (B, H, W): the share of the pixel's colour)."""
    v = images.transpose(0, 2, 3, 1) - np.asarray(BACKGROUND)  # (B, H, W, 3)
    d = np.asarray([COLORS[c] for c in PALETTE]) - np.asarray(BACKGROUND)  # (K, 3)
    alpha = v @ d.T / (d * d).sum(1)  # (B, H, W, K)
    resid = np.linalg.norm(v[..., None, :] - alpha[..., None] * d, axis=-1)  # (B, H, W, K)
    fits = resid <= RESIDUAL
    own = np.where(fits & (alpha >= MIN_ALPHA) & (alpha <= 1.6), resid, np.inf)  # (B, H, W, K)
    k = own.argmin(-1)  # (B, H, W)
    colour = np.isfinite(own.min(-1))
    explained = (fits & (alpha >= 0.1) & (alpha <= 1.6)).any(-1)
    unexplained = ~explained & (np.linalg.norm(v, axis=-1) > UNEXPLAINED)
    K = len(PALETTE)
    classes = np.where(colour, k + 1, np.where(unexplained, K + 1, 0))
    a = np.take_along_axis(alpha, k[..., None], -1)[..., 0]  # (B, H, W)
    return classes, np.where(colour, a, 1.0)


def label(classes: np.ndarray) -> np.ndarray:
    """4-neighbour connected components of equal nonzero classes: (B, H, W) → ids (the flat index of a member
    pixel), −1 where the class is 0. Min-label propagation with pointer jumping, all images at once."""
    on = classes > 0
    big = classes.size
    lab = np.where(on, np.arange(big).reshape(classes.shape), big)  # (B, H, W)
    links = [(np.s_[:, :, 1:], np.s_[:, :, :-1]), (np.s_[:, 1:, :], np.s_[:, :-1, :])]
    same = [on[a] & (classes[a] == classes[b]) for a, b in links]
    while True:
        new = lab.copy()
        for (a, b), s in zip(links, same):
            new[a] = np.where(s, np.minimum(new[a], lab[b]), new[a])
            new[b] = np.where(s, np.minimum(new[b], lab[a]), new[b])
        flat = new.reshape(-1)
        inside = flat < big
        flat[inside] = flat[flat[inside]]  # jump to the label's own label
        if np.array_equal(new, lab):
            return np.where(on, lab, -1)
        lab = new


def _shape(fill: float, offset: float, aspect: float, diagonal: float) -> str | None:
    """Shape of a component from its box fill ratio, centroid offset (y, in box heights), aspect ratio and
    diagonal ratio (mean extent along the diagonals over the mean side: a square's √2, a circle's 1)."""
    if not 0.7 <= aspect <= 1.43:
        return None
    if offset + 0.5 * (0.66 - fill) >= 0.06:  # low in its box, or sparse: an upright triangle
        return "triangle" if 0.4 <= fill <= 0.82 and offset >= 0.02 and diagonal <= 1.15 else None
    if abs(offset) >= 0.075:
        return None
    if diagonal >= 1.17:
        return "square" if fill >= 0.7 else None
    return "circle" if 0.6 <= fill <= 0.96 else None


def _components(classes: np.ndarray, alpha: np.ndarray, labels: np.ndarray) -> list[list[Detection]]:
    B, H, W = classes.shape
    ids = labels.reshape(-1)
    keep = ids >= 0
    uniq, inv = np.unique(ids[keep], return_inverse=True)  # (n,), (m,)
    flat = np.flatnonzero(keep)  # (m,) pixel indices
    ys, xs = (flat // W) % H, flat % W
    area = np.bincount(inv, minlength=len(uniq))  # (n,)
    mean = lambda v: np.bincount(inv, weights=v, minlength=len(uniq)) / area  # noqa: E731
    cy, cx, solid = mean(ys), mean(xs), mean(alpha.reshape(-1)[flat])
    lo = np.full((len(uniq), 2), np.iinfo(np.int64).max)
    hi = np.full((len(uniq), 2), -1)
    np.minimum.at(lo, inv, np.stack([xs, ys], 1))
    np.maximum.at(hi, inv, np.stack([xs, ys], 1))
    dlo = np.full((len(uniq), 2), np.iinfo(np.int64).max)
    dhi = np.full((len(uniq), 2), np.iinfo(np.int64).min)
    np.minimum.at(dlo, inv, np.stack([xs + ys, xs - ys], 1))
    np.maximum.at(dhi, inv, np.stack([xs + ys, xs - ys], 1))
    diag = ((dhi - dlo + 1).mean(1) / np.sqrt(2)) / ((hi - lo + 1).mean(1))  # (n,)
    out: list[list[Detection]] = [[] for _ in range(B)]
    min_area, K = MIN_AREA * H * W / 32 ** 2, len(PALETTE)
    for j, u in enumerate(uniq):
        if area[j] < min_area:
            continue
        cls = int(classes.reshape(-1)[u])
        (x0, y0), (x1, y1) = lo[j], hi[j] + 1
        w, h = x1 - x0, y1 - y0
        kind = None
        if cls <= K and max(w, h) <= MAX_SIDE * max(H, W) and solid[j] >= MIN_SOLID:
            kind = _shape(area[j] / (w * h), (cy[j] + 0.5 - (y0 + y1) / 2) / h, w / h, diag[j])
        out[int(u // (H * W))].append(Detection(kind, PALETTE[cls - 1] if cls <= K else None,
                                                (float(x0), float(y0), float(x1), float(y1)),
                                                (float(cx[j]) + 0.5, float(cy[j]) + 0.5), int(area[j])))
    return out


def detect_batch(images: torch.Tensor) -> list[list[Detection]]:
    """(B, C, H, W) in [0, 1] (one channel is repeated to three) → each image's detections, specks dropped."""
    x = images.detach().float().clamp(0, 1).cpu()
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    classes, alpha = segment(x[:, :3].numpy().astype(np.float64))
    return _components(classes, alpha, label(classes))


def detect(image: torch.Tensor) -> list[Detection]:
    """One image (C, H, W) in [0, 1] → its detections (see the module doc)."""
    return detect_batch(image[None])[0]


def constraints_met(dets: list[Detection], meta: dict) -> list[bool]:
    """Each constraint of a record's ``include`` (module doc), in order, then 'clean': met or not."""
    met: list[bool] = []
    matched: list[list[Detection]] = []
    for req in meta["include"]:
        of_class = [d for d in dets if d.kind == req["class"]]
        met.append(len(of_class) == int(req.get("count", 1)))
        if "color" in req:
            met.append(bool(of_class) and all(d.color == req["color"] for d in of_class))
            of_class = [d for d in of_class if d.color == req["color"]]
        if "position" in req:
            rel, j = req["position"][0], int(req["position"][1])
            others = matched[j] if j < len(matched) else []
            met.append(bool(of_class) and bool(others) and
                       all(rel in relative_position(a.box, b.box) for a in of_class for b in others))
        matched.append(of_class)
    met.append(all(d.kind is not None for d in dets))
    return met


def _scores(images: torch.Tensor, metadata: list[dict], strict: bool) -> torch.Tensor:
    out = torch.full((images.shape[0],), float("nan"))
    todo = [i for i, m in enumerate(metadata) if (m or {}).get("include")]
    if todo:
        for i, dets in zip(todo, detect_batch(images[todo])):
            met = constraints_met(dets, metadata[i])
            out[i] = float(all(met)) if strict else sum(met) / len(met)
    return out


@per_frame
def shapes_correct(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
    """1 when the image meets every constraint of its prompt's metadata, else 0: (B, 3, H, W) → (B,)."""
    return _scores(images, metadata, strict=True)


@per_frame
def shapes_score(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
    """The fraction of the prompt's constraints the image meets: (B, 3, H, W) → (B,) in [0, 1]."""
    return _scores(images, metadata, strict=False)


__all__ = ["Detection", "constraints_met", "detect", "detect_batch", "label", "segment", "shapes_correct",
           "shapes_score"]
