"""The shapes task: small RGB scenes of one to four coloured shapes, prompts in GenEval's six categories with the
constraints each states, the train / held-out split, and a renderer that draws a random scene for a prompt.

Scenes: circles, squares and upright triangles (each inside a square bounding box of side ``size``) in red, green,
blue or yellow on a dark grey background, at least ``GAP`` pixels apart, never overlapping; images are float
tensors (3, H, W) in [0, 1] (default 32 × 32), anti-aliased by 4 × 4 supersampling.

Prompts (grammar; ``<n>`` is two, three or four, ``<rel>`` one of ``left of``, ``right of``, ``above``, ``below``):

  single_object  "a <shape>"
  two_object     "a <shape> and a <shape>"                       (two different shapes)
  counting       "<n> <shape>s"
  colors         "a <color> <shape>"
  color_attr     "a <color> <shape> and a <color> <shape>"       (different shapes, different colours)
  position       "a <color> <shape> <rel> a <color> <shape>"     (different shapes, different colours)

Each prompt is a record ``{"prompt", "tag", "include"}`` in GenEval's metadata format: ``include`` lists
``{"class": shape, "count": n, "color"?: colour, "position"?: [relation, index]}``, where a position entry is
placed relative to ``include[index]`` (for "a red circle left of a blue square", ``include[0]`` is the blue
square). A checker reads these constraints; it never re-parses the text (:func:`parse` is the inverse of
:func:`describe`, for tests and user prompts).

Split (deterministic): the held-out prompts (``test``) are combinations RL never trains on. In ``colors`` a
prompt is held out when it names a held-out colour–shape pair (:data:`HELD_OUT_PAIRS`: red triangle, green
square, blue circle), so "a red triangle" alone is never a training prompt; in ``color_attr`` and ``position``
a prompt binding a held-out pair is held out for half of its pairings (a fixed draw on its text: RL meets the pair
only beside other objects, and is tested on pairings and relations it never saw); in ``counting`` the diagonal
(two squares, three triangles, four circles) is held out, in ``two_object`` the circle–triangle pair (both
orders), in ``single_object`` the triangle. Every category has prompts in both splits; every colour, shape, count
and relation appears in training.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

import numpy as np
import torch

SHAPES = ("circle", "square", "triangle")
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.90, 0.15, 0.15), "green": (0.15, 0.75, 0.25), "blue": (0.20, 0.35, 0.95), "yellow": (0.95, 0.85, 0.15)}
BACKGROUND = (0.12, 0.12, 0.12)
RELATIONS = ("left of", "right of", "above", "below")
CATEGORIES = ("single_object", "two_object", "counting", "colors", "color_attr", "position")
NUMBERS = {2: "two", 3: "three", 4: "four"}
HELD_OUT_PAIRS = frozenset({("red", "triangle"), ("green", "square"), ("blue", "circle")})
HELD_OUT_COUNTS = frozenset({(2, "square"), (3, "triangle"), (4, "circle")})
HELD_OUT_SHAPE_SETS = frozenset({frozenset({"circle", "triangle"})})
HELD_OUT_SINGLE = frozenset({"triangle"})
IMAGE_SIZE = 32
GAP = 2.0  # pixels between the bounding boxes of two objects
GRID_SIZES = (0.28, 0.40)  # object sides in a 2 × 2 grid layout, as fractions of the image side
SUPERSAMPLE = 4
EVAL_ROWS = 12  # held-out rows per category in the shipped test set (× eval.seeds_per_prompt samples)


@dataclass(frozen=True)
class Shape:
    """One object: ``kind`` in :data:`SHAPES`, ``color`` in :data:`COLORS`, centre (x right, y down) of its square
    bounding box in pixels, ``size`` its side in pixels."""
    kind: str
    color: str
    x: float
    y: float
    size: float

    @property
    def box(self) -> tuple[float, float, float, float]:
        h = self.size / 2
        return (self.x - h, self.y - h, self.x + h, self.y + h)


@dataclass(frozen=True)
class Scene:
    """The objects of one image (drawn in order) and the image side in pixels."""
    objects: tuple[Shape, ...]
    image_size: int = IMAGE_SIZE


# ------------------------------------------------------------------------------------------- prompts
def _noun(color: str | None, shape: str) -> str:
    return f"a {color} {shape}" if color else f"a {shape}"


def describe(meta: dict) -> str:
    """The prompt text of a record's constraints (``tag`` and ``include``)."""
    inc, tag = meta["include"], meta["tag"]
    if tag == "counting":
        return f"{NUMBERS[inc[0]['count']]} {inc[0]['class']}s"
    if tag == "position":
        ref, obj = inc
        return f"{_noun(obj.get('color'), obj['class'])} {obj['position'][0]} {_noun(ref.get('color'), ref['class'])}"
    return " and ".join(_noun(r.get("color"), r["class"]) for r in inc)


