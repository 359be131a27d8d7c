"""Run outputs: metrics.jsonl mirrored to the trackers (``log.trackers``), sample grids and the reward-curve plot.

The trackers (``run.trackers``: accelerate's tracker classes) sit behind the small ``Tracker`` protocol: scalars at
a step, an image grid with a caption, a per-sample table (``media.SampleTable`` rows: a W&B Table with the images,
TensorBoard text), finish. ``MetricsWriter`` appends every row to
``metrics.jsonl`` and sends its finite scalars to each tracker; it is a context manager whose ``close`` (after the
run's last write, the end evaluation) finishes every tracker once, however the run ends.
"""
from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import TrainingError
from ..fileio import append_line, atomic_write, read_jsonl
from ..media import captioned_grid, grid_frames, table_columns
from .trackers import AccelerateTracker


class Tracker(Protocol):
    """An experiment tracker: scalars at a step, an image with a caption, and one ``finish`` at the end."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def log_image(self, key: str, image: np.ndarray, step: int, caption: str) -> None:
        """``image``: (H, W, 3) uint8."""

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int, run_dir: Path) -> None:
        """A per-sample table: ``columns`` names, ``rows`` values; an ``image`` / ``video`` column holds paths
        relative to ``run_dir``."""

    def finish(self) -> None: ...


def _start(name: str, key: str, run_dir: Path, config: dict | None) -> Tracker:
    """Tracker ``name``, or its setup failure (a wandb login, a bad directory) as one line naming ``key``."""
    try:
        return AccelerateTracker(name, run_dir, config)
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - a tracker library's own error, whatever its class
        first = (str(e).strip().splitlines() or [""])[0][:300]
        off = f"set {key}=false" if key != "log.trackers" else f"remove {name} from log.trackers"
        raise TrainingError(f"{key}: the {name} tracker could not start ({type(e).__name__}: {first}); fix it or "
                            f"{off}") from None


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` and mirrors each row's finite scalars (at its
    ``iteration``) and the evaluation grids to the trackers. ``close`` is idempotent; use it as ``with writer:``.
    ``names``: tracker name → the key that asked for it (``trackers.requested``); ``trackers``: ready ones."""

    def __init__(self, run_dir: Path, names: dict[str, str] | None = None, config: dict | None = None,
                 trackers: list[Tracker] | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = list(trackers or [])
        try:
            for name, key in (names or {}).items():
                self.trackers.append(_start(name, key, Path(run_dir), config))
        except BaseException:
            self.close()
            raise
        self.closed = False

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        append_line(self.path, json.dumps(clean))
        if "iteration" not in row or not self.trackers:
            return
        scalars = {k: v for k, v in row.items()
                   if k != "iteration" and isinstance(v, (int, float)) and not isinstance(v, bool)
                   and math.isfinite(float(v))}
        for t in self.trackers:
            t.log(scalars, step=int(row["iteration"]))

    def log_images(self, images: torch.Tensor, step: int, nrow: int, caption: str, key: str = "eval/samples") -> None:
        """An evaluation's images (N, C, H, W) in [0, 1] as one grid, at ``step``, to every tracker."""
        if not self.trackers:
            return
        grid = grid_array(images, nrow, scale=1)
        if grid.ndim == 2:
            grid = np.repeat(grid[:, :, None], 3, axis=2)
        for t in self.trackers:
            t.log_image(key, grid, step=int(step), caption=caption)

    def log_table(self, rows: list[dict], step: int, key: str = "eval/samples_table") -> None:
        """An evaluation's per-sample rows (``media.SampleTable.close()``) to every tracker."""
        if not self.trackers or not rows:
            return
        columns, data = table_columns(rows)
        for t in self.trackers:
            if hasattr(t, "log_table"):  # a tracker written before tables were part of the protocol
                t.log_table(key, columns, data, step=int(step), run_dir=self.path.parent)

    def close(self) -> None:
        """Finish every tracker once (the first error is raised after all were tried)."""
        trackers, self.trackers, self.closed = self.trackers, [], True
        error = None
        for t in trackers:
            try:
                t.finish()
            except Exception as e:  # noqa: BLE001 - finish the others, then report
                error = error or e
        if error is not None:
            raise error

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: Path, log=print) -> list[dict]:
    """The rows of a metrics log; a torn last line is dropped with a warning (see ``fileio.read_jsonl``)."""
    return read_jsonl(path, log=log)


def grid_array(images: torch.Tensor, nrow: int, scale: int = 4) -> np.ndarray:
    """images (N, C, H, W) in [0, 1] → one uint8 grid, ``nrow`` images per row, upscaled ``scale``× (nearest):
    (H', W') for one channel, (H', W', C) otherwise. Videos (N, C, F, H, W) show their first frames."""
    images = grid_frames(images)
    n, c, h, w = images.shape
    ncol = nrow
    nr = math.ceil(n / ncol)
    pad = 1
    grid = torch.ones(c, nr * (h + pad) + pad, ncol * (w + pad) + pad)
    for i in range(n):
        r, q = divmod(i, ncol)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = images[i].cpu()
    arr = (grid.clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr[0].numpy() if c == 1 else arr.permute(1, 2, 0).numpy()
    return arr.repeat(scale, axis=0).repeat(scale, axis=1) if scale > 1 else arr


def save_grid(images: torch.Tensor, path: Path, nrow: int, scale: int = 4, captions: list[str] | None = None,
              title: str | None = None) -> None:
    """images (N, C, H, W) in [0, 1] → one PNG, ``nrow`` images per row, upscaled ``scale``× (nearest); with
    ``captions`` (one per image, e.g. prompt and reward) or a ``title`` (e.g. ``start (base model)``), tiles 128 px
    wide with the caption below each and the title above them."""
    from PIL import Image

    arr = (grid_array(images, nrow, scale) if captions is None and title is None
           else captioned_grid(images, captions or [], nrow, title=title))
    img = Image.fromarray(np.ascontiguousarray(arr))
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG"}.get(Path(path).suffix.lower(), "PNG")
    atomic_write(path, lambda tmp: img.save(tmp, format=fmt))


def curve_png(rows: list[dict], keys: tuple[str, ...] | list[str], title: str = "", *, size: tuple[float, float] = (6, 3.5),
              dpi: int = 110, fontsize: int = 8) -> bytes | None:
    """PNG bytes of a line plot of ``keys`` against iteration for the rows that have them (numeric values), or None
    when there is nothing to plot. The one curve plotter: run outputs (:func:`plot_curves`) and reports use it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    drew = False
    for key in keys:
        pts = [(r["iteration"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and "iteration" in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, label=key)
            drew = True
    png = None
    if drew:
        ax.set_xlabel("iteration")
        ax.set_title(title)
        ax.legend(fontsize=fontsize)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, dpi=dpi, format="png")
        png = buf.getvalue()
    plt.close(fig)
    return png


def plot_curves(rows: list[dict], path: Path, keys: tuple[str, ...], title: str = "") -> bool:
    """Line plot of ``keys`` against iteration written to ``path``. Returns False if nothing to plot."""
    png = curve_png(rows, keys, title)
    if png is not None:
        atomic_write(path, png)
    return png is not None
