"""The shapes checker's measured accuracy and false-pass rates: rendered right images per category, mildly
perturbed right images, deliberately wrong images per kind, and right images under growing blur; written as
table.md (with the command that made it), results.json and examples.png (a right image and each wrong kind
for a few prompts).

    OMP_NUM_THREADS=1 python benchmarks/shapes_checker.py --n 500 --out benchmarks/results/shapes_checker
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from diffgrpo.rewards import REWARDS
from diffgrpo.tasks import shapes, shapes_wrong

BLURS = (0.5, 0.75, 1.0, 1.5, 2.0, 3.0)


def records(rng: np.random.Generator, n: int, tag: str | None = None) -> list[dict]:
    """``n`` prompt records of ``tag`` (every category uniformly when None), each prompt of it uniformly."""
    out = []
    for _ in range(n):
        t = tag or shapes.CATEGORIES[int(rng.integers(len(shapes.CATEGORIES)))]
        pool = [r for r in shapes.all_prompts() if r["tag"] == t]
        out.append(pool[int(rng.integers(len(pool)))])
    return out


def rates(images: list[torch.Tensor], metas: list[dict]) -> dict:
    """Pass rate (shapes_correct) and mean partial credit (shapes_score) of images for their prompts."""
    x, prompts = torch.stack(images), [m["prompt"] for m in metas]
    return {"n": len(images), "pass": float(REWARDS["shapes_correct"](x, prompts, metas).mean()),
            "score": float(REWARDS["shapes_score"](x, prompts, metas).mean())}


def measure(n: int, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    out: dict = {"right": {}, "mild": {}, "wrong": {}, "blur": {}}
    for tag in shapes.CATEGORIES:
        metas = records(rng, n, tag)
        out["right"][tag] = rates([shapes.render(m, rng) for m in metas], metas)
    for kind in shapes_wrong.MILD:
        metas = records(rng, n)
        out["mild"][kind] = rates([shapes_wrong.mild(kind, m, rng) for m in metas], metas)
    for kind in shapes_wrong.WRONG:
        images, metas = [], []
        while len(images) < n:
            meta = records(rng, 1)[0]
            image = shapes_wrong.wrong(kind, meta, rng)
            if image is not None:
                images.append(image)
                metas.append(meta)
        out["wrong"][kind] = rates(images, metas)
    for sigma in BLURS:
        metas = records(rng, n)
        out["blur"][str(sigma)] = rates([shapes_wrong.blur(shapes.render(m, rng), sigma) for m in metas], metas)
    return out


def table(res: dict, command: str) -> str:
    lines = ["# The shapes checker: accuracy and false passes", "", "Command:", "", f"    {command}", "",
             "Seeded; every number is over the `n` images of its row (`pass`: `shapes_correct`, `score`: mean "
             "`shapes_score`). Mild: Gaussian blur σ = 0.5 px or Gaussian noise σ = 0.03 on right images. "
             "Wrong kinds: `diffgrpo.tasks.shapes_wrong`.", "",
             "| right images, category | n | accuracy | mean score |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['pass']:.4f} | {v['score']:.3f} |" for k, v in res["right"].items()]
    lines += ["", "| mildly perturbed right images | n | pass rate | mean score |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['pass']:.4f} | {v['score']:.3f} |" for k, v in res["mild"].items()]
    lines += ["", "| wrong images, kind | n | false-pass rate | mean score |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['pass']:.4f} | {v['score']:.3f} |" for k, v in res["wrong"].items()]
    lines += ["", "| right images blurred, σ (px) | n | pass rate | mean score |", "|---|---|---|---|"]
    lines += [f"| {k} | {v['n']} | {v['pass']:.4f} | {v['score']:.3f} |" for k, v in res["blur"].items()]
    return "\n".join(lines) + "\n"


def examples(path: Path, seed: int, prompts: int = 4) -> None:
    """A grid: one row per prompt, a right image then one image of each wrong kind (blank where it does not apply),
    upscaled 4× without smoothing."""
    rng = np.random.default_rng(seed)
    rows = []
    for meta in records(rng, prompts, "position")[:2] + records(rng, prompts - 2):
        cells = [shapes.render(meta, rng)] + [shapes_wrong.wrong(k, meta, rng) for k in shapes_wrong.WRONG]
        rows.append(torch.cat([c if c is not None else torch.ones(3, 32, 32) for c in cells], 2))  # (3, 32, 32·10)
    grid = torch.cat(rows, 1)  # (3, 32·rows, 32·10)
    arr = (grid.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
    Image.fromarray(arr).resize((arr.shape[1] * 4, arr.shape[0] * 4), Image.NEAREST).save(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=500, help="images per row of the table")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/shapes_checker")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = measure(args.n, args.seed)
    command = "OMP_NUM_THREADS=1 python benchmarks/shapes_checker.py " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:])
    (out / "table.md").write_text(table(res, command.strip()))
    (out / "results.json").write_text(json.dumps({"command": command.strip(), "seed": args.seed, **res}, indent=1))
    examples(out / "examples.png", args.seed)
    print(table(res, command.strip()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
