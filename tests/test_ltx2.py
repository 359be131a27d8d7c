"""LTX-2 text-to-audio+video behind ``DiffusersFlowPolicy``: a tiny random-weight ``LTX2Pipeline`` built from the
pipeline's own classes (a Gemma 3 text encoder and its connectors, the video and audio VAEs, the vocoder, the
transformer) and saved locally. The library's ODE rollout of the paired state (video and audio latents) reproduces
the pipeline's sampling of both streams, with and without CFG; the video decodes as the pipeline decodes it and the
audio as its vocoder makes it; a command-line run (full and LoRA) exports files diffusers reloads and samples to
the trained latents; two FSDP2 ranks train as one process."""
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
from diffgrpo.models.pipelines import ltx2
from diffgrpo.samplers.flow_sde import sigma_grid
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.distributed import join_gloo, leave_gloo
from tests.helpers.pipelines import ltx2_pipeline
from tests.helpers.tensors import flat_grad
from tests.helpers.two_ranks import assert_ranks_match, load_ranks, save_step, spawn_two, union_rollout

T, RES, FRAMES, G, MSL = 3, 32, 5, 3.0, 16
PROMPTS = ["a red cat", "a blue dog on the grass", "the sun"]
NO_EXTRAS = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0,
             "guidance_rescale": 0.0, "audio_guidance_rescale": 0.0, "spatio_temporal_guidance_blocks": None}


@pytest.fixture(scope="module")
def ltx_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-ltx2")
    ltx2_pipeline().save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def _load(d):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(str(d))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _shift(pipe) -> float:
    return ltx2.grid_shift(pipe.scheduler.config, ltx2.layout(pipe, RES, FRAMES))


def _common(pipe) -> list[str]:
    return ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
            f"sampler.num_steps={T}", f"sampler.shift={_shift(pipe)!r}", "train.prompts_per_batch=2",
            "train.group_size=2", "model.name=diffusers", f"model.resolution={RES}", f"model.num_frames={FRAMES}",
            f"model.max_sequence_length={MSL}", "eval.seeds_per_prompt=1"]


def _policy(pipe, **kw):
    lay = ltx2.layout(pipe, RES, FRAMES)
    return DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(max_sequence_length=MSL, **kw),
                               latent_shape=ltx2.latent_shape(pipe, RES, FRAMES), pipeline=pipe, layout=lay)


def _noise(pipe):
    (n,) = ltx2.latent_shape(pipe, RES, FRAMES)
    return torch.randn(len(PROMPTS), n, generator=torch.Generator().manual_seed(0))


def _pipeline_latents(pipe, x, g):
    """The pipeline's own sampling from the state ``x`` (its grid, its CFG with one scale for both streams, no
    perturbed / modality-isolated / rescaled guidance) → the flat state of its (video, audio) latents."""
    lay = ltx2.layout(pipe, RES, FRAMES)
    video = ltx2.video_latents(pipe.vae, x, lay)
    audio = ltx2.audio_latents(pipe.audio_vae, x, lay)
    with torch.no_grad():
        out = pipe(PROMPTS, negative_prompt="", num_inference_steps=T, latents=video, audio_latents=audio,
                   height=RES, width=RES, num_frames=FRAMES, frame_rate=ltx2.FRAME_RATE, guidance_scale=g,
                   audio_guidance_scale=g, max_sequence_length=MSL, output_type="latent", **NO_EXTRAS)
    return out.frames, out.audio


def _our_latents(pol, x):
    """The library's ODE rollout on its own grid → (video, audio) latents in the pipeline's output layout."""
    grid = sigma_grid(T, _shift(pol.pipeline))
    with torch.no_grad():
        z = sample_trajectories(pol, pol.encode(PROMPTS), x, grid, kernel={"sde_type": "ode"})["xs"][:, -1]
    return ltx2.video_latents(pol.pipeline.vae, z, pol.layout), ltx2.audio_latents(pol.pipeline.audio_vae, z,
                                                                                 pol.layout)


def _err(a, b) -> float:
    return max(float((p - q).abs().max()) for p, q in zip(a, b))


@pytest.mark.parametrize("g", [G, 1.0], ids=["cfg", "no-cfg"])
def test_rollout_reproduces_the_pipeline_sampling_of_both_streams(ltx_dir, g):
    """Same starting video and audio latents → the pipeline's (video, audio) latents, on the library's grid
    (sigma_grid with e^mu of the video token count)."""
    pipe = _load(ltx_dir)
    pol = _policy(pipe, guidance_scale=g)
    assert detect_pipeline(pipe.transformer) == "ltx2" and pol.uses_cfg == (g != 1.0)
    x = _noise(pipe)
    lay = pol.layout
    ours = _our_latents(pol, x)
    theirs = _pipeline_latents(pipe, x, g)
    torch.testing.assert_close(pipe.scheduler.sigmas.float(), sigma_grid(T, _shift(pipe)).float(), rtol=0, atol=1e-6)
    assert theirs[0].shape == (3, 4, 3, 16, 16) and theirs[1].shape == (3, 2, 5, 2)
    err = _err(ours, theirs)
    print(f"ltx-2 (g={g}): max |ours − pipeline| = {err:.2e} (video and audio)")
    assert err < 1e-5, err
    start = (ltx2.video_latents(pipe.vae, x, lay), ltx2.audio_latents(pipe.audio_vae, x, lay))
    assert _err(theirs, start) > 0.1  # both streams moved
    with torch.no_grad():  # a sample does not depend on the other prompts of its batch (fixed-length text)
        v_all = pol.velocity(x, torch.full((3,), 0.6), pol.encode(PROMPTS))
        v_one = pol.velocity(x[1:2], torch.full((1,), 0.6), pol.encode(PROMPTS[1:2]))
    torch.testing.assert_close(v_all[1:2], v_one, rtol=1e-4, atol=1e-5)


