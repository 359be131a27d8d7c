"""The command line as users type it: overrides anywhere on every subcommand, TRL / flow_grpo names, suggestions
across sections, print-config --docs / --changed (and docs/config.md kept equal to it), accelerate launch's flags,
the CPU thread rule, and the hub's one-line failures without network."""
from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import yaml

from diffgrpo import RunConfig
from diffgrpo.cli.app import main, parse_args
from diffgrpo.cli.configdoc import reference_markdown
from diffgrpo.cli.flags import accelerate_overrides
from diffgrpo.cli.hub import check_hub, needed
from diffgrpo.cli.runtime import apply_cpu_threads, cpu_threads
from diffgrpo.errors import ConfigError
from diffgrpo.validation import applies

ROOT = Path(__file__).resolve().parents[1]


def test_overrides_anywhere_on_every_subcommand():
    cases = {
        ("export", "RUN", "--out", "DIR", "model.pretrained=/x"): ["model.pretrained=/x"],
        ("export", "RUN", "model.pretrained=/x", "--out", "DIR", "--merge", "seed=2"): ["model.pretrained=/x", "seed=2"],
        ("train", "seed=1", "--config", "c.yaml", "train.lr=1e-5"): ["seed=1", "train.lr=1e-5"],
        ("train", "--train.lr", "1e-5", "--resume", "auto", "--seed=3"): ["train.lr=1e-5", "seed=3"],
        ("sample", "--out", "s.png", "seed=4", "--prompt", "a=b", "--num", "2"): ["seed=4"],
        ("bench", "engines", "--repeats", "1", "train.group_size=2"): ["train.group_size=2"],
        ("print-config", "--changed", "seed=5"): ["seed=5"],
        ("download", "--dry-run", "seed=6"): ["seed=6"],
        ("pretrain", "--task", "sudoku", "seed=7"): ["seed=7"],
    }
    for argv, overrides in cases.items():
        args = parse_args(list(argv))
        assert args.overrides == overrides, argv
    args = parse_args(["sample", "--out", "s.png", "seed=4", "--prompt", "a=b"])
    assert args.prompt == ["a=b"] and args.out == "s.png"  # a flag's own value is never an override
    args = parse_args(["export", "RUN", "--out", "DIR", "model.pretrained=/x"])
    assert args.source == "RUN" and args.out == "DIR"


def test_aliases_map_with_a_note_or_are_refused_with_the_key(capsys):
    args = parse_args(["train", "--learning_rate", "3e-5", "num_generations=4", "beta=0.04", "--max-grad-norm=0.5"])
    assert args.overrides == ["train.lr=3e-5", "train.group_size=4", "loss.beta=0.04", "train.max_grad_norm=0.5"]
    err = capsys.readouterr().err
    assert "note: learning_rate is train.lr here" in err and "num_generations is train.group_size" in err
    cfg = RunConfig.from_overrides(args.overrides)
    assert (cfg.train.lr, cfg.train.group_size, cfg.loss.beta) == (3e-5, 4, 0.04)
    with pytest.raises(ConfigError, match="num_iterations.*train.num_inner_epochs here; the run's length"):
        parse_args(["train", "num_iterations=3"])
    assert main(["print-config", "engine.group_size=3"]) == 2
    assert "did you mean 'train.group_size'?" in capsys.readouterr().err
    assert main(["print-config", "sampler.lora_alpha=2"]) == 2  # the leaf lives in two other sections
    assert "'model.lora_alpha' or 'dllm.lora_alpha'" in capsys.readouterr().err
    assert main(["print-config", "--bogus-flag", "1"]) == 2
    assert "unknown config key 'bogus_flag'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # report takes no overrides: argparse's usage error, exit 2
        main(["report", "RUN", "seed=1"])
    assert e.value.code == 2 and "unrecognized arguments: seed=1" in capsys.readouterr().err


