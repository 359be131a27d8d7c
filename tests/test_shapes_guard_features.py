"""The shapes task's guard feature space (rewards.shapes_encoder): it separates scenes, its Fréchet distance is small
between two renders of the same prompts and large against a collapse (and the guard trips), the cached encoder
reads back bitwise, and a shapes run logs eval/fid and eval/guard/kid through the command line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffgrpo import guards
from diffgrpo.config import ConfigError, RunConfig
from diffgrpo.feature_stats import frechet_distance, gaussian_stats, kid
from diffgrpo.rewards import shapes_encoder as se
from diffgrpo.tasks import shapes

BUDGET = {"steps": 60, "pool": 600}  # a small training budget: a few seconds


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    return se.load_encoder(32, cache_dir=str(tmp_path_factory.mktemp("enc")), log=lambda *a: None, **BUDGET)


def renders(records: list[dict], n: int, seed: int, grid: bool = True) -> torch.Tensor:
    """``n`` scenes, the records in turn, from one seed → (n, 3, 32, 32)."""
    rng = np.random.default_rng(seed)
    return torch.stack([shapes.render(records[i % len(records)], rng, 32, grid=grid) for i in range(n)])


def record(text: str) -> dict:
    return next(r for r in shapes.all_prompts() if r["prompt"] == text)


def test_the_encoder_separates_scenes_of_different_prompts(encoder):
    red, blue = record("a red square"), record("a blue circle")
    with torch.no_grad():
        a1, a2 = encoder.features(renders([red], 16, 1)), encoder.features(renders([red], 16, 2))  # (16, 64) each
        b = encoder.features(renders([blue], 16, 3))
    assert a1.shape == (16, se.FEATURE_DIM)
    same, other = (a1.mean(0) - a2.mean(0)).norm(), (a1.mean(0) - b.mean(0)).norm()
    assert other > 5 * same
    # scene by scene: every blue circle is farther from the red squares' mean than the spread of red squares
    spread = (a2 - a1.mean(0)).norm(dim=1).max()
    assert ((b - a1.mean(0)).norm(dim=1) > spread).all()


def test_targets_count_objects_and_mark_their_quadrants():
    scene = shapes.Scene((shapes.Shape("circle", "red", 8, 8, 6), shapes.Shape("circle", "red", 24, 24, 6),
                          shapes.Shape("square", "blue", 24, 8, 6)), 32)
    t = se.targets(scene)  # (60,)
    i, j = se.LABELS.index(("circle", "red")), se.LABELS.index(("square", "blue"))
    assert t[i] == 2 and t[j] == 1 and t[:12].sum() == 3
    quads = t[12:].view(12, 4)
    assert quads[i].tolist() == [1, 0, 0, 1] and quads[j].tolist() == [0, 1, 0, 0] and quads.sum() == 3


def test_fd_is_small_between_renders_of_one_prompt_set_and_the_guard_trips_on_a_collapse(encoder):
    check_collapse(encoder, max_kid=None)


@pytest.mark.slow
def test_at_the_task_defaults_the_trained_encoder_trips_both_distance_guards_on_a_collapse():
    """The encoder the guards use (full training budget, cached) with the shapes task's default thresholds."""
    check_collapse(se.load_encoder(32), max_kid=RunConfig.from_overrides(["train.task=shapes"]).train.guard_max_kid)


