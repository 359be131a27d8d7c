"""What a diversity objective hands the GRPO loss weights: a reward bonus, a training subset, an advantage map, and
its statistics; and how several of them compose. A part never runs a network and never touches the engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class Part:
    """One objective's effect on a scored batch of B samples (any field None: no effect of that kind)."""

    bonus: torch.Tensor | None = None  # (B,) added to the rewards the advantages are formed from
    subset: torch.Tensor | None = None  # (B,) bool: samples that enter the group statistics and the loss
    adjust: Callable[[torch.Tensor], torch.Tensor] | None = None  # advantages (B,) → (B,)
    stats: dict[str, float] = field(default_factory=dict)  # logged as diversity/<name>


def compose(parts: list[Part]) -> Part:
    """Bonuses add, subsets intersect, advantage maps apply in the order given, statistics merge."""
    bonus = subset = None
    maps = [p.adjust for p in parts if p.adjust is not None]
    stats: dict[str, float] = {}
    for p in parts:
        if p.bonus is not None:
            bonus = p.bonus if bonus is None else bonus + p.bonus
        if p.subset is not None:
            subset = p.subset if subset is None else subset & p.subset
        stats.update(p.stats)

    def adjust(adv: torch.Tensor) -> torch.Tensor:
        for f in maps:
            adv = f(adv)
        return adv

    return Part(bonus=bonus, subset=subset, adjust=adjust if maps else None, stats=stats)


def parse_methods(text: str, known: tuple[str, ...]) -> tuple[str, ...]:
    """``diversity.method`` (one name, or several comma-separated; ``off`` alone for none) → the methods in order.
    Raises ValueError naming an unknown one or ``off`` beside a method."""
    names = tuple(n.strip() for n in str(text).split(",") if n.strip())
    if names in ((), ("off",)):
        return ()
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown method {bad[0]!r}; choose off or any of {list(known)} (a list for several)")
    if len(set(names)) != len(names):
        raise ValueError(f"a method is named twice in {list(names)}")
    return names