def test_trl_names_for_logging_checkpoints_precision_trackers_and_resume(capsys):
    args = parse_args(["train", "logging_steps=5", "--save_total_limit", "3", "report_to=[wandb, tensorboard]"])
    assert args.overrides == ["log.every=5", "train.keep_checkpoints=3", "log.trackers=[wandb, tensorboard]"]
    err = capsys.readouterr().err
    assert "note: logging_steps is log.every here" in err and "save_total_limit is train.keep_checkpoints" in err
    assert "note: report_to=[wandb, tensorboard] is log.trackers=[wandb, tensorboard] here" in err
    assert parse_args(["train", "report_to=mlflow"]).overrides == ["log.trackers=[mlflow]"]
    assert parse_args(["train", "report_to=none"]).overrides == ["log.trackers=[]", "log.wandb=false",
                                                                 "log.tensorboard=false"]
    assert "note: report_to=none is log.trackers=[] log.wandb=false log.tensorboard=false here" in capsys.readouterr().err
    refusals = {("report_to=neptune",): "report_to: neptune is not a tracker here; name them among ['tensorboard', "
                                        "'wandb', 'mlflow', 'trackio', 'comet_ml', 'aim', 'clearml', 'dvclive']",
                ("bf16=true",): "'bf16': model.mixed_precision=bf16 (flow models: autocast) or dllm.dtype=bfloat16",
                ("--bf16",): "'bf16': model.mixed_precision=bf16",
                ("--fp16", "--resume", "auto"): "'fp16': model.mixed_precision=fp16",
                ("resume_from_checkpoint=runs/x",): "'resume_from_checkpoint': resuming is a flag of the command: "
                                                    "diffgrpo train --resume RUN_DIR"}
    for argv, msg in refusals.items():
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and len(err.strip().splitlines()) == 1, err
    assert "keep_checkpoints" not in err  # the old suggestion for resume_from_checkpoint


def test_a_flat_trl_yaml_maps_like_the_command_line(tmp_path, capsys):
    flat = tmp_path / "trl.yaml"
    flat.write_text("learning_rate: 1.0e-5\nnum_generations: 4\nlogging_steps: 5\nsave_total_limit: 3\n"
                    "report_to: [tensorboard]\ntrain:\n  num_iterations: 3\nseed: 2\n")
    assert main(["print-config", "--config", str(flat), "--changed", "beta=0.04"]) == 0
    out, err = capsys.readouterr()
    want = ["train.lr=1e-5", "train.group_size=4", "log.every=5", "train.keep_checkpoints=3", "log.trackers=[tensorboard]",
            "train.num_iterations=3", "seed=2", "loss.beta=0.04"]
    assert main(["print-config", "--changed", *want]) == 0
    assert yaml.safe_load(out) == yaml.safe_load(capsys.readouterr().out)  # the same config as the dotted keys give
    assert "note: learning_rate is train.lr here; using train.lr=1e-05" in err
    assert "note: num_generations is train.group_size here" in err and "note: beta is loss.beta here" in err
    cases = {"num_iterations: 3\n": "'num_iterations': TRL's num_iterations (updates per batch, mu) is "
                                     "train.num_inner_epochs here",
             "bf16: true\n": "'bf16': model.mixed_precision=bf16",
             "resume_from_checkpoint: runs/x\n": "diffgrpo train --resume RUN_DIR",
             "learning_rat: 1.0e-5\n": "unknown config key 'learning_rat'",
             "learning_rate: 1.0e-5\ntrain:\n  lr: 1.0e-4\n": "train.lr is set twice, under train: and by a "
                                                              "top-level name"}
    for text, msg in cases.items():
        flat.write_text(text)
        assert main(["print-config", "--config", str(flat)]) == 2
        lines = capsys.readouterr().err.strip().splitlines()  # the notes of the keys before it, then one error
        assert msg in lines[-1] and [x.startswith("error: ") for x in lines].count(True) == 1, lines


def test_help_of_every_command_that_builds_a_run_names_the_key_reference(capsys):
    from diffgrpo.cli.app import MOST_USED
    from diffgrpo.cli.flags import known

    assert all(known(k) for k in MOST_USED)
    for argv in (["train"], ["pretrain"], ["sample"], ["bench", "quality"], ["bench", "engines"], ["print-config"],
                 ["download"]):
        with pytest.raises(SystemExit):
            main([*argv, "--help"])
        out = capsys.readouterr().out
        assert "diffgrpo print-config --docs (docs/config.md)" in out, argv
        assert all(k in out for k in MOST_USED) and "resume_from_checkpoint is --resume" in out, argv


def test_print_config_changed_is_a_config_that_reproduces_the_run(tmp_path, capsys):
    over = ["train.lr=3e-4", "seed=2", "reward.weights={jpeg_compressibility: 1.0}", "sampler.num_steps=6"]
    assert main(["print-config", "--changed", *over]) == 0
    changed = yaml.safe_load(capsys.readouterr().out)
    assert changed == {"seed": 2, "sampler": {"num_steps": 6}, "reward": {"weights": {"jpeg_compressibility": 1.0}},
                       "train": {"lr": 3e-4}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(changed))
    assert RunConfig.from_yaml(tmp_path / "c.yaml").to_dict() == RunConfig.from_overrides(over).to_dict()
    assert main(["print-config", "--changed"]) == 0 and "every key at its default" in capsys.readouterr().out