def check_collapse(encoder, max_kid: float | None) -> None:
    """FD / KID of a render of the evaluation rows against another render, and of a collapse (one image 288 times);
    the FID guard (and with ``max_kid`` the KID guard at that limit) trips on the collapse and not on the render."""
    records = shapes.prompt_set("test")  # the shipped evaluation rows
    with torch.no_grad():
        ref, start = encoder.features(renders(records, 288, 1)), encoder.features(renders(records, 288, 2))
        collapsed = encoder.features(renders(records[:1], 1, 3)).expand(288, -1)  # every sample one image
    same = frechet_distance(*gaussian_stats(start), *gaussian_stats(ref))
    far = frechet_distance(*gaussian_stats(collapsed), *gaussian_stats(ref))
    assert far > 10 * same

    def evaluate(feats):  # GuardStats with the shapes reference: eval/fid and eval/guard/kid of one evaluation
        g = guards.GuardStats(32, 4, (encoder.features, ref))
        g.add(list(range(len(feats))), feats)
        return g.result()

    row0, row1 = evaluate(start), evaluate(collapsed)
    scale = float(start.double().pow(2).sum(1).mean())  # E‖f‖²: the streamed sums' round-off is relative to it
    assert row0["eval/fid"] == pytest.approx(same, rel=1e-9, abs=1e-9 * scale)
    assert row0["eval/guard/kid"] == pytest.approx(kid(start, ref), rel=1e-9)
    assert row1["eval/guard/kid"] > row0["eval/guard/kid"] + 10 * abs(row0["eval/guard/kid"])
    th = guards.thresholds(RunConfig.from_overrides(["train.task=shapes", "train.guard_distance=fid"]).train)
    assert not guards.tripped(row0, evaluate(ref), th)  # the reference itself as the next evaluation: inside
    assert any(t.startswith("eval/fid") for t in guards.tripped(row0, row1, th))
    if max_kid is not None:  # the task's default distance guard
        kid_th = guards.thresholds(RunConfig.from_overrides(["train.task=shapes"]).train)
        assert (kid_th.distance, kid_th.max_kid) == ("kid", max_kid)
        assert not guards.tripped(row0, evaluate(ref), kid_th)
        assert any(t.startswith("eval/guard/kid") for t in guards.tripped(row0, row1, kid_th))


def test_the_cached_encoder_reads_back_bitwise_and_training_is_deterministic(tmp_path):
    budget = {"steps": 10, "pool": 120}
    first = se.load_encoder(32, cache_dir=str(tmp_path), log=lambda *a: None, **budget)
    (entry,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.iterdir()) == ["info.json", "model.safetensors"]
    assert f"-v{se.RECIPE}" in entry.name and json.loads((entry / "info.json").read_text())["steps"] == 10
    se._ENCODERS.clear()  # read the file again, not this process's copy
    again = se.load_encoder(32, cache_dir=str(tmp_path), log=lambda *a: None, **budget)
    assert again is not first
    for k, v in first.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    fresh, _ = se.train_encoder(32, **budget)
    for k, v in first.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[k]), k
    x = renders(shapes.all_prompts(), 8, 0)
    with torch.no_grad():
        assert torch.equal(first.features(x), again.features(x))


def test_auto_resolves_to_shapes_on_shapes_and_the_objectives_keep_the_detections():
    cfg = RunConfig.from_overrides(["train.task=shapes"])
    assert guards.feature_kind(cfg) == "shapes" and guards.diversity_space(cfg) == "detections"
    assert guards.image_feature_fn(cfg, "cpu") is se.features
    assert guards.feature_kind(RunConfig.from_overrides(["train.task=shapes_video"])) == "none"
    for bad in (["train.task=digits", "eval.guard_features=shapes"],
                ["train.task=shapes_video", "eval.guard_features=shapes"]):
        with pytest.raises(ConfigError, match=r"^eval\.guard_features: 'shapes' reads the built-in model's shapes"):
            RunConfig.from_overrides(bad)


def test_the_shapes_task_guards_the_distance_with_kid_unless_a_config_names_fid():
    """FID's 1.5x limit fires in 11 % of pairs of one unchanged shapes model, KID's in none (guard_noise_shapes)."""
    assert RunConfig.from_overrides(["train.task=shapes"]).train.guard_distance == "kid"
    assert RunConfig.from_overrides(["train.task=shapes", "train.guard_distance=fid"]).train.guard_distance == "fid"
    assert RunConfig.from_overrides(["train.task=digits"]).train.guard_distance == "fid"


def test_a_shapes_run_logs_fid_and_kid_against_rendered_scenes(tmp_path, monkeypatch, encoder):
    from diffgrpo.cli.app import main

    monkeypatch.setattr(se, "features", lambda im: encoder.features(im.float()))  # the small-budget encoder
    out = tmp_path / "run"
    cli = ["train.task=shapes", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16",
           "pretrain.steps=10", "pretrain.batch_size=8", "sampler.num_steps=3", "train.prompts_per_batch=2",
           "train.group_size=2", "eval.seeds_per_prompt=2", "log.progress=false", "train.num_iterations=1",
           "eval.every=0", f"log.output_dir={out}"]
    assert main(["train", *cli]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert len(evals) == 2
    for r in evals:
        assert np.isfinite(r["eval/fid"]) and r["eval/fid"] > 0 and np.isfinite(r["eval/guard/kid"])
        assert np.isfinite(r["eval/guard/fd_base"]) and 0 <= r["eval/guard/detection_diversity"] <= 1
    assert evals[0]["eval/guard/fd_base"] == 0
