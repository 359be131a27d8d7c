"""``diffgrpo export``: a tiny StableDiffusion3Pipeline (saved locally, no download) trained 2 iterations with LoRA
from the command line (sharded checkpoints), exported as an adapter and as a merged pipeline; diffusers' own
``load_lora_weights`` and ``StableDiffusion3Pipeline.from_pretrained`` then reproduce the trained model's samples
(same starting noise → the same images). The model card states what the run's files say. Bad sources fail
with one line."""
from __future__ import annotations

import json

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.cli.app import main
from tests.helpers.pipelines import PROMPTS
from tests.helpers.runs import copy_run, edit_state
from tests.helpers.tiny import QUIET

T = 3  # sampler.num_steps in QUIET


def _pipe_images(pipe, x: torch.Tensor) -> torch.Tensor:
    """The pipeline's own sampling from the latents ``x`` on the σ grid the library's ODE rollout uses."""
    with torch.no_grad():
        return pipe(PROMPTS, negative_prompt=[""] * len(PROMPTS), num_inference_steps=T, guidance_scale=3.0,
                    sigmas=torch.linspace(1, 0, T + 1)[:-1].tolist(), latents=x.clone(), height=16, width=16,
                    max_sequence_length=8, output_type="pt").images


def test_export_adapter_and_merged_pipeline_reproduce_the_trained_samples(sd3_dir, tmp_path, capsys):  # noqa: F811
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    from diffgrpo.models.diffusers_adapter import build_diffusers_policy
    from diffgrpo.samplers import flow_sde
    from diffgrpo.samplers.rollout import sample_trajectories

    run = tmp_path / "run"
    assert main(["train", *QUIET, "model.name=diffusers", f"model.pretrained={sd3_dir}", "model.resolution=16",
                 "model.max_sequence_length=8", "model.guidance_scale=3.0", "model.lora_rank=4", "model.lora_alpha=8",
                 "train.lr=0.05", "train.num_iterations=2", "train.checkpoint_format=dcp", "eval.seeds_per_prompt=1",
                 f"train.prompts_file={sd3_dir / 'prompts.txt'}", f"eval.prompts_file={sd3_dir / 'prompts.txt'}",
                 f"log.output_dir={run}"]) == 0
    ckpt = run / "checkpoints" / "iter_000002"
    assert json.loads((ckpt / "state.json").read_text())["format"] == "dcp"
    assert main(["export", str(run), "--out", str(tmp_path / "adapter")]) == 0
    assert main(["export", str(ckpt), "--out", str(tmp_path / "merged"), "--merge"]) == 0

    # the trained model: the run's config and final weights in the library's own policy, ODE rollout + VAE decode
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = torch.randn(len(PROMPTS), 4, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        traj = sample_trajectories(trained, trained.encode(PROMPTS), x, flow_sde.sigma_grid(T, 3.0),
                                   kernel={"sde_type": "ode"})
        reference = trained.decode(traj["xs"][:, -1])

    base = StableDiffusion3Pipeline.from_pretrained(str(sd3_dir))
    assert (_pipe_images(base, x) - reference).abs().max() > 1e-4  # training changed the samples
    base.load_lora_weights(str(tmp_path / "adapter"))
    torch.testing.assert_close(_pipe_images(base, x), reference, rtol=1e-4, atol=1e-5)
    merged = StableDiffusion3Pipeline.from_pretrained(str(tmp_path / "merged"))
    assert not any("lora" in n for n, _ in merged.transformer.named_parameters())  # fused, not an adapter
    torch.testing.assert_close(_pipe_images(merged, x), reference, rtol=1e-4, atol=1e-5)

    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "eval/reward" in r][-1]
    for d in ("adapter", "merged"):
        card = (tmp_path / d / "README.md").read_text()
        assert str(sd3_dir) in card and "jpeg_incompressibility" in card and "| engine | recompute |" in card
        assert "| iterations | 2 " in card and f"{last['eval/reward']:.4f} at iteration {last['iteration']}" in card


@pytest.mark.parametrize("case", ["missing", "no_checkpoint", "merge_tiny", "out_not_empty"])
def test_export_errors_are_one_line(case, make_trainer, tmp_path, capsys):
    run = tmp_path / "run"
    out = tmp_path / "out"
    if case == "missing":
        src = tmp_path / "nowhere"
    elif case == "no_checkpoint":
        run.mkdir()
        (run / "config.yaml").write_text("seed: 0\n")
        src = run
    else:
        tr = make_trainer(f"log.output_dir={run}")
        tr.save_checkpoint()
        src = run
        if case == "out_not_empty":
            out.mkdir()
            (out / "keep.txt").write_text("mine")
    argv = ["export", str(src), "--out", str(out), *(["--merge"] if case == "merge_tiny" else [])]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err
    assert {"missing": "neither a run directory", "no_checkpoint": "no complete checkpoint",
            "merge_tiny": "--merge", "out_not_empty": "not empty"}[case] in err
    if case == "out_not_empty":
        assert (out / "keep.txt").read_text() == "mine"


