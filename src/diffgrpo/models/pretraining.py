"""The optimiser update shared by the built-in models' pretraining loops (the tiny flow model, the tiny dLLM)."""
from __future__ import annotations

import torch
import torch.nn as nn


def pretrain_step(loss: torch.Tensor, net: nn.Module, opt, sched, bar, ema: float | None) -> float:
    """One pretraining update of a built-in model (backward, clip at 1, step, schedule) and the progress bar's
    smoothed loss. Returns the new smoothed loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
    opt.step()
    sched.step()
    ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
    bar.set_postfix(loss=f"{ema:.4f}")
    return ema


__all__ = ["pretrain_step"]
