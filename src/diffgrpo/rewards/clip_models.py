"""CLIP-class preference rewards: ``pickscore``, ``clip_score`` and ``aesthetic``.

- ``pickscore``: PickScore v1 (``yuvalkirstain/PickScore_v1``, a CLIP ViT-H/14 fine-tuned on Pick-a-Pic
  preferences, with the ``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` processor, as PickScore and FlowGRPO load it):
  ``logit_scale · cos(image, prompt) / divide_by`` (``divide_by`` = 26 as in FlowGRPO, so typical scores lie near
  0.8-0.9).
- ``clip_score``: ``cos(image, prompt)`` of ``openai/clip-vit-large-patch14`` embeddings, in [-1, 1] (CLIPScore
  without its ×100 / ×2.5 rescaling and clipping at 0).
- ``aesthetic``: the LAION improved aesthetic predictor: the L2-normalised CLIP ViT-L/14 image embedding through the
  ``sac+logos+ava1-l14-linearMSE`` MLP head (a 1-10 rating; ``camenduru/improved-aesthetic-predictor`` on the hub).
  The head is read from safetensors or with ``torch.load(weights_only=True)`` (a plain state dict), never
  unpickled.

Every score is exact (one forward of the image and text towers, no sampling); cost: one CLIP image forward per
image (per frame for video) plus one text forward per prompt, in chunks of ``batch_size``. The processor runs on
the CPU (uint8 images, as the models were trained); the towers run on ``device`` in ``dtype``; scores come back as
float32 (B,).
"""
from __future__ import annotations

import os

import torch
import torch.nn as nn

from ..types import DTYPES
from .loading import batches, cached, default_device, features, per_frame, to_uint8_hwc

PICKSCORE_MODEL = "yuvalkirstain/PickScore_v1"
PICKSCORE_PROCESSOR = "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"
CLIP_L14 = "openai/clip-vit-large-patch14"
AESTHETIC_HEAD = "camenduru/improved-aesthetic-predictor:sac+logos+ava1-l14-linearMSE.pth"


def load_clip(model: str, processor: str, device, dtype: str):
    """(processor, CLIP model in eval mode on ``device`` in ``dtype``), loaded once per process per key."""
    def load():
        from transformers import AutoModel, AutoProcessor

        proc = AutoProcessor.from_pretrained(processor)
        net = AutoModel.from_pretrained(model)
        return proc, net.eval().requires_grad_(False).to(device=device, dtype=DTYPES[dtype])

    return cached(("clip", model, processor, str(torch.device(device)), dtype), load)


def image_embeds(proc, net, images: torch.Tensor) -> torch.Tensor:
    """(n, C, H, W) in [0, 1] → unit-norm image embeddings (n, D) in float32."""
    p = next(net.parameters())
    pix = proc(images=to_uint8_hwc(images), return_tensors="pt")["pixel_values"].to(p.device, p.dtype)  # (n,3,h,w)
    e = features(net.get_image_features(pixel_values=pix)).float()  # (n, D)
    return e / e.norm(dim=-1, keepdim=True)


def text_embeds(proc, net, prompts: list[str]) -> torch.Tensor:
    """n prompts → unit-norm text embeddings (n, D) in float32 (truncated to the text tower's positions)."""
    p = next(net.parameters())
    tok = proc(text=list(prompts), padding=True, truncation=True,
               max_length=net.config.text_config.max_position_embeddings, return_tensors="pt")
    tok = {k: v.to(p.device) for k, v in tok.items() if k in ("input_ids", "attention_mask")}
    e = features(net.get_text_features(**tok)).float()  # (n, D)
    return e / e.norm(dim=-1, keepdim=True)


def pickscore(device=None, *, model: str = PICKSCORE_MODEL, processor: str = PICKSCORE_PROCESSOR,
              dtype: str = "float32", batch_size: int = 16, divide_by: float = 26.0):
    """The ``pickscore`` reward: (images, prompts, metadata) → (B,) logit_scale · cos(image, prompt) / divide_by."""
    device = device or default_device()

    @torch.no_grad()
    def score(images, prompts, metadata):
        proc, net = load_clip(model, processor, device, dtype)
        out = []
        for s in batches(len(prompts), batch_size):
            cos = (image_embeds(proc, net, images[s]) * text_embeds(proc, net, prompts[s])).sum(-1)  # (n,)
            out.append(net.logit_scale.exp().float() * cos / divide_by)
        return torch.cat(out).cpu()

    return per_frame(score)


def clip_score(device=None, *, model: str = CLIP_L14, processor: str = "", dtype: str = "float32",
               batch_size: int = 16):
    """The ``clip_score`` reward: (images, prompts, metadata) → (B,) cos(CLIP image, CLIP prompt) in [-1, 1]."""
    device = device or default_device()

    @torch.no_grad()
    def score(images, prompts, metadata):
        proc, net = load_clip(model, processor or model, device, dtype)
        out = [(image_embeds(proc, net, images[s]) * text_embeds(proc, net, prompts[s])).sum(-1)
               for s in batches(len(prompts), batch_size)]
        return torch.cat(out).cpu()

    return per_frame(score)


class AestheticHead(nn.Module):
    """The LAION improved-aesthetic-predictor MLP: unit-norm CLIP image embedding (B, D) → rating (B, 1).
    Module names match the published state dict (``layers.{0,2,4,6,7}``); dropout is inactive in eval mode."""

    def __init__(self, dim: int = 768):
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(dim, 1024), nn.Dropout(0.2), nn.Linear(1024, 128), nn.Dropout(0.2),
                                    nn.Linear(128, 64), nn.Dropout(0.1), nn.Linear(64, 16), nn.Linear(16, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def read_state_dict(spec: str) -> dict[str, torch.Tensor]:
    """A state dict from a local file or ``repo_id:filename`` on the hub: ``.safetensors`` through safetensors,
    anything else through ``torch.load(weights_only=True)`` (tensors only, no arbitrary unpickling)."""
    path = os.path.expanduser(spec)
    if not os.path.exists(path) and ":" in spec:
        from huggingface_hub import hf_hub_download

        repo, _, name = spec.partition(":")
        path = hf_hub_download(repo, name)
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return torch.load(path, map_location="cpu", weights_only=True)


def load_aesthetic_head(spec: str, device, dtype: str) -> AestheticHead:
    """The aesthetic MLP from ``spec`` (see :func:`read_state_dict`), once per process per key."""
    def load():
        state = read_state_dict(spec)
        head = AestheticHead(state["layers.0.weight"].shape[1])
        head.load_state_dict(state)
        return head.eval().requires_grad_(False).to(device=device, dtype=DTYPES[dtype])

    return cached(("aesthetic_head", spec, str(torch.device(device)), dtype), load)


def aesthetic(device=None, *, model: str = CLIP_L14, processor: str = "", head: str = AESTHETIC_HEAD,
              dtype: str = "float32", batch_size: int = 16):
    """The ``aesthetic`` reward: (images, prompts, metadata) → (B,) LAION aesthetic rating (about 1-10)."""
    device = device or default_device()

    @torch.no_grad()
    def score(images, prompts, metadata):
        proc, net = load_clip(model, processor or model, device, dtype)
        mlp = load_aesthetic_head(head, device, dtype)
        out = []
        for s in batches(len(images), batch_size):
            e = image_embeds(proc, net, images[s])  # (n, D) unit norm, float32
            out.append(mlp(e.to(next(mlp.parameters()).dtype))[:, 0].float())  # (n,)
        return torch.cat(out).cpu()

    return per_frame(score)
