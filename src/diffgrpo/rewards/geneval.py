"""The ``geneval`` reward: GenEval-style compositional checks (objects, counts, colours, positions) with partial credit.

Metadata is GenEval's own format, per sample::

    {"tag": "counting", "include": [{"class": "cat", "count": 2, "color": "red"},
                                    {"class": "dog", "count": 1, "position": ["left of", 0]}],
     "exclude": [{"class": "cat", "count": 3}]}

``position`` = [relation, index of the include entry it is relative to]; relations "left of", "right of",
"above", "below" as GenEval computes them (box centres, offsets shrunk by 0.1 × the summed box sizes).

Detections: a zero-shot detector from transformers (OWLv2 ``google/owlv2-base-patch16-ensemble`` by default, any
``AutoModelForZeroShotObjectDetection`` works) queried with "a photo of a {class}" for every class the metadata
names; boxes above ``threshold``, class-wise NMS at IoU ``nms_iou``, at most 16 per class, by confidence.
Colour: CLIP zero-shot (``openai/clip-vit-large-patch14``) on each box crop over GenEval's ten colours with the
prompt "a photo of a {color} {class}" (GenEval also masks the background with the segmentation mask; a detector
gives boxes only). Differences from GenEval (Mask2Former, thresholds 0.3 / 0.9 for counting): the detector and
its threshold, so absolute numbers are not comparable with published GenEval scores.

Scoring (:func:`geneval_score`, pure): the mean of these credits, each in [0, 1]:

- per include entry, count: min(n_found, count) / count;
- per include entry with a colour: (# of its top-``count`` objects classified as that colour, at most count) / count;
- per include entry with a position: the share of (object, target object) pairs in the relation, 0 when the
  target entry is not matched (GenEval: matched = enough objects of the right colour);
- per exclude entry: 1 if fewer than ``count`` objects of the class are found, else 0.

The mean is 1 exactly when GenEval's strict rule calls the image correct; ``strict=True`` returns that 0/1 instead
(FlowGRPO's GenEval reward likewise gives partial credit for training and reports the strict accuracy).
Cost: one detector forward per image (per frame for video) and one CLIP forward per coloured crop.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..types import DTYPES
from .clip_models import image_embeds, load_clip, text_embeds
from .loading import batches, cached, default_device, per_frame, to_uint8_hwc

COLORS = ("red", "orange", "yellow", "green", "blue", "purple", "pink", "brown", "black", "white")
RELATIONS = ("left of", "right of", "above", "below")
POSITION_THRESHOLD = 0.1
MAX_OBJECTS = 16
OWLV2 = "google/owlv2-base-patch16-ensemble"


@dataclass
class Detection:
    """One detected object: box (x0, y0, x1, y1) in pixels, detector confidence, colour (when classified)."""
    box: tuple[float, float, float, float]
    score: float
    color: str | None = None


def relative_position(a: tuple, b: tuple) -> set[str]:
    """GenEval's relations of box ``a`` relative to box ``b`` (image y grows downwards)."""
    boxes = np.array([a, b], dtype=np.float64).reshape(2, 2, 2)  # (object, corner, xy)
    center_a, center_b = boxes.mean(axis=-2)
    dim_a, dim_b = np.abs(np.diff(boxes, axis=-2))[..., 0, :]
    offset = center_a - center_b
    revised = np.maximum(np.abs(offset) - POSITION_THRESHOLD * (dim_a + dim_b), 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    rel = set()
    if dx < -0.5:
        rel.add("left of")
    if dx > 0.5:
        rel.add("right of")
    if dy < -0.5:
        rel.add("above")
    if dy > 0.5:
        rel.add("below")
    return rel


def geneval_score(objects: dict[str, list[Detection]], metadata: dict) -> tuple[float, bool]:
    """Detections per class (best first) and GenEval metadata → (partial-credit score in [0, 1], strict correct)."""
    credits: list[float] = []
    matched: list[list[Detection] | None] = []
    for req in metadata.get("include", []):
        count = int(req.get("count", 1))
        found = objects.get(req["class"], [])[:count]
        credits.append(min(len(found), count) / count)
        ok = len(found) >= count
        if "color" in req:
            hits = sum(d.color == req["color"] for d in found)
            credits.append(min(hits, count) / count)
            ok = ok and hits >= count
        if "position" in req:
            rel, target = req["position"][0], int(req["position"][1])
            others = matched[target] if target < len(matched) else None
            if not ok or not others:
                credits.append(0.0)
                ok = False
            else:
                pairs = [rel in relative_position(d.box, o.box) for d in found for o in others]
                credits.append(sum(pairs) / len(pairs))
                ok = all(pairs)
        matched.append(found if ok else None)
    for req in metadata.get("exclude", []):
        credits.append(float(len(objects.get(req["class"], [])) < int(req.get("count", 1))))
    if not credits:
        return float("nan"), False
    score = sum(credits) / len(credits)
    return score, score == 1.0


def nms(boxes: torch.Tensor, scores: torch.Tensor, iou: float) -> list[int]:
    """Greedy non-maximum suppression: boxes (n, 4) x0y0x1y1, scores (n,) → kept indices, best first."""
    order = scores.argsort(descending=True).tolist()
    area = (boxes[:, 2] - boxes[:, 0]).clamp(min=0) * (boxes[:, 3] - boxes[:, 1]).clamp(min=0)  # (n,)
    keep: list[int] = []
    for i in order:
        if keep:
            k = torch.tensor(keep)
            lt = torch.maximum(boxes[k, :2], boxes[i, :2])  # (m, 2)
            rb = torch.minimum(boxes[k, 2:], boxes[i, 2:])  # (m, 2)
            inter = (rb - lt).clamp(min=0).prod(-1)  # (m,)
            if bool((inter / (area[k] + area[i] - inter).clamp(min=1e-9) > iou).any()):
                continue
        keep.append(i)
    return keep


def _classes(meta: dict) -> list[str]:
    names = [r["class"] for r in meta.get("include", []) + meta.get("exclude", [])]
    return list(dict.fromkeys(names))


def load_detector(model: str, device, dtype: str):
    """(processor, zero-shot detector in eval mode), once per process per key."""
    def load():
        from transformers import AutoModelForZeroShotObjectDetection, AutoProcessor

        proc = AutoProcessor.from_pretrained(model)
        net = AutoModelForZeroShotObjectDetection.from_pretrained(model)
        return proc, net.eval().requires_grad_(False).to(device=device, dtype=DTYPES[dtype])

    return cached(("detector", model, str(torch.device(device)), dtype), load)


@torch.no_grad()
def detect(proc, net, image: np.ndarray, classes: list[str], threshold: float, nms_iou: float
           ) -> dict[str, list[Detection]]:
    """RGB uint8 (H, W, 3) → {class: detections above ``threshold`` after class-wise NMS, best first}."""
    H, W = image.shape[:2]
    p = next(net.parameters())
    inputs = proc(text=[[f"a photo of a {c}" for c in classes]], images=[image], return_tensors="pt")
    inputs = {k: v.to(p.device, p.dtype if v.is_floating_point() else v.dtype) for k, v in inputs.items()}
    out = net(**inputs)
    # the image processor's own post-processing: best query per box, sigmoid score, boxes in pixels of the input
    # (OWLv2 pads to a square before resizing; its processor scales by the longer side)
    det = proc.image_processor.post_process_object_detection(out, threshold=threshold, target_sizes=[(H, W)])[0]
    score, label = det["scores"].float().cpu(), det["labels"].cpu()  # (m,), (m,)
    boxes = det["boxes"].float().cpu()  # (m, 4) x0 y0 x1 y1
    objects: dict[str, list[Detection]] = {}
    for j, name in enumerate(classes):
        idx = (label == j).nonzero()[:, 0]  # (k,)
        kept = [int(idx[i]) for i in nms(boxes[idx], score[idx], nms_iou)] if len(idx) else []
        objects[name] = [Detection(tuple(float(v) for v in boxes[i]), float(score[i])) for i in kept[:MAX_OBJECTS]]
    return objects


@torch.no_grad()
def classify_colors(clip, image: np.ndarray, classname: str, dets: list[Detection], batch_size: int) -> None:
    """Set ``color`` of each detection to CLIP's zero-shot choice among :data:`COLORS` on its box crop."""
    if not dets:
        return
    proc, net = clip
    H, W = image.shape[:2]
    crops = []
    for d in dets:
        x0, y0, x1, y1 = (int(round(v)) for v in d.box)
        x0, y0 = min(max(x0, 0), W - 1), min(max(y0, 0), H - 1)
        x1, y1 = max(min(x1, W), x0 + 1), max(min(y1, H), y0 + 1)
        crop = torch.from_numpy(image[y0:y1, x0:x1]).permute(2, 0, 1).float() / 255  # (3, h, w)
        crops.append(torch.nn.functional.interpolate(crop[None], size=(H, W), mode="bilinear")[0])
    text = text_embeds(proc, net, [f"a photo of a {c} {classname}" for c in COLORS])  # (10, D)
    for s in batches(len(crops), batch_size):
        img = image_embeds(proc, net, torch.stack(crops[s]))  # (n, D)
        for d, k in zip(dets[s], (img @ text.T).argmax(-1).tolist()):
            d.color = COLORS[k]


def geneval(device=None, *, detector: str = OWLV2, clip: str = "openai/clip-vit-large-patch14", dtype: str = "float32",
            batch_size: int = 16, threshold: float = 0.1, nms_iou: float = 0.5, strict: bool = False):
    """The ``geneval`` reward: (images, prompts, metadata) → (B,) partial credit in [0, 1] (0/1 with ``strict``);
    NaN for a sample whose metadata names no object."""
    device = device or default_device()

    def score(images, prompts, metadata):
        out = torch.full((len(prompts),), float("nan"))
        for i, (arr, meta) in enumerate(zip(to_uint8_hwc(images), metadata)):
            classes = _classes(meta or {})
            if not classes:
                continue
            objects = detect(*load_detector(detector, device, dtype), arr, classes, threshold, nms_iou)
            for req in meta.get("include", []):
                if "color" in req:
                    top = objects.get(req["class"], [])[:int(req.get("count", 1))]
                    classify_colors(load_clip(clip, clip, device, dtype), arr, req["class"],
                                    [d for d in top if d.color is None], batch_size)
            s, ok = geneval_score(objects, meta)
            out[i] = float(ok) if strict else s
        return out

    return per_frame(score)
