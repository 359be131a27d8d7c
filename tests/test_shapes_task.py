"""train.task=shapes: the task's config defaults and rules, its shipped prompt set, the built-in shapes model, the
diversity from the checker's detections, and a short run through the command line."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from diffgrpo import guards
from diffgrpo.config import ConfigError, RunConfig
from diffgrpo.data import default_prompts, task_metadata
from diffgrpo.data_sources import load_prompts
from diffgrpo.models import tiny_shapes
from diffgrpo.rewards import shapes_diversity as sd
from diffgrpo.rewards.shapes import Detection
from diffgrpo.tasks import shapes

SHAPES_CLI = ["train.task=shapes", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16",
              "pretrain.steps=10", "pretrain.batch_size=8", "sampler.num_steps=3", "train.prompts_per_batch=2",
              "train.group_size=2", "eval.seeds_per_prompt=2", "log.progress=false"]


# ---------------------------------------------------------------------- config
def test_the_digits_task_is_the_default_and_keeps_its_settings():
    assert RunConfig().train.task == "digits"
    assert RunConfig.from_overrides([]).to_dict() == RunConfig.from_overrides(["train.task=digits"]).to_dict()
    digits = RunConfig.from_overrides([])
    assert digits.reward.weights == {"digit_alignment": 1.0}
    assert (digits.model.image_size, digits.model.patch_size, digits.model.num_layers) == (16, 2, 2)
    assert digits.train.prompts_file == digits.eval.prompts_file == ""


def test_the_shapes_task_sets_its_defaults_and_keeps_what_a_config_sets():
    cfg = RunConfig.from_overrides(["train.task=shapes"])
    assert (cfg.model.image_size, cfg.model.patch_size, cfg.model.num_layers) == (32, 8, 3)
    assert (cfg.pretrain.steps, cfg.pretrain.lr, cfg.pretrain.batch_size) == (2400, 1e-3, 64)
    assert (cfg.train.prompts_file, cfg.eval.prompts_file) == ("builtin:shapes/train", "builtin:shapes/test")
    assert cfg.reward.weights == {"shapes_correct": 1.0, "shapes_score": 0.0}
    assert cfg.eval.guard_rewards == ["shapes_score"]  # strict correctness trained, partial credit held out
    again = RunConfig.from_overrides([], base=cfg)  # a saved config read back: unchanged
    assert again.to_dict() == cfg.to_dict()
    own = RunConfig.from_overrides(["train.task=shapes", "reward.weights={shapes_score: 1.0}", "model.patch_size=1"])
    assert own.reward.weights == {"shapes_score": 1.0} and own.eval.guard_rewards == ["shapes_correct"]  # never trained
    assert own.model.patch_size == 1


def test_a_key_written_out_keeps_its_value_under_a_task_even_at_the_global_default(tmp_path):
    """pretrain.steps=800 is the global default; the shapes task's is 2400: written on the command line or in a
    YAML file, 800 stays (a task fills only the keys nobody wrote), and a saved config reads back unchanged."""
    assert RunConfig.from_overrides(["train.task=shapes"]).pretrain.steps == 2400
    cli = RunConfig.from_overrides(["train.task=shapes", "pretrain.steps=800", "model.patch_size=4"])
    assert (cli.pretrain.steps, cli.model.patch_size, cli.model.num_layers) == (800, 4, 3)
    y = tmp_path / "c.yaml"
    y.write_text("train: {task: shapes}\npretrain: {steps: 800}\n")
    from_yaml = RunConfig.from_yaml(y)
    assert (from_yaml.pretrain.steps, from_yaml.pretrain.lr) == (800, 1e-3)
    saved = tmp_path / "saved.yaml"
    saved.write_text(cli.to_yaml())
    assert RunConfig.from_yaml(saved).to_dict() == cli.to_dict()
    again = RunConfig.from_overrides(["seed=3"], base=cli)  # a derived config keeps what its base wrote
    assert again.pretrain.steps == 800 and again.seed == 3


@pytest.mark.parametrize("overrides, match", [
    (["train.task=shapes", "model.name=diffusers", "model.pretrained=org/model"],
     r"^train\.task: value 'shapes' applies to the built-in"),
    (["train.task=shapes", "model.name=tiny_mlm"], r"train\.task"),
    (["train.task=shapes", "model.image_size=8"], r"^model\.image_size: value 8 is not drawn by train\.task=shapes"),
    (["train.task=shapes", "reward.weights={digit_alignment: 0.5}"], r"^reward\.weights: digit_alignment scores digits"),
    (["train.task=shapes", "eval.guard_features=digits"], r"^eval\.guard_features: 'digits'"),
])
def test_a_wrong_combination_is_a_one_line_config_error(overrides, match):
    with pytest.raises(ConfigError, match=match) as e:
        RunConfig.from_overrides(overrides)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("overrides", [
    ["model.name=diffusers", "model.pretrained=org/model", "reward.weights={jpeg_compressibility: 1.0}"],
    ["model.name=tiny_mlm"],
])
def test_other_models_ignore_the_default_task(overrides):
    cfg = RunConfig.from_overrides(overrides, purpose="print")
    assert cfg.train.task == "digits" and cfg.train.prompts_file == "" and "shapes_score" not in cfg.reward.weights


def test_a_weight_zero_reward_may_be_a_guard_reward_and_a_trained_one_may_not():
    RunConfig.from_overrides(["reward.weights={jpeg_compressibility: 1.0, jpeg_incompressibility: 0.0}",
                              "eval.guard_rewards=[jpeg_incompressibility]"])
    with pytest.raises(ConfigError, match="is also in reward.weights"):
        RunConfig.from_overrides(["reward.weights={jpeg_compressibility: 1.0, jpeg_incompressibility: 0.5}",
                                  "eval.guard_rewards=[jpeg_incompressibility]"])


def test_guard_features_are_shapes_for_shapes_and_digits_for_digits():
    assert guards.feature_kind(RunConfig.from_overrides(["train.task=shapes"])) == "shapes"
    assert guards.feature_kind(RunConfig.from_overrides([])) == "digits"
    assert guards.feature_kind(RunConfig.from_overrides(["train.task=digits"])) == "digits"


# ---------------------------------------------------------------------- prompts
@pytest.mark.parametrize("split", ["train", "test"])
def test_the_shipped_prompt_set_is_the_task_split_with_its_constraints(split):
    records = load_prompts(f"builtin:shapes/{split}")
    assert records == shapes.prompt_set(split)
    assert all(r["include"] and r["tag"] in shapes.CATEGORIES for r in records)
    assert all(shapes.is_held_out(r) == (split == "test") for r in records)


@pytest.mark.parametrize("split", ["train", "test"])
def test_the_shipped_sets_weigh_every_category_the_same(split):
    records = shapes.prompt_set(split)
    counts = {t: sum(r["tag"] == t for r in records) for t in shapes.CATEGORIES}
    assert len(set(counts.values())) == 1, counts
    distinct = {r["prompt"] for r in records}
    if split == "train":  # every train prompt is listed
        assert distinct == {r["prompt"] for r in shapes.prompts("train")}
    else:
        assert counts["position"] == shapes.EVAL_ROWS and distinct <= {r["prompt"] for r in shapes.prompts("test")}
        relations = {r["include"][1]["position"][0] for r in records if r["tag"] == "position"}
        assert relations == set(shapes.RELATIONS)


def test_a_repeated_evaluation_prompt_gets_fresh_seeds():
    from diffgrpo.data_sources import listing_counts
    assert listing_counts(["a", "b", "a", "a", "c", "b"]) == [0, 0, 1, 2, 0, 1]
    cfg = RunConfig.from_overrides(["train.task=shapes", "eval.seeds_per_prompt=2"])
    from diffgrpo.flow.family import FlowFamily
    prompts, seeds, _ = FlowFamily.eval_prompts(type("F", (), {"cfg": cfg})())
    pairs = list(zip(prompts, seeds))
    assert len(set(pairs)) == len(pairs)  # no sample drawn twice
    assert seeds[:2] == [cfg.eval.seed, cfg.eval.seed + 1]


def test_a_prompt_without_metadata_gets_the_constraints_its_text_states():
    meta = task_metadata("a red circle left of a blue square", "shapes")
    assert meta["tag"] == "position" and meta["include"][1]["position"] == ["left of", 0]
    assert task_metadata("a handwritten digit 7") == {"digit": 7}
    assert "include" not in task_metadata("a cat", "shapes")
    assert len(default_prompts("shapes")) == len(shapes.CATEGORIES) and len(default_prompts()) == 10
    assert all(shapes.is_held_out(task_metadata(p, "shapes")) for p in default_prompts("shapes"))


# ---------------------------------------------------------------------- the model
def test_the_shapes_model_predicts_rgb_velocities_from_the_prompt():
    net = tiny_shapes.ShapesFlowNet(image_size=32, patch_size=4, num_layers=1, num_heads=2, head_dim=8, text_dim=16)
    c = net.text.encode(["a red circle left of a blue square", "two squares"])
    v = net(torch.randn(2, 3, 32, 32), torch.tensor([0.3, 0.9]), c["prompt_embeds"], c["pooled"])
    assert v.shape == (2, 3, 32, 32) and torch.isfinite(v).all()
    ids = tiny_shapes.tokenize(["a red circle left of a blue square", "a purple blob"])
    assert (ids[0] > 2).sum() == 8 and (ids[1] == tiny_shapes.VOCAB.index("<unk>")).sum() == 2


def test_the_pretraining_pool_holds_scenes_of_every_prompt_and_their_mirrors():
    images, prompts = tiny_shapes.scene_pool(16, 32, seed=0)
    assert images.shape == (32, 3, 32, 32) and images.min() >= -1 and images.max() <= 1
    assert torch.equal(images[16:], images[:16].flip(-1))
    grammar = {r["prompt"] for r in shapes.all_prompts()}
    assert set(prompts) <= grammar
    _, many = tiny_shapes.scene_pool(600, 32, seed=0)  # held-out combinations are pretrained on, as a base model's
    assert {shapes.parse(p)["tag"] for p in many if shapes.is_held_out(shapes.parse(p))} == set(shapes.CATEGORIES)
    for p, q in zip(prompts[:16], prompts[16:]):
        a, b = shapes.parse(p), shapes.parse(q)
        if a["tag"] != "position" or a["include"][1]["position"][0] in ("above", "below"):
            assert p == q
        else:
            assert p != q and {a["include"][1]["position"][0], b["include"][1]["position"][0]} == {"left of", "right of"}


def test_a_mirrored_scene_satisfies_the_mirrored_prompt():
    from diffgrpo.rewards.shapes import shapes_correct

    rng = np.random.default_rng(3)
    recs = [r for r in shapes.prompts("train", ("position",)) if r["include"][1]["position"][0] == "left of"][:8]
    images = torch.stack([shapes.render(r, rng) for r in recs]).flip(-1)  # (8, 3, 32, 32)
    mirrored = [tiny_shapes.mirror(r) for r in recs]
    assert shapes_correct(images, [m["prompt"] for m in mirrored], mirrored).tolist() == [1.0] * 8


# ---------------------------------------------------------------------- diversity from detections
def _det(kind, color, x, y, area=64):
    return Detection(kind, color, (x - 4, y - 4, x + 4, y + 4), (x, y), area)


def test_identical_samples_have_no_detection_diversity():
    one = sd.layout([_det("circle", "red", 8, 8), _det("square", "blue", 20, 20)], 32, 32)
    assert sd.layout_distance(one, one) == 0.0
    assert sd.prompt_diversity([one, one, one]) == 0.0
    assert sd.layout_distance(sd.layout([], 32, 32), sd.layout([], 32, 32)) == 0.0


def test_distinct_layouts_are_diverse_and_the_order_of_samples_does_not_matter():
    a = sd.layout([_det("circle", "red", 8, 8)], 32, 32)
    b = sd.layout([_det("circle", "red", 24, 8)], 32, 32)
    c = sd.layout([_det("square", "red", 8, 8)], 32, 32)  # another object: as far as objects can be
    assert sd.layout_distance(a, b) == pytest.approx(0.5)  # moved half the image side
    assert sd.layout_distance(a, c) == 1.0 and sd.layout_distance(a, sd.layout([], 32, 32)) == 0.5
    assert sd.layout_distance(a, b) == sd.layout_distance(b, a)
    forward = sd.detection_diversity({0: a, 1: b, 2: c, 3: a, 4: a, 5: a}, 3)
    backward = sd.detection_diversity({0: c, 1: a, 2: b, 3: a, 4: a, 5: a}, 3)
    assert forward == pytest.approx(backward) and forward == pytest.approx((0.5 + 1 + 1) / 3 / 2)


def test_rendered_samples_of_one_prompt_are_diverse_and_copies_are_not():
    rec = shapes.prompts("test", ("color_attr",))[0]
    rng = np.random.default_rng(0)
    varied = torch.stack([shapes.render(rec, rng) for _ in range(4)])
    copies = varied[:1].expand(4, -1, -1, -1)
    assert sd.detection_diversity(dict(enumerate(sd.layouts(varied))), 4) > 0.05
    assert sd.detection_diversity(dict(enumerate(sd.layouts(copies))), 4) == 0.0


def test_color_diversity_is_the_chance_two_objects_of_a_colour_free_prompt_differ_in_colour():
    import math

    from diffgrpo.rewards import shapes_diversity as sd

    def lay(*colors):  # a layout with one square per colour
        return (tuple(("square", c) for c in colors), np.zeros((len(colors), 3)))

    four = {0: lay("red"), 1: lay("green"), 2: lay("blue"), 3: lay("yellow")}
    assert sd.color_diversity(four, {0, 1, 2, 3}, 4) == pytest.approx(0.75)
    one = {i: lay("green") for i in range(4)}
    assert sd.color_diversity(one, {0, 1, 2, 3}, 4) == 0.0
    half = {0: lay("red", "red"), 1: lay("green", "green")}  # p = (1/2, 1/2) over four objects
    assert sd.color_diversity(half, {0, 1}, 2) == pytest.approx(0.5)
    assert sd.color_diversity({**four, **{4 + i: lay("red") for i in range(4)}}, {0, 1, 2, 3}, 4) == \
        pytest.approx(0.75)  # prompts that name a colour are left out
    assert math.isnan(sd.color_diversity(four, set(), 4))
    blob = {0: lay("red", None), 1: lay("green")}  # an unrecognised object of no palette colour is left out
    assert sd.color_diversity(blob, {0, 1}, 2) == pytest.approx(0.5)
    assert sd.color_free({"include": [{"class": "triangle", "count": 1}]})
    assert not sd.color_free({"include": [{"class": "triangle", "count": 1, "color": "red"}]})


def test_a_colour_collapse_of_a_colour_free_prompt_trips_the_colour_guard():
    cfg = RunConfig.from_overrides(["train.task=shapes", "eval.seeds_per_prompt=4"])
    g = guards.EvalGuards.for_flow(cfg, "cpu")
    rec = shapes.prompts("test", ("single_object",))[0]  # "a triangle": any colour
    colored = [{**rec, "include": [{**rec["include"][0], "color": c}]} for c in shapes.COLORS]
    rng = np.random.default_rng(2)
    varied = torch.stack([shapes.render(m, rng) for m in colored])  # four colours
    same = torch.stack([shapes.render(colored[1], rng) for _ in range(4)])  # all green

    def evaluate(images):
        ev = g.begin()
        ev.add([0, 1, 2, 3], g.chunk(images, [rec["prompt"]] * 4, [rec] * 4))
        return ev.result()

    start, end = evaluate(varied), evaluate(same)
    assert start["eval/guard/color_diversity"] == pytest.approx(0.75) and end["eval/guard/color_diversity"] == 0.0
    assert any("color_diversity" in t for t in guards.tripped(start, end, guards.Thresholds()))
    coloured_only = g.begin()  # an evaluation whose prompts all name a colour reports no colour guard
    coloured_only.add([0, 1, 2, 3], g.chunk(varied, [m["prompt"] for m in colored], colored))
    assert "eval/guard/color_diversity" not in coloured_only.result()


def test_the_evaluation_guards_report_detection_diversity_and_its_drop_trips():
    cfg = RunConfig.from_overrides(["train.task=shapes", "eval.seeds_per_prompt=4"])
    g = guards.EvalGuards.for_flow(cfg, "cpu")
    rec = shapes.prompts("test", ("colors",))[0]
    rng = np.random.default_rng(1)
    images = torch.stack([shapes.render(rec, rng) for _ in range(4)])
    ev = g.begin()
    ev.add([0, 1, 2, 3], g.chunk(images, [rec["prompt"]] * 4, [rec] * 4))
    row = ev.result()
    assert row["eval/guard/rewards/shapes_score/mean"] == 1.0 and row["eval/guard/detection_diversity"] > 0
    collapsed = {**row, "eval/guard/detection_diversity": 0.5 * row["eval/guard/detection_diversity"]}
    assert any("detection_diversity" in t for t in guards.tripped(row, collapsed, guards.Thresholds()))
    digits = guards.EvalGuards.for_flow(RunConfig.from_overrides(["train.task=digits"]), "cpu")
    assert digits.detections is False


# ---------------------------------------------------------------------- the command line
def test_train_task_shapes_trains_and_evaluates_through_the_command_line(tmp_path, capsys):
    from diffgrpo.cli.app import main

    out = tmp_path / "run"
    assert main(["train", *SHAPES_CLI, "train.num_iterations=2", "eval.every=0", f"log.output_dir={out}"]) == 0
    printed = capsys.readouterr().out
    assert "eval/rewards/shapes_correct/mean:" in printed
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert len(evals) == 2
    for r in evals:
        for k in ("eval/rewards/shapes_correct/mean", "eval/rewards/shapes_score/mean",
                  "eval/guard/rewards/shapes_score/mean", "eval/guard/detection_diversity"):
            assert np.isfinite(r[k]) and 0 <= r[k] <= 1, k
        assert r["eval/rewards/shapes_score/mean"] == r["eval/guard/rewards/shapes_score/mean"]
        assert np.isfinite(r["eval/fid"])  # in the shapes encoder's space (tests/test_shapes_guard_features.py)
    train = [r for r in rows if "reward" in r and "iteration" in r and "eval/reward" not in r]
    assert train and all("rewards/shapes_correct" in json.dumps(r) for r in train)
    assert (out / "samples_start_end.png").is_file()


def test_pretrain_with_train_task_shapes_caches_the_shapes_model(tmp_path, capsys):
    from diffgrpo.cli.app import main

    assert main(["pretrain", *SHAPES_CLI, f"model.cache_dir={tmp_path}"]) == 0
    assert "built-in shapes model cached in" in capsys.readouterr().out
    assert [p.name[:12] for p in tmp_path.iterdir() if p.is_dir()] == ["tiny-shapes-"]  # no digits model, no classifier


def test_one_seed_per_prompt_reports_no_detection_diversity_and_trips_no_guard():
    """eval.seeds_per_prompt=1: no prompt has two samples, so the layout diversity is undefined; the row leaves it
    out (as the colour guard where no prompt is colour-free) instead of a NaN that every evaluation, the start's
    too, would count as a guard that cannot be computed (train.on_hacking=stop would stop before training)."""
    cfg = RunConfig.from_overrides(["train.task=shapes", "eval.seeds_per_prompt=1"])
    g = guards.EvalGuards.for_flow(cfg, "cpu")
    recs = shapes.prompts("test", ("colors",))[:4]
    rng = np.random.default_rng(1)
    ev = g.begin()
    ev.add([0, 1, 2, 3], g.chunk(torch.stack([shapes.render(r, rng) for r in recs]), [r["prompt"] for r in recs], recs))
    row = ev.result()
    assert row["eval/guard/rewards/shapes_score/mean"] == 1.0
    assert "eval/guard/detection_diversity" not in row
    assert guards.tripped(row, dict(row), guards.Thresholds()) == []
