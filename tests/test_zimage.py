"""Z-Image (and the Turbo layout: no CFG, few steps) behind ``DiffusersFlowPolicy``: a tiny random-weight
``ZImagePipeline`` built from the pipeline's own classes (a Qwen3 text encoder, a chat-template tokenizer built in
memory, an AutoencoderKL, the Z-Image transformer) and saved locally. The library's ODE rollout reproduces the
pipeline's sampling; a command-line run (full and LoRA) exports files diffusers reloads and samples to the
trained latents."""
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
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.pipelines import PROMPTS
from tests.helpers.tensors import flat_grad

T, RES = 3, 32
LATENT = (4, 8, 8)
COMMON = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
          f"sampler.num_steps={T}", "train.prompts_per_batch=2", "train.group_size=2", "model.name=diffusers",
          f"model.resolution={RES}", "model.max_sequence_length=64", "eval.seeds_per_prompt=1"]


def _tokenizer():
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1}
    for c in string.ascii_lowercase + string.digits + ".,!?'-<>|/":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    t.chat_template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|a|>"
    return t


def _zimage_pipeline():
    from diffusers import (
        AutoencoderKL,
        FlowMatchEulerDiscreteScheduler,
        ZImagePipeline,
        ZImageTransformer2DModel,
    )
    from transformers import Qwen3Config, Qwen3Model

    torch.manual_seed(0)
    tr = ZImageTransformer2DModel(in_channels=4, dim=32, n_layers=1, n_refiner_layers=1, n_heads=2, n_kv_heads=2,
                                  cap_feat_dim=16, axes_dims=[4, 6, 6], axes_lens=[256, 32, 32])
    vae = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 3,
                        up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(8, 8, 16), layers_per_block=1,
                        latent_channels=4, norm_num_groups=8, sample_size=32, scaling_factor=0.3611,
                        shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
    text = Qwen3Model(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=False)
    return ZImagePipeline(scheduler=sched, vae=vae, text_encoder=text, tokenizer=_tokenizer(), transformer=tr)


@pytest.fixture(scope="module")
def zimage_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-zimage")
    _zimage_pipeline().save_pretrained(str(d))
    (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return d


def _noise():
    return torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(0))


def _pipeline_latents(pipe, x, g_pipe):
    """The pipeline's own sampling (its default Z-Image σ schedule, shifted by its scheduler)."""
    with torch.no_grad():
        return pipe(list(PROMPTS), negative_prompt=[""] * len(PROMPTS), num_inference_steps=T, guidance_scale=g_pipe,
                    latents=x.clone(), height=RES, width=RES, max_sequence_length=64, output_type="latent").images


def _our_latents(pol, pipe, x):
    """The library's ODE rollout on the grid the pipeline's last call used (its scheduler's σ, ending at 0)."""
    _pipeline_latents(pipe, x, 0.0)  # sets the scheduler's grid as the pipeline sets it
    sigmas = pipe.scheduler.sigmas.float()
    with torch.no_grad():
        return sample_trajectories(pol, pol.encode(PROMPTS), x, sigmas, kernel={"sde_type": "ode"})["xs"][:, -1]


@pytest.mark.parametrize("g_pipe", [0.0, 3.0], ids=["turbo-no-cfg", "cfg"])
def test_rollout_reproduces_the_pipeline_sampling(zimage_dir, g_pipe):
    """Z-Image's conventions (timestep 1 − σ, output −v, unpadded caption features, guidance pos + g·(pos − neg))
    in the adapter: same grid and noise → the pipeline's latents (g = 0: the Turbo recipe's guidance-free
    sampling; ours is model.guidance_scale = g + 1)."""
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(zimage_dir))
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(max_sequence_length=64,
                                                                       guidance_scale=g_pipe + 1.0),
                              latent_shape=LATENT, pipeline=pipe)
    assert detect_pipeline(pipe.transformer) == "zimage" and pol.uses_cfg == (g_pipe > 0)
    cond = pol.encode(PROMPTS)
    assert not bool(cond["prompt_mask"].all())  # prompts of different lengths, padded and masked
    x = _noise()
    err = float((_our_latents(pol, pipe, x) - _pipeline_latents(pipe, x, g_pipe)).abs().max())
    assert err < 1e-5, err
    # a sample's velocity does not depend on the other prompts of the batch (padding is masked)
    with torch.no_grad():
        v_all = pol.velocity(x, torch.full((3,), 0.6), cond)
        v_one = pol.velocity(x[2:], torch.full((1,), 0.6), pol.encode(PROMPTS[2:]))
    torch.testing.assert_close(v_all[2:], v_one, rtol=1e-4, atol=1e-5)


def test_lora_gradient_reaches_the_adapter(zimage_dir):
    from diffusers import ZImagePipeline

    pipe = ZImagePipeline.from_pretrained(str(zimage_dir))
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(max_sequence_length=64, lora_rank=2),
                              latent_shape=LATENT, pipeline=pipe)
    names = list(pol.named_trainable_parameters())
    assert names and all("lora_" in n for n in names)
    for n, p in pol.named_trainable_parameters().items():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    v = pol.velocity(_noise(), torch.tensor([0.9, 0.5, 0.2]), pol.encode(PROMPTS))
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
def test_cli_run_exports_what_diffusers_reloads_and_samples(zimage_dir, tmp_path, lora):
    from diffusers import ZImagePipeline, ZImageTransformer2DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run = zimage_dir, tmp_path / "run"
    assert main(["train", *COMMON, f"model.pretrained={d}", "model.guidance_scale=4.0", f"model.lora_rank={lora}",
                 "train.lr=0.05" if lora else "train.lr=0.002", "train.num_iterations=2",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={run}"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    reference = _our_latents(trained, trained.pipeline, x)
    pipe = ZImagePipeline.from_pretrained(str(d))
    assert float((_pipeline_latents(pipe, x, 3.0) - reference).abs().max()) > 1e-4  # training moved it
    if lora:
        pipe.load_lora_weights(str(out))
    else:
        pipe.transformer = ZImageTransformer2DModel.from_pretrained(str(out))
    err = float((_pipeline_latents(pipe, x, 3.0) - reference).abs().max())
    print(f"z-image {'lora' if lora else 'full'}: max |pipeline − trained| = {err:.2e}")
    assert err < 1e-4, err
