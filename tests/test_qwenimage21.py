"""Qwen-Image 2.1 (and the Turbo layout: a distilled ``sample_sigmas`` grid, no guidance) behind
``DiffusersFlowPolicy``: a tiny random-weight ``QwenImage21Pipeline`` built from the pipeline's own classes (a
Qwen3-VL text encoder over a character tokenizer, the 2.1 VAE, the block-causal transformer) and saved locally.
The library's ODE rollout reproduces the pipeline's sampling; a sample does not depend on the other prompts of its
batch; a command-line run (full and LoRA) exports files diffusers reloads and samples to the trained latents."""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.models.diffusers_adapter import (
    DiffusersFlowPolicy,
    PolicyOptions,
    build_diffusers_policy,
    detect_pipeline,
)
from diffgrpo.models.pipelines import PIPELINES
from diffgrpo.models.pipelines.qwenimage21 import grid_shift
from diffgrpo.samplers.flow_sde import sigma_grid
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.pipelines import PROMPTS, qwen3vl_image_only_processor, qwenimage21_pipeline
from tests.helpers.tensors import flat_grad

T, RES = 3, 64
LATENT = (8, 4, 4)
COMMON = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
          f"sampler.num_steps={T}", "train.prompts_per_batch=2", "train.group_size=2", "model.name=diffusers",
          f"model.resolution={RES}", "eval.seeds_per_prompt=1"]


@pytest.fixture(scope="module", autouse=True)
def _processor():
    with qwen3vl_image_only_processor():
        yield


@pytest.fixture(scope="module")
def q21_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-qwenimage21")
    qwenimage21_pipeline().save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def _load(d):
    from diffusers import QwenImage21Pipeline

    pipe = QwenImage21Pipeline.from_pretrained(str(d))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise(n: int = 3):
    return torch.randn(n, *LATENT, generator=torch.Generator().manual_seed(0))


def _tokens(x):
    return x.flatten(2).transpose(1, 2)  # (B, C, h, w) → (B, h·w, C): the pipeline's packed latents


def _pipeline_latents(pipe, x, g, sigmas=None):
    """The pipeline's own sampling, one prompt per call (its batch pads every prompt to the longest)."""
    out = []
    with torch.no_grad():
        for i, p in enumerate(PROMPTS[:len(x)]):
            lat = pipe([p], negative_prompt=" " if g > 1 else None, true_cfg_scale=g, num_inference_steps=T,
                       sigmas=sigmas, latents=_tokens(x[i:i + 1]).clone(), height=RES, width=RES,
                       output_type="latent").images  # (1, h·w, C)
            out.append(lat.transpose(1, 2).reshape(1, *LATENT))
    return torch.cat(out)


def _our_latents(pol, pipe, x, g=1.0, sigmas=None):
    """The library's ODE rollout on the grid the pipeline's last call used (its scheduler's σ, ending at 0)."""
    _pipeline_latents(pipe, x[:1], g, sigmas)  # sets the scheduler's grid as the pipeline sets it
    grid = pipe.scheduler.sigmas.float()
    with torch.no_grad():
        return sample_trajectories(pol, pol.encode(PROMPTS), x, grid, kernel={"sde_type": "ode"})["xs"][:, -1]


@pytest.mark.parametrize("g", [1.0, 3.0], ids=["no-cfg", "cfg"])
def test_rollout_reproduces_the_pipeline_sampling(q21_dir, g):
    """Latent layout, σ timestep, block-causal text conditioning without padding, the pipeline's CFG: same grid
    and noise → the pipeline's latents; a sample's velocity does not depend on the other prompts of the batch."""
    pipe = _load(q21_dir)
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(guidance_scale=g, negative_prompt=""),
                              latent_shape=LATENT, pipeline=pipe)
    assert detect_pipeline(pipe.transformer) == "qwenimage21" and pol.uses_cfg == (g > 1)
    cond = pol.encode(PROMPTS)
    assert not bool(cond["prompt_mask"].all())  # prompts of different lengths, padded and masked
    x = _noise()
    err = float((_our_latents(pol, pipe, x, g) - _pipeline_latents(pipe, x, g)).abs().max())
    print(f"qwen-image 2.1 (g={g}): max |ours − pipeline| = {err:.2e}")
    assert err < 1e-5, err
    with torch.no_grad():
        v_all = pol.velocity(x, torch.full((3,), 0.6), cond)
        v_one = pol.velocity(x[2:], torch.full((1,), 0.6), pol.encode(PROMPTS[2:]))
    torch.testing.assert_close(v_all[2:], v_one, rtol=1e-4, atol=1e-5)


