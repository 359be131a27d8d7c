"""Real diffusers transformers (SD3, FLUX, Wan, Qwen-Image) behind ``DiffusersFlowPolicy``, at tiny sizes.

Everything is built locally from the real classes with random weights (no downloads): a full
``StableDiffusion3Pipeline`` (two CLIP text encoders, T5, tokenizers built from in-memory vocabularies, a VAE,
the transformer) saved to disk and trained from its directory through ``model.name=diffusers``; the other
families are tested at the adapter level with a stub text encoding and a stub decoder.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from diffgrpo import RunConfig, Trainer
from diffgrpo.config import ConfigError
from diffgrpo.models.diffusers_adapter import (
    DiffusersFlowPolicy,
    PolicyOptions,
    cfg_combine,
    detect_pipeline,
    pack_2x2,
    unpack_2x2,
)
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.pipelines import LATENTS, PROMPTS, adapter_policy
from tests.helpers.tensors import flat_grad, rel_err
from tests.helpers.tiny import QUIET


# ------------------------------------------------------------------------------------------- the SD3 pipeline
def test_sd3_pipeline_trains_from_its_directory_and_lora_reloads(sd3_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    cfg = RunConfig.from_overrides([
        *QUIET, "model.name=diffusers", f"model.pretrained={sd3_dir}", "model.resolution=16",
        "model.max_sequence_length=8", "model.guidance_scale=3.0", "model.negative_prompt=blurry",
        "model.lora_rank=4", "model.lora_alpha=8", "loss.beta=0.04", "train.lr=0.05", "train.num_iterations=1",
        f"train.prompts_file={sd3_dir / 'prompts.txt'}", f"eval.prompts_file={sd3_dir / 'prompts.txt'}",
        "eval.seeds_per_prompt=1", f"log.output_dir={tmp_path / 'run'}"])
    tr = Trainer(cfg, log=lambda *a: None)
    pol = tr.policy
    assert pol.row.name == "sd3" and pol.latent_shape == (4, 8, 8) and pol.uses_cfg
    assert pol._ref is None  # the LoRA reference is the base model with the adapter disabled, no copy
    assert tr.params and all("lora_" in n for n in pol.named_trainable_parameters())

    ro = tr.rollout()
    assert set(ro.prompts) <= set(PROMPTS) and ro.traj.images.shape == (4, 3, 16, 16)
    assert float(ro.traj.images.min()) >= 0 and float(ro.traj.images.max()) <= 1
    stats = tr.backward(ro)
    n_pairs = int(ro.selected.sum())
    assert stats.metrics["ratio_max_dev"] < 1e-5 and stats.metrics["kl"] < 1e-10
    assert stats.forwards_grad == 2 * n_pairs  # CFG: two sample-forwards per trained pair
    assert flat_grad(tr.params).abs().sum() > 0

    tr.train()  # one full iteration end to end: eval, rollout, optimizer step, eval, saving
    out = tmp_path / "run"
    assert (out / "weights.safetensors").is_file() and (out / "lora" / "pytorch_lora_weights.safetensors").is_file()
    lora_b = [v for k, v in pol.state_dict().items() if "lora_B" in k]
    assert max(float(v.abs().max()) for v in lora_b) > 0  # the update moved the adapter off its zero init

    # the diffusers pipeline + load_lora_weights reproduces the trained policy
    pipe = StableDiffusion3Pipeline.from_pretrained(str(sd3_dir))
    options = PolicyOptions(guidance_scale=3.0, negative_prompt="blurry", max_sequence_length=8)
    base = DiffusersFlowPolicy(pipe.transformer, options=options, latent_shape=(4, 8, 8), pipeline=pipe)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 4, 8, 8, generator=g)
    sig = torch.tensor([0.9, 0.5, 0.2])
    cond = pol.encode(PROMPTS)
    with torch.no_grad():
        v_trained = pol.velocity(x, sig, cond)
        with pol.reference():
            v_ref = pol.velocity(x, sig, cond)
        v_base = base.velocity(x, sig, base.encode(PROMPTS))
    torch.testing.assert_close(v_ref, v_base, rtol=1e-5, atol=1e-6)  # adapter disabled == base weights
    assert rel_err(v_trained, v_base) > 1e-4
    # the adapter's ODE rollout + VAE decode reproduce the diffusers pipeline's own sampling (same σ grid)
    from diffgrpo.samplers import flow_sde

    T = 3
    with torch.no_grad():
        traj = sample_trajectories(base, base.encode(PROMPTS), x, flow_sde.sigma_grid(T, 3.0), kernel={"sde_type": "ode"})
        images = pipe(PROMPTS, negative_prompt=["blurry"] * 3, num_inference_steps=T, guidance_scale=3.0,
                      sigmas=torch.linspace(1, 0, T + 1)[:-1].tolist(), latents=x.clone(), height=16, width=16,
                      max_sequence_length=8, output_type="pt").images
    torch.testing.assert_close(base.decode(traj["xs"][:, -1]), images, rtol=1e-4, atol=1e-5)

    pipe.load_lora_weights(str(out / "lora"))
    loaded = DiffusersFlowPolicy(pipe.transformer, options=options, latent_shape=(4, 8, 8), pipeline=pipe)
    sigmas = tr.family.sigmas
    runs = []
    for p in (pol, loaded):
        with torch.no_grad():
            runs.append(sample_trajectories(p, p.encode(PROMPTS), x, sigmas, kernel=tr.family.kernel,
                                            generator=torch.Generator().manual_seed(5)))
    torch.testing.assert_close(runs[1]["velocities"], runs[0]["velocities"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(runs[1]["xs"], runs[0]["xs"], rtol=1e-4, atol=1e-5)

    # weights.safetensors (peft names) restores the adapter into a fresh policy
    from safetensors.torch import load_file

    fresh = Trainer(cfg, log=lambda *a: None).policy
    fresh.load_state_dict(load_file(str(out / "weights.safetensors")))
    with torch.no_grad():
        torch.testing.assert_close(fresh.velocity(x, sig, fresh.encode(PROMPTS)), v_trained, rtol=1e-5, atol=1e-6)


def test_config_errors_name_the_field(sd3_dir, tmp_path):
    with pytest.raises(ConfigError, match="model.pretrained"):
        RunConfig.from_overrides(["model.name=diffusers"])
    with pytest.raises(ConfigError, match="train.prompts_file"):
        RunConfig.from_overrides([f"train.prompts_file={tmp_path / 'missing.txt'}"])
    with pytest.raises(ConfigError, match="model.pipeline"):
        RunConfig.from_overrides(["model.pipeline=sdxl"])
    with pytest.raises(ConfigError, match="model.pretrained: path .* does not exist"):  # refused on reading
        RunConfig.from_overrides(["model.name=diffusers", f"model.pretrained={tmp_path / 'nope'}"])
    with pytest.raises(ConfigError, match=r"^reward\.weights: 'digit_alignment' scores .* RGB"):  # the default reward
        RunConfig.from_overrides(["model.name=diffusers", f"model.pretrained={sd3_dir}"])
    cfg = RunConfig.from_overrides(["model.name=diffusers", f"model.pretrained={sd3_dir}", "model.resolution=18",
                                    "reward.weights={jpeg_incompressibility: 1.0}"])
    with pytest.raises(ConfigError, match="model.resolution"):
        Trainer(cfg, log=lambda *a: None)


# ------------------------------------------------------------------------------------------- every family
@pytest.mark.parametrize("family,lora,gscale", [("sd3", 0, 2.0), ("flux", 4, 3.5), ("wan", 4, 2.0),
                                                ("qwenimage", 4, 2.0)])
def test_family_rollout_backward_and_step_through_the_trainer(family, lora, gscale, tmp_path):
    torch.manual_seed(0)
    (tmp_path / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    cfg = RunConfig.from_overrides([*QUIET, "loss.beta=0.04", "train.lr=0.05",
                                    f"train.prompts_file={tmp_path / 'prompts.txt'}"])
    pol = adapter_policy(family, guidance_scale=gscale, lora_rank=lora, lora_alpha=2 * lora, keep_reference=True)
    assert detect_pipeline(pol.transformer) == family
    assert pol.uses_cfg == (family != "flux")  # FLUX: distilled guidance embedding, one forward
    assert (pol._ref is None) == (lora > 0)
    tr = Trainer(cfg, policy=pol, log=lambda *a: None)
    ro = tr.rollout()
    assert ro.traj.xs.shape == (4, 4, *LATENTS[family])
    before = [p.detach().clone() for p in tr.params]
    stats, info = tr.update(ro)
    n_pairs = int(ro.selected.sum())
    mult = 2 if pol.uses_cfg else 1
    assert stats.metrics["ratio_max_dev"] < 1e-5 and stats.metrics["kl"] < 1e-10
    assert stats.forwards_grad == mult * n_pairs and stats.forwards_nograd == mult * n_pairs  # + reference
    assert info["grad_norm"] > 0 and info["skipped_updates"] == 0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, tr.params))
    # after the step the policy moved and the reference did not
    with torch.no_grad():
        k = 1
        v_new = pol.velocity(ro.traj.xs[:, k], ro.traj.sigmas[k].expand(4), ro.traj.cond)
        with pol.reference():
            v_ref = pol.velocity(ro.traj.xs[:, k], ro.traj.sigmas[k].expand(4), ro.traj.cond)
    torch.testing.assert_close(v_ref, ro.traj.velocities[:, k], rtol=1e-4, atol=1e-5)
    assert rel_err(v_new, ro.traj.velocities[:, k]) > 1e-6


def test_packing_guidance_and_cfg_rules():
    x = torch.randn(2, 4, 6, 8)
    t = pack_2x2(x)
    assert t.shape == (2, 12, 16)
    torch.testing.assert_close(unpack_2x2(t, 4, 6, 8), x)
    # token (0, 0) holds the 2×2 patch at the top-left corner, channel-major
    torch.testing.assert_close(t[0, 0].view(4, 2, 2), x[0, :, :2, :2])
    # Qwen-Image rescales the guided prediction to the conditional one's per-token norm
    v_c, v_u = torch.randn(3, 5, 16), torch.randn(3, 5, 16)
    v = cfg_combine(v_c, v_u, 4.0, renorm=True)
    torch.testing.assert_close(v.norm(dim=-1), v_c.norm(dim=-1))
    torch.testing.assert_close(cfg_combine(v_c, v_u, 4.0, renorm=False), v_u + 4 * (v_c - v_u))
    # FLUX: the guidance value enters through the embedding (one forward per sample)
    pol = adapter_policy("flux", guidance_scale=3.5)
    cond = pol.encode(PROMPTS[:2])
    x, s = torch.randn(2, 4, 8, 8), torch.tensor([0.7, 0.3])
    with torch.no_grad():
        v1 = pol.velocity(x, s, cond)
        pol.guidance_scale = 1.0
        v2 = pol.velocity(x, s, cond)
    assert pol.counters["forwards_nograd"] == 4 and rel_err(v1, v2) > 1e-6
    # batching: a sample's velocity does not depend on the rest of the batch (Qwen pads prompts of other lengths)
    q = adapter_policy("qwenimage", guidance_scale=2.0)
    c2 = q.encode(PROMPTS[:2])
    assert c2["prompt_mask"].shape[1] == c2["prompt_embeds"].shape[1] and not bool(c2["prompt_mask"].all())
    with torch.no_grad():
        v_pair = q.velocity(x, s, c2)
        v_one = q.velocity(x[:1], s[:1], q.encode(PROMPTS[:1]))
    torch.testing.assert_close(v_pair[:1], v_one, rtol=1e-4, atol=1e-5)
    # the prompt-encoding cache is bounded (LRU) and a re-encoded prompt gives the same conditioning
    q.cache_size = 1
    c_again = q.encode(PROMPTS[:2])
    assert len(q._cache) == 1
    for k in c2:
        torch.testing.assert_close(c_again[k], c2[k])
    # full fine-tune without a KL term keeps no reference copy
    with pytest.raises(RuntimeError, match="keep_reference"):
        with adapter_policy("sd3").reference():
            pass


def test_gradient_checkpointing_is_exact_and_bf16_autocast_is_close():
    x = torch.randn(2, 4, 8, 8)
    s = torch.tensor([0.8, 0.4])
    grads, vels, pols = [], [], []
    for kw in ({}, {"gradient_checkpointing": True}, {"mixed_precision": "bf16"}):
        pol = adapter_policy("sd3", guidance_scale=2.0, **kw)
        v = pol.velocity(x, s, pol.encode(PROMPTS[:2]))
        assert v.dtype == torch.float32
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        grads.append(flat_grad(pol.trainable_parameters()))
        vels.append(v.detach())
        pols.append(pol)
    assert [p.transformer.gradient_checkpointing for p in pols] == [False, True, False]
    assert rel_err(grads[1], grads[0]) < 1e-5
    torch.testing.assert_close(vels[1], vels[0])
    assert 0 < rel_err(vels[2], vels[0]) < 5e-2  # bf16 matmuls: close, not equal
    assert rel_err(grads[2], grads[0]) < 1e-1
    # LoRA gradients survive (non-reentrant) checkpointing
    lora_grads = []
    for kw in ({}, {"gradient_checkpointing": True}):
        torch.manual_seed(1)
        pol = adapter_policy("qwenimage", guidance_scale=2.0, lora_rank=2, **kw)
        for n, p in pol.named_trainable_parameters().items():  # move B off zero so A gets gradients too
            if "lora_B" in n:
                p.data.normal_(0, 0.1)
        v = pol.velocity(x, s, pol.encode(PROMPTS[:2]))
        (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
        lora_grads.append(flat_grad(pol.trainable_parameters()))
    assert lora_grads[0].abs().sum() > 0 and rel_err(lora_grads[1], lora_grads[0]) < 1e-5


CONFIGS = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("name", CONFIGS)
def test_real_model_configs_validate(name, tmp_path, monkeypatch, capsys):
    """Every shipped config resolves on a fresh checkout: registry rewards, shipped prompt sets, no PYTHONPATH;
    its header names the one command that trains it."""
    from diffgrpo.cli.app import main
    from diffgrpo.models.pipelines.hunyuanvideo15 import has_lora_io
    from diffgrpo.rewards import REWARDS

    path = Path(__file__).resolve().parents[1] / "configs" / f"{name}.yaml"
    monkeypatch.chdir(tmp_path)  # nothing relative to the checkout
    for flags in ([], ["--check-data"]):
        assert main(["print-config", *flags, "--config", str(path)]) == 0, capsys.readouterr().err
    cfg = RunConfig.from_yaml(path)
    assert cfg.model.name == "diffusers" and cfg.model.pretrained
    assert cfg.model.lora_rank > 0 or (name.startswith("hunyuanvideo15") and not has_lora_io())  # no LoRA loader
    assert cfg.train.prompts_file.startswith("builtin:") and cfg.eval.prompts_file.startswith("builtin:")
    assert all(":" not in r and r in REWARDS for r in cfg.reward.weights)
    assert f"diffgrpo train --config configs/{name}.yaml" in path.read_text()
    assert "PYTHONPATH" not in path.read_text()


def test_print_config_checks_data_only_when_asked(tmp_path, capsys):
    """print-config resolves a config whose prompt files are elsewhere; --check-data and train check them, and
    train refuses before any model loads (the hub id below is never fetched)."""
    from diffgrpo.cli.app import main

    args = ["--config", str(Path(__file__).resolve().parents[1] / "configs" / "sd35_medium_ocr.yaml"),
            f"train.prompts_file={tmp_path / 'missing.jsonl'}", f"log.output_dir={tmp_path / 'run'}"]
    assert main(["print-config", *args]) == 0
    capsys.readouterr()
    assert main(["print-config", "--check-data", *args]) == 2
    assert "train.prompts_file" in capsys.readouterr().err
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "train.prompts_file" in err and "does not exist" in err and len(err.strip().splitlines()) == 1
    assert main(["print-config", *args[:2], "eval.prompts_file=builtin:ocr/nope"]) == 2
    err = capsys.readouterr().err
    assert "builtin:ocr/test" in err and "builtin:geneval/train" in err