def test_export_full_fine_tune_of_the_builtin_model(make_trainer, tmp_path):
    """Without --merge a full fine-tune exports the transformer as a from_pretrained directory with its weights."""
    from diffusers import SD3Transformer2DModel

    tr = make_trainer(f"log.output_dir={tmp_path / 'run'}")
    tr.step()
    tr.save_checkpoint()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    loaded = SD3Transformer2DModel.from_pretrained(str(tmp_path / "out"))
    live = dict(tr.policy.transformer.named_parameters())
    for n, p in loaded.named_parameters():
        assert torch.equal(p, live[n].detach())
    assert "| iterations | 1 " in (tmp_path / "out" / "README.md").read_text()


def test_export_masked_lm_from_a_sharded_checkpoint(tmp_path):
    """A masked diffusion LM (the built-in one, random init) checkpointed in the sharded format exports as a
    transformers from_pretrained directory holding the trained weights."""
    from transformers import AutoModelForMaskedLM

    from diffgrpo import Trainer
    from diffgrpo.models.hf_masked_lm import build_tiny_mlm_policy

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "train.checkpoint_format=dcp", "log.progress=false",
                                    f"log.output_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    tr = Trainer(cfg, policy=build_tiny_mlm_policy(cfg, progress=False, pretrained=False), log=lambda *a: None)
    with torch.no_grad():
        for p in tr.params:  # trained weights, not the ones a fresh build would draw
            p.add_(0.5)
    tr.save_checkpoint()
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out"), "--merge"]) == 0
    loaded = AutoModelForMaskedLM.from_pretrained(str(tmp_path / "out"))
    live = tr.policy.state_dict()
    sd = loaded.state_dict()
    assert set(live) <= set(sd)
    for k, v in live.items():
        assert torch.equal(sd[k], v), k


# --------------------------------------------------------------------- issue 25 M-5, M-7: model card and export folder
def test_model_card_with_a_null_evaluation_reward():  # M-5
    from diffgrpo.cli.export import last_held_out, model_card

    rows = [{"iteration": 0, "eval/reward": 0.5}, {"iteration": 1, "eval/reward": None, "eval/rewards/x": None}]
    held = last_held_out(rows, 1)
    assert held == rows[0]
    assert "0.5000 at iteration 0" in model_card({"model": {"name": "tiny"}}, 1, held, "adapter")
    assert "n/a" in model_card({"model": {"name": "tiny"}}, 1, last_held_out(rows[1:], 1), "adapter")


def test_export_into_the_current_empty_folder_keeps_it(small_run, tmp_path, monkeypatch):  # M-7
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    assert main(["export", str(small_run), "--out", "."]) == 0
    assert here.is_dir() and (here / "README.md").is_file() and (here / "diffusion_pytorch_model.safetensors").is_file()
    assert not [p for p in here.iterdir() if p.name.startswith(".")]


# ---------------------------------------------- issue 25, low ones: export of damaged and moved runs, export to a file
def test_export_says_when_it_skips_a_damaged_newer_checkpoint(small_run, tmp_path, capsys):
    import shutil

    run = copy_run(small_run, tmp_path)
    newer = run / "checkpoints" / "iter_000002"
    shutil.copytree(run / "checkpoints" / "iter_000001", newer)
    with open(newer / "trainable.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\x00\x01\x02")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("warning: export: the newer checkpoint(s) ['iter_000002'] are incomplete or damaged (their "
                    "files do not match state.json); exporting iter_000001")]


def test_sample_and_export_of_a_moved_run_need_no_prompts_file(small_run, tmp_path):
    import yaml

    run = copy_run(small_run, tmp_path)
    gone = str(tmp_path / "moved-away" / "prompts.txt")
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    cfg["train"]["prompts_file"] = cfg["eval"]["prompts_file"] = gone
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    edit_state(run / "checkpoints" / "iter_000001",
                lambda s: (s["config"]["train"].update(prompts_file=gone), s["config"]["eval"].update(prompts_file=gone)))
    out = tmp_path / "s.png"
    assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(out), "--prompt", "a handwritten digit 3"]) == 0
    assert out.is_file()
    assert main(["export", str(run), "--out", str(tmp_path / "exp")]) == 0


def test_export_to_a_file_says_it_is_a_file(small_run, tmp_path, capsys):
    f = tmp_path / "out.bin"
    f.write_text("x")
    assert main(["export", str(small_run), "--out", str(f)]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
