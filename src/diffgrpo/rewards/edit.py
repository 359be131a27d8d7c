"""Rewards of image edits, which score the result against its source (``metadata["source_images"]``).

``clip_direction``: the directional CLIP similarity of an edit (StyleGAN-NADA, InstructPix2Pix's metric),
cos(E_img(result) − E_img(source), E_txt(instruction) − E_txt("")), with unit-norm CLIP embeddings E; in [-1, 1],
high when the image moved the way the instruction moves the text. Exact (no sampling); cost: two image forwards
per sample (result and its first source) and one text forward per prompt plus one for "", in chunks of
``batch_size``. A sample without a source scores NaN (excluded from its group's statistics and the loss).
"""
from __future__ import annotations

import torch

from ..sources import REWARD_FIELD
from .clip_models import CLIP_L14, image_embeds, load_clip, text_embeds
from .loading import batches, default_device


def direction_cosine(img: torch.Tensor, src: torch.Tensor, txt: torch.Tensor, empty: torch.Tensor) -> torch.Tensor:
    """Unit embeddings img, src (n, D), txt (n, D), empty (D,) → (n,) cos(img − src, txt − empty)."""
    d_img, d_txt = img - src, txt - empty[None]
    return torch.nn.functional.cosine_similarity(d_img, d_txt, dim=-1, eps=1e-12)


def clip_direction(device=None, *, model: str = CLIP_L14, processor: str = "", dtype: str = "float32",
                   batch_size: int = 16):
    """The ``clip_direction`` reward: (images, prompts, metadata with source_images) → (B,) (see the module doc)."""
    device = device or default_device()

    @torch.no_grad()
    def score(images, prompts, metadata):
        proc, net = load_clip(model, processor or model, device, dtype)
        metadata = list(metadata) if metadata is not None else [{} for _ in prompts]
        out = torch.full((len(prompts),), float("nan"))
        have = [i for i, m in enumerate(metadata) if m.get(REWARD_FIELD)]
        if not have:
            return out
        empty = text_embeds(proc, net, [""])[0]
        for s in batches(len(have), batch_size):
            rows = have[s]
            img = image_embeds(proc, net, images[rows])
            src = torch.cat([image_embeds(proc, net, metadata[i][REWARD_FIELD][0][None].to(images.device))
                             for i in rows])  # sources may differ in size from the results and from each other
            txt = text_embeds(proc, net, [prompts[i] for i in rows])
            out[rows] = direction_cosine(img, src, txt, empty).cpu()
        return out

    return score


__all__ = ["clip_direction", "direction_cosine"]