def test_distilled_grid_and_the_shift_that_equals_it(q21_dir):
    """A Turbo-style checkpoint's ``sample_sigmas`` (uniform, 3 steps) is its default grid; the library's
    sigma_grid(T, grid_shift(scheduler, resolution)) equals it, and the rollout on it reproduces the pipeline."""
    pipe = _load(q21_dir)
    sigmas = [1.0, 2 / 3, 1 / 3]
    pipe.register_to_config(sample_sigmas=sigmas)
    pol = DiffusersFlowPolicy(pipe.transformer, latent_shape=LATENT, pipeline=pipe)
    x = _noise()
    ours = _our_latents(pol, pipe, x)  # the pipeline call without sigmas: its config's grid
    torch.testing.assert_close(pipe.scheduler.sigmas.float(),
                               sigma_grid(T, grid_shift(pipe.scheduler.config, RES)).float(), rtol=0, atol=1e-6)
    err = float((ours - _pipeline_latents(pipe, x, 1.0)).abs().max())
    assert err < 1e-5, err


def test_lora_gradient_reaches_the_adapter(q21_dir):
    pipe = _load(q21_dir)
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(lora_rank=2), latent_shape=LATENT,
                              pipeline=pipe)
    names = list(pol.named_trainable_parameters())
    assert names and all("lora_" in n for n in names)
    assert PIPELINES["qwenimage21"].lora_targets == ("to_q", "to_k", "to_v", "to_out.0")
    for n, p in pol.named_trainable_parameters().items():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    v = pol.velocity(_noise(), torch.tensor([0.9, 0.5, 0.2]), pol.encode(PROMPTS))
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0


def test_decode_is_the_pipelines_rgb(q21_dir):
    """The policy's decode equals the pipeline's own decoded output (its RGBA's first three channels)."""
    pipe = _load(q21_dir)
    pol = DiffusersFlowPolicy(pipe.transformer, latent_shape=LATENT, pipeline=pipe)
    x = _noise(1)
    with torch.no_grad():
        img = pipe([PROMPTS[0]], num_inference_steps=1, sigmas=[1e-6], latents=_tokens(x), height=RES, width=RES,
                   output_type="pt").images  # one step at σ≈0 leaves the latents (to 1e-6 of a velocity)
    ours = pol.decode(x)
    assert ours.shape == (1, 3, RES, RES) and img.shape[1] == 4
    torch.testing.assert_close(ours, img[:, :3].float(), rtol=0, atol=1e-4)


@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
def test_cli_run_exports_what_diffusers_reloads_and_samples(q21_dir, tmp_path, lora):
    from diffusers import QwenImage21Transformer2DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = q21_dir, tmp_path / "run"
    assert main(["train", *COMMON, f"model.pretrained={d}", "model.guidance_scale=3.0", "model.negative_prompt= ",
                 f"model.lora_rank={lora}", "train.lr=0.05" if lora else "train.lr=0.002", "train.num_iterations=2",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={run}"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    reference = _our_latents(trained, trained.pipeline, x, 3.0)
    pipe = _load(d)
    assert float((_pipeline_latents(pipe, x, 3.0) - reference).abs().max()) > 1e-4  # training moved it
    if lora:
        pipe.load_lora_weights(str(out))
    else:
        pipe.transformer = QwenImage21Transformer2DModel.from_pretrained(str(out))
    err = float((_pipeline_latents(pipe, x, 3.0) - reference).abs().max())
    print(f"qwen-image 2.1 {'lora' if lora else 'full'}: max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err
