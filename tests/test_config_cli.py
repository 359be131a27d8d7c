"""Configuration parsing/validation and the command line."""
import json
import subprocess
import sys
import time

import pytest
import torch
import yaml

from diffgrpo import ConfigError, RunConfig
from diffgrpo.cli.app import main
from diffgrpo.studies.engines import ZERO_GRADIENT
from diffgrpo.tasks import shapes


def test_defaults_and_overrides():
    cfg = RunConfig.from_overrides(["engine.name=recompute", "seed=3", "train.lr=5e-5", "loss.beta=0.01",
                                    "train.task=digits", "train.digits=[1, 7]", "log.progress=false"])
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
    cfg = RunConfig.from_overrides(["train.task=digits", "reward.weights.jpeg_compressibility=0.5"])
    assert cfg.reward.weights == {"digit_alignment": 1.0, "jpeg_compressibility": 0.5}


@pytest.mark.parametrize("overrides, message", [
    (["engine.nmae=recompute"], "unknown config key 'engine.nmae' (did you mean 'name'?)"),
    (["sampler.sde_typ=cps"], "did you mean 'sde_type'?"),
    (["trian.lr=1"], "unknown config key 'trian' (did you mean 'train'?)"),
    (["sampler.sde_type=euler"], "sampler.sde_type: value 'euler' is not allowed; choose one of ['flow_sde', 'dance_sde', 'flash_sde', 'cps', 'ode']"),
    (["sampler.sde_type=ode"], "sampler.sde_type: 'ode' has no exploration noise"),
    (["train.lr=-1"], "train.lr: value -1.0 is out of range; must be >= 0.0"),
    (["train.group_size=1"], "train.group_size: value 1 is out of range; must be >= 2"),
    (["train.group_size=2.5"], "train.group_size: value 2.5 is not a valid int"),
    (["log.progress=maybe"], "log.progress: value 'maybe' is not a valid bool"),
    (["engine.name=fast"], "engine.name: value 'fast' is not a registered engine"),
    (["reward.weights={hpsv3: 1.0}"], "reward.weights: unknown reward 'hpsv3'"),
    (["train.task=shapes", "reward.weights={}"],
     "reward.weights: at least one reward is required, e.g. reward.weights={shapes_score: 1.0}"),
    (["reward.weights={}"], "e.g. reward.weights={digit_alignment: 1.0}"),
    (["model.name=diffusers", "model.pretrained=org/m", "reward.weights={}"], "e.g. reward.weights={pickscore: 1.0}"),
    (["train.task=shapes", "train.digits=[1, 7]"], "train.digits: value [1, 7] is read only by train.task=digits, not train.task=shapes; set "
                              "train.task=digits or remove it"),
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


TINY_CLI = ["train.task=digits", "model.image_size=8", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8",
            "model.text_dim=16", "pretrain.steps=20", "pretrain.batch_size=16", "sampler.num_steps=4",
            "train.prompts_per_batch=2", "train.group_size=2", "eval.seeds_per_prompt=1", "log.progress=false"]


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


# ----------------------------------------------------------------------- issue 25 H-4: YAML 1.1 scalars in string keys
@pytest.mark.parametrize("typed", ["001", "010", "12:30", "on", "0x1F", "1e3", "2024-01-01"])
def test_string_keys_get_the_text_as_typed(typed):
    from diffgrpo import RunConfig

    assert RunConfig.from_overrides([f"log.output_dir={typed}"]).log.output_dir == typed
    assert RunConfig.from_overrides([f"model.negative_prompt={typed}"]).model.negative_prompt == typed


def test_words_and_numbers_parse_as_yaml_1_2():
    from diffgrpo import RunConfig

    cfg = RunConfig.from_overrides(["train.task=digits", "model.negative_prompt=no",
                                    "reward.weights={digit_alignment: 1e-3}", "train.lr=1e-3", "train.num_iterations=010",
                                    "log.progress=on"])
    assert cfg.model.negative_prompt == "no" and cfg.reward.weights == {"digit_alignment": 0.001}
    assert cfg.train.lr == 0.001 and cfg.train.num_iterations == 10 and cfg.log.progress is True
    assert type(cfg.train.lr) is float and type(cfg.reward.weights["digit_alignment"]) is float
    assert RunConfig.from_yaml  # the file loader is the same strict one
    again = RunConfig.from_overrides([], base=None)
    assert again.to_yaml()  # plain values dump


def test_yaml_files_refuse_duplicate_keys_and_alias_bombs(tmp_path):
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    dup = tmp_path / "dup.yaml"
    dup.write_text("train:\n  lr: 0.1\ntrain:\n  lr: 0.2\n")
    with pytest.raises(ConfigError, match=r"duplicate key 'train' at line 3 \(first at line 1\)"):
        RunConfig.from_yaml(dup)
    with pytest.raises(ConfigError, match=r"^reward\.weights: duplicate key 'a'"):
        RunConfig.from_overrides(["reward.weights={a: 1, a: 2}"])
    levels = ["a: &a [x, x, x, x, x, x, x, x, x]"] + [
        f"{c}: &{c} [{', '.join([f'*{p}'] * 9)}]" for p, c in zip("abcdefgh", "bcdefghi")]
    bomb = tmp_path / "bomb.yaml"
    bomb.write_text("\n".join(levels) + "\n")
    assert bomb.stat().st_size < 400
    t0 = time.perf_counter()
    with pytest.raises(ConfigError) as err:
        RunConfig.from_yaml(bomb)
    assert "aliases expand to" in str(err.value) and len(str(err.value)) < 300
    assert time.perf_counter() - t0 < 5


def test_echoed_values_are_bounded():
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides(["train.lr=[" + ", ".join(["123456789"] * 5000) + "]"])
    assert len(str(err.value)) < 400 and "characters)" in str(err.value)


# ---------------------------------------------------------------- issue 25 M-6: overrides anywhere on the command line
@pytest.mark.parametrize("argv, overrides", [
    (["export", "model.pretrained=/base", "RUN", "--out", "D"], ["model.pretrained=/base"]),
    (["export", "RUN", "--out", "D", "model.pretrained=/base", "--merge"], ["model.pretrained=/base"]),
    (["export", "--out", "D", "--model.pretrained", "/base", "RUN"], ["model.pretrained=/base"]),
    (["train", "seed=1", "--resume", "R", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["sample", "seed=1", "--prompt", "a=b", "--weights", "R", "sampler.num_steps=3"], ["seed=1", "sampler.num_steps=3"]),
    (["print-config", "seed=1", "--changed", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["bench", "engines", "seed=1", "--repeats", "1", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["download", "seed=1", "--dry-run", "train.lr=1"], ["seed=1", "train.lr=1"]),
    (["pretrain", "seed=1", "--task", "sudoku", "train.lr=1"], ["seed=1", "train.lr=1"])])
def test_overrides_anywhere_on_every_subcommand(argv, overrides):  # M-6
    from diffgrpo.cli.app import parse_args

    args = parse_args(argv)
    assert args.overrides == overrides
    if args.command == "export":
        assert (args.source, args.out) == ("RUN", "D")
    if args.command == "sample":
        assert args.prompt == ["a=b"] and args.weights == "R"


# ----------------------------------------------------- issue 25, low ones: settings that would be ignored or fail late
@pytest.mark.parametrize("override, why", [
    ("train.warmup_iterations=5", "train.warmup_iterations: value 5 is more than train.num_iterations=3"),
    ("train.digits=[3]", "train.digits: value [3] is not read with train.prompts_file set"),
    ("reward.options={pickscore: {model: /nonexistent/pickscore}}",
     "reward.options.pickscore.model: '/nonexistent/pickscore' names a local path that does not exist"),
    ("reward.options={pickscore: {device: 'cuda:7'}}", ("reward.options.pickscore.device: value 'cuda:7' is not a "
                                                        "device of this machine"))])
def test_settings_that_would_be_ignored_or_fail_late_are_refused(tmp_path, override, why):
    from diffgrpo import RunConfig
    from diffgrpo.errors import ConfigError

    if "cuda:7" in override and torch.cuda.device_count() > 7:
        pytest.skip("this machine has a cuda:7")
    prompts = tmp_path / "p.txt"
    prompts.write_text("a handwritten digit 3\n")
    base = ["train.num_iterations=3", "reward.weights={pickscore: 1.0}" if "pickscore" in override else "seed=0",
            *(["train.task=digits", f"train.prompts_file={prompts}"] if "digits" in override else [])]
    with pytest.raises(ConfigError) as err:
        RunConfig.from_overrides([*base, override])
    assert str(err.value).startswith(why) and "\n" not in str(err.value)


def test_configs_list_ends_each_description_at_a_word_with_an_ellipsis(capsys):
    from diffgrpo.cli.recipes import shipped, summary

    assert main(["configs", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    for (name, text), line in zip(shipped().items(), out):
        desc = line[len(name):].strip()
        assert desc == summary(text) and len(desc) <= 100, line
        words = " ".join(x.lstrip("#").strip() for x in text.splitlines() if x.startswith("#")).split()
        shown = desc.removesuffix(" …").split()  # whole words of the header, the last without its punctuation
        last = words[len(shown) - 1]
        assert shown[:-1] == words[: len(shown) - 1] and shown[-1] in (last, last.rstrip(".,;:(-–")), line
    assert summary("# A b c. More text here.\nx: 1\n") == "A b c"
    assert summary("# FLUX.2 [dev] (a. b) + LoRA. Then more.\n") == "FLUX.2 [dev] (a. b) + LoRA"
    assert summary("# " + "word " * 40 + "end.\n") == ("word " * 19).strip() + " …"


def test_print_config_check_data_says_what_it_checked(tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a red circle\ntwo blue squares\n")
    assert main(["print-config", "--check-data", "train.task=shapes", f"train.prompts_file={prompts}"]) == 0
    captured = capsys.readouterr()
    assert yaml.safe_load(captured.out)["train"]["prompts_file"] == str(prompts)  # stdout: the config
    held_out = len(shapes.prompt_set("test"))  # the shapes task's evaluation rows
    assert captured.err == (f"data checked: train.prompts_file {str(prompts)!r}: 2 prompts; eval.prompts_file "
                            f"'builtin:shapes/test': {held_out} prompts\n")
    assert main(["print-config", "--check-data", "train.task=digits"]) == 0
    assert capsys.readouterr().err == ("data checked: train.prompts_file: the digit prompts; eval.prompts_file: the "
                                       "digit prompts\n")
    assert main(["print-config", f"train.prompts_file={prompts}"]) == 0
    assert capsys.readouterr().err == ""  # without --check-data nothing is loaded, nothing said


# The shapes task's model at its smallest: one block, a 10-step pretraining of 8-image batches, 3 sampling steps.
SHAPES_CLI = ["train.task=shapes", "model.num_layers=1", "model.num_heads=2", "model.head_dim=8", "model.text_dim=16", "pretrain.steps=10",
              "pretrain.batch_size=8", "sampler.num_steps=3", "train.prompts_per_batch=2", "train.group_size=2",
              "log.progress=false"]


def test_bench_engines_runs_on_the_shapes_task(tmp_path):
    out = tmp_path / "bench"
    assert main(["bench", "engines", *SHAPES_CLI, "reward.weights={'tests.helpers.rewards:brightness': 1.0}", "--variants",
                 "recompute;retain", "--repeats", "1", "--out", str(out)]) == 0
    rep = json.loads((out / "engines.json").read_text())
    assert rep["config"]["train"]["task"] == "shapes" and rep["config"]["model"]["image_size"] == 32
    rows = {row["variant"]: row for row in rep["rows"]}
    assert set(rows) == {"recompute", "retain"}
    for row in rows.values():  # the same gradient, of a loss that is not zero
        assert row["grad_cos_vs_recompute"] == pytest.approx(1.0) and row["metrics"]["loss"] != 0.0
        assert row["counters"]["sample_backwards"] == 4 * 2  # 4 samples × 2 trainable steps
    assert "note" not in rep and "Note:" not in (out / "engines.md").read_text()
    flat = tmp_path / "flat"  # rewards that tie in every group: no gradient to compare, and the report says so
    assert main(["bench", "engines", *SHAPES_CLI, "reward.weights={'tests.helpers.rewards:constant': 1.0}",
                 "--variants", "recompute", "--repeats", "1", "--out", str(flat)]) == 0
    assert json.loads((flat / "engines.json").read_text())["note"] == ZERO_GRADIENT
    assert (flat / "engines.md").read_text().endswith("\n\n" + ZERO_GRADIENT + "\n")


def test_help_names_the_default_task(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    listed = " ".join(capsys.readouterr().out.split())
    assert "run GRPO (default: the built-in digits model)" in listed
    assert "pretrain and cache the built-in model (for digits also its reward classifier)" in listed
    with pytest.raises(SystemExit):
        main(["sample", "--help"])
    assert "default: the task's (a held-out one per shapes category, or digits 0-9)" in " ".join(
        capsys.readouterr().out.split())


def test_a_shapes_task_run_samples_and_exports_from_the_command_line(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", *SHAPES_CLI, "eval.seeds_per_prompt=1", "train.num_iterations=1", "train.save_every=1",
                 "model.lora_rank=0", f"log.output_dir={run}"]) == 0  # a full fine-tune: its export is a transformer
    assert "eval/rewards/shapes_correct/mean:" in capsys.readouterr().out
    assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(tmp_path / "s.png")]) == 0
    assert "wrote 6 samples" in capsys.readouterr().out  # a held-out prompt per shapes category
    assert main(["export", str(run), "--out", str(tmp_path / "model")]) == 0
    card = (tmp_path / "model" / "README.md").read_text()  # what else loading it needs, for this model
    assert "built-in shapes model" in card and "predicts the clean sample" in card
    assert "diffgrpo.models.tiny_shapes.velocity_from_clean" in card
    from diffusers import SD3Transformer2DModel

    net = SD3Transformer2DModel.from_pretrained(tmp_path / "model")  # the three-channel 32-pixel transformer
    assert (net.config.in_channels, net.config.sample_size, net.config.patch_size) == (3, 32, 8)