def test_decode_and_lora_gradient(ltx_dir):
    """Video pixels and audio waveform as the pipeline makes them; a LoRA gradient reaches both streams'
    attention."""
    pipe = _load(ltx_dir)
    pol = _policy(pipe, lora_rank=2)
    names = list(pol.named_trainable_parameters())
    assert names and all("lora_" in n for n in names) and any("audio_attn" in n for n in names)
    for n, p in pol.named_trainable_parameters().items():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    x = _noise(pipe)
    v = pol.velocity(x, torch.tensor([0.9, 0.5, 0.2]), pol.encode(PROMPTS))
    nv, na = ltx2.sizes(pol.layout)
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0 and v[:, nv:].abs().sum() > 0
    lay = pol.layout
    z = x[:2]
    with torch.no_grad():  # the pipeline's decode: denormalise, vae.decode; audio VAE then vocoder
        video5 = z[:, :nv].reshape(2, 3, 16, 16, 4).permute(0, 4, 1, 2, 3)
        video5 = video5 * pipe.vae.latents_std.view(1, -1, 1, 1, 1) / 0.9 + pipe.vae.latents_mean.view(1, -1, 1, 1, 1)
        video = pipe.vae.decode(video5, None, return_dict=False)[0]
        tokens = z[:, nv:].reshape(2, 5, 4) * pipe.audio_vae.latents_std + pipe.audio_vae.latents_mean
        audio4 = pipe._unpack_audio_latents(tokens, 5, num_mel_bins=2)
        wave = pipe.vocoder(pipe.audio_vae.decode(audio4, return_dict=False)[0])
    ours = pol.decode(z)
    assert ours.shape == (2, 3, FRAMES, RES, RES)
    torch.testing.assert_close(ours, (video / 2 + 0.5).clamp(0, 1), rtol=0, atol=1e-6)
    torch.testing.assert_close(ltx2.decode_audio(pipe, z, lay), wave, rtol=0, atol=1e-6)


def test_a_policy_of_the_row_needs_its_layout(ltx_dir):
    pipe = _load(ltx_dir)
    with pytest.raises(ValueError, match="layout"):
        DiffusersFlowPolicy(pipe.transformer, latent_shape=ltx2.latent_shape(pipe, RES, FRAMES), pipeline=pipe)


@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
def test_cli_run_exports_what_diffusers_reloads_and_samples(ltx_dir, tmp_path, lora):
    """Train (CFG) → export → ``load_lora_weights`` / ``from_pretrained`` samples the trained latents."""
    from diffusers import LTX2VideoTransformer3DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = ltx_dir, tmp_path / "run"
    assert main(["train", *_common(_load(d)), f"model.pretrained={d}", f"model.guidance_scale={G}",
                 f"model.lora_rank={lora}", "train.lr=0.05" if lora else "train.lr=0.002", "train.num_iterations=2",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={run}"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise(trained.pipeline)
    reference = _our_latents(trained, x)
    pipe = _load(d)
    assert _err(_pipeline_latents(pipe, x, G), reference) > 1e-4  # training moved it
    if lora:
        pipe.load_lora_weights(str(out))
    else:
        pipe.transformer = LTX2VideoTransformer3DModel.from_pretrained(str(out))
    err = _err(_pipeline_latents(pipe, x, G), reference)
    print(f"ltx-2 {'lora' if lora else 'full'}: max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err


# ------------------------------------------------------------------------------------------- two gloo ranks
def _dist_overrides(pipe_dir: str, shift_args: list[str]) -> list[str]:
    return [*shift_args, "train.max_grad_norm=0", "engine.name=dgpo", "sampler.sde_type=ode",
            "engine.forward_timesteps=2", "engine.dgpo_time_fraction=1.0", "model.lora_rank=0",
            f"model.guidance_scale={G}", "train.lr=0.002", f"model.pretrained={pipe_dir}", "seed=0",
            f"train.prompts_file={pipe_dir}/prompts.txt"]


def _dist_worker(rank: int, world: int, port: int, out_dir: str, pipe_dir: str, common: list[str]) -> None:
    from diffgrpo import Trainer

    join_gloo(rank, world, port, timeout_s=300)
    cfg = RunConfig.from_overrides([*_dist_overrides(pipe_dir, common), "dist.mode=fsdp2", "dist.backend=gloo",
                                    f"log.output_dir={out_dir}/run"])
    save_step(Trainer(cfg, log=lambda *a: None), f"{out_dir}/rank{rank}.pt")
    leave_gloo()


@pytest.mark.slow
def test_two_fsdp2_ranks_train_as_one_process(ltx_dir, tmp_path):
    """Two gloo ranks, FSDP2 sharding every transformer block (a full fine-tune with CFG): each rank's synced
    gradient equals one process's on the union of both ranks' units."""
    from diffgrpo import Trainer

    d = tmp_path / "dist"
    d.mkdir()
    common = _common(_load(ltx_dir))
    spawn_two(_dist_worker, str(d), str(ltx_dir), common)
    parts = load_ranks(d)
    assert parts[0]["sharded"] == parts[0]["n_params"] > 0  # every trained weight is sharded
    cfg = RunConfig.from_overrides([*_dist_overrides(str(ltx_dir), common), f"log.output_dir={tmp_path / 'run'}"])
    assert_ranks_match(Trainer(cfg, log=lambda *a: None), union_rollout(parts), parts, "ltx-2 fsdp2")