def test_docs_config_md_is_the_generated_reference(capsys):
    """docs/config.md is `diffgrpo print-config --docs`; regenerate it with that command when a field changes."""
    assert main(["print-config", "--docs"]) == 0
    out = capsys.readouterr().out
    assert out == reference_markdown()
    assert (ROOT / "docs" / "config.md").read_text() == out, "run: diffgrpo print-config --docs > docs/config.md"
    for key in ("`train.lr`", "`model.cpu_threads`", "`loss.beta`", "`dllm.method`", "`dist.mode`"):
        assert key in out
    assert "| `sampler.sde_type` | str | `flow_sde` | `flow_sde` \\| `dance_sde` \\| `flash_sde` \\| `cps` \\| `ode` |" in out


def test_accelerate_launch_flags_honoured_or_refused():
    assert accelerate_overrides({"ACCELERATE_MIXED_PRECISION": "no"}) == []
    assert accelerate_overrides({"ACCELERATE_MIXED_PRECISION": "bf16"}) == ["model.mixed_precision=bf16"]
    assert accelerate_overrides({"ACCELERATE_USE_FSDP": "true"}) == ["dist.mode=fsdp2"]
    with pytest.raises(ConfigError, match="dllm.dtype=bfloat16"):
        accelerate_overrides({"ACCELERATE_MIXED_PRECISION": "bf16"},
                             applies=lambda key: applies(RunConfig.from_overrides(["model.name=tiny_mlm"]), key))
    assert accelerate_overrides({"ACCELERATE_MIXED_PRECISION": "bf16"}, applies=lambda key: applies(RunConfig(), key)) \
        == ["model.mixed_precision=bf16"]  # the built-in image model reads it
    with pytest.raises(ConfigError, match="--use_deepspeed true: not supported"):
        accelerate_overrides({"ACCELERATE_USE_DEEPSPEED": "true"})
    with pytest.raises(ConfigError, match="--gradient_accumulation_steps 4"):
        accelerate_overrides({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "4"})
    assert accelerate_overrides({"ACCELERATE_GRADIENT_ACCUMULATION_STEPS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}) == []


def test_accelerate_mixed_precision_reaches_the_config(monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert main(["print-config", "--changed"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == {"model": {"mixed_precision": "bf16"}}
    assert main(["print-config", "--changed", "model.mixed_precision=fp16"]) == 0  # the command line wins
    assert yaml.safe_load(capsys.readouterr().out) == {"model": {"mixed_precision": "fp16"}}
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert main(["print-config"]) == 2 and "not supported by diffgrpo" in capsys.readouterr().err


def test_cpu_thread_rule(monkeypatch):
    assert cpu_threads(0, model_name="tiny", device="cpu", environ={}) == 1
    assert cpu_threads(0, model_name="tiny_mlm", device="cpu", environ={}) == 1
    assert cpu_threads(0, model_name="diffusers", device="cpu", environ={}) is None  # torch's default
    assert cpu_threads(0, model_name="tiny", device="cuda", environ={}) is None
    assert cpu_threads(3, model_name="tiny", device="cpu", environ={}) == 3
    assert cpu_threads(3, model_name="tiny", device="cpu", environ={"OMP_NUM_THREADS": "2"}) is None
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        torch.set_num_threads(2)
        assert apply_cpu_threads(RunConfig.from_overrides(["model.device=cpu"])) == 1
        assert apply_cpu_threads(RunConfig.from_overrides(["model.device=cpu", "model.cpu_threads=2"])) == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert apply_cpu_threads(RunConfig.from_overrides(["model.device=cpu"])) == 2  # the environment wins
    finally:
        torch.set_num_threads(before)


SD = ["model.name=diffusers", "model.pretrained=org-that-does-not-exist/pipeline",
      "reward.weights={pickscore: 1.0, aesthetic: 0.5}"]


def test_hub_models_of_a_config(tmp_path):
    local = tmp_path / "pickscore"  # a local path (it must exist: a missing one is refused at validation)
    local.mkdir()
    cfg = RunConfig.from_overrides([*SD, f"reward.options={{pickscore: {{model: {local}}}}}"])
    assert needed(cfg) == [
        ("model.pretrained", "org-that-does-not-exist/pipeline", None),
        ("reward.options.pickscore.processor", "laion/CLIP-ViT-H-14-laion2B-s32B-b79K", None),
        ("reward.options.aesthetic.model", "openai/clip-vit-large-patch14", None),
        ("reward.options.aesthetic.head", "camenduru/improved-aesthetic-predictor", "sac+logos+ava1-l14-linearMSE.pth")]
    assert needed(RunConfig()) == []  # the built-in model needs nothing from the hub


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_hub_failures_are_one_line_and_fast_without_network(tmp_path, monkeypatch, capsys):
    """Offline mode, and a hub endpoint that refuses connections, fail in one line within seconds, before any
    model loads and without writing a run directory."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.setattr("diffgrpo.trainer.POLICIES", {})  # building a policy would raise KeyError
    out = tmp_path / "run"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.perf_counter()
    assert main(["train", *SD, f"log.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not in the local Hugging Face cache and HF_HUB_OFFLINE=1" in err
    assert "diffgrpo download" in err
    monkeypatch.delenv("HF_HUB_OFFLINE")
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(ConfigError, match="cannot reach the Hugging Face hub .* not in the local cache") as e:
        check_hub(RunConfig.from_overrides(SD))
    assert "\n" not in str(e.value)
    assert time.perf_counter() - t0 < 60 and not out.exists()
    assert main(["download", *SD, "--dry-run"]) == 0
    assert "would fetch org-that-does-not-exist/pipeline  (model.pretrained)" in capsys.readouterr().out
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["download", *SD]) == 2 and "HF_HUB_OFFLINE=1 is set" in capsys.readouterr().err


class _GatedHub:
    """A local stand-in for the hub's API: every request about ``org/gated`` answers 403 with the hub's
    ``X-Error-Code: GatedRepo`` (a gated model this account has not been granted), about ``org/missing`` 404
    ``RepoNotFound``; anything else 200 ``{}``."""

    def __enter__(self):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        paths = self.paths = []

        class Handler(BaseHTTPRequestHandler):
            def _answer(self):
                paths.append(self.path)
                code, err = (403, "GatedRepo") if "org/gated" in self.path else (
                    (404, "RepoNotFound") if "org/missing" in self.path else (200, None))
                body = b'{"error": "Access to model org/gated is restricted."}' if err else b"{}"
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                if err:
                    self.send_header("X-Error-Code", err)
                    self.send_header("X-Error-Message", "Access to this model is restricted")
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_HEAD = _answer

            def log_message(self, *a):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def test_a_gated_model_fails_in_one_line_before_anything_loads(tmp_path, monkeypatch, capsys):
    """A gated hub model (FLUX.1-dev, SD3.5 without an accepted licence): train and download say so in one line
    naming the key, the licence page and the login, before the policy loads and without a run directory; a
    missing repository is told apart from a gated one."""
    import huggingface_hub.constants as hc
    from huggingface_hub import hf_api

    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(hc, "HF_HUB_OFFLINE", False)  # a library imported under HF_HUB_OFFLINE=1 may have set it
    monkeypatch.setattr("diffgrpo.trainer.POLICIES", {})  # building a policy would raise KeyError
    gated = ["model.name=diffusers", "model.pretrained=org/gated", "reward.weights={jpeg_compressibility: 1.0}"]
    out = tmp_path / "run"
    with _GatedHub() as hub:
        monkeypatch.setattr(hc, "ENDPOINT", hub.url)
        monkeypatch.setattr(hf_api.api, "endpoint", hub.url)  # the module's client took ENDPOINT at its import
        t0 = time.perf_counter()
        assert main(["train", *gated, f"log.output_dir={out}"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        assert err.startswith("error: model.pretrained: 'org/gated' is a gated model: accept its licence on "
                              "https://huggingface.co/org/gated"), err
        assert "hf auth login" in err and not out.exists() and time.perf_counter() - t0 < 30
        assert any("org/gated" in p for p in hub.paths)  # it asked the hub, once, quickly
        assert main(["download", *gated]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "'org/gated' is a gated model" in err, err
        with pytest.raises(ConfigError, match="no model 'org/missing' on the hub"):
            check_hub(RunConfig.from_overrides(["model.name=diffusers", "model.pretrained=org/missing",
                                                "reward.weights={jpeg_compressibility: 1.0}"]))


def test_a_closed_pipe_ends_a_command_quietly():
    """`diffgrpo configs list | head -1`: the reader goes away; the command stops without a
    traceback (exit 128 + SIGPIPE, as a shell reports a command ended by a closed pipe)."""
    import os
    import subprocess
    import sys

    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line is written
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo", "configs", "list"], stdout=write, stderr=subprocess.PIPE)
    os.close(write)
    err = p.communicate(timeout=60)[1].decode()
    assert p.returncode == 141 and "Traceback" not in err and "Exception ignored" not in err, err
