"""Exponential moving average of the trainable parameters (FlowGRPO keeps one for evaluation samples).

After each optimizer update: ema ← decay·ema + (1 − decay)·θ. ``swapped_in()`` temporarily loads the EMA
weights into the parameters (e.g. for evaluation) and restores the live weights afterwards.
"""
from __future__ import annotations

import contextlib

import torch

from . import distributed


@contextlib.contextmanager
def swapped(params: list[torch.Tensor], values: list[torch.Tensor], module=None):
    """Inside the block ``params`` hold ``values`` (copied in place; the live values are restored after, also on an
    error). ``module`` (FSDP2) is resharded after each copy so that its forwards gather the swapped values. The one
    parameter swap: EMA weights for evaluation, NFT's θ_old for sampling."""
    with torch.no_grad():
        live = [p.detach().clone() for p in params]
        for p, v in zip(params, values):
            p.copy_(v)
    distributed.reshard(module)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, v in zip(params, live):
                p.copy_(v)
        distributed.reshard(module)


class EMA:
    def __init__(self, named_params: dict[str, torch.nn.Parameter], decay: float):
        if not 0.0 < decay < 1.0:
            raise ValueError(f"train.ema_decay must be in (0, 1), got {decay}")
        self.decay = decay
        self.params = named_params
        self.shadow = {n: p.detach().clone() for n, p in named_params.items()}

    @torch.no_grad()
    def update(self) -> None:
        for n, p in self.params.items():
            self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)

    def swapped_in(self) -> contextlib.AbstractContextManager:
        """The EMA weights in the parameters for the block (:func:`swapped`)."""
        return swapped(list(self.params.values()), [self.shadow[n] for n in self.params])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t.clone() for n, t in self.shadow.items()}

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        missing = set(self.shadow) - set(sd)
        if missing:
            raise KeyError(f"EMA state lacks {sorted(missing)[:3]}…")
        for n in self.shadow:
            self.shadow[n].copy_(sd[n])
