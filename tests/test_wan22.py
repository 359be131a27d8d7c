"""Wan 2.2: the A14B two-expert layout (``transformer`` for high noise, ``transformer_2`` for low noise, switched at
the pipeline's boundary) and the single-transformer TI2V-5B layout (per-token timesteps), on tiny random-weight
``WanPipeline``s built from the pipeline's own classes and saved locally (no download).

The library's ODE rollout reproduces the pipeline's own sampling (same σ grid, same starting noise); the experts
train as selected (LoRA per expert, or full); a run from the command line exports files that diffusers reloads
(``from_pretrained`` / ``load_lora_weights(..., load_into_transformer_2=True)``) and samples to the trained model's
latents."""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.config import ConfigError
from diffgrpo.models.diffusers_adapter import (
    DiffusersFlowPolicy,
    PolicyOptions,
    build_diffusers_policy,
)
from diffgrpo.models.pipelines import wan
from diffgrpo.models.pipelines.wan import WanExperts
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.distributed import join_gloo, leave_gloo
from tests.helpers.pipelines import PROMPTS, t5_tokenizer
from tests.helpers.tensors import flat_grad, rel_err
from tests.helpers.two_ranks import assert_ranks_match, load_ranks, save_step, spawn_two, union_rollout

T = 4
RES, FRAMES = 32, 5
LATENT = (4, 2, 4, 4)  # (C, (5−1)/4 + 1, 32/8, 32/8)
BOUNDARY = 0.5
# a grid that crosses the boundary at a trained step (shift 3 keeps σ ≥ 0.5 on every trained step of 4)
CROSS = ["sampler.num_steps=6", "sampler.shift=1.0", "steps.mode=all"]
COMMON = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
          f"sampler.num_steps={T}", "train.prompts_per_batch=2", "train.group_size=2", "model.name=diffusers",
          f"model.resolution={RES}", f"model.num_frames={FRAMES}", "model.max_sequence_length=8",
          "model.guidance_scale=3.0", "eval.seeds_per_prompt=1"]


def _wan_transformer(seed: int, in_channels: int = 4):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                                 in_channels=in_channels, out_channels=in_channels, text_dim=16, freq_dim=16,
                                 ffn_dim=32, num_layers=1, rope_max_seq_len=32)


def _wan_pipeline(two_experts: bool):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True], latents_mean=[0.1, -0.2, 0.05, 0.3],
                           latents_std=[1.5, 0.8, 1.2, 2.0])
    text = UMT5EncoderModel(UMT5Config(vocab_size=100, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2))
    kw = dict(transformer_2=_wan_transformer(1), boundary_ratio=BOUNDARY) if two_experts else \
        dict(expand_timesteps=True)
    return WanPipeline(tokenizer=t5_tokenizer(), text_encoder=text, vae=vae,
                       scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), transformer=_wan_transformer(0), **kw)


@pytest.fixture(scope="module")
def wan_dirs(tmp_path_factory):
    out = {}
    for name, two in (("a14b", True), ("ti2v", False)):
        d = tmp_path_factory.mktemp(f"tiny-wan22-{name}")
        _wan_pipeline(two).save_pretrained(str(d))
        (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        out[name] = d
    return out


def _policy(pipe, **kw) -> DiffusersFlowPolicy:
    transformer = wan.experts(pipe.transformer, pipe.transformer_2, pipe.config.boundary_ratio)
    return DiffusersFlowPolicy(transformer, options=PolicyOptions(max_sequence_length=8, **kw), latent_shape=LATENT,
                               pipeline=pipe)


def _pipeline_latents(pipe, x, guidance=3.0, guidance_2=None):
    with torch.no_grad():
        return pipe(PROMPTS, negative_prompt=[""] * len(PROMPTS), num_inference_steps=T, guidance_scale=guidance,
                    guidance_scale_2=guidance_2, latents=x.clone(), height=RES, width=RES, num_frames=FRAMES,
                    max_sequence_length=8, output_type="latent").frames


def _our_latents(pol, pipe, x):
    """The library's ODE rollout on the pipeline's own σ grid (its scheduler after set_timesteps)."""
    pipe.scheduler.set_timesteps(T)
    sigmas = pipe.scheduler.sigmas.float()
    with torch.no_grad():
        return sample_trajectories(pol, pol.encode(PROMPTS), x, sigmas, kernel={"sde_type": "ode"})["xs"][:, -1]


def _noise():
    return torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(0))


