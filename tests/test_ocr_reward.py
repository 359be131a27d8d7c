"""The ``ocr`` reward: its scoring rule on hand-computed cases, and a real RapidOCR run on text rendered with Pillow
(the engine's ONNX models ship inside the pip package; nothing is downloaded)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffgrpo.rewards import compute_rewards, make_rewards
from diffgrpo.rewards.ocr import edit_distance, ocr_score, target_text


def test_edit_distance_on_hand_computed_pairs():
    cases = {("kitten", "sitting"): 3, ("flaw", "lawn"): 2, ("", "abc"): 3, ("abc", ""): 3, ("abc", "abc"): 0,
             ("hell0w0rld", "helloworld"): 2, ("ab", "ba"): 2, ("a", "b"): 1}
    for (a, b), d in cases.items():
        assert edit_distance(a, b) == d == edit_distance(b, a), (a, b)


def test_ocr_score_rule():
    assert ocr_score("HELL0 W0RLD", "hello world") == pytest.approx(1 - 2 / 10)  # whitespace and case ignored
    assert ocr_score("Open 24 hours", "OPEN 24 HOURS") == 1.0
    assert ocr_score("big sale: open now", "open") == 1.0  # the target inside longer text: distance 0 (FlowGRPO)
    assert ocr_score("", "open") == 0.0  # nothing read: distance 4 = len → 0
    assert ocr_score("completely different text", "ab") == 0.0  # clipped at 0
    assert ocr_score("opn", "open") == pytest.approx(0.75)
    assert math.isnan(ocr_score("anything", "  "))


def test_target_text_prefers_metadata_then_the_quoted_prompt_text():
    assert target_text('a sign that says "OPEN"', {"text": "CLOSED"}) == "CLOSED"
    assert target_text('a sign that says "OPEN" and "SHUT"', {}) == "OPEN"
    assert target_text("a neon sign reading “Café 24”", None) == "Café 24"
    assert target_text("a cat", {"text": ""}) is None


def _render(text: str, w: int = 320, h: int = 96, size: int = 40) -> torch.Tensor:
    """Black text on white, rendered by Pillow → (3, h, w) in [0, 1]."""
    from PIL import Image, ImageDraw, ImageFont

    im = Image.new("RGB", (w, h), "white")
    ImageDraw.Draw(im).text((12, 24), text, fill="black", font=ImageFont.load_default(size=size))
    return torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255


def test_real_ocr_reads_rendered_text():
    pytest.importorskip("rapidocr_onnxruntime")
    images = torch.stack([_render("OPEN 24 HOURS"), _render("HELLO WORLD"), _render("diffusion"),
                          torch.ones(3, 96, 320)])  # (4, 3, 96, 320); the last is blank
    fn = make_rewards({"ocr": 1.0}, {"ocr": {"det_limit_side_len": 96}}, "cpu")["ocr"]
    right = fn(images, ["a", "b", "c", "d"], [{"text": "OPEN 24 HOURS"}, {"text": "hello world"},
                                              {"text": "diffusion"}, {"text": "blank"}])
    wrong = fn(images, ['a sign that says "CLOSED"', 'a sign that says "HELLO WORD"', "c", "d"],
               [{}, {}, {"text": "difusion models"}, {}])
    # measured: right = [1, 1, 1, 0] (every rendered string read exactly, nothing read on the blank image)
    assert right[:3].tolist() == [1.0, 1.0, 1.0] and right[3] == 0.0
    # measured: wrong = [0, 8/9, 0.5, NaN]: "open24hours" is 10 edits from "closed" (> its 6 letters: clipped to 0);
    # "helloworld" is one deletion from the target "helloword"; "diffusion" is 7 edits from "difusionmodels" (14)
    assert wrong[0] == 0.0 and wrong[1] == pytest.approx(1 - 1 / 9) and wrong[2] == pytest.approx(0.5)
    assert math.isnan(wrong[3])  # no metadata text and no quoted text: excluded, not scored


def test_ocr_through_compute_rewards_and_on_video():
    pytest.importorskip("rapidocr_onnxruntime")
    frames = torch.stack([_render("STOP"), torch.ones(3, 96, 320)], 1)  # (3, F=2, 96, 320): text, then blank
    video = frames[None]  # (1, 3, 2, 96, 320)
    fns = make_rewards({"ocr": 1.0}, {"ocr": {"det_limit_side_len": 96}}, "cpu")
    total, comps = compute_rewards({"ocr": 2.0}, video, ['a road sign saying "STOP"'], [{}], rewards=fns)
    assert comps["ocr"].tolist() == [0.5]  # mean over frames of 1 (read) and 0 (blank)
    assert total.tolist() == [1.0]
