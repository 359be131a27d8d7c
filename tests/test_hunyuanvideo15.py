"""HunyuanVideo 1.5 text-to-video behind ``DiffusersFlowPolicy``: a tiny random-weight ``HunyuanVideo15Pipeline``
built from the pipeline's own classes (a Qwen2.5-VL text model with a chat template, a ByT5 glyph encoder, the 1.5
VAE and transformer, its CFG guider) and saved locally. The library's ODE rollout reproduces the pipeline's
sampling (both text encoders, a quoted glyph text included); a command-line full fine-tune exports a transformer
diffusers reloads and samples to the trained latents; a LoRA run is refused up front (the pipeline has no LoRA
loader in diffusers 0.42); two FSDP2 ranks train as one process."""
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
from diffgrpo.samplers.flow_sde import sigma_grid
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.distributed import join_gloo, leave_gloo
from tests.helpers.pipelines import hunyuanvideo15_pipeline
from tests.helpers.tensors import flat_grad
from tests.helpers.two_ranks import assert_ranks_match, load_ranks, save_step, spawn_two, union_rollout

T, RES, FRAMES, G = 3, 32, 5, 4.0
LATENT = (4, 2, 2, 2)
PROMPTS = ["a red cat", 'a sign saying "hello"', "the sun"]
COMMON = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
          f"sampler.num_steps={T}", "sampler.shift=5.0", "train.prompts_per_batch=2", "train.group_size=2",
          "model.name=diffusers", f"model.resolution={RES}", f"model.num_frames={FRAMES}", "eval.seeds_per_prompt=1"]


@pytest.fixture(scope="module")
def hy_dirs(tmp_path_factory):
    """Two saved pipelines: the guider at G (CFG) and at 1 (no CFG)."""
    dirs = {}
    for g in (G, 1.0):
        d = tmp_path_factory.mktemp(f"tiny-hunyuanvideo15-g{g:g}")
        hunyuanvideo15_pipeline(guidance_scale=g).save_pretrained(str(d))
        (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        dirs[g] = d
    return dirs


def _load(d):
    from diffusers import HunyuanVideo15Pipeline

    pipe = HunyuanVideo15Pipeline.from_pretrained(str(d))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise():
    return torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(0))


def _pipeline_latents(pipe, x):
    """The pipeline's own sampling (its σ grid, its guider, the empty negative prompt)."""
    with torch.no_grad():
        return pipe(PROMPTS, num_inference_steps=T, latents=x.clone(), height=RES, width=RES, num_frames=FRAMES,
                    output_type="latent").frames


def _our_latents(pol, x):
    """The library's ODE rollout on its own grid (sampler num_steps T, shift = the scheduler's)."""
    grid = sigma_grid(T, pol.pipeline.scheduler.config.shift)
    with torch.no_grad():
        return sample_trajectories(pol, pol.encode(PROMPTS), x, grid, kernel={"sde_type": "ode"})["xs"][:, -1]


@pytest.mark.parametrize("g", [G, 1.0], ids=["cfg", "no-cfg"])
def test_rollout_reproduces_the_pipeline_sampling(hy_dirs, g):
    """Channels [x, 0, 0], zero image embeddings, σ·1000, both text encoders and the guider's CFG: same noise →
    the pipeline's latents, on the library's own grid (sigma_grid with the scheduler's shift)."""
    pipe = _load(hy_dirs[g])
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(guidance_scale=g), latent_shape=LATENT,
                              pipeline=pipe)
    assert detect_pipeline(pipe.transformer) == "hunyuanvideo15" and pol.uses_cfg == (g != 1.0)
    cond = pol.encode(PROMPTS)
    assert cond["glyph_mask"][1].sum() > 0 and cond["glyph_mask"][[0, 2]].sum() == 0  # the quoted text only
    x = _noise()
    ours = _our_latents(pol, x)
    pipeline = _pipeline_latents(pipe, x)
    torch.testing.assert_close(pipe.scheduler.sigmas.float(), sigma_grid(T, 5.0).float(), rtol=0, atol=1e-6)
    err = float((ours - pipeline).abs().max())
    print(f"hunyuanvideo 1.5 (g={g}): max |ours − pipeline| = {err:.2e}")
    assert err < 1e-5, err
    with torch.no_grad():  # a sample does not depend on the other prompts of its batch (fixed-length text)
        v_all = pol.velocity(x, torch.full((3,), 0.6), cond)
        v_one = pol.velocity(x[1:2], torch.full((1,), 0.6), pol.encode(PROMPTS[1:2]))
    torch.testing.assert_close(v_all[1:2], v_one, rtol=1e-4, atol=1e-5)


