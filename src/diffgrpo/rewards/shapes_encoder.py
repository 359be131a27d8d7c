"""A feature space for the shapes task's images, learned from rendered scenes: the guards' ``eval/fid`` and
``eval/guard/kid`` on ``train.task=shapes`` (``eval.guard_features=shapes``), as the digit classifier's features are
on the digits task.

  ShapesEncoder            a small CNN: (B, 3, S, S) in [0, 1] → (B, 64) penultimate features (ReLU) → (B, 60) head
  targets(scene)           what the head predicts of a scene: per (shape, colour) label its object count (12), and
                           per label and image quadrant whether an object of it has its centre there (12 · 4)
  scene_pool(n, S, seed)   ``n`` rendered scenes of every prompt of the grammar (categories in turn, each
                           category's prompts in turn), 2 × 2 grid layouts (the built-in model's pretraining scenes)
                           and free layouts alternating → (images (n, 3, S, S), targets (n, 60))
  train_encoder(S, steps)  Adam on MSE(counts) + BCE(quadrants) over a fresh pool; seeded, deterministic
  load_encoder(S)          the trained encoder, cached in the model cache (safetensors; key: size, steps, recipe)
  features(images)         (B, 3, S, S) in [0, 1] → (B, 64) float32: the guards' feature map
  reference_features(metadata, S)  features (N, 64) of scenes rendered for the evaluation records that state
                           constraints (each record in turn, ≥ ``REFERENCE_MIN`` scenes, fixed seed, grid layouts),
                           the reference set of ``eval/fid`` / ``eval/guard/kid`` (cached per record list)

Cost: training ≈ 20–30 s on one CPU thread (rendering the pool included), once per cache; one small CNN forward a
sample at evaluation; the reference set once per process and evaluation prompt list.
"""
from __future__ import annotations

import json

import numpy as np
import torch
from torch import nn

from ..cache import cache_lock, cache_root, save_dir_atomic
from ..tasks import shapes as task

RECIPE = 1  # bump when the architecture, targets, data or optimiser change: the cache key holds it
STEPS = 700
POOL = 4000
BATCH = 128
FEATURE_DIM = 64
REFERENCE_MIN = 1024
REFERENCE_SEED = 0
LABELS = [(s, c) for s in task.SHAPES for c in task.COLORS]  # (shape, colour), 12
_ENCODERS: dict[tuple, ShapesEncoder] = {}
_REFERENCES: dict[tuple, torch.Tensor] = {}