def _entry(shape: str, color: str | None = None, count: int = 1) -> dict:
    e: dict = {"class": shape, "count": count}
    if color:
        e["color"] = color
    return e


def _record(tag: str, include: list[dict]) -> dict:
    meta = {"tag": tag, "include": include}
    return {"prompt": describe(meta), **meta}


def _pairs() -> list[tuple[str, str]]:
    return [(c, s) for s in SHAPES for c in COLORS]


def _category_records(tag: str) -> list[dict]:
    two = _pairs()
    if tag == "single_object":
        return [_record(tag, [_entry(s)]) for s in SHAPES]
    if tag == "two_object":
        return [_record(tag, [_entry(a), _entry(b)]) for a in SHAPES for b in SHAPES if a != b]
    if tag == "counting":
        return [_record(tag, [_entry(s, count=n)]) for n in NUMBERS for s in SHAPES]
    if tag == "colors":
        return [_record(tag, [_entry(s, c)]) for c, s in two]
    distinct = [(p, q) for p in two for q in two if p[0] != q[0] and p[1] != q[1]]
    if tag == "color_attr":
        return [_record(tag, [_entry(p[1], p[0]), _entry(q[1], q[0])]) for p, q in distinct]
    # position: "<p> <rel> <q>": q is the reference, include[0]
    return [_record(tag, [_entry(q[1], q[0]), {**_entry(p[1], p[0]), "position": [rel, 0]}])
            for p, q in distinct for rel in RELATIONS]


def all_prompts() -> list[dict]:
    """Every prompt record of every category, in a fixed order."""
    return [r for tag in CATEGORIES for r in _category_records(tag)]


def is_held_out(meta: dict) -> bool:
    """Whether a record belongs to the held-out split (see the module doc for the rule of each category)."""
    inc, tag = meta["include"], meta["tag"]
    if tag == "single_object":
        return inc[0]["class"] in HELD_OUT_SINGLE
    if tag == "two_object":
        return frozenset(r["class"] for r in inc) in HELD_OUT_SHAPE_SETS
    if tag == "counting":
        return (inc[0]["count"], inc[0]["class"]) in HELD_OUT_COUNTS
    binds = any((r.get("color"), r["class"]) in HELD_OUT_PAIRS for r in inc)
    if tag == "colors":
        return binds
    # color_attr, position: half of the pairings of a held-out pair (a fixed draw on the prompt's text)
    return binds and hashlib.sha256(describe(meta).encode()).digest()[0] % 2 == 0


