"""Where a diffusers policy's parts live and in which dtype: the text encoders' offload to the CPU, the dtype its
transformer's inputs take, and the fp16 loss scale applied to the gradient reaching the transformer's output."""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class TextEncoderOffload:
    """Where the text encoders live. ``offload`` True: on ``home`` (the CPU) except inside :meth:`active`, which
    moves them to the compute ``device`` for one encoding and back. ``location`` is "home" or "device"; ``moves``
    records every change of it as (location, bytes moved), also where both are the CPU (so the logic is testable
    without an accelerator). ``offload`` False: they stay on ``device``."""

    def __init__(self, modules: list[nn.Module], device: torch.device, offload: bool, home: str = "cpu"):
        self.modules = [m for m in modules if m is not None]
        self.device, self.offload, self.home = torch.device(device), bool(offload), torch.device(home)
        self.moves: list[tuple[str, int]] = []
        self.location = ""
        self._move("home" if self.offload else "device")

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.modules for p in m.parameters())

    def _move(self, where: str) -> None:
        if where == self.location:
            return
        for m in self.modules:
            m.to(self.home if where == "home" else self.device)
        if self.location:  # the initial placement is not a move
            self.moves.append((where, self.nbytes()))
        self.location = where

    @contextlib.contextmanager
    def active(self):
        """The encoders on the compute device inside the block; back on ``home`` after it when offloading."""
        self._move("device")
        try:
            yield
        finally:
            if self.offload:
                self._move("home")


class ScaleGrad(torch.autograd.Function):
    """Identity in the forward; multiplies the incoming gradient by ``scale`` (a 0-d tensor) in the backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.save_for_backward(scale)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        (scale,) = ctx.saved_tensors
        return g * scale.to(g.dtype), None


TEXT_ENCODER_NAMES = ("text_encoder", "text_encoder_2", "text_encoder_3")


def weight_dtype(module: nn.Module) -> torch.dtype:
    """The dtype holding most of ``module``'s floating-point weights: the one its inputs must have. Not the first
    parameter's: diffusers keeps some small modules in float32 in a bf16 model (Wan's ``scale_shift_table``, its
    time embedder and norms: ``_keep_in_fp32_modules``)."""
    count: dict[torch.dtype, int] = {}
    for p in module.parameters():
        if p.is_floating_point():
            count[p.dtype] = count.get(p.dtype, 0) + p.numel()
    return max(count, key=count.get) if count else torch.float32


__all__ = ["ScaleGrad", "TEXT_ENCODER_NAMES", "TextEncoderOffload", "weight_dtype"]