class ShapesEncoder(nn.Module):
    """Three conv blocks (16, 32, 32 channels, each 3 × 3 conv, ReLU, 2 × 2 max-pool), a 64-unit ReLU layer (the
    features), a linear head: 12 counts, then 48 quadrant logits."""

    def __init__(self, image_size: int = task.IMAGE_SIZE):
        super().__init__()
        blocks = []
        for cin, cout in ((3, 16), (16, 32), (32, 32)):
            blocks += [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)]
        self.conv = nn.Sequential(*blocks, nn.Flatten())
        self.body = nn.Sequential(nn.Linear(32 * (image_size // 8) ** 2, FEATURE_DIM), nn.ReLU())
        self.head = nn.Linear(FEATURE_DIM, len(LABELS) * 5)

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """(B, 3, S, S) in [0, 1] → (B, 64)."""
        return self.body(self.conv(images * 2 - 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))  # (B, 60)


def targets(scene: task.Scene) -> torch.Tensor:
    """A scene's (60,) float32 targets: counts per label (12), then per label its four quadrants (left-top,
    right-top, left-bottom, right-bottom) 1 where an object of that label has its centre there (48)."""
    out = torch.zeros(len(LABELS), 5)
    half = scene.image_size / 2
    for o in scene.objects:
        i = LABELS.index((o.kind, o.color))
        out[i, 0] += 1
        out[i, 1 + int(o.x >= half) + 2 * int(o.y >= half)] = 1
    return torch.cat([out[:, 0], out[:, 1:].reshape(-1)])


def scene_pool(n: int, image_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` scenes: record i is category i mod 6's prompt number ⌊i / 6⌋ (cycled), grid layout for odd i →
    (images (n, 3, S, S) in [0, 1], targets (n, 60))."""
    rng = np.random.default_rng(seed)
    by_tag = [task.prompts("train", (t,)) + task.prompts("test", (t,)) for t in task.CATEGORIES]
    scenes = [task.layout(by_tag[i % 6][(i // 6) % len(by_tag[i % 6])], rng, image_size, grid=bool(i % 2))
              for i in range(n)]
    return torch.stack([task.draw(s) for s in scenes]), torch.stack([targets(s) for s in scenes])


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """MSE on the counts plus BCE on the quadrant logits; out, y (B, 60)."""
    k = len(LABELS)
    return (nn.functional.mse_loss(out[:, :k], y[:, :k])
            + nn.functional.binary_cross_entropy_with_logits(out[:, k:], y[:, k:]))


@torch.enable_grad()  # also when the first evaluation (under no_grad) asks for the encoder
def train_encoder(image_size: int = task.IMAGE_SIZE, steps: int = STEPS, pool: int = POOL, seed: int = 0
                  ) -> tuple[ShapesEncoder, dict]:
    """A freshly trained encoder (eval mode) and its held-out figures: loss, and the share of scenes whose every
    rounded count is right, on 512 scenes of another seed."""
    torch.manual_seed(seed)
    x, y = scene_pool(pool, image_size, seed)
    net = ShapesEncoder(image_size)
    opt = torch.optim.Adam(net.parameters(), lr=2e-3)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        idx = torch.randint(len(x), (BATCH,), generator=g)
        loss = loss_fn(net(x[idx]), y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    net.eval().requires_grad_(False)
    xt, yt = scene_pool(512, image_size, seed + 1)
    with torch.no_grad():
        out = net(xt)
    exact = (out[:, :len(LABELS)].round() == yt[:, :len(LABELS)]).all(1).float().mean()
    return net, {"held_out_loss": float(loss_fn(out, yt)), "held_out_counts_exact": float(exact),
                 "steps": steps, "pool": pool}


def load_encoder(image_size: int = task.IMAGE_SIZE, cache_dir: str = "", steps: int = STEPS, pool: int = POOL,
                 log=print) -> ShapesEncoder:
    """The encoder for ``image_size``, trained once per cache directory (under a lock) and read back from
    ``model.safetensors``; eval mode, no gradients."""
    from safetensors.torch import load_file, save_file

    path = cache_root(cache_dir) / f"shapes-encoder-{image_size}px-s{steps}-p{pool}-v{RECIPE}"
    key = (str(path),)
    if key in _ENCODERS:
        return _ENCODERS[key]
    with cache_lock(path):
        if not (path / "model.safetensors").is_file():
            log(f"training the shapes guards' encoder ({image_size}px, runs once)")
            net, info = train_encoder(image_size, steps, pool)

            def write(tmp):
                save_file(net.state_dict(), str(tmp / "model.safetensors"))
                (tmp / "info.json").write_text(json.dumps(info))

            save_dir_atomic(path, write)
    net = ShapesEncoder(image_size)
    net.load_state_dict(load_file(str(path / "model.safetensors")))
    _ENCODERS[key] = net.eval().requires_grad_(False)
    return _ENCODERS[key]


@torch.no_grad()
def features(images: torch.Tensor) -> torch.Tensor:
    """Evaluation images (B, 3, S, S) in [0, 1] → (B, 64) float32 penultimate features of the encoder."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"expected images (B, 3, S, S), got shape {tuple(images.shape)}")
    return load_encoder(images.shape[-1]).features(images.float().cpu())


def reference_features(metadata: list[dict], image_size: int) -> torch.Tensor:
    """(N, 64) features of scenes rendered for the records of ``metadata`` that state constraints (``include``),
    in turn until ≥ :data:`REFERENCE_MIN` scenes, from seed :data:`REFERENCE_SEED`, grid layouts; every prompt of
    the grammar where no record states constraints. Cached per record list and size."""
    records = [m for m in metadata if (m or {}).get("include")] or task.all_prompts()
    key = (json.dumps(records, sort_keys=True, default=str), image_size, str(cache_root()))
    if key not in _REFERENCES:
        rng = np.random.default_rng(REFERENCE_SEED)
        n = -(-REFERENCE_MIN // len(records)) * len(records)
        images = torch.stack([task.render(records[i % len(records)], rng, image_size, grid=True) for i in range(n)])
        _REFERENCES[key] = features(images)
    return _REFERENCES[key]


__all__ = ["FEATURE_DIM", "LABELS", "RECIPE", "ShapesEncoder", "features", "load_encoder", "reference_features",
           "scene_pool", "targets", "train_encoder"]
