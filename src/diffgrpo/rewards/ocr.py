"""The ``ocr`` reward: how well the text rendered in an image matches the text the prompt asks for (FlowGRPO).

reward = 1 − min(d(recognised, target) / len(target), 1), with d the Levenshtein edit distance on normalised text
(lower case, whitespace removed) and d = 0 when the target occurs inside the recognised text (extra text is not
penalised, as in FlowGRPO). The target is the sample's metadata key ``text``, else the first double-quoted span
of the prompt (``A sign that says "OPEN"`` → ``OPEN``); a sample with neither scores NaN (excluded from the
group statistics). Recognised text is every box the engine reads, in its reading order, joined.

Engine: RapidOCR (``rapidocr-onnxruntime``: PP-OCRv4 detection and recognition as ONNX files inside the pip
package, so nothing is downloaded), on the CPU by onnxruntime, one image at a time; cost ≈ 0.1-1 s per image on
one CPU core depending on the text area. Exact given the engine's reading (deterministic).
"""
from __future__ import annotations

import re

import numpy as np
import torch

from .loading import cached, per_frame, to_uint8_hwc

_QUOTED = re.compile(r'"([^"]+)"|“([^”]+)”')


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (unit insert, delete, substitute) by the two-row dynamic programme, O(len a · len b)."""
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalise(text: str) -> str:
    """Lower case, whitespace removed (FlowGRPO's normalisation)."""
    return "".join(text.split()).lower()


def ocr_score(recognised: str, target: str) -> float:
    """1 − min(edit_distance / len(target), 1) on normalised text; 1 when the target occurs in the recognised text;
    NaN for an empty target."""
    r, t = normalise(recognised), normalise(target)
    if not t:
        return float("nan")
    d = 0 if t in r else edit_distance(r, t)
    return 1.0 - min(d / len(t), 1.0)


def target_text(prompt: str, metadata: dict | None) -> str | None:
    """The text a sample should show: metadata ``text``, else the prompt's first quoted span, else None."""
    if metadata and isinstance(metadata.get("text"), str) and metadata["text"].strip():
        return metadata["text"]
    m = _QUOTED.search(prompt)
    return (m.group(1) or m.group(2)) if m else None


def load_engine(det_limit_side_len: int = 736):
    """The RapidOCR engine (bundled ONNX models), once per process per setting. The detector rescales each image
    so that its shorter side is at least ``det_limit_side_len`` pixels (RapidOCR's default 736; smaller is faster
    for large, clear text)."""
    def load():
        from rapidocr_onnxruntime import RapidOCR

        return RapidOCR(det_limit_side_len=det_limit_side_len)

    return cached(("ocr", "rapidocr_onnxruntime", det_limit_side_len), load)


def recognise(engine, image: np.ndarray, min_confidence: float = 0.0) -> str:
    """RGB uint8 (H, W, 3) → the text of every box RapidOCR keeps (its own recognition threshold is 0.5) with
    confidence > ``min_confidence``, in reading order, joined by spaces."""
    result, _ = engine(np.ascontiguousarray(image[..., ::-1]))  # RapidOCR reads arrays as OpenCV BGR
    return " ".join(text for _, text, conf in (result or []) if float(conf) > min_confidence)


def ocr(device=None, *, min_confidence: float = 0.0, det_limit_side_len: int = 736):
    """The ``ocr`` reward: (images, prompts, metadata) → (B,) in [0, 1] (NaN where a sample has no target)."""
    def score(images, prompts, metadata):
        targets = [target_text(p, m) for p, m in zip(prompts, metadata)]
        out = torch.full((len(prompts),), float("nan"))
        if all(t is None for t in targets):
            return out
        engine = load_engine(det_limit_side_len)
        for i, (arr, t) in enumerate(zip(to_uint8_hwc(images), targets)):
            if t is not None:
                out[i] = ocr_score(recognise(engine, arr, min_confidence), t)
        return out

    return per_frame(score)
