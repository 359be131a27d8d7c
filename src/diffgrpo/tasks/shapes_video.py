"""The shapes_video task: short clips of coloured shapes moving in a named direction, the prompts with the
constraints each states, the train / held-out split, and a renderer of a random clip for a prompt.

Clips: ``F`` frames (default :data:`NUM_FRAMES`) of :mod:`diffgrpo.tasks.shapes` scenes (32 × 32, dark grey
background, anti-aliased by supersampling, drawn with ``shapes.draw``); each object moves by :data:`STEP` pixels
(scaled by the side / 32) per frame in its direction, all of its path inside the frame. A clip is a float tensor
(3, F, H, W) in [0, 1], diffusers' video layout (C, F, H, W).

Prompts (grammar; ``<dir>`` one of ``left``, ``right``, ``up``, ``down``):

  motion      "a <color> <shape> moving <dir>"
  motion_two  "a <color> <shape> moving <dir> and a <color> <shape> moving <dir>"  (different shapes and colours)

Each prompt is a record ``{"prompt", "tag", "include"}`` in the shapes task's metadata format, each ``include``
entry ``{"class", "count": 1, "color", "motion": <dir>}``; the checker reads these, never the text.

Split (deterministic): a prompt is held out (``test``) when it binds a held-out colour–shape pair
(``shapes.HELD_OUT_PAIRS``: red triangle, green square, blue circle), whatever its directions, so no training
clip ever shows those colours on those shapes; every colour, shape and direction appears in training.
"""
from __future__ import annotations

import re

import numpy as np
import torch

from . import shapes

DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}  # (dx, dy)
CATEGORIES = ("motion", "motion_two")
NUM_FRAMES = 4
IMAGE_SIZE = 32
STEP = 4.0  # pixels per frame at 32 × 32
TWO_DIRECTIONS = (("left", "up"), ("right", "down"), ("up", "right"), ("down", "left"))  # motion_two's pairs


# ------------------------------------------------------------------------------------------- prompts
def _entry(shape: str, color: str, motion: str) -> dict:
    return {"class": shape, "count": 1, "color": color, "motion": motion}


def describe(meta: dict) -> str:
    """The prompt text of a record's ``include``."""
    return " and ".join(f"a {r['color']} {r['class']} moving {r['motion']}" for r in meta["include"])


def _record(tag: str, include: list[dict]) -> dict:
    return {"prompt": describe({"include": include}), "tag": tag, "include": include}


def all_prompts() -> list[dict]:
    """Every prompt record of both categories, in a fixed order."""
    pairs = [(c, s) for s in shapes.SHAPES for c in shapes.COLORS]
    one = [_record("motion", [_entry(s, c, d)]) for c, s in pairs for d in DIRECTIONS]
    two = [_record("motion_two", [_entry(p[1], p[0], d1), _entry(q[1], q[0], d2)])
           for p in pairs for q in pairs if p[0] != q[0] and p[1] < q[1] for d1, d2 in TWO_DIRECTIONS]
    return one + two


def is_held_out(meta: dict) -> bool:
    """Whether a record binds a held-out colour–shape pair (the module doc's split)."""
    return any((r["color"], r["class"]) in shapes.HELD_OUT_PAIRS for r in meta["include"])


def prompts(split: str = "train", tags: tuple[str, ...] = CATEGORIES) -> list[dict]:
    """The prompt records of ``split`` (``train`` or ``test``, the held-out bindings) in categories ``tags``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return [r for r in all_prompts() if r["tag"] in tags and is_held_out(r) == (split == "test")]


_ONE = rf"an? ({'|'.join(shapes.COLORS)}) ({'|'.join(shapes.SHAPES)}) moving ({'|'.join(DIRECTIONS)})"
_PROMPT = re.compile(rf"{_ONE}(?: and {_ONE})?")


def parse(text: str) -> dict | None:
    """The record (``tag``, ``include``) a prompt of this grammar states, or None when it is not one."""
    m = _PROMPT.fullmatch(text.strip().lower())
    if not m:
        return None
    g = m.groups()
    include = [_entry(g[1], g[0], g[2])] + ([_entry(g[4], g[3], g[5])] if g[3] else [])
    return {"tag": "motion_two" if len(include) == 2 else "motion", "include": include}


# ------------------------------------------------------------------------------------------- clips
def _first_frames(meta: dict, rng: np.random.Generator, image_size: int, num_frames: int
                  ) -> tuple[shapes.Shape, ...] | None:
    """Objects at frame 0, each with its whole path inside the image, apart from the others in every frame."""
    step = STEP * image_size / IMAGE_SIZE
    travel = step * (num_frames - 1)
    n = len(meta["include"])
    lo, hi = shapes._size_range(n, image_size)
    objs: list[shapes.Shape] = []
    for r in meta["include"]:
        size = float(rng.uniform(lo, min(hi, image_size - travel - 2)))
        dx, dy = DIRECTIONS[r["motion"]]
        a, b = size / 2 + 1, image_size - size / 2 - 1
        x = rng.uniform(a + travel * (dx < 0), b - travel * (dx > 0))
        y = rng.uniform(a + travel * (dy < 0), b - travel * (dy > 0))
        objs.append(shapes.Shape(r["class"], r["color"], float(x), float(y), size))
    clips = [_moved(objs, meta, t, step) for t in range(num_frames)]
    if all(shapes.apart(p, q) for frame in clips for i, p in enumerate(frame) for q in frame[i + 1:]):
        return tuple(objs)
    return None


def _moved(objs, meta: dict, t: int, step: float) -> tuple[shapes.Shape, ...]:
    out = []
    for o, r in zip(objs, meta["include"]):
        dx, dy = DIRECTIONS[r["motion"]]
        out.append(shapes.Shape(o.kind, o.color, o.x + dx * step * t, o.y + dy * step * t, o.size))
    return tuple(out)


def clip_scenes(meta: dict, rng: np.random.Generator, image_size: int = IMAGE_SIZE,
                num_frames: int = NUM_FRAMES) -> list[shapes.Scene]:
    """The ``num_frames`` scenes of a random clip satisfying a record (objects, colours, directions)."""
    for _ in range(2000):
        objs = _first_frames(meta, rng, image_size, num_frames)
        if objs is not None:
            step = STEP * image_size / IMAGE_SIZE
            return [shapes.Scene(_moved(objs, meta, t, step), image_size) for t in range(num_frames)]
    raise RuntimeError(f"no clip found for {meta.get('prompt', meta)!r} at {image_size}px")


def render(meta: dict, rng: np.random.Generator, image_size: int = IMAGE_SIZE,
           num_frames: int = NUM_FRAMES) -> torch.Tensor:
    """A clip (3, F, H, W) in [0, 1] of a random path satisfying a prompt record (see :func:`clip_scenes`)."""
    return torch.stack([shapes.draw(s) for s in clip_scenes(meta, rng, image_size, num_frames)], 1)


__all__ = ["CATEGORIES", "DIRECTIONS", "IMAGE_SIZE", "NUM_FRAMES", "STEP", "all_prompts", "clip_scenes",
           "describe", "is_held_out", "parse", "prompts", "render"]
