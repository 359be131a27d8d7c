"""Write the shipped image-editing set ``edit/``: simple source images (one coloured shape on a plain background,
256 × 256 PNG, drawn with Pillow) and (source, instruction) records, ``{"prompt": ..., "image": "images/..."}``.

``python compose_edit.py <prompts folder>`` rewrites the files identically (no randomness). Train and test use
disjoint source images; the instructions are shared templates (in-distribution edits of unseen images)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

SIDE = 256
SHAPES = ("circle", "square", "triangle", "diamond")
COLOURS = {"red": (220, 40, 40), "blue": (40, 80, 220), "green": (40, 170, 70), "yellow": (235, 200, 40),
           "purple": (140, 60, 190), "orange": (240, 130, 30)}
BACKGROUNDS = {"white": (245, 245, 245), "grey": (150, 150, 150), "light blue": (190, 215, 240)}
# (shape, colour, background) of each source; the last two are the test split's
SOURCES = [("circle", "red", "white"), ("square", "blue", "grey"), ("triangle", "green", "white"),
           ("diamond", "yellow", "light blue"), ("circle", "purple", "grey"), ("square", "orange", "light blue"),
           ("triangle", "blue", "light blue"), ("diamond", "red", "grey")]
INSTRUCTIONS = ["make the {shape} {other}", "turn the background black",
                "add a small yellow sun in the top left corner", "make the {shape} twice as large",
                "draw a thick black border around the image", "replace the {shape} with a cat"]


def draw(shape: str, colour: str, background: str):
    from PIL import Image, ImageDraw

    im = Image.new("RGB", (SIDE, SIDE), BACKGROUNDS[background])
    d = ImageDraw.Draw(im)
    lo, hi, mid = SIDE // 4, 3 * SIDE // 4, SIDE // 2
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([lo, lo, hi, hi], fill=fill)
    elif shape == "square":
        d.rectangle([lo, lo, hi, hi], fill=fill)
    elif shape == "triangle":
        d.polygon([(mid, lo), (hi, hi), (lo, hi)], fill=fill)
    else:
        d.polygon([(mid, lo), (hi, mid), (mid, hi), (lo, mid)], fill=fill)
    return im


def records(sources: list[tuple[str, str, str]], first: int) -> list[dict]:
    out = []
    for i, (shape, colour, _) in enumerate(sources, first):
        other = next(c for c in COLOURS if c != colour)
        for template in INSTRUCTIONS:
            out.append({"prompt": template.format(shape=shape, other=other), "image": f"images/source_{i}.png"})
    return out


def main(root: Path) -> None:
    d = root / "edit"
    (d / "images").mkdir(parents=True, exist_ok=True)
    for i, src in enumerate(SOURCES):
        draw(*src).save(d / "images" / f"source_{i}.png", optimize=True)
    for split, recs in (("train", records(SOURCES[:6], 0)), ("test", records(SOURCES[6:], 6))):
        (d / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs), encoding="utf-8")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
