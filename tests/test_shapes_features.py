"""The shapes checker's detection features (diffgrpo.rewards.shapes_features): closed forms on drawn scenes, the
empty scene, video as the mean over frames, and the diversity objectives on train.task=shapes through the
command line (the guards' own feature space stays none there)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffgrpo import guards
from diffgrpo.config import RunConfig
from diffgrpo.rewards import shapes_features as sf
from diffgrpo.tasks.shapes import BACKGROUND, Scene, Shape, draw, layout

N = 32
RED_SQUARE = Shape("square", "red", 10.0, 12.0, 8.0)  # pixel-aligned: covers columns 6..13, rows 8..15
BLUE_CIRCLE = Shape("circle", "blue", 23.0, 22.0, 9.0)


def _dims(kind, color):
    j = sf.LABELS.index((kind, color))
    return slice(sf.PER_LABEL * j, sf.PER_LABEL * (j + 1))


def _features(*scenes: Scene) -> torch.Tensor:
    return sf.detection_features(torch.stack([draw(s) for s in scenes]))  # (B, DIM)


def test_the_vector_of_a_drawn_scene_is_its_objects_counts_places_and_sizes():
    f = _features(Scene((RED_SQUARE, BLUE_CIRCLE)))[0]
    assert f.shape == (sf.DIM,) == (53,)
    # a pixel-aligned 8 × 8 square: 64 pixels centred on its centre; a circle's pixels are symmetric about its centre
    assert torch.allclose(f[_dims("square", "red")], torch.tensor([1.0, 10 / N, 12 / N, 8 / N]), atol=1e-6)
    c = f[_dims("circle", "blue")]
    assert c[0] == 1 and torch.allclose(c[1:3], torch.tensor([23 / N, 22 / N]), atol=1e-6)
    assert abs(float(c[3]) - np.sqrt(np.pi) * 4.5 / N) < 0.5 / N  # √(π r²) within half a pixel
    rest = torch.ones(sf.DIM, dtype=torch.bool)
    rest[_dims("square", "red")] = rest[_dims("circle", "blue")] = False
    assert torch.equal(f[rest], torch.zeros(int(rest.sum())))  # no other label, not empty


def test_identical_scenes_have_identical_vectors_and_a_drawn_layout_is_deterministic():
    meta = {"include": [{"class": "circle", "count": 2}, {"class": "triangle", "count": 1, "color": "green"}]}
    scene = layout(meta, np.random.default_rng(3))
    f = _features(scene, scene, layout(meta, np.random.default_rng(3)))
    assert torch.equal(f[0], f[1]) and torch.equal(f[0], f[2])
    assert float(f[0, sf.PER_LABEL * sf.LABELS.index(sf.UNRECOGNISED)]) == 0  # the checker recognises every object
    assert float(f[0][::sf.PER_LABEL][:-1].sum()) == 3  # three objects counted (the last entry is the empty flag)


@pytest.mark.parametrize("dx, dy", [(3, 0), (0, -5), (4, 2)])
def test_moving_one_object_moves_only_its_labels_position(dx, dy):
    moved = Shape(RED_SQUARE.kind, RED_SQUARE.color, RED_SQUARE.x + dx, RED_SQUARE.y + dy, RED_SQUARE.size)
    a, b = _features(Scene((RED_SQUARE, BLUE_CIRCLE)), Scene((moved, BLUE_CIRCLE)))
    d = b - a
    own = _dims("square", "red")
    assert torch.allclose(d[own], torch.tensor([0.0, dx / N, dy / N, 0.0]), atol=1e-6)  # an integer shift: exact
    d[own] = 0
    assert torch.equal(d, torch.zeros(sf.DIM))


def test_recolouring_an_object_moves_its_count_to_the_other_label():
    green = Shape("square", "green", RED_SQUARE.x, RED_SQUARE.y, RED_SQUARE.size)
    a, b = _features(Scene((RED_SQUARE, BLUE_CIRCLE)), Scene((green, BLUE_CIRCLE)))
    red, grn = _dims("square", "red"), _dims("square", "green")
    assert float(a[red][0]) == 1 and float(a[grn][0]) == 0 and float(b[red][0]) == 0 and float(b[grn][0]) == 1
    assert torch.equal(a[red], b[grn]) and torch.equal(b[red], torch.zeros(4))
    assert torch.equal(a[_dims("circle", "blue")], b[_dims("circle", "blue")])


def test_adding_an_object_of_a_label_averages_its_places():
    other = Shape("square", "red", 24.0, 6.0, 8.0)
    f = _features(Scene((RED_SQUARE, other)))[0]
    assert torch.allclose(f[_dims("square", "red")], torch.tensor([2.0, 17 / N, 9 / N, 8 / N]), atol=1e-6)


def test_a_blank_image_is_the_empty_vector_and_an_unexplained_blob_is_unrecognised():
    blank = torch.tensor(BACKGROUND, dtype=torch.float32)[:, None, None].expand(3, N, N)
    blob = blank.clone()
    blob[:, 4:12, 4:12] = 1.0  # white: no palette colour explains it
    f = sf.detection_features(torch.stack([blank, blob]))
    empty = torch.zeros(sf.DIM)
    empty[-1] = 1
    assert torch.equal(f[0], empty)
    u = f[1][_dims(*sf.UNRECOGNISED)]
    assert torch.allclose(u, torch.tensor([1.0, 8 / N, 8 / N, 8 / N]), atol=1e-6) and float(f[1][-1]) == 0


def test_video_is_the_mean_of_its_frames():
    frames = [draw(Scene((RED_SQUARE, BLUE_CIRCLE))), draw(Scene((BLUE_CIRCLE,))),
              torch.tensor(BACKGROUND, dtype=torch.float32)[:, None, None].expand(3, N, N)]
    images = torch.stack(frames)  # (3, 3, H, W)
    clip = torch.stack([images, images.flip(0)]).permute(0, 2, 1, 3, 4)  # (2, 3, F=3, H, W)
    f = sf.detection_features(clip)
    assert f.shape == (2, sf.DIM)
    ref = sf.detection_features(images).double().mean(0).float()
    assert torch.allclose(f[0], ref, atol=1e-7) and torch.allclose(f[1], ref, atol=1e-7)
    with pytest.raises(ValueError, match="expected images"):
        sf.detection_features(images[0])


# ---------------------------------------------------------------------- the diversity objectives' space
def test_the_shapes_tasks_give_the_objectives_detections():
    for task, kind in (("shapes", "shapes"), ("shapes_video", "none")):
        cfg = RunConfig.from_overrides([f"train.task={task}", "diversity.method=gardo"])
        assert guards.feature_kind(cfg) == kind
        assert guards.diversity_space(cfg) == "detections"
        assert guards.diversity_feature_fn(cfg, "cpu") is sf.detection_features
    digits = RunConfig.from_overrides(["train.task=digits", "diversity.method=gardo"])
    assert guards.diversity_space(digits) == "digits"
    assert guards.diversity_feature_fn(digits, "cpu") is guards.digit_features


TINY = ["train.task=shapes", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16",
        "pretrain.steps=10", "pretrain.batch_size=8", "sampler.num_steps=3", "train.num_iterations=1",
        "train.prompts_per_batch=2", "train.group_size=2", "eval.seeds_per_prompt=1", "eval.every=0",
        "log.progress=false"]
LOGGED = {"gardo": "diversity/gardo_diversity_mean", "diversegrpo": "diversity/cluster_bonus_mean",
          "drift": "diversity/drift_subset_frac"}


@pytest.mark.parametrize("method", sorted(LOGGED))
def test_each_objective_trains_on_the_shapes_task_through_the_command_line(tmp_path, capsys, method):
    from diffgrpo.cli.app import main

    out = tmp_path / "run"
    assert main(["train", *TINY, f"diversity.method={method}", f"log.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if LOGGED[method] in r]
    assert len(train) == 1 and np.isfinite(train[0][LOGGED[method]])
    assert all(np.isfinite(r["eval/fid"]) for r in rows if "eval/reward" in r)  # the guards' own: the shapes encoder
