"""Run outputs: metrics.jsonl (+ optional TensorBoard), sample grids and the reward-curve plot."""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from .fileio import append_line, atomic_write, read_jsonl


class MetricsWriter:
    """Appends one JSON object per line to ``metrics.jsonl``; mirrors scalars to TensorBoard when asked."""

    def __init__(self, run_dir: Path, tensorboard: bool = False, wandb: bool = False, config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tb = None
        self.wandb = None
        if wandb:
            try:
                import wandb as _wandb
            except ImportError as e:
                raise RuntimeError("log.wandb=true needs the wandb package (pip install wandb)") from e
            self.wandb = _wandb.init(project="diffgrpo", dir=str(run_dir), config=config or {},
                                     name=Path(run_dir).name, resume="allow")
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:  # pragma: no cover - depends on the environment
                raise RuntimeError("log.tensorboard=true needs the tensorboard package "
                                   "(pip install 'diffgrpo[tensorboard]')") from e
            self.tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def write(self, row: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
        append_line(self.path, json.dumps(clean))
        if self.tb is not None and "iteration" in row:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "iteration" and math.isfinite(float(v)):
                    self.tb.add_scalar(k, v, row["iteration"])
        if self.wandb is not None and "iteration" in row:
            self.wandb.log({k: v for k, v in clean.items() if k != "iteration"}, step=row["iteration"])

    def close(self):
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.finish()


def read_metrics(path: Path, log=print) -> list[dict]:
    """The rows of a metrics log; a torn last line is dropped with a warning (see ``fileio.read_jsonl``)."""
    return read_jsonl(path, log=log)


def save_grid(images: torch.Tensor, path: Path, nrow: int, scale: int = 4) -> None:
    """images (N, C, H, W) in [0, 1] → one PNG, ``nrow`` images per row, upscaled ``scale``× (nearest)."""
    from PIL import Image

    n, c, h, w = images.shape
    ncol = nrow
    nr = math.ceil(n / ncol)
    pad = 1
    grid = torch.ones(c, nr * (h + pad) + pad, ncol * (w + pad) + pad)
    for i in range(n):
        r, q = divmod(i, ncol)
        grid[:, pad + r * (h + pad): pad + r * (h + pad) + h, pad + q * (w + pad): pad + q * (w + pad) + w] = images[i]
    arr = (grid.clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr[0].numpy() if c == 1 else arr.permute(1, 2, 0).numpy()
    img = Image.fromarray(arr)
    img = img.resize((img.width * scale, img.height * scale), Image.NEAREST)
    fmt = {".jpg": "JPEG", ".jpeg": "JPEG"}.get(Path(path).suffix.lower(), "PNG")
    atomic_write(path, lambda tmp: img.save(tmp, format=fmt))


def plot_curves(rows: list[dict], path: Path, keys: tuple[str, ...], title: str = "") -> bool:
    """Line plot of ``keys`` against iteration for the rows that have them. Returns False if nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    drew = False
    for key in keys:
        pts = [(r["iteration"], r[key]) for r in rows if r.get(key) is not None and "iteration" in r]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if len(pts) < 20 else None, label=key)
            drew = True
    if drew:
        ax.set_xlabel("iteration")
        ax.set_title(title)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=110, format="png"))
    plt.close(fig)
    return drew
