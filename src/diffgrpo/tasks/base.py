"""What every text task shares: an instance (:class:`Example`), the seeded train/test split, the <answer> tag
reader and the :class:`Task` interface (instances, reference completion, a reward that never raises)."""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch


# ---------------------------------------------------------------------------------------------- helpers
@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str  # one reference completion (pretraining target)
    meta: dict = field(default_factory=dict, hash=False, compare=False)


def _is_test(key: str, test_fraction: float, seed: int) -> bool:
    h = int(hashlib.sha256(f"{seed}:{key}".encode()).hexdigest()[:8], 16)
    return (h / 0xFFFFFFFF) < test_fraction


_ANSWER_RE = re.compile(r"^<answer>(.*?)</answer>$", re.DOTALL)


def extract_answer(text: str) -> str | None:
    """The content of exactly one <answer>…</answer> pair spanning the whole completion (trimmed), else None."""
    m = _ANSWER_RE.match(text.strip())
    if m is None or "<answer>" in m.group(1) or "</answer>" in m.group(1):
        return None
    return m.group(1).strip()


def draw(pool: list, n: int, generator: torch.Generator) -> list:
    """``n`` instances of ``pool`` drawn uniformly with replacement from ``generator``."""
    idx = torch.randint(len(pool), (n,), generator=generator)
    return [pool[int(i)] for i in idx]


class Task:
    """Base: ``instances(split)`` lists every instance of a split; ``sample`` draws seeded examples."""

    name = ""
    prompt_length = 0
    gen_length = 0
    test_fraction = 0.2
    split_seed = 0

    def instances(self, split: str) -> list[Example]:
        raise NotImplementedError

    def sample(self, split: str, n: int, generator: torch.Generator) -> list[Example]:
        return draw(self.instances(split), n, generator)

    def example(self, prompt: str, answer: str) -> Example:
        """An instance from a prompt and its reference answer (a data file's record): the verifier's fields are
        read from them. Raises ValueError when they are not an instance of this task."""
        raise NotImplementedError

    refused: ClassVar[dict[str, float]] = {}  # the components of a completion that cannot be read (all zero)

    @property
    def max_chars(self) -> int:
        """Longest completion that is parsed at all: 64 characters per token of ``gen_length`` (the built-in
        vocabulary's longest token has 9), so that an adversarial string costs O(1) to refuse."""
        return 64 * self.gen_length

    def reward(self, completion: str, ex: Example) -> dict[str, float]:
        """→ {"reward": float, <components>: float, "correct": 0/1}. Any string is scored and nothing raises:
        a non-string or a completion longer than ``max_chars`` gets ``refused`` (reward 0)."""
        if not isinstance(completion, str) or len(completion) > self.max_chars:
            return dict(self.refused)
        return self.score(completion, ex)

    def score(self, completion: str, ex: Example) -> dict[str, float]:
        """The verifier proper, given a string of at most ``max_chars`` characters."""
        raise NotImplementedError

    def slip(self, ex: Example) -> str | None:
        """A wrong answer in the right format made by the task's systematic slip (same rule for every prompt),
        or None when the task has none. Used by ``pretrain.answer_noise`` to give the built-in base a habit
        that a verifiable reward can train away."""
        return None

    def rewards(self, completions: list[str], examples: list[Example]) -> dict[str, torch.Tensor]:
        rows = [self.reward(c, e) for c, e in zip(completions, examples)]
        return {k: torch.tensor([r[k] for r in rows], dtype=torch.float32) for k in rows[0]}
