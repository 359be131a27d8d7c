"""What an evaluation leaves to read: one file per sample (PNG image, MP4 / GIF video) and the per-sample table.

The table (like TRL's ``log_completions``) is ``<run>/samples/eval_<iteration>.jsonl``, one row per evaluation
sample in prompt order: ``{"iteration", "index", "prompt", "metadata", "rewards": {name: value}, "reward",`` and
one of ``"image"`` / ``"video"`` (the file's path relative to the run directory, under
``samples/eval_<iteration>/``) or ``"completion"`` (diffusion LMs)``}``. Non-finite rewards are written as null.

Videos ((C, F, H, W) samples, e.g. Wan) are written with diffusers' ``export_to_video`` (imageio + imageio-ffmpeg,
whose wheel bundles an ffmpeg binary) as MP4, or as an animated GIF with Pillow when imageio-ffmpeg is missing.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import numpy as np
import torch

from .fileio import atomic_write

VIDEO_FPS = 16  # Wan 2.1 generates 16 frames per second


def to_uint8(sample: torch.Tensor) -> np.ndarray:
    """One sample in [0, 1] → uint8 for writing: image (C, H, W) → (H, W, C); video (C, F, H, W) → (F, H, W, C).
    One channel is repeated to three."""
    x = (sample.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()
    if x.shape[0] == 1:
        x = x.repeat(3, *([1] * (x.dim() - 1)))
    return (x.permute(1, 2, 0) if x.dim() == 3 else x.permute(1, 2, 3, 0)).numpy()


def grid_frames(images: torch.Tensor) -> torch.Tensor:
    """Samples for a grid: images (N, C, H, W) as they are; videos (N, C, F, H, W) → their first frames."""
    return images[:, :, 0] if images.dim() == 5 else images


def can_write_mp4() -> bool:
    return importlib.util.find_spec("imageio") is not None and importlib.util.find_spec("imageio_ffmpeg") is not None


def save_image(arr: np.ndarray, path: Path) -> Path:
    """(H, W, 3) uint8 → PNG at ``path``."""
    from PIL import Image

    atomic_write(path, lambda tmp: Image.fromarray(np.ascontiguousarray(arr)).save(tmp, format="PNG"))
    return Path(path)


def save_video(frames: np.ndarray, stem: Path, fps: int = VIDEO_FPS) -> Path:
    """(F, H, W, 3) uint8 → ``stem``.mp4 (diffusers' ``export_to_video``), or ``stem``.gif without imageio-ffmpeg.
    Returns the path written."""
    from PIL import Image

    pil = [Image.fromarray(np.ascontiguousarray(f)) for f in frames]
    if can_write_mp4():
        from diffusers.utils import export_to_video

        path = Path(stem).with_suffix(".mp4")
        def write(tmp: Path) -> None:  # imageio picks the container by the file's extension
            named = tmp.with_name(tmp.name + ".mp4")
            try:
                export_to_video(pil, str(named), fps=fps)
                os.replace(named, tmp)
            finally:
                named.unlink(missing_ok=True)

        atomic_write(path, write)
        return path
    path = Path(stem).with_suffix(".gif")
    atomic_write(path, lambda tmp: pil[0].save(tmp, format="GIF", save_all=True, append_images=pil[1:],
                                               duration=max(1, round(1000 / fps)), loop=0))
    return path


def _number(v) -> float | None:
    v = float(v)
    return v if math.isfinite(v) else None


class SampleTable:
    """The per-sample table of one evaluation (see the module doc). ``add`` rows in any order (each with its index
    in the evaluation's prompt order); ``close`` writes the JSONL sorted by index and returns the rows."""

    def __init__(self, run_dir: Path, iteration: int, *, save_media: bool = True):
        self.run_dir = Path(run_dir)
        self.iteration = int(iteration)
        self.save_media = save_media
        self.name = f"eval_{self.iteration:06d}"
        self.path = self.run_dir / "samples" / f"{self.name}.jsonl"
        self.rows: list[dict] = []

    def _row(self, index: int, prompt: str, metadata: dict, rewards: dict[str, float], total: float) -> dict:
        return {"iteration": self.iteration, "index": int(index), "prompt": prompt, "metadata": metadata,
                "rewards": {k: _number(v) for k, v in rewards.items()}, "reward": _number(total)}

    def add_sample(self, index: int, prompt: str, metadata: dict, rewards: dict[str, float], total: float,
                   media: np.ndarray | None, source: np.ndarray | None = None) -> None:
        """``media``: uint8 (H, W, 3) image or (F, H, W, 3) video (see :func:`to_uint8`), or None (no file);
        ``source``: an image edit's source (uint8 (H, W, 3)), saved beside the result (``source_image``)."""
        row = self._row(index, prompt, metadata, rewards, total)
        if media is not None and self.save_media:
            stem = self.run_dir / "samples" / self.name / f"{int(index):05d}"
            if source is not None:
                src = save_image(source, stem.with_name(stem.name + "_source.png"))
                row["source_image"] = src.relative_to(self.run_dir).as_posix()
            path = save_image(media, stem.with_suffix(".png")) if media.ndim == 3 else save_video(media, stem)
            row["video" if media.ndim == 4 else "image"] = path.relative_to(self.run_dir).as_posix()
        self.rows.append(row)

    def add_completion(self, index: int, prompt: str, metadata: dict, rewards: dict[str, float], total: float,
                       completion: str) -> None:
        self.rows.append({**self._row(index, prompt, metadata, rewards, total), "completion": completion})

    def close(self) -> list[dict]:
        self.rows.sort(key=lambda r: r["index"])
        # strict JSON: a NaN / infinity anywhere (e.g. in a prompt's metadata) is written as null
        atomic_write(self.path, "".join(json.dumps(_finite(r), default=str, allow_nan=False) + "\n"
                                        for r in self.rows))
        return self.rows


def _finite(v):
    """``v`` with every non-finite float (also inside dicts and lists) as None."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


def caption_of(row: dict) -> str:
    """A grid caption for a table row: the verdict of the shapes checker (``shapes_correct``: ✓ correct / ✗ wrong)
    when the row carries it, else the sample's total reward; then, on the next line, the prompt."""
    verdict = row.get("rewards", {}).get("shapes_correct")
    if isinstance(verdict, (int, float)):
        head = "✓ correct" if verdict >= 0.5 else "✗ wrong"
    else:
        head = "n/a" if row["reward"] is None else f"{row['reward']:.3f}"
    return f"{head}\n{row['prompt']}"


def grid_title(tag: str, iteration: int) -> str:
    """The label above an evaluation's grid: ``start (base model)``, ``end (iteration N)`` or ``iteration N``."""
    return {"start": "start (base model)", "end": f"end (iteration {iteration})"}.get(tag, f"iteration {iteration}")


def table_columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    """Rows of a :class:`SampleTable` → (columns, values) for a tracker's table: index, prompt, metadata (JSON),
    each reward component, reward, and the media path or completion."""
    names = sorted({k for r in rows for k in r["rewards"]})
    media = next((k for k in ("image", "video", "completion") if any(k in r for r in rows)), None)
    media = ([media] if media else []) + (["source_image"] if any("source_image" in r for r in rows) else [])
    cols = ["index", "prompt", "metadata", *[f"rewards/{n}" for n in names], "reward", *media]
    data = [[r["index"], r["prompt"], json.dumps(r["metadata"], default=str), *[r["rewards"].get(n) for n in names],
             r["reward"], *[r.get(m) for m in media]] for r in rows]
    return cols, data


def with_source(frame: torch.Tensor, source: torch.Tensor | None, gap: int = 2) -> torch.Tensor:
    """A grid tile of an image edit: its source (3, H, W) left of the result ``frame`` (3, H, W), on white, →
    (3, H, 2W + gap); ``frame`` itself without a source."""
    if source is None:
        return frame
    src = source.to(frame.device, frame.dtype)
    return torch.cat([src, torch.ones_like(frame[:, :, :gap]), frame], dim=-1)


CAPTION_PX, CAPTION_LINES, TITLE_PX = 14, 3, 20  # caption font size and lines per tile, title font size


def grid_font(size: int, bold: bool = False):
    """DejaVu Sans (the TrueType font matplotlib ships, which has ✓ and ✗) at ``size`` pixels; Pillow's own
    scalable default font when it is missing."""
    import matplotlib
    from PIL import ImageFont

    path = Path(matplotlib.get_data_path(), "fonts", "ttf", f"DejaVuSans{'-Bold' if bold else ''}.ttf")
    return ImageFont.truetype(str(path), size) if path.is_file() else ImageFont.load_default(size)


def caption_lines(text: str, font, width: int, max_lines: int = CAPTION_LINES) -> list[str]:
    """``text`` wrapped at spaces (and broken at newlines) into at most ``max_lines`` lines no wider than ``width``
    pixels in ``font``; a line cut short (a word too wide, or text left over after the last line) ends in "…"."""
    def fit(line: str, cut: bool) -> str:
        if not cut and font.getlength(line) <= width:
            return line
        while line and font.getlength(line + "…") > width:
            line = line[:-1]
        return line + "…"

    lines: list[str] = []
    for paragraph in text.split("\n"):
        start = len(lines)
        for word in paragraph.split():
            if len(lines) > start and font.getlength(f"{lines[-1]} {word}") <= width:
                lines[-1] = f"{lines[-1]} {word}"
            else:
                lines.append(word)
    kept = lines[:max_lines]
    return [fit(line, cut=len(lines) > max_lines and i == len(kept) - 1) for i, line in enumerate(kept)]


def captioned_grid(images: torch.Tensor, captions: list[str], nrow: int, tile: int = 128,
                   title: str | None = None) -> np.ndarray:
    """Samples (N, C, H, W) or videos (N, C, F, H, W, first frames shown) in [0, 1] → one (H', W', 3) uint8 grid,
    ``nrow`` tiles per row, each ``tile`` pixels wide (nearest-neighbour upscaling of small images) with its caption
    (e.g. verdict or reward, and prompt) in up to ``CAPTION_LINES`` lines of DejaVu Sans below it; ``title`` (e.g.
    ``start (base model)``) in a band above the tiles."""
    from PIL import Image, ImageDraw

    frames = grid_frames(images)
    n, _, h, w = frames.shape
    th = max(1, round(tile * h / w))
    font, line = grid_font(CAPTION_PX), CAPTION_PX + 3
    cap = CAPTION_LINES * line + 4
    band = TITLE_PX + 12 if title else 0
    cols, rows, pad = nrow, math.ceil(n / nrow), 4
    canvas = Image.new("RGB", (cols * (tile + pad) + pad, band + rows * (th + cap + pad) + pad), (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    if title:
        draw.text((pad + 2, 6), title, fill=(0, 0, 0), font=grid_font(TITLE_PX, bold=True))
    for i in range(n):
        r, q = divmod(i, cols)
        x, y = pad + q * (tile + pad), band + pad + r * (th + cap + pad)
        im = Image.fromarray(np.ascontiguousarray(to_uint8(frames[i])))
        resample = Image.NEAREST if w < tile else Image.BILINEAR
        canvas.paste(im.resize((tile, th), resample), (x, y))
        for j, part in enumerate(caption_lines(captions[i] if i < len(captions) else "", font, tile)):
            draw.text((x, y + th + 2 + j * line), part, fill=(0, 0, 0), font=font)
    return np.asarray(canvas)


def side_by_side(left: Path, right: Path, out: Path, gap: int = 8, vertical: bool = False) -> bool:
    """Two PNG grids (e.g. the start and the end evaluation) next to each other in one PNG, or ``left`` above
    ``right`` when ``vertical`` (each keeps its width, so its captions stay legible); False when one is missing."""
    from PIL import Image

    if not (Path(left).is_file() and Path(right).is_file()):
        return False
    a, b = Image.open(left).convert("RGB"), Image.open(right).convert("RGB")
    size = ((max(a.width, b.width), a.height + gap + b.height) if vertical
            else (a.width + gap + b.width, max(a.height, b.height)))
    canvas = Image.new("RGB", size, (255, 255, 255))
    canvas.paste(a, (0, 0))
    canvas.paste(b, (0, a.height + gap) if vertical else (a.width + gap, 0))
    atomic_write(out, lambda tmp: canvas.save(tmp, format="PNG"))
    return True


__all__ = ["SampleTable", "can_write_mp4", "with_source", "caption_lines", "caption_of", "captioned_grid", "grid_font",
           "grid_title", "grid_frames", "save_image", "save_video", "side_by_side",
           "table_columns", "to_uint8"]
