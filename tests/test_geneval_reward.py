"""The ``geneval`` reward: its scoring rule on synthetic detections against hand-computed values, GenEval's
relative positions, NMS, and the detector path on a tiny random OWL-ViT saved here (plumbing only: a random
detector's boxes mean nothing)."""
from __future__ import annotations

import math

import pytest
import torch

from diffgrpo.rewards import make_rewards
from diffgrpo.rewards.geneval import (
    Detection,
    detect,
    geneval_score,
    load_detector,
    nms,
    relative_position,
)
from diffgrpo.rewards.loading import LOADS, clear_cache, to_uint8_hwc
from tests.helpers.rewards import save_tiny_clip, save_tiny_owlvit

COUNT_2_CATS = {"tag": "counting", "include": [{"class": "cat", "count": 2}], "exclude": [{"class": "cat", "count": 3}]}
DOG_THEN_CAT_LEFT = {"tag": "position", "include": [{"class": "dog", "count": 1},
                                                    {"class": "cat", "count": 1, "position": ["left of", 0]}]}


def _d(box=(0, 0, 10, 10), color=None, score=0.9) -> Detection:
    return Detection(tuple(float(v) for v in box), score, color)


def test_relative_position_as_geneval_computes_it():
    assert relative_position((10, 40, 40, 70), (60, 40, 90, 70)) == {"left of"}
    assert relative_position((60, 40, 90, 70), (10, 40, 40, 70)) == {"right of"}
    assert relative_position((40, 0, 60, 20), (40, 80, 60, 100)) == {"above"}
    assert relative_position((40, 80, 60, 100), (40, 0, 60, 20)) == {"below"}
    # centres (60, 60) vs (10, 10), sizes 20: offset (50, 50) shrinks by 0.1·40 = 4 per axis → 46/70.7 = 0.65 each
    assert relative_position((50, 50, 70, 70), (0, 0, 20, 20)) == {"right of", "below"}
    # centres 5 px apart, shrink 0.1·(40 + 40) = 8 px: no relation
    assert relative_position((5, 0, 45, 40), (0, 0, 40, 40)) == set()


@pytest.mark.parametrize("n_cats, want", [(0, (0 + 1) / 2), (1, (0.5 + 1) / 2), (2, 1.0), (3, (1 + 0) / 2)])
def test_counting_credit(n_cats, want):
    score, strict = geneval_score({"cat": [_d() for _ in range(n_cats)]}, COUNT_2_CATS)
    assert score == pytest.approx(want) and strict == (n_cats == 2)


def test_colour_credit_looks_at_the_top_count_objects():
    meta = {"tag": "colors", "include": [{"class": "car", "count": 2, "color": "red"}]}
    # best two cars: red, blue (the third, red, is beyond the requested count, as in GenEval)
    score, strict = geneval_score({"car": [_d(color="red"), _d(color="blue"), _d(color="red")]}, meta)
    assert score == pytest.approx((1 + 0.5) / 2) and not strict
    assert geneval_score({"car": [_d(color="red"), _d(color="red")]}, meta) == (1.0, True)
    assert geneval_score({"car": [_d(color="red")]}, meta)[0] == pytest.approx((0.5 + 0.5) / 2)


def test_position_credit():
    dog, cat_left, cat_right = _d((60, 40, 90, 70)), _d((10, 40, 40, 70)), _d((95, 40, 125, 70))
    assert geneval_score({"dog": [dog], "cat": [cat_left]}, DOG_THEN_CAT_LEFT) == (1.0, True)
    assert geneval_score({"dog": [dog], "cat": [cat_right]}, DOG_THEN_CAT_LEFT)[0] == pytest.approx(2 / 3)
    # no dog: its count credit 0, the cat's 1, and its position 0 (nothing to be left of)
    assert geneval_score({"cat": [cat_left]}, DOG_THEN_CAT_LEFT)[0] == pytest.approx(1 / 3)
    two = {"include": [{"class": "dog", "count": 1}, {"class": "cat", "count": 2, "position": ["left of", 0]}]}
    score, strict = geneval_score({"dog": [dog], "cat": [cat_left, cat_right]}, two)
    assert score == pytest.approx((1 + 1 + 0.5) / 3) and not strict  # one of the two (cat, dog) pairs holds


def test_two_objects_and_no_objects():
    meta = {"tag": "two_object", "include": [{"class": "cat", "count": 1}, {"class": "dog", "count": 1}]}
    assert geneval_score({"cat": [_d()]}, meta)[0] == pytest.approx(0.5)
    assert math.isnan(geneval_score({}, {"tag": "single_object"})[0])