def test_lora_gradient_and_decode(hy_dirs):
    pipe = _load(hy_dirs[1.0])
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(lora_rank=2), latent_shape=LATENT,
                              pipeline=pipe)
    names = list(pol.named_trainable_parameters())
    assert names and all("lora_" in n for n in names) and any("add_q_proj" in n for n in names)
    for n, p in pol.named_trainable_parameters().items():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    v = pol.velocity(_noise(), torch.tensor([0.9, 0.5, 0.2]), pol.encode(PROMPTS))
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0
    x = _noise()[:2]
    with torch.no_grad():  # the pipeline's decode, a sample at a time
        video = torch.cat([pipe.vae.decode(z[None] / pipe.vae.config.scaling_factor, return_dict=False)[0]
                           for z in x])
    ours = pol.decode(x)
    assert ours.shape == (2, 3, FRAMES, RES, RES)
    torch.testing.assert_close(ours, (video / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)


def test_lora_run_is_refused_before_loading_while_the_pipeline_has_no_lora_loader(hy_dirs, tmp_path, capsys):
    """diffusers 0.42's HunyuanVideo15Pipeline has no save_lora_weights / load_lora_weights: a LoRA run is refused
    from model_index.json, before anything loads or trains, naming the key."""
    from diffgrpo.cli.app import main
    from diffgrpo.models.pipelines.hunyuanvideo15 import has_lora_io

    assert not has_lora_io()
    d = hy_dirs[G]
    assert main(["train", *COMMON, f"model.pretrained={d}", "model.lora_rank=4", "train.num_iterations=1",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert "model.lora_rank" in err and "save_lora_weights" in err
    assert not (tmp_path / "run" / "weights.safetensors").exists()


@pytest.mark.slow
def test_cli_run_exports_what_diffusers_reloads_and_samples(hy_dirs, tmp_path):
    """A full fine-tune (CFG 4): train → export → ``from_pretrained`` samples the trained latents."""
    from diffusers import HunyuanVideo15Transformer3DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = hy_dirs[G], tmp_path / "run"
    assert main(["train", *COMMON, f"model.pretrained={d}", f"model.guidance_scale={G}", "model.lora_rank=0",
                 "train.lr=0.002", "train.num_iterations=2", f"train.prompts_file={d / 'prompts.txt'}",
                 f"eval.prompts_file={d / 'prompts.txt'}", f"log.output_dir={run}"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    reference = _our_latents(trained, x)
    pipe = _load(d)
    assert float((_pipeline_latents(pipe, x) - reference).abs().max()) > 1e-4  # training moved it
    pipe.transformer = HunyuanVideo15Transformer3DModel.from_pretrained(str(out))
    err = float((_pipeline_latents(pipe, x) - reference).abs().max())
    print(f"hunyuanvideo 1.5 full: max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err


# ------------------------------------------------------------------------------------------- two gloo ranks
DIST_COMMON = [*COMMON, "train.max_grad_norm=0", "engine.name=dgpo", "sampler.sde_type=ode",
               "engine.forward_timesteps=2", "engine.dgpo_time_fraction=1.0", "model.lora_rank=0",
               f"model.guidance_scale={G}", "train.lr=0.002"]


def _dist_worker(rank: int, world: int, port: int, out_dir: str, pipe_dir: str) -> None:
    from diffgrpo import Trainer

    join_gloo(rank, world, port, timeout_s=300)
    cfg = RunConfig.from_overrides([*DIST_COMMON, f"model.pretrained={pipe_dir}", "seed=0",
                                    f"train.prompts_file={pipe_dir}/prompts.txt", "dist.mode=fsdp2",
                                    "dist.backend=gloo", f"log.output_dir={out_dir}/run"])
    # the image-to-video weights get no gradient in text-to-video: saved as zeros
    save_step(Trainer(cfg, log=lambda *a: None), f"{out_dir}/rank{rank}.pt")
    leave_gloo()


@pytest.mark.slow
def test_two_fsdp2_ranks_train_as_one_process(hy_dirs, tmp_path):
    """Two gloo ranks, FSDP2 sharding every transformer block (a full fine-tune with CFG): each rank's synced
    gradient equals one process's on the union of both ranks' units."""
    from diffgrpo import Trainer

    d = tmp_path / "dist"
    d.mkdir()
    spawn_two(_dist_worker, str(d), str(hy_dirs[G]))
    parts = load_ranks(d)
    assert parts[0]["sharded"] == parts[0]["n_params"] > 0  # every trained weight is sharded
    cfg = RunConfig.from_overrides([*DIST_COMMON, f"model.pretrained={hy_dirs[G]}", "seed=0",
                                    f"train.prompts_file={hy_dirs[G] / 'prompts.txt'}",
                                    f"log.output_dir={tmp_path / 'run'}"])
    assert_ranks_match(Trainer(cfg, log=lambda *a: None), union_rollout(parts), parts, "hunyuanvideo 1.5 fsdp2")
