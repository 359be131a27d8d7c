"""The shapes task and its checker: prompts, split and renderer (tasks/shapes.py), the checker's accuracy on rendered
ground truth, its false-pass rate on deliberately wrong images (tasks/shapes_wrong.py) and the two rewards."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from diffgrpo.rewards import REWARDS
from diffgrpo.rewards import shapes as checker
from diffgrpo.tasks import shapes, shapes_wrong

N_PER_CATEGORY = 200
N_WRONG = 300


def _by_tag(tag: str) -> list[dict]:
    return [r for r in shapes.all_prompts() if r["tag"] == tag]


def _records(rng: np.random.Generator, n: int) -> list[dict]:
    """``n`` prompt records: a category uniformly, then a prompt of it uniformly."""
    out = []
    for _ in range(n):
        pool = _by_tag(shapes.CATEGORIES[int(rng.integers(len(shapes.CATEGORIES)))])
        out.append(pool[int(rng.integers(len(pool)))])
    return out


def _correct(images: list[torch.Tensor], metas: list[dict]) -> torch.Tensor:
    return REWARDS["shapes_correct"](torch.stack(images), [m["prompt"] for m in metas], metas)


def test_checker_prompt_split_holds_out_unseen_combinations_in_every_category():
    train, test = shapes.prompts("train"), shapes.prompts("test")
    assert {r["tag"] for r in train} == {r["tag"] for r in test} == set(shapes.CATEGORIES)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len(train) + len(test) == len(shapes.all_prompts()) == len({r["prompt"] for r in shapes.all_prompts()})
    bound = lambda recs: {(e.get("color"), e["class"]) for r in recs for e in r["include"] if "color" in e}  # noqa: E731
    tagged = lambda recs, tag: [r for r in recs if r["tag"] == tag]  # noqa: E731
    # "a red triangle" alone is never trained on; RL meets a held-out pair only beside another object
    assert not bound(tagged(train, "colors")) & shapes.HELD_OUT_PAIRS
    assert shapes.HELD_OUT_PAIRS <= bound(tagged(test, "colors"))
    for tag in ("color_attr", "position"):  # every held-out prompt binds a held-out pair; each pair in both splits
        assert all(bound([r]) & shapes.HELD_OUT_PAIRS for r in tagged(test, tag))
        for pair in shapes.HELD_OUT_PAIRS:
            assert pair in bound(tagged(train, tag)) and pair in bound(tagged(test, tag))
    counted = lambda recs: {(r["include"][0]["count"], r["include"][0]["class"]) for r in recs  # noqa: E731
                            if r["tag"] == "counting"}
    assert not counted(train) & counted(test)
    # every colour, shape, count and relation is trained on
    assert {e["class"] for r in train for e in r["include"]} == set(shapes.SHAPES)
    assert {e.get("color") for r in train for e in r["include"]} - {None} == set(shapes.COLORS)
    assert {r["include"][0]["count"] for r in train if r["tag"] == "counting"} == set(shapes.NUMBERS)
    assert {r["include"][1]["position"][0] for r in train if r["tag"] == "position"} == set(shapes.RELATIONS)
    with pytest.raises(ValueError, match="split"):
        shapes.prompts("validation")


def test_checker_prompt_text_states_exactly_its_constraints():
    for r in shapes.all_prompts():
        assert shapes.parse(r["prompt"]) == {"tag": r["tag"], "include": r["include"]}, r["prompt"]
    assert shapes.parse("a red circle left of a blue square")["include"] == [
        {"class": "square", "count": 1, "color": "blue"},
        {"class": "circle", "count": 1, "color": "red", "position": ["left of", 0]}]
    assert shapes.parse("three triangles")["include"] == [{"class": "triangle", "count": 3}]
    for text in ("a purple circle", "five circles", "a circle left of a square", "a red circle and a square", ""):
        assert shapes.parse(text) is None, text


def test_checker_renderer_draws_scenes_that_satisfy_their_prompt():
    rng = np.random.default_rng(0)
    for r in shapes.all_prompts()[::3]:
        scene = shapes.layout(r, rng)
        want = sorted((e["class"], e.get("color")) for e in r["include"] for _ in range(e["count"]))
        got = sorted((o.kind, o.color if any("color" in e for e in r["include"]) else None) for o in scene.objects)
        assert got == want, r["prompt"]
        for i, a in enumerate(scene.objects):
            assert all(shapes.apart(a, b) for b in scene.objects[i + 1:])
            assert min(a.box) >= 0 and max(a.box) <= scene.image_size
        if r["tag"] == "position":
            ref, obj = r["include"]
            a = next(o for o in scene.objects if o.kind == obj["class"])
            b = next(o for o in scene.objects if o.kind == ref["class"])
            assert shapes.placed_as(a, obj["position"][0], b)
    image = shapes.render(shapes.prompts("train")[0], np.random.default_rng(1))
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32 and 0 <= image.min() <= image.max() <= 1
    again = shapes.render(shapes.prompts("train")[0], np.random.default_rng(1))
    assert torch.equal(image, again)  # seeded


def test_checker_labels_connected_components_of_each_colour():
    cls = np.zeros((2, 6, 7), dtype=np.int64)
    cls[0, :, 0] = 1
    cls[0, 5, :] = 1
    cls[0, :, 6] = 1  # a U of one colour: one component
    cls[0, 2, 3] = 2  # another colour inside it
    cls[1, 0, 0] = cls[1, 1, 1] = 1  # diagonal neighbours are not connected
    lab = checker.label(cls)
    assert len(np.unique(lab[0][cls[0] == 1])) == 1 and lab[0, 2, 3] not in lab[0][cls[0] == 1]
    assert lab[1, 0, 0] != lab[1, 1, 1] and (lab[cls == 0] == -1).all()


def test_checker_detects_kind_colour_box_and_centroid():
    scene = shapes.Scene((shapes.Shape("circle", "red", 8.0, 9.0, 10.0), shapes.Shape("square", "blue", 24.0, 8.0, 9.0),
                          shapes.Shape("triangle", "yellow", 16.0, 24.0, 11.0)))
    dets = sorted(checker.detect(shapes.draw(scene)), key=lambda d: d.kind)
    assert [(d.kind, d.color) for d in dets] == [("circle", "red"), ("square", "blue"), ("triangle", "yellow")]
    circle, square, triangle = dets
    assert np.allclose(circle.centroid, (8.0, 9.0), atol=0.3) and np.allclose(square.centroid, (24.0, 8.0), atol=0.3)
    assert triangle.centroid[1] > 24.0 + 1.0  # an upright triangle's mass sits low in its box
    assert abs((square.box[2] - square.box[0]) - 9) <= 1 and abs(circle.area - np.pi * 25) < 12
    specks = torch.tensor(shapes.BACKGROUND).view(3, 1, 1).repeat(1, 32, 32)
    specks[:, 5:7, 5:7] = torch.tensor(shapes.COLORS["red"]).view(3, 1, 1)
    assert checker.detect(specks) == []  # below the minimum area


@pytest.mark.parametrize("tag", shapes.CATEGORIES)
def test_checker_accuracy_on_rendered_ground_truth(tag):
    rng = np.random.default_rng(sorted(shapes.CATEGORIES).index(tag))
    pool = _by_tag(tag)
    metas = [pool[int(i)] for i in rng.integers(len(pool), size=N_PER_CATEGORY)]
    images = [shapes.render(m, rng) for m in metas]
    correct = _correct(images, metas)
    score = REWARDS["shapes_score"](torch.stack(images), [m["prompt"] for m in metas], metas)
    accuracy = float(correct.mean())
    print(f"\nshapes checker accuracy, {tag}: {accuracy:.4f} on {N_PER_CATEGORY} rendered images")
    assert accuracy >= 0.99
    assert torch.equal(score == 1, correct == 1)  # full partial credit exactly when correct


@pytest.mark.parametrize("kind", shapes_wrong.MILD)
def test_checker_accepts_mildly_perturbed_right_images(kind):
    rng = np.random.default_rng(10 + shapes_wrong.MILD.index(kind))
    metas = _records(rng, N_WRONG)
    rate = float(_correct([shapes_wrong.mild(kind, m, rng) for m in metas], metas).mean())
    print(f"\nshapes checker pass rate, mild {kind}: {rate:.4f} on {N_WRONG} images")
    assert rate >= 0.97


@pytest.mark.parametrize("kind", shapes_wrong.WRONG)
def test_false_pass_rate_on_deliberately_wrong_images(kind):
    rng = np.random.default_rng(20 + shapes_wrong.WRONG.index(kind))
    images, metas = [], []
    while len(images) < N_WRONG:
        meta = _records(rng, 1)[0]
        image = shapes_wrong.wrong(kind, meta, rng)
        if image is not None:
            images.append(image)
            metas.append(meta)
    correct = _correct(images, metas)
    score = REWARDS["shapes_score"](torch.stack(images), [m["prompt"] for m in metas], metas)
    rate = float(correct.mean())
    print(f"\nshapes checker false-pass rate, {kind}: {rate:.4f} on {N_WRONG} images")
    assert rate <= 0.01
    assert torch.equal(score == 1, correct == 1) and float(score.mean()) < 1


def test_false_pass_partial_credit_counts_the_constraints_met():
    meta = shapes.parse("a red circle left of a blue square")  # count, colour ×2, position, clean: 6 constraints
    right = shapes.Scene((shapes.Shape("circle", "red", 8.0, 16.0, 9.0), shapes.Shape("square", "blue", 24.0, 16.0, 9.0)))
    swapped = shapes.Scene((shapes.Shape("circle", "red", 24.0, 16.0, 9.0),
                            shapes.Shape("square", "blue", 8.0, 16.0, 9.0)))
    recolored = shapes.Scene((shapes.Shape("circle", "green", 8.0, 16.0, 9.0), right.objects[1]))
    images = torch.stack([shapes.draw(s) for s in (right, swapped, recolored)] + [shapes.draw(shapes.Scene(()))])
    metas = [meta] * 4
    score = REWARDS["shapes_score"](images, ["p"] * 4, metas)
    assert score.tolist() == pytest.approx([1.0, 5 / 6, 4 / 6, 1 / 6])  # blank: only 'clean' holds
    assert REWARDS["shapes_correct"](images, ["p"] * 4, metas).tolist() == [1.0, 0.0, 0.0, 0.0]
    assert checker.constraints_met(checker.detect(images[1]), meta) == [True, True, True, True, False, True]


def test_checker_rewards_score_video_per_frame_and_skip_samples_without_constraints():
    meta = shapes.parse("two squares")
    rng = np.random.default_rng(3)
    right, blank = shapes.render(meta, rng), shapes.draw(shapes.Scene(()))
    video = torch.stack([torch.stack([right, right, blank, right], 1)] * 2)  # (B, 3, F, H, W)
    out = REWARDS["shapes_correct"](video, ["two squares"] * 2, [meta, {"tag": "colors"}])
    assert out[0].item() == pytest.approx(0.75) and torch.isnan(out[1])
    gray = REWARDS["shapes_correct"](right.mean(0, keepdim=True)[None], ["two squares"], [meta])  # one channel
    assert gray.tolist() == [0.0]