def test_nms_keeps_the_best_of_overlapping_boxes():
    boxes = torch.tensor([[1.0, 1, 11, 11], [0, 0, 10, 10], [20, 20, 30, 30]])
    scores = torch.tensor([0.8, 0.9, 0.7])
    # IoU of the first two: 81 / (100 + 100 - 81) = 0.68
    assert nms(boxes, scores, 0.5) == [1, 2]
    assert nms(boxes, scores, 0.7) == [1, 0, 2]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-geneval")
    return save_tiny_owlvit(root / "owl"), save_tiny_clip(root / "clip")


def test_detector_path_on_a_tiny_owlvit(tiny_dirs):
    owl, clip = tiny_dirs
    clear_cache()
    images = torch.rand(2, 3, 24, 40, generator=torch.Generator().manual_seed(0))  # (2, 3, H, W)
    meta = [{"tag": "colors", "include": [{"class": "cat", "count": 2, "color": "red"}]}, COUNT_2_CATS]
    opts = {"detector": str(owl), "clip": str(clip), "threshold": 0.0, "batch_size": 2}
    fn = make_rewards({"geneval": 1.0}, {"geneval": opts}, "cpu")["geneval"]
    got = fn(images, ["a photo of two red cats", "a photo of two cats"], meta)
    # the same images through detect / geneval_score by hand: every box of the one queried class passes threshold 0
    proc, net = load_detector(str(owl), "cpu", "float32")
    for img, m, g in zip(to_uint8_hwc(images), meta, got.tolist()):
        objects = detect(proc, net, img, ["cat"], 0.0, 0.5)
        cats = objects["cat"]
        assert 1 <= len(cats) <= 16 and all(a.score >= b.score for a, b in zip(cats, cats[1:]))
        assert all(d.box[0] <= d.box[2] and d.box[1] <= d.box[3] for d in cats)
        if "exclude" in m:
            assert g == pytest.approx(geneval_score(objects, m)[0])  # no colour involved
        else:
            assert 0.0 <= g <= 1.0
    assert LOADS[("detector", str(owl), "cpu", "float32")] == 1 and LOADS[("clip", str(clip), str(clip), "cpu",
                                                                          "float32")] == 1
    # nothing passes threshold 1: the hand values for no detections
    none = make_rewards({"geneval": 1.0}, {"geneval": {**opts, "threshold": 1.0}}, "cpu")["geneval"]
    assert none(images, ["x", "y"], meta).tolist() == [0.0, 0.5]
    strict = make_rewards({"geneval": 1.0}, {"geneval": {**opts, "strict": True}}, "cpu")["geneval"]
    assert set(strict(images, ["x", "y"], meta).tolist()) <= {0.0, 1.0}
    video = torch.stack([images, images.flip(-1)], 2)  # (2, 3, F=2, H, W)
    per_frame = torch.stack([fn(video[:, :, f], ["x", "y"], meta) for f in range(2)], 1)
    torch.testing.assert_close(fn(video, ["x", "y"], meta), per_frame.mean(1))
    clear_cache()


@pytest.mark.parametrize("v2", [False, True], ids=["owlvit", "owlv2"])
def test_detector_boxes_are_in_input_pixels(v2, tmp_path):
    """Boxes by hand from the raw output: OWL-ViT's are relative to the resized image (scale W, H); OWLv2 pads the
    image to a square first, so its boxes scale by the longer side on both axes."""
    path = save_tiny_owlvit(tmp_path / "owl", v2=v2)
    proc, net = load_detector(str(path), "cpu", "float32")
    img = to_uint8_hwc(torch.rand(1, 3, 24, 40, generator=torch.Generator().manual_seed(1)))[0]  # H=24, W=40
    got = detect(proc, net, img, ["cat"], 0.0, 1.0)["cat"]  # one class, nothing suppressed (IoU > 1 never holds)
    with torch.no_grad():
        out = net(**proc(text=[["a photo of a cat"]], images=[img], return_tensors="pt"))
    cx, cy, w, h = out.pred_boxes[0].unbind(-1)  # (16,) each, relative
    sx, sy = (40, 40) if v2 else (40, 24)
    want = torch.stack([(cx - w / 2) * sx, (cy - h / 2) * sy, (cx + w / 2) * sx, (cy + h / 2) * sy], -1)  # (16, 4)
    order = out.logits[0, :, 0].argsort(descending=True)[:16]
    assert len(got) == 16
    torch.testing.assert_close(torch.tensor([d.box for d in got]), want[order], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(torch.tensor([d.score for d in got]), out.logits[0, order, 0].sigmoid())
    clear_cache()
