"""Run outputs: metrics.jsonl mirrored to the trackers (TensorBoard, W&B), sample grids and the reward-curve plot.

The trackers (TensorBoard through ``torch.utils.tensorboard``, W&B through ``wandb``) sit behind the small
``Tracker`` protocol: scalars at a step, an image grid with a caption, a per-sample table (``media.SampleTable``
rows: a W&B Table with the images, TensorBoard text), finish. (``accelerate.tracking``'s classes
are not used: they log through accelerate's process state, which this trainer does not create.) ``MetricsWriter`` appends every row to
``metrics.jsonl`` and sends its finite scalars to each tracker; it is a context manager whose ``close`` (after the
run's last write, the end evaluation) finishes every tracker once, however the run ends.
"""
from __future__ import annotations

import importlib.util
import io
import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from ..errors import ConfigError, TrainingError
from ..fileio import append_line, atomic_write, check_below, read_jsonl
from ..media import captioned_grid, grid_frames, table_columns


class Tracker(Protocol):
    """An experiment tracker: scalars at a step, an image with a caption, and one ``finish`` at the end."""

    def log(self, values: dict[str, float], step: int) -> None: ...

    def log_image(self, key: str, image: np.ndarray, step: int, caption: str) -> None:
        """``image``: (H, W, 3) uint8."""

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int, run_dir: Path) -> None:
        """A per-sample table: ``columns`` names, ``rows`` values; an ``image`` / ``video`` column holds paths
        relative to ``run_dir``."""

    def finish(self) -> None: ...


class TensorBoardTracker:
    """Event files in ``<run_dir>/tensorboard`` (``torch.utils.tensorboard``); an image's caption is logged as
    text under ``<key>/caption``."""

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        d = Path(run_dir) / "tensorboard"
        check_below(d / "events")  # a planted tensorboard/ link is refused, never written through
        try:
            self._w = SummaryWriter(str(d))
        except OSError as e:  # e.g. a file named tensorboard: one line, before any training
            raise TrainingError(f"log.tensorboard: cannot create {str(d)!r} ({e.strerror or e})") from None

    def log(self, values: dict[str, float], step: int) -> None:
        for k, v in values.items():
            self._w.add_scalar(k, v, step)
        self._w.flush()

    def log_image(self, key: str, image: np.ndarray, step: int, caption: str) -> None:
        self._w.add_image(key, image, step, dataformats="HWC")
        self._w.add_text(f"{key}/caption", caption, step)
        self._w.flush()

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int, run_dir: Path) -> None:
        """As a Markdown table in the text tab."""
        def cell(v) -> str:
            text = f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v)
            return text.replace("|", "\\|").replace("\n", " ")

        lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
        self._w.add_text(key, "\n".join(lines), step)
        self._w.flush()

    def finish(self) -> None:
        self._w.close()


def wandb_settings(log: dict, run_dir: Path, environ=None) -> tuple[str, str, list[str] | None]:
    """(project, run name, tags) of a run's W&B run: ``log.wandb_project`` / ``log.wandb_name`` / ``log.wandb_tags``
    when set, else ``WANDB_PROJECT`` / ``WANDB_NAME`` / ``WANDB_TAGS`` from the environment, else ``diffgrpo``, the run
    directory's name and no tags."""
    env = os.environ if environ is None else environ
    project = log.get("wandb_project") or env.get("WANDB_PROJECT") or "diffgrpo"
    name = log.get("wandb_name") or env.get("WANDB_NAME") or Path(run_dir).name
    tags = list(log.get("wandb_tags") or []) or [t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()]
    return project, name, [str(t) for t in tags] or None


