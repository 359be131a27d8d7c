"""PickScore as a user reward for ``diffgrpo`` (``reward.weights={pickscore_reward:pickscore: 1.0}``).

Run with this directory on the import path, e.g. ``PYTHONPATH=examples diffgrpo train --config ...``.
Weights come from the Hugging Face Hub on first use (``yuvalkirstain/PickScore_v1`` with the
``laion/CLIP-ViT-H-14-laion2B-s32B-b79K`` processor), or from local directories given by the environment
variables ``PICKSCORE_MODEL`` / ``PICKSCORE_PROCESSOR``. Scores are divided by 26, as in FlowGRPO, so that a
typical reward lies around 0.8-0.9. Video batches (B, 3, F, H, W) are scored frame by frame and averaged.
"""
from __future__ import annotations

import os

import torch

_MODEL = {}


def _load(device):
    if device not in _MODEL:
        from transformers import AutoModel, AutoProcessor

        proc = AutoProcessor.from_pretrained(os.environ.get("PICKSCORE_PROCESSOR",
                                                            "laion/CLIP-ViT-H-14-laion2B-s32B-b79K"))
        model = AutoModel.from_pretrained(os.environ.get("PICKSCORE_MODEL", "yuvalkirstain/PickScore_v1"))
        _MODEL[device] = (proc, model.eval().requires_grad_(False).to(device))
    return _MODEL[device]


@torch.no_grad()
def pickscore(images: torch.Tensor, prompts: list[str], metadata=None) -> torch.Tensor:
    """images (B, 3, H, W) or (B, 3, F, H, W) in [0, 1] → (B,) PickScore / 26."""
    if images.dim() == 5:  # video: mean over frames
        B, C, Fr = images.shape[:3]
        frames = images.permute(0, 2, 1, 3, 4).reshape(B * Fr, C, *images.shape[-2:])
        return pickscore(frames, [p for p in prompts for _ in range(Fr)]).view(B, Fr).mean(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    proc, model = _load(device)
    pil = [(im.float().clamp(0, 1) * 255).round().byte().permute(1, 2, 0).cpu().numpy() for im in images]
    img_in = proc(images=pil, return_tensors="pt").to(device)
    txt_in = proc(text=list(prompts), padding=True, truncation=True, max_length=77, return_tensors="pt").to(device)
    img, txt = model.get_image_features(**img_in), model.get_text_features(**txt_in)
    img = getattr(img, "pooler_output", img)  # transformers >= 5 returns a model output
    txt = getattr(txt, "pooler_output", txt)
    img = img / img.norm(dim=-1, keepdim=True)
    txt = txt / txt.norm(dim=-1, keepdim=True)
    return (model.logit_scale.exp() * (img * txt).sum(-1) / 26.0).float().cpu()
