"""Image rewards. Every reward maps (images (B, C, H, W) in [0, 1], prompts, metadata) → (B,) float.

- ``digit_alignment``: probability that an independent CNN, trained on the digits *train* split (the same
  images the generator saw; its held-out accuracy is measured on the test split), assigns to the digit the
  prompt asks for. Cached like the built-in model.
- ``jpeg_compressibility`` / ``jpeg_incompressibility``: ∓ JPEG size in kB at quality 95 (FlowGRPO / DDPO).
"""
from __future__ import annotations

import io
import json

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from ..cache import cache_lock, cache_root, save_dir_atomic
from ..data import digits_split, prompt_digit
from .loading import per_frame


class DigitClassifier(nn.Module):
    """Small CNN: (B, 1, S, S) in [0, 1] → logits (B, 10)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4))
        self.fc = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(32 * 16, 64), nn.ReLU(), nn.Linear(64, 10))

    def forward(self, x):
        return self.fc(self.conv(x))


def train_classifier(image_size: int = 16, epochs: int = 25, seed: int = 0) -> tuple[DigitClassifier, float]:
    """Train on the digits train split (with shift/noise augmentation); return (model, held-out accuracy)."""
    with torch.enable_grad():  # callers may sit inside no_grad (evaluation)
        return _train_classifier(image_size, epochs, seed)


def _train_classifier(image_size: int, epochs: int, seed: int) -> tuple[DigitClassifier, float]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    (x_tr, y_tr), (x_te, y_te) = digits_split(image_size)
    clf = DigitClassifier()
    opt = torch.optim.Adam(clf.parameters(), lr=2e-3)
    for _ in range(epochs):
        clf.train()
        perm = torch.randperm(len(y_tr), generator=g)
        for i in range(0, len(perm), 64):
            idx = perm[i:i + 64]
            x = x_tr[idx]
            s = torch.randint(-1, 2, (2,), generator=g)
            x = torch.roll(x, shifts=(int(s[0]), int(s[1])), dims=(2, 3))
            x = (x + 0.05 * torch.randn(x.shape, generator=g)).clamp(0, 1)
            loss = F.cross_entropy(clf(x), y_tr[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    clf.eval()
    with torch.no_grad():
        acc = (clf(x_te).argmax(1) == y_te).float().mean().item()
    return clf, acc


_CLASSIFIERS: dict[tuple, tuple[DigitClassifier, float]] = {}


def load_classifier(image_size: int = 16, cache_dir: str = "", epochs: int = 25, log=print):
    """Cached classifier for ``image_size``: (model, held-out accuracy)."""
    from safetensors.torch import load_file, save_file

    key = (image_size, str(cache_root(cache_dir)), epochs)
    if key in _CLASSIFIERS:
        return _CLASSIFIERS[key]
    path = cache_root(cache_dir) / f"digit-classifier-{image_size}px-e{epochs}-v1"
    with cache_lock(path):
        if not (path / "model.safetensors").is_file():
            log(f"training the digit_alignment reward classifier ({image_size}px, runs once)")
            trained, acc = train_classifier(image_size, epochs)

            def write(tmp):
                save_file(trained.state_dict(), str(tmp / "model.safetensors"))
                (tmp / "info.json").write_text(json.dumps({"test_accuracy": acc}))

            save_dir_atomic(path, write)
    clf = DigitClassifier()
    clf.load_state_dict(load_file(str(path / "model.safetensors")))
    acc = json.loads((path / "info.json").read_text())["test_accuracy"]
    clf.eval()
    clf.requires_grad_(False)
    _CLASSIFIERS[key] = (clf, acc)
    return clf, acc


def digit_alignment(images: torch.Tensor, prompts: list[str], metadata: list[dict] | None = None) -> torch.Tensor:
    """P(classifier says the prompted digit). images (B, 1, S, S) in [0, 1] → (B,); NaN if no digit in prompt."""
    clf, _ = load_classifier(images.shape[-1])
    with torch.no_grad():
        p = clf(images.float().cpu()).softmax(-1)  # (B, 10)
    want = [prompt_digit(q) for q in prompts]
    out = torch.full((len(prompts),), float("nan"))
    for i, d in enumerate(want):
        if d is not None:
            out[i] = p[i, d]
    return out


def _jpeg_kb(img: torch.Tensor) -> float:
    from PIL import Image

    arr = (img.detach().float().cpu().clamp(0, 1) * 255).round().to(torch.uint8)
    arr = arr[0].numpy() if arr.shape[0] == 1 else arr.permute(1, 2, 0).numpy()
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(arr)).save(buf, format="JPEG", quality=95)
    return buf.tell() / 1000.0


@per_frame
def jpeg_compressibility(images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
    """−(JPEG size in kB): higher for simpler images (video: the mean over frames)."""
    return torch.tensor([-_jpeg_kb(im) for im in images])


@per_frame
def jpeg_incompressibility(images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
    """+(JPEG size in kB): higher for more detailed images (video: the mean over frames)."""
    return torch.tensor([_jpeg_kb(im) for im in images])