class WandBTracker:
    """A W&B run (project, name and tags: :func:`wandb_settings`); its id is kept in ``<run_dir>/wandb_id``
    so that a resumed run continues the same W&B run."""

    def __init__(self, run_dir: Path, config: dict | None = None):
        import wandb

        id_file = Path(run_dir) / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        atomic_write(id_file, run_id)
        project, name, tags = wandb_settings((config or {}).get("log", {}), run_dir)
        self._run = wandb.init(project=project, dir=str(run_dir), config=config or {}, name=name, tags=tags,
                               id=run_id, resume="allow")

    def log(self, values: dict[str, float], step: int) -> None:
        self._run.log(values, step=step)

    def log_image(self, key: str, image: np.ndarray, step: int, caption: str) -> None:
        import wandb

        self._run.log({key: wandb.Image(image, caption=caption)}, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int, run_dir: Path) -> None:
        """A ``wandb.Table``; image paths become ``wandb.Image`` cells, video paths ``wandb.Video`` cells."""
        import wandb

        kinds = {"image": wandb.Image, "video": wandb.Video}
        data = [[kinds[c](str(Path(run_dir) / v)) if c in kinds and v else v for c, v in zip(columns, row)]
                for row in rows]
        self._run.log({key: wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self) -> None:
        self._run.finish()


_WANDB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # what wandb.init accepts as a run id (no :;,#?/' and short)


def check_trackers(run_dir: str | Path, *, tensorboard: bool, wandb: bool) -> None:
    """The trackers' files in ``run_dir`` as a ConfigError (one line, naming the key) before any model loads: a
    ``tensorboard`` that is a link, a file or not writable; a ``wandb_id`` that is a link, unreadable or not an id.
    Whatever else fails when a tracker starts is a one-line TrainingError then (:class:`MetricsWriter`)."""
    d = Path(run_dir)
    if tensorboard:
        tb = d / "tensorboard"
        if tb.is_symlink():
            raise ConfigError(f"log.tensorboard: {str(tb)!r} is a symbolic link; the event files are never written "
                              "through a link (remove it)")
        if tb.exists() and not tb.is_dir():
            raise ConfigError(f"log.tensorboard: {str(tb)!r} exists and is not a directory (remove it, or set "
                              "log.tensorboard=false)")
        if tb.is_dir() and not os.access(tb, os.W_OK | os.X_OK):
            raise ConfigError(f"log.tensorboard: {str(tb)!r} is not writable (fix its permissions, or set "
                              "log.tensorboard=false)")
    if wandb:
        f = d / "wandb_id"
        if f.is_symlink() or (f.exists() and not f.is_file()):
            raise ConfigError(f"log.wandb: {str(f)!r} is not a regular file (remove it to start a new W&B run)")
        if f.is_file():
            try:
                run_id = f.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"log.wandb: {str(f)!r} cannot be read ({e}); remove it to start a new W&B "
                                  "run") from None
            if not _WANDB_ID.match(run_id):
                raise ConfigError(f"log.wandb: {str(f)!r} holds {run_id[:40]!r}, not a W&B run id (1-64 of "
                                  "A-Z a-z 0-9 _ . -); restore the id or remove the file to start a new W&B run")
    if (tensorboard or wandb) and d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"log.output_dir: {str(d)!r} is not writable")


def _start(key: str, tracker, *args):
    """A tracker, or its setup failure (a wandb login, a bad directory) as one line naming the key."""
    try:
        return tracker(*args)
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - a tracker library's own error, whatever its class
        first = (str(e).strip().splitlines() or [""])[0][:300]
        raise TrainingError(f"{key}: the tracker could not start ({type(e).__name__}: {first}); fix it or set "
                            f"{key}=false") from None


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl`` and mirrors each row's finite scalars (at its
    ``iteration``) and the evaluation grids to the trackers. ``close`` is idempotent; use it as ``with writer:``."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False, config: dict | None = None,
                 trackers: list[Tracker] | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.trackers: list[Tracker] = list(trackers or [])
        try:
            for wanted, package in ((wandb, "wandb"), (tensorboard, "tensorboard")):
                if wanted and importlib.util.find_spec(package) is None:
                    raise RuntimeError(f"log.{package}=true needs the {package} package "
                                       "(pip install 'diffgrpo[trackers]')")
            if wandb:
                self.trackers.append(_start("log.wandb", WandBTracker, Path(run_dir), config))
            if tensorboard:
                self.trackers.append(_start("log.tensorboard", TensorBoardTracker, Path(run_dir)))
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


def save_grid(images: torch.Tensor, path: Path, nrow: int, scale: int = 4, captions: list[str] | None = None) -> None:
    """images (N, C, H, W) in [0, 1] → one PNG, ``nrow`` images per row, upscaled ``scale``× (nearest); with
    ``captions`` (one per image, e.g. prompt and reward), tiles 128 px wide with the caption below each."""
    from PIL import Image

    arr = grid_array(images, nrow, scale) if captions is None else captioned_grid(images, captions, nrow)
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