# ------------------------------------------------------------------------------------------- sampling and routing
@pytest.mark.parametrize("name", ["a14b", "ti2v"])
def test_rollout_reproduces_the_pipeline_sampling(wan_dirs, name):
    """Same σ grid and starting noise: the policy's ODE latents equal ``WanPipeline.__call__``'s, with the expert
    switch at the boundary (A14B, a different guidance for the low-noise expert) or per-token timesteps (TI2V)."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan_dirs[name]))
    two = name == "a14b"
    assert (pipe.transformer_2 is not None) == two and bool(pipe.config.expand_timesteps) == (not two)
    pol = _policy(pipe, guidance_scale=3.0, guidance_scale_2=2.0 if two else None)
    assert isinstance(pol.transformer, WanExperts) == two
    x = _noise()
    ours = _our_latents(pol, pipe, x)
    theirs = _pipeline_latents(pipe, x, 3.0, 2.0 if two else None)
    err = float((ours - theirs).abs().max())
    assert err < 1e-5, err
    if two:  # both experts shape the result: another low-noise guidance or a perturbed expert changes it
        assert float((theirs - _pipeline_latents(pipe, x, 3.0, 3.0)).abs().max()) > 1e-4
        pipe.scheduler.set_timesteps(T)
        hi = pol.transformer.expert_rows(pipe.scheduler.timesteps)
        assert hi.any() and not hi.all()  # the grid crosses the boundary


def test_experts_route_rows_by_their_own_timestep(wan_dirs):
    """A batch mixing high- and low-noise rows: each row's velocity equals its expert's alone."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan_dirs["a14b"]))
    pol = _policy(pipe, guidance_scale=3.0, guidance_scale_2=1.5)
    x = _noise()
    sig = torch.tensor([0.9, 0.2, 0.5])  # high, low, exactly the boundary (high: t ≥ boundary·1000)
    cond = pol.encode(PROMPTS)
    with torch.no_grad():
        v = pol.velocity(x, sig, cond)
        for i, expert in enumerate([pipe.transformer, pipe.transformer_2, pipe.transformer]):
            options = PolicyOptions(max_sequence_length=8, guidance_scale=3.0 if expert is pipe.transformer else 1.5)
            single = DiffusersFlowPolicy(expert, options=options, latent_shape=LATENT, pipeline=pipe)
            v_i = single.velocity(x[i:i + 1], sig[i:i + 1], {k: c[i:i + 1] for k, c in cond.items()})
            torch.testing.assert_close(v[i:i + 1], v_i, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("experts,lora", [("both", 4), ("high", 4), ("low", 0)])
def test_trained_experts_are_selectable_with_lora_per_expert(wan_dirs, experts, lora):
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(str(wan_dirs["a14b"]))
    pol = _policy(pipe, guidance_scale=1.0, lora_rank=lora, train_experts=experts, keep_reference=True)
    names = list(pol.named_trainable_parameters())
    assert names
    want = {"both": ("high.", "low."), "high": ("high.",), "low": ("low.",)}[experts]
    assert all(n.startswith(want) for n in names) and {n.split(".")[0] for n in names} == {w[:-1] for w in want}
    if lora:
        assert all("lora_" in n for n in names)
        sd = pol.state_dict()
        assert {k.split(".")[0] for k in sd} == {"transformer" if w == "high." else "transformer_2" for w in want}
    # a gradient through both experts reaches exactly the trained ones
    x = _noise()
    sig = torch.tensor([0.9, 0.3, 0.1])
    v = pol.velocity(x, sig, pol.encode(PROMPTS))
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    for n, p in pol.named_trainable_parameters().items():
        assert p.grad is not None, n
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0
    # the reference is the base experts (adapters disabled, or frozen copies)
    with torch.no_grad(), pol.reference():
        v_ref = pol.velocity(x, sig, pol.encode(PROMPTS))
    torch.testing.assert_close(v_ref, v.detach(), rtol=1e-5, atol=1e-6)  # nothing trained yet


def test_expert_keys_need_two_experts(wan_dirs, tmp_path):
    cfg = RunConfig.from_overrides([*COMMON, f"model.pretrained={wan_dirs['ti2v']}", "model.train_experts=high"])
    with pytest.raises(ConfigError, match="model.train_experts"):
        build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    cfg = RunConfig.from_overrides([*COMMON, f"model.pretrained={wan_dirs['ti2v']}", "model.guidance_scale_low=2"])
    with pytest.raises(ConfigError, match="model.guidance_scale_low"):
        build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    with pytest.raises(ConfigError, match="model.train_experts"):
        RunConfig.from_overrides([*COMMON, "model.train_experts=middle"])


# ------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
def test_cli_run_exports_what_diffusers_reloads_and_samples(wan_dirs, tmp_path, lora):
    """``diffgrpo train`` on the tiny A14B pipeline (both experts), then ``diffgrpo export``: diffusers'
    ``load_lora_weights`` (the second expert's adapter with ``load_into_transformer_2=True``) or
    ``WanTransformer3DModel.from_pretrained`` of each expert, and the pipeline's own sampling equals the trained
    policy's ODE latents."""
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = wan_dirs["a14b"], tmp_path / "run"
    ov = [*COMMON, *CROSS, f"model.pretrained={d}", "model.guidance_scale_low=2.0", f"model.lora_rank={lora}",
          "train.lr=0.05" if lora else "train.lr=0.002", "train.num_iterations=2", "train.save_every=2",
          f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
          f"log.output_dir={run}"]
    assert main(["train", *ov]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    if lora:  # the adapters folded into both experts of a whole pipeline
        assert main(["export", str(run), "--out", str(tmp_path / "merged"), "--merge"]) == 0

    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    reference = _our_latents(trained, trained.pipeline, x)

    pipe = WanPipeline.from_pretrained(str(d))
    assert float((_pipeline_latents(pipe, x, 3.0, 2.0) - reference).abs().max()) > 1e-4  # training moved it
    if lora:
        pipe.load_lora_weights(str(out))
        pipe.load_lora_weights(str(out / "transformer_2"), load_into_transformer_2=True)
    else:
        pipe.transformer = WanTransformer3DModel.from_pretrained(str(out))
        pipe.transformer_2 = WanTransformer3DModel.from_pretrained(str(out / "transformer_2"))
    got = _pipeline_latents(pipe, x, 3.0, 2.0)
    err = float((got - reference).abs().max())
    print(f"wan2.2 a14b {'lora' if lora else 'full'}: max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err
    assert rel_err(got, reference) < 1e-5
    if lora:
        merged = WanPipeline.from_pretrained(str(tmp_path / "merged"))
        assert not any("lora" in n for n, _ in merged.transformer_2.named_parameters())
        err_m = float((_pipeline_latents(merged, x, 3.0, 2.0) - reference).abs().max())
        print(f"wan2.2 a14b merged: max |pipeline − trained| = {err_m:.2e}")
        assert err_m < 1e-4, err_m


@pytest.mark.slow
def test_ti2v_cli_run_full_and_reload(wan_dirs, tmp_path):
    from diffusers import WanPipeline, WanTransformer3DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = wan_dirs["ti2v"], tmp_path / "run"
    assert main(["train", *COMMON, f"model.pretrained={d}", "train.lr=0.002", "train.num_iterations=1",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={run}", "engine.name=dgpo", "sampler.sde_type=ode"]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    reference = _our_latents(trained, trained.pipeline, x)
    pipe = WanPipeline.from_pretrained(str(d))
    assert float((_pipeline_latents(pipe, x) - reference).abs().max()) > 1e-4  # training moved it
    pipe.transformer = WanTransformer3DModel.from_pretrained(str(run / "transformer"))
    err = float((_pipeline_latents(pipe, x) - reference).abs().max())
    print(f"wan2.2 ti2v full (dgpo): max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err


def test_trainer_steps_both_experts(wan_dirs, tmp_path):
    """One update through the trainer (recompute, LoRA on both experts): both adapters move."""
    cfg = RunConfig.from_overrides([*COMMON, *CROSS, f"model.pretrained={wan_dirs['a14b']}", "model.lora_rank=2",
                                    "train.lr=0.05", f"train.prompts_file={wan_dirs['a14b'] / 'prompts.txt'}",
                                    f"log.output_dir={tmp_path / 'run'}"])
    tr = Trainer(cfg, log=lambda *a: None)
    assert isinstance(tr.policy.transformer, WanExperts)
    before = {n: p.detach().clone() for n, p in tr.policy.named_trainable_parameters().items()}
    ro = tr.rollout()
    assert ro.traj.images.shape[:3] == (4, 3, FRAMES)
    tr.update(ro)
    moved = {n.split(".")[0] for n, p in tr.policy.named_trainable_parameters().items()
             if not torch.equal(p.detach(), before[n])}
    assert moved == {"high", "low"}


# ------------------------------------------------------------------------------------------- two gloo ranks
WAN_DIST = ("ddp", "fsdp2")
WAN_DIST_COMMON = [*COMMON, *CROSS[:2], "train.max_grad_norm=0", "engine.name=dgpo", "sampler.sde_type=ode",
                   "engine.forward_timesteps=3", "engine.dgpo_time_fraction=1.0", "model.lora_rank=2",
                   "train.lr=0.05"]


def _wan_dist_worker(rank: int, world: int, port: int, out_dir: str, pipe_dir: str) -> None:
    join_gloo(rank, world, port)
    for mode in WAN_DIST:
        cfg = RunConfig.from_overrides([*WAN_DIST_COMMON, f"model.pretrained={pipe_dir}", "seed=0",
                                        f"train.prompts_file={pipe_dir}/prompts.txt", f"dist.mode={mode}",
                                        "dist.backend=gloo", f"log.output_dir={out_dir}/run-{mode}"])
        tr = Trainer(cfg, log=lambda *a: None)
        save_step(tr, f"{out_dir}/{mode}-rank{rank}.pt",
                  experts=sorted({n.split(".")[0] for n in tr.policy.named_trainable_parameters()}))
    leave_gloo()


@pytest.fixture(scope="module")
def two_rank_wan(wan_dirs, tmp_path_factory):
    d = tmp_path_factory.mktemp("wan-dist")
    spawn_two(_wan_dist_worker, str(d), str(wan_dirs["a14b"]))
    return {mode: load_ranks(d, f"{mode}-") for mode in WAN_DIST}


@pytest.mark.parametrize("mode", WAN_DIST)
def test_two_ranks_train_both_experts_as_one_process(two_rank_wan, wan_dirs, tmp_path, mode):
    """Two gloo ranks (DDP; FSDP2 sharding the blocks of both experts) on a batch whose units fall on both sides
    of the boundary: each rank's synced gradient equals one process's on the union of both ranks' units."""
    parts = two_rank_wan[mode]
    assert parts[0]["experts"] == ["high", "low"]
    if mode == "fsdp2":
        assert parts[0]["sharded"] == parts[0]["n_params"] > 0  # every adapter weight of both experts is sharded
    cfg = RunConfig.from_overrides([*WAN_DIST_COMMON, f"model.pretrained={wan_dirs['a14b']}", "seed=0",
                                    f"train.prompts_file={wan_dirs['a14b'] / 'prompts.txt'}",
                                    f"log.output_dir={tmp_path / 'run'}"])
    tr = Trainer(cfg, log=lambda *a: None)
    ro = union_rollout(parts)
    hi = tr.policy.transformer.expert_rows(ro.traj.sigmas[ro.traj.engine_state.idx] * 1000)
    assert hi.any() and not hi.all()  # units on both experts
    assert_ranks_match(tr, ro, parts, f"wan 2.2 {mode}")
