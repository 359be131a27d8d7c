"""Configuration guards: every bad value ends in one ConfigError line naming the key, raised by
RunConfig.from_overrides / from_yaml / validate before any model loads."""
import os
from pathlib import Path

import pytest
import torch
import yaml

from diffgrpo import ConfigError, RunConfig
from diffgrpo import validation as config_mod
from diffgrpo.cli.app import main
from diffgrpo.config import MAX_SAMPLES_PER_ITERATION
from diffgrpo.validation import validate

MLM = ["model.name=tiny_mlm"]


def _error(fn, *args) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


BAD_OVERRIDES = [
    # 1. NaN / inf in float fields and in reward weights
    (["train.lr=inf"], "train.lr: value inf is not a finite number; must be >= 0.0"),
    (["train.lr=nan"], "train.lr: value nan is not a finite number; must be >= 0.0"),
    (["train.lr=.nan"], "train.lr: value nan is not a finite number; must be >= 0.0"),
    (["train.lr=-inf"], "train.lr: value -inf is not a finite number; must be >= 0.0"),
    (["sampler.noise_level=nan"], "sampler.noise_level: value nan is not a finite number; must be >= 0.0"),
    (["sampler.shift=nan"], "sampler.shift: value nan is not a finite number; must be >= 0.001"),
    ([*MLM, "dllm.temperature=nan"], "dllm.temperature: value nan is not a finite number; must be >= 0.0"),
    (["train.ema_decay=nan"], "train.ema_decay: value nan is not a finite number; must be in [0.0, 0.9999]"),
    (["model.guidance_scale=inf"], "model.guidance_scale: value inf is not a finite number; must be >= 0.0"),
    (["train.max_grad_norm=1e999"], "train.max_grad_norm: value inf is not a finite number; must be >= 0.0"),
    (["reward.weights={digit_alignment: .nan}"], "reward.weights.digit_alignment: weight nan must be a finite number"),
    (["reward.weights.digit_alignment=.inf"], "reward.weights.digit_alignment: weight inf must be a finite number"),
    (["reward.weights={digit_alignment: [1]}"], "reward.weights.digit_alignment: weight [1] must be a number"),
    (["train.num_iterations=1e999"], "train.num_iterations: value '1e999' is not a valid int"),
    (["train.num_iterations=.inf"], "train.num_iterations: value inf is not a valid int"),
    # 3. plausibility bound on the samples per iteration
    (["train.prompts_per_batch=1000000000"],
     "train.prompts_per_batch: value 1000000000 is out of range; must be <= 65536"),
    (["train.group_size=100000"], "train.group_size: value 100000 is out of range; must be <= 65536"),
    (["train.prompts_per_batch=8192", "train.group_size=16"],
     "train.prompts_per_batch: value 8192 is out of range with train.group_size=16 (131072 samples per iteration); "
     "prompts_per_batch × group_size must be <= 65536"),
    (["pretrain.batch_size=1000000000"], "pretrain.batch_size: value 1000000000 is out of range; must be <= 65536"),
    # 4. YAML syntax in an override value
    (["train.lr=[1,"], "train.lr: value '[1,' is not valid YAML (line 1, column 4: "),
    (["engine.name={a: b"], "engine.name: value '{a: b' is not valid YAML (line 1, column 6: "),
    (["train.digits=[1, 2]]"], "train.digits: value '[1, 2]]' is not valid YAML (line 1, column 7: "),
    (["train.lr=2020-13-45"], "train.lr: value '2020-13-45' is not a valid float"),  # YAML 1.2: a date is text
    # 5. plug-ins given as module:Class / module:function
    (["engine.name=foo:Bar"], "engine.name: value 'foo:Bar' cannot be imported (ModuleNotFoundError: No module named "
                              "'foo'); choose one of ['awm', 'dgpo', 'jagg', 'nft', 'recompute', 'retain', 'reweight', 'single_step'] or "
                              "an importable module:Class"),
    (["engine.name=json:dumps"], "engine.name: value 'json:dumps' is not a class (it is a function)"),
    (["engine.name=json:NoSuchThing"], "engine.name: value 'json:NoSuchThing' cannot be imported (AttributeError: "),
    (["engine.name=:Bar"], "engine.name: value ':Bar' is not a valid module:Class (the module name is empty)"),
    (["engine.name='json:'"], "engine.name: value 'json:' is not a valid module:Class ('' is not a Python name)"),
    (["engine.name=json: x"], "engine.name: value {'json': 'x'} is not a valid str"),
    (["reward.weights={':fn': 1}"], "reward.weights: reward ':fn' is not a valid module:function (the module name is "
                                    "empty); choose one of ['aesthetic', 'clip_direction', 'clip_score', 'd1_format', "
                                    "'digit_alignment', 'geneval', 'http', 'jpeg_compressibility', "
                                    "'jpeg_incompressibility', 'ocr', 'pickscore', 'shapes_correct', 'shapes_score', "
                                    "'shapes_video_correct', 'shapes_video_score', 'verify_code', 'verify_code_pass_at_1', "
                                    "'verify_countdown', 'verify_gsm8k', 'verify_json_schema', 'verify_math', 'verify_sudoku'] "
                                    "or package.module:function"),
    (["reward.weights={'.rel:fn': 1}"], "reward.weights: reward '.rel:fn' is not a valid module:function ('.rel' is "
                                        "not a dotted module name)"),
    (["reward.weights={'json:': 1}"], "reward.weights: reward 'json:' is not a valid module:function"),
    # 6. devices
    (["model.device=gpu"], "model.device: value 'gpu' is not a torch device; choose 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    (["model.device="], "model.device: value '' is not a torch device"),
    (["model.device=meta"], "model.device: value 'meta' is not supported; choose 'cpu', 'cuda', 'cuda:N' or 'mps'"),
    # 8. a window start beyond the trainable steps
    (["steps.window_start=50"], "steps.window_start: value 50 is out of range; a window of 4 steps "
                                "(steps.window_size=4) must end within the 9 trainable steps of sampler.num_steps=10: "
                                "must be <= 5 (or -1: a random start per sample)"),
    (["steps.mode=window", "steps.window_start=6"], "steps.window_start: value 6 is out of range"),
    # 10. masked-LM sizes (arithmetic: default gen_length 8, longest answer 5 tokens)
    ([*MLM, "dllm.block_length=3"], "dllm.block_length: value 3 does not divide the generation length 8 "
                                    "(dllm.task=arithmetic's default gen_length 8); choose one of [1, 2, 4, 8] or 0"),
    ([*MLM, "dllm.block_length=16"], "dllm.block_length: value 16 does not divide the generation length 8"),
    ([*MLM, "dllm.block_length=4", "dllm.diffusion_steps=3"],
     "dllm.diffusion_steps: value 3 is not a multiple of the 2 blocks (generation length 8 / dllm.block_length 4); "
     "choose one of [2, 4, 6, 8] or 0 (= 8)"),
    ([*MLM, "dllm.diffusion_steps=16"], "dllm.diffusion_steps: value 16 is out of range; at most one step per token: "
                                        "must be <= the generation length 8"),
    ([*MLM, "dllm.task=json_schema", "dllm.gen_length=12"],
     "dllm.gen_length: value 12 is out of range; the longest dllm.task=json_schema answer has 31 tokens; "
     "must be >= 31 (0 = the task's default 32)"),
    ([*MLM, "dllm.gen_length=4"], "dllm.gen_length: value 4 is out of range; the longest dllm.task=arithmetic answer "
                                  "has 5 tokens; must be >= 5"),
    ([*MLM, "dllm.gen_length=16"], "dllm.gen_length: value 16 is out of range; the built-in tiny_mlm for "
                                   "dllm.task=arithmetic has positions for 8 completion tokens; must be <= 8"),
    ([*MLM, "dllm.gen_length=6", "dllm.block_length=4"],
     "dllm.block_length: value 4 does not divide the generation length 6 (dllm.gen_length=6); choose one of "
     "[1, 2, 3, 6] or 0"),
    # 11. dist.timeout
    (["dist.timeout=0"], "dist.timeout: value 0.0 is out of range; must be > 0.0"),
    (["dist.timeout=-5"], "dist.timeout: value -5.0 is out of range; must be > 0.0"),
    (["dist.timeout=inf"], "dist.timeout: value inf is not a finite number; must be > 0.0"),
    (["dist.timeout=nan"], "dist.timeout: value nan is not a finite number; must be > 0.0"),
    ([*MLM, "dist.timeout=.nan"], "dist.timeout: value nan is not a finite number; must be > 0.0"),
    # container values where a scalar belongs
    (["model.device={a: 1}"], "model.device: value {'a': 1} is not a valid str"),
    (["train.digits=[[1]]"], "train.digits: value [[1]] is not a valid list"),
    (["train.digits=[true]"], "train.digits: value [True] must be a non-empty list of digits 0..9"),
]


@pytest.mark.parametrize("overrides, start", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_override_is_one_line_naming_the_key(overrides, start):
    msg = _error(RunConfig.from_overrides, overrides)
    assert msg.startswith(start), msg


@pytest.mark.parametrize("overrides, start", BAD_OVERRIDES[:6] + BAD_OVERRIDES[18:20],
                         ids=[" ".join(o) for o, _ in BAD_OVERRIDES[:6] + BAD_OVERRIDES[18:20]])
def test_cli_prints_the_same_single_line(overrides, start, capsys):
    assert main(["print-config", *overrides]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: " + start), err


def test_good_values_still_pass():
    cfg = RunConfig.from_overrides(["train.prompts_per_batch=4096", "train.group_size=16", "steps.mode=window",
                                    "steps.window_start=5", "dist.timeout=60", "engine.name=diffgrpo.engines:JaggEngine"])
    assert cfg.train.prompts_per_batch * cfg.train.group_size == MAX_SAMPLES_PER_ITERATION
    assert cfg.dist.timeout == 60.0
    mlm = RunConfig.from_overrides([*MLM, "dllm.gen_length=6", "dllm.block_length=3", "dllm.diffusion_steps=4"])
    assert mlm.dllm.gen_length == 6
    RunConfig.from_overrides([*MLM, "dllm.task=json_schema", "dllm.gen_length=31"])


# ------------------------------------------------------------------------------------------ 2. validate(cfg)
def test_validate_reapplies_field_checks_to_a_python_built_config():
    cfg = RunConfig()
    cfg.train.group_size = 1
    assert _error(validate, cfg).startswith("train.group_size: value 1 is out of range; must be >= 2")
    cases = [
        ("train", "lr", float("nan"), "train.lr: value nan is not a finite number; must be >= 0.0"),
        ("train", "lr", "fast", "train.lr: value 'fast' is not a valid float"),
        ("sampler", "sde_type", "euler", "sampler.sde_type: value 'euler' is not allowed; choose one of"),
        ("model", "name", "gpt", "model.name: value 'gpt' is not allowed; choose one of"),
        ("log", "progress", "maybe", "log.progress: value 'maybe' is not a valid bool"),
        ("train", "ema_decay", 1.0, "train.ema_decay: value 1.0 is out of range; must be <= 0.9999"),
        ("sampler", "num_steps", 2.5, "sampler.num_steps: value 2.5 is not a valid int"),
        ("dist", "timeout", 0, "dist.timeout: value 0.0 is out of range; must be > 0.0"),
        ("train", "prompts_per_batch", 10**9, "train.prompts_per_batch: value 1000000000 is out of range; must be <= 65536"),
    ]
    for section, key, value, start in cases:
        cfg = RunConfig()
        setattr(getattr(cfg, section), key, value)
        assert _error(validate, cfg).startswith(start), (key, value)
    cfg = RunConfig()
    cfg.reward.weights = {"digit_alignment": float("inf")}
    assert _error(validate, cfg).startswith("reward.weights.digit_alignment: weight inf must be a finite number")
    cfg = RunConfig()
    cfg.train = None
    assert _error(validate, cfg).startswith("train: value None is not a section; it must be a TrainConfig")
    assert _error(validate, {"seed": 1}).startswith("config: value of type dict is not a RunConfig")


def test_validate_coerces_python_values():
    cfg = RunConfig()
    cfg.train.lr = 1  # an int learning rate is stored as the float it means
    validate(cfg)
    assert cfg.train.lr == 1.0 and isinstance(cfg.train.lr, float)


def test_a_python_built_config_gets_its_task_keys_as_the_command_line_does():
    cfg = RunConfig()
    cfg.train.task = "shapes"
    validate(cfg)
    assert cfg.to_dict() == RunConfig.from_overrides(["train.task=shapes"]).to_dict()
    assert (cfg.model.image_size, cfg.train.prompts_file) == (32, "builtin:shapes/train")
    digits = RunConfig()
    digits.train.task = "digits"
    validate(digits)
    assert digits.to_dict() == RunConfig.from_overrides(["train.task=digits"]).to_dict()
    assert (digits.model.image_size, digits.train.prompts_file) == (16, "")


def test_trainer_refuses_a_python_built_config_before_loading_a_model():
    from diffgrpo import Trainer

    cfg = RunConfig()
    cfg.sampler.noise_level = float("nan")
    with pytest.raises(ConfigError, match=r"^sampler.noise_level: value nan is not a finite number"):
        Trainer(cfg, policy=object())


# ------------------------------------------------------------------------------------------ 4. config files
def test_config_file_syntax_error_names_file_and_line(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train:\n  lr: 1e-4\n  group_size: 8: 9\n")
    msg = _error(RunConfig.from_yaml, p)
    assert msg.startswith(f"--config: file {str(p)!r} is not valid YAML (line 3, column 16: mapping values are not "
                          f"allowed here); fix the syntax there"), msg
    p.write_text("train:\n  group_size: [1,\n")
    assert _error(RunConfig.from_yaml, p).startswith(f"--config: file {str(p)!r} is not valid YAML (line 3, column 1: "
                                                     f"expected the node content, but found '<stream end>')")
    p.write_text("train:\n  lr: 1\n bad: 2\n")
    assert _error(RunConfig.from_yaml, p).startswith(f"--config: file {str(p)!r} is not valid YAML (line 3, ")


def test_nested_unknown_key_in_a_config_file_names_the_full_key(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text(yaml.safe_dump({"engine": {"nmae": "jagg"}}))
    assert _error(RunConfig.from_yaml, p).startswith("unknown config key 'engine.nmae' (did you mean 'name'?); "
                                                     "keys under engine: ")
    p.write_text(yaml.safe_dump({"train": {"lr": 1e-4, "grup_size": 4}}))
    assert _error(RunConfig.from_yaml, p).startswith("unknown config key 'train.grup_size' (did you mean "
                                                     "'group_size'?)")
    assert _error(RunConfig.from_overrides, ["engine={nmae: jagg}"]).startswith("unknown config key 'engine.nmae'")
    p.write_text(yaml.safe_dump({"train": {"lr": float("nan")}}))
    assert _error(RunConfig.from_yaml, p).startswith("train.lr: value nan is not a finite number")


def test_non_utf8_files_name_the_key(tmp_path):
    p = tmp_path / "latin1.yaml"
    p.write_bytes("seed: 1\nlog:\n  output_dir: caf\xe9\n".encode("latin-1"))
    assert _error(RunConfig.from_yaml, p).startswith(f"--config: file {str(p)!r} is not UTF-8 text (byte 0xe9 at "
                                                     f"offset 30); save it as UTF-8")
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"a digit\n\xff\xfe seven\n")
    for key in ("train.prompts_file", "eval.prompts_file"):
        msg = _error(RunConfig.from_overrides, [f"{key}={prompts}"])
        assert msg.startswith(f"{key}: file {str(prompts)!r} is not UTF-8 text (byte 0xff at offset 8)"), msg
    bom = tmp_path / "bom.yaml"
    bom.write_bytes(b"\xef\xbb\xbfseed: 4\n")  # a UTF-8 byte-order mark is fine
    assert RunConfig.from_yaml(bom).seed == 4


def test_unreadable_config_file(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("seed: 1\n")
    p.chmod(0)
    try:
        if os.access(p, os.R_OK):
            pytest.skip("running as a user who can read any file (root)")
        assert _error(RunConfig.from_yaml, p).startswith(f"--config: file {str(p)!r} cannot be read (Permission denied)")
    finally:
        p.chmod(0o600)


# ------------------------------------------------------------------------------------------ 6. devices
def test_cuda_device_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for dev in ("cuda", "cuda:0", "cuda:3"):
        msg = _error(RunConfig.from_overrides, [f"model.device={dev}"])
        assert msg.startswith(f"model.device: value {dev!r} is not available: torch.cuda.is_available() is false"), msg


def test_cuda_index_beyond_the_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert _error(RunConfig.from_overrides, ["model.device=cuda:3"]).startswith(
        "model.device: value 'cuda:3' is out of range; this machine has 2 CUDA device(s): cuda:0 .. cuda:1")
    assert RunConfig.from_overrides(["model.device=cuda:1"]).model.device == "cuda:1"
    assert RunConfig.from_overrides(["model.device=cuda"]).model.device == "cuda"


def test_mps_device_when_unavailable(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert _error(RunConfig.from_overrides, ["model.device=mps"]).startswith(
        "model.device: value 'mps' is not available: torch.backends.mps.is_available() is false")


# ------------------------------------------------------------------------------------------ 7. logging packages
def test_logging_backends_need_their_packages(monkeypatch):
    from diffgrpo.run import trackers

    monkeypatch.setattr(trackers, "_installed", lambda name: False)
    assert _error(RunConfig.from_overrides, ["log.wandb=true"]) == (
        "log.wandb: wandb needs the wandb package, which is not installed; pip install 'diffgrpo[wandb]', or set "
        "log.wandb=false")
    assert _error(RunConfig.from_overrides, ["log.tensorboard=true"]) == (
        "log.tensorboard: tensorboard needs the tensorboard package, which is not installed; pip install "
        "'diffgrpo[tensorboard]', or set log.tensorboard=false")
    monkeypatch.setattr(trackers, "_installed", lambda name: True)
    cfg = RunConfig.from_overrides(["log.wandb=true", "log.tensorboard=true"])
    assert cfg.log.wandb and cfg.log.tensorboard


def test_importable_probe():
    assert config_mod._importable("yaml") and not config_mod._importable("no_such_module_xyz")
    assert not config_mod._importable("no_such_module_xyz.sub")


# ------------------------------------------------------------------------------------------ 9. log.output_dir
def test_output_dir_expands_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = RunConfig.from_overrides(["log.output_dir=~/runs/x"])
    assert cfg.log.output_dir == str(tmp_path / "runs" / "x")
    cfg = RunConfig()
    cfg.log.output_dir = "~/y"
    validate(cfg)
    assert cfg.log.output_dir == str(tmp_path / "y")
    back = RunConfig.from_yaml(_write(tmp_path / "c.yaml", cfg.to_yaml()))
    assert back.log.output_dir == str(tmp_path / "y")


def _write(p: Path, text: str) -> Path:
    p.write_text(text)
    return p


def test_output_dir_that_is_a_file(tmp_path):
    f = _write(tmp_path / "file.txt", "x")
    assert _error(RunConfig.from_overrides, [f"log.output_dir={f}"]).startswith(
        f"log.output_dir: value {str(f)!r} is an existing file, not a directory; choose a directory path")
    assert _error(RunConfig.from_overrides, [f"log.output_dir={f}/run"]).startswith(
        f"log.output_dir: value {str(f) + '/run'!r} cannot be created: {str(f)!r} is a file")


def test_output_dir_without_write_permission(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root)")
        assert _error(RunConfig.from_overrides, [f"log.output_dir={ro}/run"]).startswith(
            f"log.output_dir: value {str(ro) + '/run'!r} cannot be created: no write permission in {str(ro)!r}")
        assert _error(RunConfig.from_overrides, [f"log.output_dir={ro}"]).startswith(
            f"log.output_dir: value {str(ro)!r} is not writable (no write permission)")
    finally:
        ro.chmod(0o700)


def test_output_dir_new_nested_path_is_fine(tmp_path):
    assert RunConfig.from_overrides([f"log.output_dir={tmp_path}/a/b/c"]).log.output_dir == f"{tmp_path}/a/b/c"


# ------------------------------------------------------------------------------------------ 11. dist.timeout
def test_dist_timeout_is_a_shared_key():
    assert RunConfig().dist.timeout == 1800.0
    assert "a stalled rank fails the job" in RunConfig.__dataclass_fields__["dist"].default_factory.__dataclass_fields__[
        "timeout"].metadata["doc"]
    for family in ([], MLM):
        assert RunConfig.from_overrides([*family, "dist.timeout=120"]).dist.timeout == 120.0


def test_output_dir_without_write_permission_simulated(tmp_path, monkeypatch):
    """The same refusal where the suite runs as root (which may write anywhere): os.access says no."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == ro else real(p, mode))
    assert _error(RunConfig.from_overrides, [f"log.output_dir={ro}/run/x"]).startswith(
        f"log.output_dir: value {str(ro) + '/run/x'!r} cannot be created: no write permission in {str(ro)!r}")
    assert _error(RunConfig.from_overrides, [f"log.output_dir={ro}"]).startswith(
        f"log.output_dir: value {str(ro)!r} is not writable (no write permission)")


# ------------------------------------------------------------------------------------------ YAML booleans
def test_yaml_booleans_where_a_word_is_meant():
    """YAML 1.1 reads no / true / 1 as booleans or ints; a choice field gets the word, a bool field the value."""
    assert RunConfig.from_overrides(["model.mixed_precision=no"]).model.mixed_precision == "no"
    mlm = RunConfig.from_overrides([*MLM, "dllm.logits_shift=true"])
    assert mlm.dllm.logits_shift == "true"
    assert RunConfig.from_overrides([*MLM, "dllm.logits_shift=false"]).dllm.logits_shift == "false"
    assert RunConfig.from_overrides(["log.progress=0"]).log.progress is False
    assert RunConfig.from_overrides(["log.progress=1"]).log.progress is True
    assert _error(RunConfig.from_overrides, ["log.progress=2"]).startswith("log.progress: value 2 is not a valid bool")
