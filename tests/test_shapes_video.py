"""train.task=shapes_video: prompts and split, the clip renderer, the checker (accuracy on rendered clips, false
passes on wrong ones), the tiny Wan model's velocity, the config rules and the command line end to end."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffgrpo.config import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.rewards.registry import REWARDS
from diffgrpo.rewards.shapes_video import shapes_video_correct, shapes_video_score
from diffgrpo.tasks import shapes
from diffgrpo.tasks import shapes_video as task

VIDEO_CLI = ["train.task=shapes_video", "model.num_layers=1", "model.num_heads=2", "model.head_dim=12",
             "model.text_dim=16", "pretrain.steps=4", "pretrain.batch_size=4", "sampler.num_steps=3",
             "train.prompts_per_batch=2", "train.group_size=2", "eval.seeds_per_prompt=1", "log.progress=false"]


def _records(n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    every = task.all_prompts()
    return [every[i] for i in rng.integers(len(every), size=n)]


def _clips(recs: list[dict], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.stack([task.render(r, rng) for r in recs])  # (B, 3, F, H, W)


# ---------------------------------------------------------------------- prompts and clips
def test_split_holds_out_the_shapes_bindings_and_the_shipped_files_equal_it():
    from diffgrpo.data_sources import load_prompts

    train, test = task.prompts("train"), task.prompts("test")
    assert len(train) + len(test) == len(task.all_prompts()) and not {r["prompt"] for r in train} & \
        {r["prompt"] for r in test}
    bound = lambda rs: {(e["color"], e["class"]) for r in rs for e in r["include"]}  # noqa: E731
    assert not bound(train) & shapes.HELD_OUT_PAIRS and shapes.HELD_OUT_PAIRS <= bound(test)
    assert {e["motion"] for r in train for e in r["include"]} == set(task.DIRECTIONS)
    assert {r["tag"] for r in train} == {r["tag"] for r in test} == set(task.CATEGORIES)
    for r in task.all_prompts():
        assert task.parse(r["prompt"]) == {"tag": r["tag"], "include": r["include"]}
    for split, recs in (("train", train), ("test", test)):
        assert [dict(r) for r in load_prompts(f"builtin:shapes_video/{split}")] == recs


def test_clips_move_each_object_by_a_step_per_frame_inside_the_frame():
    rng = np.random.default_rng(0)
    for r in _records(40, 1):
        frames = task.clip_scenes(r, rng)
        assert len(frames) == task.NUM_FRAMES
        for i, e in enumerate(r["include"]):
            dx, dy = task.DIRECTIONS[e["motion"]]
            for a, b in zip(frames, frames[1:]):
                assert (b.objects[i].x - a.objects[i].x, b.objects[i].y - a.objects[i].y) == \
                    pytest.approx((dx * task.STEP, dy * task.STEP))
            assert all(0 <= v for f in frames for v in f.objects[i].box) and \
                all(v <= 32 for f in frames for v in f.objects[i].box)
    x = task.render(r, rng)
    assert x.shape == (3, task.NUM_FRAMES, 32, 32) and 0 <= x.min() and x.max() <= 1


# ---------------------------------------------------------------------- the checker
def test_checker_accepts_rendered_clips():
    recs = _records(300, 2)
    x = _clips(recs, 3)
    ok = shapes_video_correct(x, [r["prompt"] for r in recs], recs)
    assert ok.mean() >= 0.99, [r["prompt"] for r, o in zip(recs, ok) if o < 1][:5]
    assert torch.equal(shapes_video_score(x, [r["prompt"] for r in recs], recs) == 1, ok == 1)


def _wrong(recs: list[dict], x: torch.Tensor, rng) -> list[tuple[str, torch.Tensor]]:
    """Clips that must fail their record: played backwards, frozen, another direction's clip, another colour or
    shape, blank, noise."""
    other = {"left": "up", "right": "down", "up": "right", "down": "left"}
    swap = lambda r, k, f: [{**e, k: f(e[k])} for e in r["include"]]  # noqa: E731
    wrong = [("reversed", x.flip(2)), ("static", x[:, :, :1].expand_as(x))]
    turned = [{**r, "include": swap(r, "motion", other.get)} for r in recs]
    wrong.append(("turned", _clips(turned, 5)))
    recolour = {"red": "yellow", "yellow": "green", "green": "blue", "blue": "red"}
    reshape = {"circle": "square", "square": "triangle", "triangle": "circle"}
    wrong.append(("colour", _clips([{**r, "include": swap(r, "color", recolour.get)} for r in recs], 6)))
    wrong.append(("shape", _clips([{**r, "include": swap(r, "class", reshape.get)} for r in recs], 7)))
    wrong.append(("blank", torch.tensor(shapes.BACKGROUND).view(1, 3, 1, 1, 1).expand_as(x).clone()))
    wrong.append(("noise", torch.rand(x.shape, generator=torch.Generator().manual_seed(8))))
    return wrong


def test_false_pass_rate_on_wrong_clips_is_at_most_one_percent():
    recs = _records(100, 4)
    x = _clips(recs, 4)
    for name, bad in _wrong(recs, x, np.random.default_rng(9)):
        passed = shapes_video_correct(bad, [r["prompt"] for r in recs], recs)
        assert passed.mean() <= 0.01, name
        assert (shapes_video_score(bad, [r["prompt"] for r in recs], recs) < 1).all(), name


def test_checker_reads_metadata_only_and_refuses_images():
    recs = _records(2, 0)
    x = _clips(recs, 0)
    assert torch.isnan(shapes_video_correct(x, ["", ""], [{}, {}])).all()
    with pytest.raises(ValueError, match="expected video"):
        shapes_video_score(x[:, :, 0], ["", ""], recs)
    assert REWARDS["shapes_video_correct"] is shapes_video_correct


# ---------------------------------------------------------------------- model and config
def test_policy_velocity_is_derived_from_the_clean_prediction():
    from diffgrpo.models.tiny import build_tiny_policy

    cfg = RunConfig.from_overrides(VIDEO_CLI + ["model.device=cpu"])
    torch.manual_seed(0)
    pol = build_tiny_policy(cfg, pretrained=False, progress=False)
    assert pol.latent_shape == (3, 4, 32, 32) and pol.row.name == "wan"
    cond = pol.encode(["a red circle moving left"])
    x, sigma = torch.randn(1, 3, 4, 32, 32), torch.tensor([0.5])
    clean = pol.transformer(hidden_states=x, encoder_hidden_states=cond["prompt_embeds"], timestep=sigma * 1000,
                            return_dict=False)[0]
    torch.testing.assert_close(pol.velocity(x, sigma, cond), (x - clean) / 0.5, rtol=1e-4, atol=1e-5)


def test_config_sets_the_video_defaults_and_refuses_image_settings():
    cfg = RunConfig.from_overrides(["train.task=shapes_video"])
    assert (cfg.model.num_frames, cfg.model.image_size, cfg.train.prompts_file) == \
        (4, 32, "builtin:shapes_video/train")
    assert set(cfg.reward.weights) == {"shapes_video_score", "shapes_video_correct"}
    for bad, key in ((["model.num_frames=12"], "model.num_frames"), (["model.image_size=8"], "model.image_size"),
                     (["reward.weights={shapes_score: 1.0}"], "reward.weights")):
        with pytest.raises(ConfigError, match=key):
            RunConfig.from_overrides(["train.task=shapes_video", *bad])


def test_train_task_shapes_video_trains_and_samples_clips_through_the_command_line(tmp_path, capsys):
    from diffgrpo.cli.app import main

    out = tmp_path / "run"
    assert main(["train", *VIDEO_CLI, f"model.cache_dir={tmp_path / 'cache'}", "train.num_iterations=1",
                 "eval.every=0", f"log.output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/rewards/shapes_video_correct/mean" in r]
    assert len(evals) == 2 and all(0 <= r["eval/rewards/shapes_video_score/mean"] <= 1 for r in evals)
    assert [p.name[:18] for p in (tmp_path / "cache").iterdir() if p.is_dir()] == ["tiny-shapes-video-"]
    capsys.readouterr()
    assert main(["sample", "--weights", str(out), "--num", "1", "--out", str(tmp_path / "s.png")]) == 0
    clips = sorted(p.suffix for p in tmp_path.glob("s_*"))
    assert len(clips) == len(task.CATEGORIES) and set(clips) <= {".mp4", ".gif"}
