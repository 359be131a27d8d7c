"""What the model-based rewards share: a process-wide, thread-safe model cache, option parsing, batching, frames.

Models are loaded lazily on first use, under a lock (the trainer may score from a worker thread), once per
process per key (hub id or path, device, dtype); :data:`LOADS` counts the real loads per key. Images arrive as
(B, C, H, W) in [0, 1]; video as (B, C, F, H, W) is scored frame by frame and averaged over frames.
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import numpy as np
import torch

_CACHE: dict[tuple, object] = {}
_LOCK = threading.RLock()
LOADS: Counter = Counter()  # key → number of real loads (a second load of one key is a bug)


def cached(key: tuple, load: Callable[[], object]) -> object:
    """``load()`` once per process for ``key`` (lazy, under a lock); later calls return the same object."""
    obj = _CACHE.get(key)
    if obj is not None:
        return obj
    with _LOCK:
        if key not in _CACHE:
            _CACHE[key] = load()
            LOADS[key] += 1
        return _CACHE[key]


def clear_cache() -> None:
    """Forget every loaded reward model (tests; frees memory)."""
    with _LOCK:
        _CACHE.clear()
        LOADS.clear()


def default_device() -> str:
    """The device a reward uses when neither the trainer nor ``reward.options`` names one."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def per_frame(score: Callable[[torch.Tensor, list[str], list[dict]], torch.Tensor]):
    """Lift an image scorer (B, C, H, W) → (B,) to video: (B, C, F, H, W) → mean over the F frame scores."""
    def wrapped(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
        B = images.shape[0]
        metadata = list(metadata) if metadata is not None else [{} for _ in range(B)]
        if images.dim() == 4:
            return score(images, list(prompts), metadata)
        if images.dim() != 5:
            raise ValueError(f"expected images (B, C, H, W) or video (B, C, F, H, W), got shape {tuple(images.shape)}")
        F = images.shape[2]
        frames = images.permute(0, 2, 1, 3, 4).reshape(B * F, images.shape[1], *images.shape[-2:])  # (B·F, C, H, W)
        rep = lambda xs: [x for x in xs for _ in range(F)]  # noqa: E731 - sample i's value for each of its frames
        return score(frames, rep(prompts), rep(metadata)).view(B, F).mean(1)  # (B,)
    wrapped.__doc__ = score.__doc__
    return wrapped


def to_uint8_hwc(images: torch.Tensor) -> list[np.ndarray]:
    """(B, C, H, W) in [0, 1] → B RGB uint8 arrays (H, W, 3); one channel is repeated to three."""
    x = (images.detach().float().clamp(0, 1) * 255).round().to(torch.uint8).cpu()  # (B, C, H, W)
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)
    return [np.ascontiguousarray(im.permute(1, 2, 0).numpy()[..., :3]) for im in x]


def batches(n: int, size: int):
    """Index slices [lo, hi) covering range(n) in chunks of ``size``."""
    for lo in range(0, n, size):
        yield slice(lo, min(n, lo + size))


def features(out) -> torch.Tensor:
    """``get_image_features`` / ``get_text_features`` output → (B, D): a tensor (transformers 4) or the pooled,
    projected output of a model output (transformers 5)."""
    return out if torch.is_tensor(out) else out.pooler_output
