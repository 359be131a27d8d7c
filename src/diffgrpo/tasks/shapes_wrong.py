"""Deliberately wrong images for a shapes prompt, and mildly perturbed right ones: what a checker of the shapes
task must reject (false passes) and what it must still accept (robustness).

Wrong, each from a random right scene of the prompt (:func:`diffgrpo.tasks.shapes.layout`):

  count     one object removed, or a copy of one added at a free place
  color     one object that the prompt gives a colour repainted another palette colour (coloured prompts only)
  shape     one object redrawn as another shape in the same box
  position  the two objects' centres swapped, so the relation is reversed (position prompts only)
  blank     the background alone
  noise     uniform noise in [0, 1] per pixel and channel
  blob      one object of a prompted shape and colour covering 60–95 % of the image side
  smear     a right image blurred with a Gaussian of σ in [2, 3] pixels
  gradient  a linear blend between two palette colours across the image, in a random direction

Mild (:data:`MILD`): a Gaussian blur of σ = 0.5 pixel, or Gaussian noise of σ = 0.03 per channel, on a right image.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

from .shapes import BACKGROUND, COLORS, SHAPES, Scene, Shape, apart, draw, layout

WRONG = ("count", "color", "shape", "position", "blank", "noise", "blob", "smear", "gradient")
MILD = ("blur", "noise")


def blur(image: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur with replicated borders: (3, H, W) → (3, H, W)."""
    r = max(1, math.ceil(3 * sigma))
    k = torch.exp(-torch.arange(-r, r + 1, dtype=torch.float32) ** 2 / (2 * sigma * sigma))
    k = k / k.sum()  # (2r + 1,)
    x = F.pad(image[None], (r, r, r, r), mode="replicate")  # (1, 3, H + 2r, W + 2r)
    x = F.conv2d(x, k.view(1, 1, 1, -1).repeat(3, 1, 1, 1), groups=3)
    x = F.conv2d(x, k.view(1, 1, -1, 1).repeat(3, 1, 1, 1), groups=3)
    return x[0]


def _other(options, current, rng: np.random.Generator):
    rest = [o for o in options if o != current]
    return rest[rng.integers(len(rest))]


def _free_copy(scene: Scene, obj: Shape, rng: np.random.Generator) -> Shape | None:
    n = scene.image_size
    for _ in range(200):
        x, y = rng.uniform(obj.size / 2 + 1, n - obj.size / 2 - 1, size=2)
        cand = replace(obj, x=float(x), y=float(y))
        if all(apart(cand, o) for o in scene.objects):
            return cand
    return None


def _count(scene: Scene, meta: dict, rng: np.random.Generator) -> Scene | None:
    objs = list(scene.objects)
    i = int(rng.integers(len(objs)))
    if rng.random() < 0.5:
        return replace(scene, objects=tuple(objs[:i] + objs[i + 1:]))
    extra = _free_copy(scene, objs[i], rng)
    return None if extra is None else replace(scene, objects=(*objs, extra))


def _color(scene: Scene, meta: dict, rng: np.random.Generator) -> Scene | None:
    named = {(r["class"], r["color"]) for r in meta["include"] if "color" in r}
    idx = [i for i, o in enumerate(scene.objects) if (o.kind, o.color) in named]
    if not idx:
        return None
    i = idx[int(rng.integers(len(idx)))]
    objs = list(scene.objects)
    objs[i] = replace(objs[i], color=_other(list(COLORS), objs[i].color, rng))
    return replace(scene, objects=tuple(objs))


def _shape(scene: Scene, meta: dict, rng: np.random.Generator) -> Scene:
    objs = list(scene.objects)
    i = int(rng.integers(len(objs)))
    objs[i] = replace(objs[i], kind=_other(SHAPES, objs[i].kind, rng))
    return replace(scene, objects=tuple(objs))


def _position(scene: Scene, meta: dict, rng: np.random.Generator) -> Scene | None:
    if meta["tag"] != "position":
        return None
    a, b = scene.objects
    return replace(scene, objects=(replace(a, x=b.x, y=b.y), replace(b, x=a.x, y=a.y)))


def _blob(meta: dict, rng: np.random.Generator, n: int) -> torch.Tensor:
    req = meta["include"][int(rng.integers(len(meta["include"])))]
    color = req.get("color") or list(COLORS)[int(rng.integers(len(COLORS)))]
    size = float(rng.uniform(0.6, 0.95)) * n
    x, y = rng.uniform(size / 2, n - size / 2, size=2) if size < n else (n / 2, n / 2)
    return draw(Scene((Shape(req["class"], color, float(x), float(y), size),), n))


def _gradient(rng: np.random.Generator, n: int) -> torch.Tensor:
    names = list(COLORS)
    first = names[int(rng.integers(len(names)))]
    a = np.asarray(COLORS[first])
    b = np.asarray(COLORS[_other(names, first, rng)] if rng.random() < 0.5 else BACKGROUND)
    theta = rng.uniform(0, 2 * np.pi)
    t = (np.arange(n) + 0.5) / n
    y, x = np.meshgrid(t, t, indexing="ij")  # (H, W)
    s = np.clip(0.5 + (x - 0.5) * np.cos(theta) + (y - 0.5) * np.sin(theta), 0, 1)[None]  # (1, H, W)
    return torch.from_numpy((a[:, None, None] * (1 - s) + b[:, None, None] * s).astype(np.float32))


_SCENE_EDITS = {"count": _count, "color": _color, "shape": _shape, "position": _position}


def wrong(kind: str, meta: dict, rng: np.random.Generator, image_size: int = 32) -> torch.Tensor | None:
    """A wrong image (3, H, W) in [0, 1] of ``kind`` (:data:`WRONG`) for a prompt record, or None when the kind
    does not apply to the prompt (a colour edit of a prompt without colours, a swap without a relation)."""
    if kind in _SCENE_EDITS:
        edited = _SCENE_EDITS[kind](layout(meta, rng, image_size), meta, rng)
        return None if edited is None else draw(edited)
    if kind == "blank":
        return draw(Scene((), image_size))
    if kind == "noise":
        return torch.from_numpy(rng.random((3, image_size, image_size)).astype(np.float32))
    if kind == "blob":
        return _blob(meta, rng, image_size)
    if kind == "smear":
        return blur(draw(layout(meta, rng, image_size)), float(rng.uniform(2.0, 3.0)))
    if kind == "gradient":
        return _gradient(rng, image_size)
    raise ValueError(f"unknown wrong-image kind {kind!r}; choose one of {WRONG}")


def mild(kind: str, meta: dict, rng: np.random.Generator, image_size: int = 32) -> torch.Tensor:
    """A right image (3, H, W) of the prompt, mildly perturbed (:data:`MILD`: ``blur`` or ``noise``)."""
    image = draw(layout(meta, rng, image_size))
    if kind == "blur":
        return blur(image, 0.5)
    if kind == "noise":
        noise = torch.from_numpy(rng.standard_normal(image.shape).astype(np.float32))
        return (image + 0.03 * noise).clamp(0, 1)
    raise ValueError(f"unknown perturbation {kind!r}; choose one of {MILD}")


__all__ = ["MILD", "WRONG", "blur", "mild", "wrong"]
