"""What the built-in models' pretraining shares: the optimiser update of their loops (the tiny flow models, the
tiny dLLM) and the cached-weights step of the image and video models (pretrain once, write atomically, load)."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

from ..cache import cache_lock, save_dir_atomic


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


def load_or_train(path: Path, net: nn.Module, train: Callable[[], nn.Module], meta: dict, *, what: str,
                  steps: int, log=print) -> nn.Module:
    """``net`` (eval mode) with the weights cached at ``path``; when absent, ``train()`` makes them once (under the
    cache's lock, so concurrent runs and torchrun ranks share one pretraining), written atomically beside
    ``config.json`` = ``meta``."""
    from safetensors.torch import load_file, save_file

    with cache_lock(path):
        if not (path / "model.safetensors").is_file():
            log(f"no cached {what} at {path}; pretraining it ({steps} steps, runs once)")
            trained = train()

            def write(tmp: Path):
                save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(tmp / "model.safetensors"))
                (tmp / "config.json").write_text(json.dumps(meta, indent=2))

            save_dir_atomic(path, write)
    net.load_state_dict(load_file(str(path / "model.safetensors")))
    return net.eval()


__all__ = ["load_or_train", "pretrain_step"]
