"""Configuration parsing/validation and the command line."""
import json
import subprocess
import sys

import pytest
import yaml

from diffgrpo import ConfigError, RunConfig
from diffgrpo.cli.app import main


def test_defaults_and_overrides():
    cfg = RunConfig.from_overrides(["engine.name=recompute", "seed=3", "train.lr=5e-5", "loss.beta=0.01",
                                    "train.digits=[1, 7]", "log.progress=false"])
    assert cfg.seed == 3 and cfg.train.lr == 5e-5 and cfg.loss.beta == 0.01 and cfg.train.digits == [1, 7]
    assert cfg.log.progress is False
    assert RunConfig().train.lr == 1e-4  # defaults untouched


def test_yaml_roundtrip_and_file_plus_overrides(tmp_path):
    cfg = RunConfig.from_overrides(["sampler.num_steps=12", "reward.weights={jpeg_compressibility: 2.0}"])
    p = tmp_path / "run.yaml"
    p.write_text(cfg.to_yaml())
    back = RunConfig.from_yaml(p, ["seed=9"])
    assert back.sampler.num_steps == 12 and back.reward.weights == {"jpeg_compressibility": 2.0} and back.seed == 9
    p.write_text(yaml.safe_dump({"engine": {"name": "recompute"}, "sampler": {"shift": 1.0}}))
    assert RunConfig.from_yaml(p).sampler.shift == 1.0


def test_dict_entry_override():
    cfg = RunConfig.from_overrides(["reward.weights.jpeg_compressibility=0.5"])
    assert cfg.reward.weights == {"digit_alignment": 1.0, "jpeg_compressibility": 0.5}


@pytest.mark.parametrize("overrides, message", [
    (["engine.nmae=recompute"], "unknown config key 'engine.nmae' (did you mean 'name'?)"),
    (["sampler.sde_typ=cps"], "did you mean 'sde_type'?"),
    (["trian.lr=1"], "unknown config key 'trian' (did you mean 'train'?)"),
    (["sampler.sde_type=euler"], "sampler.sde_type: value 'euler' is not allowed; choose one of ['flow_sde', 'dance_sde', 'cps', 'ode']"),
    (["sampler.sde_type=ode"], "sampler.sde_type: 'ode' has no exploration noise"),
    (["train.lr=-1"], "train.lr: value -1.0 is out of range; must be >= 0.0"),
    (["train.group_size=1"], "train.group_size: value 1 is out of range; must be >= 2"),
    (["train.group_size=2.5"], "train.group_size: value 2.5 is not a valid int"),
    (["log.progress=maybe"], "log.progress: value 'maybe' is not a valid bool"),
    (["engine.name=fast"], "engine.name: value 'fast' is not a registered engine"),
    (["reward.weights={hpsv3: 1.0}"], "reward.weights: unknown reward 'hpsv3'"),
    (["reward.weights={}"], "reward.weights: at least one reward is required"),
    (["reward.weights={digit_alignment: high}"], "reward.weights.digit_alignment: weight 'high' must be a number"),
    (["train.digits=[3, 12]"], "train.digits: value [3, 12] must be a non-empty list of digits 0..9"),
    (["sampler.num_steps=1"], "sampler.num_steps: must be >= 2"),
    (["loss.aggregation=median"], "loss.aggregation: value 'median' is not allowed"),
    (["seed"], "override 'seed' must look like key=value"),
    (["engine=recompute"], "engine: is a section"),
    (["model.name=tiny_mlm", "model.lora_rank=8"], "model.lora_rank: does not apply to model.name=tiny_mlm "
                                                   "(the dllm family)"),
    # keys of the other family are refused, naming the key and the family
    (["model.name=tiny_mlm", "engine.name=jagg"], "engine.name: does not apply to model.name=tiny_mlm "
                                                  "(the dllm family); it is read only for flow-matching models"),
    (["model.name=tiny_mlm", "loss.clip_range=0.3"], "loss.clip_range: does not apply to model.name=tiny_mlm"),
    (["model.name=tiny_mlm", "reward.weights={jpeg_compressibility: 1.0}"],
     "reward.weights: 'jpeg_compressibility' scores images and cannot score a masked diffusion LM's completions"),
    (["model.name=tiny_mlm", "reward.background=true"], "reward.background: does not apply to model.name=tiny_mlm"),
    (["dllm.task=sudoku"], "dllm.task: does not apply to model.name=tiny (the flow family); it is read only for "
                           "masked diffusion LMs"),
    (["daca.dps_score=entropy"], "daca.dps_score: does not apply to model.name=tiny (the flow family)"),
    (["model.name=hf_masked_lm"], "dllm.model_path: required for model.name=hf_masked_lm"),
    # engine keys that the chosen engine never reads
    (["engine.window=3"], "engine.window: does not apply to engine.name=recompute; it is read only by ['jagg']"),
    (["engine.name=jagg", "engine.wave_size=2"], "engine.wave_size: does not apply to engine.name=jagg"),
    (["engine.evaluation=retain"], "engine.evaluation: does not apply to engine.name=recompute; it is read only "
                                   "by ['jagg', 'single_step']"),
])
def test_bad_input_is_one_clear_line(overrides, message):
    with pytest.raises(ConfigError) as e:
        RunConfig.from_overrides(overrides)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_config_file():
    with pytest.raises(ConfigError, match="--config: file 'nope.yaml' does not exist"):
        RunConfig.from_yaml("nope.yaml")


def test_cli_print_config_and_error_exit_code(capsys):
    assert main(["print-config", "engine.name=recompute", "seed=5"]) == 0
    out = yaml.safe_load(capsys.readouterr().out)
    assert out["seed"] == 5 and out["engine"]["name"] == "recompute"
    assert main(["train", "engine.window=0"]) == 2
    assert "engine.window: value 0 is out of range; must be >= 2" in capsys.readouterr().err


def test_cli_entry_point_runs_as_a_module():
    r = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "print-config", "sampler.num_steps=7"],
                       capture_output=True, text=True, check=True)
    assert yaml.safe_load(r.stdout)["sampler"]["num_steps"] == 7


TINY_CLI = ["model.image_size=8", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16",
            "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4", "train.prompts_per_batch=2",
            "train.group_size=2", "eval.seeds_per_prompt=1", "log.progress=false"]


def test_cli_train_sample_and_bench_end_to_end(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *TINY_CLI, "train.num_iterations=1", f"log.output_dir={run}"]) == 0
    out = capsys.readouterr().out
    assert "eval/rewards/digit_alignment/mean:" in out
    assert (run / "weights.safetensors").is_file()
    assert (run / "transformer" / "config.json").is_file()  # the tiny model exports like any SD3 transformer
    assert main(["sample", "--weights", str(run), "--prompt", "a handwritten digit 3", "--num", "2",
                 "--out", str(tmp_path / "s.png")]) == 0
    assert (tmp_path / "s.png").is_file()
    assert main(["sample", "--weights", str(tmp_path / "missing"), *TINY_CLI]) == 2
    assert main(["bench", "engines", *TINY_CLI, "--variants", "recompute", "--repeats", "1",
                 "--out", str(tmp_path / "bench")]) == 0
    rep = json.loads((tmp_path / "bench" / "engines.json").read_text())
    (row,) = rep["rows"]
    assert row["variant"] == "recompute" and row["train_speedup"] == 1.0
    assert row["grad_cos_vs_recompute"] == pytest.approx(1.0)
    assert row["counters"]["sample_backwards"] == 4 * 3  # 4 samples × 3 trainable steps
    assert (tmp_path / "bench" / "engines.md").read_text().count("| recompute |") == 1
