"""Local data: scikit-learn's handwritten digits (shipped with the package, nothing is downloaded), and the
prompts of the built-in image tasks (``train.task``: digits, shapes, shapes_video) given without a prompt file.

1,797 8×8 images with 17 grey levels, upsampled bilinearly to the requested size. The split is fixed
(seeded permutation) so the reward classifier's held-out accuracy is measured on images neither it nor the
generator saw in training.
"""
from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from .tasks import shapes, shapes_video

NUMBER_WORDS = ("zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")
_DIGIT_RE = re.compile(r"\b(\d)\b")


def digits_split(image_size: int = 16, test_fraction: float = 0.2, seed: int = 0):
    """Return ((x_train, y_train), (x_test, y_test)); x (N, 1, S, S) float32 in [0, 1], y (N,) long."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N, 1, 8, 8)
    if image_size != 8:
        x = F.interpolate(x, size=(image_size, image_size), mode="bilinear", align_corners=False).clamp(0, 1)
    y = torch.tensor(d.target, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(y), generator=g)
    n_test = int(round(len(y) * test_fraction))
    te, tr = perm[:n_test], perm[n_test:]
    return (x[tr], y[tr]), (x[te], y[te])


def digit_prompt(d: int) -> str:
    return f"a handwritten digit {d}"


def prompt_digit(prompt: str) -> int | None:
    """The digit a prompt asks for ("a handwritten digit 7", "the number seven"), or None."""
    m = _DIGIT_RE.search(prompt)
    if m:
        return int(m.group(1))
    for i, w in enumerate(NUMBER_WORDS):
        if re.search(rf"\b{w}\b", prompt.lower()):
            return i
    return None


def task_metadata(prompt: str, task: str = "digits") -> dict:
    """What the rewards receive for a prompt given without metadata: the digit it names (or None), and for
    ``train.task=shapes`` the constraints its text states (``tag``, ``include``; nothing when it is not a prompt
    of the shapes grammar)."""
    meta = {"digit": prompt_digit(prompt)}
    if task in ("shapes", "shapes_video"):
        meta.update((shapes if task == "shapes" else shapes_video).parse(prompt) or {})
    return meta


def default_prompts(task: str = "digits") -> list[str]:
    """The prompts a command samples when given none: the ten digit prompts, or (shapes) the first held-out prompt
    of each GenEval category."""
    if task in ("shapes", "shapes_video"):
        mod = shapes if task == "shapes" else shapes_video
        return [mod.prompts("test", (tag,))[0]["prompt"] for tag in mod.CATEGORIES]
    return [digit_prompt(d) for d in range(10)]