def prompts(split: str = "train", tags: tuple[str, ...] = CATEGORIES) -> list[dict]:
    """The prompt records of ``split`` (``train`` or ``test``, the held-out combinations) in categories ``tags``."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    return [r for r in all_prompts() if r["tag"] in tags and is_held_out(r) == (split == "test")]


def prompt_set(split: str = "train") -> list[dict]:
    """The shipped prompt set of ``split``, each GenEval category weighing the same (GenEval's overall score is the
    mean of its categories): ``train`` lists every category's train prompts cycled to the largest category's count,
    so a batch draws each category equally often; ``test`` lists :data:`EVAL_ROWS` rows per category: a category
    with fewer held-out prompts repeats them (the evaluation gives a repeat fresh seeds), one with more keeps
    :data:`EVAL_ROWS` of them drawn with a fixed seed."""
    by_tag = {t: prompts(split, (t,)) for t in CATEGORIES}
    if split == "train":
        n = max(len(v) for v in by_tag.values())
        return [v[i % len(v)] for v in by_tag.values() for i in range(n)]
    rng = np.random.default_rng(0)
    return [r for v in by_tag.values() for r in _spread(v, rng)]


def _spread(records: list[dict], rng: np.random.Generator) -> list[dict]:
    """:data:`EVAL_ROWS` rows of one category: its records cycled when fewer, else drawn (fixed seed) round-robin
    over the relations, so a position set holds every relation."""
    if len(records) <= EVAL_ROWS:
        return [records[i % len(records)] for i in range(EVAL_ROWS)]
    groups: dict[str, list[dict]] = {}
    for r in records:
        groups.setdefault(r["include"][-1].get("position", [""])[0], []).append(r)
    drawn = [[g[i] for i in rng.permutation(len(g))] for g in groups.values()]
    return [g[j] for j in range(max(map(len, drawn))) for g in drawn if j < len(g)][:EVAL_ROWS]


_NOUN = rf"an? (?:({'|'.join(COLORS)}) )?({'|'.join(SHAPES)})"
_COUNT = re.compile(rf"({'|'.join(NUMBERS.values())}) ({'|'.join(SHAPES)})s")
_POSITION = re.compile(rf"{_NOUN} ({'|'.join(RELATIONS)}) {_NOUN}")
_AND = re.compile(rf"{_NOUN}(?: and {_NOUN})?")


def parse(text: str) -> dict | None:
    """The record (``tag``, ``include``) a prompt of this grammar states, or None when it is not one."""
    text = text.strip().lower()
    if m := _COUNT.fullmatch(text):
        n = {v: k for k, v in NUMBERS.items()}[m.group(1)]
        return {"tag": "counting", "include": [_entry(m.group(2), count=n)]}
    if m := _POSITION.fullmatch(text):
        c1, s1, rel, c2, s2 = m.groups()
        if not (c1 and c2):
            return None
        return {"tag": "position", "include": [_entry(s2, c2), {**_entry(s1, c1), "position": [rel, 0]}]}
    if m := _AND.fullmatch(text):
        c1, s1, c2, s2 = m.groups()
        if s2 is None:
            return {"tag": "colors" if c1 else "single_object", "include": [_entry(s1, c1)]}
        if bool(c1) != bool(c2):
            return None
        return {"tag": "color_attr" if c1 else "two_object", "include": [_entry(s1, c1), _entry(s2, c2)]}
    return None


# ------------------------------------------------------------------------------------------- layout
def _size_range(n: int, image_size: int) -> tuple[float, float]:
    """Object sides in pixels: smaller when the scene holds more objects."""
    return (0.25 * image_size, (0.38 if n <= 2 else 0.30) * image_size)


def apart(a: Shape, b: Shape) -> bool:
    """Bounding boxes at least GAP pixels apart along x or y."""
    return (abs(a.x - b.x) >= (a.size + b.size) / 2 + GAP) or (abs(a.y - b.y) >= (a.size + b.size) / 2 + GAP)


def placed_as(a: Shape, rel: str, b: Shape) -> bool:
    """Whether ``a`` lies ``rel`` of ``b`` with a clear margin: separated along the relation's axis by more than
    the half-sides plus GAP, and off that axis by at most 0.4 × the separation."""
    dx, dy = a.x - b.x, a.y - b.y
    along, across = {"left of": (-dx, dy), "right of": (dx, dy), "above": (-dy, dx), "below": (dy, dx)}[rel]
    return along >= (a.size + b.size) / 2 + GAP and abs(across) <= 0.4 * along


def relations_hold(objs: list[Shape], meta: dict) -> bool:
    """Every position entry's object in its relation to its reference's (position records hold one object per
    entry, so entry i is object i)."""
    return all(placed_as(objs[i], r["position"][0], objs[int(r["position"][1])])
               for i, r in enumerate(meta["include"]) if "position" in r)


def _wanted(meta: dict, rng: np.random.Generator) -> list[tuple[str, str]]:
    """(shape, colour) of every object a record asks for, in include order; unnamed colours drawn at random."""
    names = list(COLORS)
    return [(r["class"], r.get("color") or names[rng.integers(len(names))])
            for r in meta["include"] for _ in range(int(r.get("count", 1)))]


def _try_layout(wanted: list[tuple[str, str]], meta: dict, rng: np.random.Generator, image_size: int
                ) -> tuple[Shape, ...] | None:
    lo, hi = _size_range(len(wanted), image_size)
    objs: list[Shape] = []
    for kind, color in wanted:
        size = float(rng.uniform(lo, hi))
        for _ in range(50):
            x, y = rng.uniform(size / 2 + 1, image_size - size / 2 - 1, size=2)
            cand = Shape(kind, color, float(x), float(y), size)
            if all(apart(cand, o) for o in objs):
                objs.append(cand)
                break
        else:
            return None
    return tuple(objs) if relations_hold(objs, meta) else None


def _try_grid(wanted: list[tuple[str, str]], meta: dict, rng: np.random.Generator, image_size: int
              ) -> tuple[Shape, ...] | None:
    cell = image_size / 2
    objs = []
    for (kind, color), c in zip(wanted, rng.permutation(4)):
        size = float(rng.uniform(*GRID_SIZES)) * image_size
        j = (cell - size) / 2 - 0.5  # jitter that keeps the object inside its cell
        x, y = (c % 2 + 0.5) * cell + rng.uniform(-j, j), (c // 2 + 0.5) * cell + rng.uniform(-j, j)
        objs.append(Shape(kind, color, float(x), float(y), size))
    return tuple(objs) if relations_hold(objs, meta) else None


def layout(meta: dict, rng: np.random.Generator, image_size: int = IMAGE_SIZE, grid: bool = False) -> Scene:
    """A random scene that satisfies a record's constraints (objects, counts, colours, relations): anywhere in the
    image, or with ``grid`` one object per cell of a 2 × 2 grid (sides ``GRID_SIZES`` of the image's, jittered
    inside the cell; the built-in model's pretraining scenes)."""
    wanted = _wanted(meta, rng)
    for _ in range(2000):
        objs = (_try_grid if grid else _try_layout)(wanted, meta, rng, image_size)
        if objs is not None:
            order = rng.permutation(len(objs))  # drawing order carries no meaning
            return Scene(tuple(objs[i] for i in order), image_size)
    raise RuntimeError(f"no layout found for {meta.get('prompt', meta)!r} at {image_size}px")


# ------------------------------------------------------------------------------------------- drawing
def coverage(obj: Shape, image_size: int) -> np.ndarray:
    """The fraction of each pixel that ``obj`` covers: (H, W) in [0, 1], from SUPERSAMPLE² points per pixel."""
    s = SUPERSAMPLE
    t = (np.arange(image_size * s) + 0.5) / s  # sample coordinates in pixels
    y, x = np.meshgrid(t, t, indexing="ij")  # (H·s, W·s)
    h = obj.size / 2
    if obj.kind == "circle":
        inside = (x - obj.x) ** 2 + (y - obj.y) ** 2 <= h * h
    elif obj.kind == "square":
        inside = (np.abs(x - obj.x) <= h) & (np.abs(y - obj.y) <= h)
    elif obj.kind == "triangle":  # apex at the top centre, base along the bottom edge
        top = obj.y - h
        inside = (y <= obj.y + h) & (np.abs(x - obj.x) <= (y - top) / 2)
    else:
        raise ValueError(f"unknown shape {obj.kind!r}; choose one of {SHAPES}")
    return inside.reshape(image_size, s, image_size, s).mean(axis=(1, 3))  # (H, W)


def draw(scene: Scene) -> torch.Tensor:
    """The image of a scene: (3, H, W) float32 in [0, 1]."""
    n = scene.image_size
    img = np.broadcast_to(np.asarray(BACKGROUND, dtype=np.float64)[:, None, None], (3, n, n)).copy()  # (3, H, W)
    for obj in scene.objects:
        a = coverage(obj, n)[None]  # (1, H, W)
        img = img * (1 - a) + np.asarray(COLORS[obj.color])[:, None, None] * a
    return torch.from_numpy(img.astype(np.float32))


def render(meta: dict, rng: np.random.Generator, image_size: int = IMAGE_SIZE, grid: bool = False) -> torch.Tensor:
    """An image (3, H, W) in [0, 1] of a random scene satisfying a prompt record (see :func:`layout`)."""
    return draw(layout(meta, rng, image_size, grid))


__all__ = ["BACKGROUND", "CATEGORIES", "COLORS", "GAP", "GRID_SIZES", "HELD_OUT_PAIRS", "IMAGE_SIZE", "NUMBERS", "RELATIONS",
           "SHAPES", "Scene", "Shape", "all_prompts", "apart", "coverage", "describe", "draw", "is_held_out", "layout",
           "parse", "placed_as", "prompts", "render"]
