"""Latent layouts shared by the diffusers families: FLUX / Qwen-Image 2×2 token packing and FLUX rotary ids.

Exact reshapes (no arithmetic); ``unpack_2x2`` inverts ``pack_2x2``.
"""
from __future__ import annotations

import torch


def pack_2x2(x: torch.Tensor) -> torch.Tensor:
    """(B, C, H, W) → (B, H/2·W/2, 4C), the FLUX / Qwen-Image token layout."""
    B, C, H, W = x.shape
    return x.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // 2) * (W // 2), C * 4)


def unpack_2x2(t: torch.Tensor, C: int, H: int, W: int) -> torch.Tensor:
    """(B, H/2·W/2, 4C) → (B, C, H, W); the inverse of :func:`pack_2x2`."""
    B = t.shape[0]
    return t.view(B, H // 2, W // 2, C, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(B, C, H, W)


def flux_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """FLUX rotary position ids of the packed image tokens: (h·w, 3) with (0, row, col)."""
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(h * w, 3).to(device=device, dtype=dtype)


__all__ = ["flux_image_ids", "pack_2x2", "unpack_2x2"]
