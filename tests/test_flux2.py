"""FLUX.2 [dev] and FLUX.2 [klein] behind ``DiffusersFlowPolicy``: tiny random-weight ``Flux2Pipeline`` /
``Flux2KleinPipeline`` built from the pipelines' own classes (a Mistral-3 / Qwen3 text encoder, a character
tokenizer with a chat template built in memory, an ``AutoencoderKLFlux2`` with non-trivial batch-norm statistics, a
``Flux2Transformer2DModel``) and saved locally. The library's ODE rollout reproduces each pipeline's sampling
(latents and decoded images); its ``sampler.shift`` = e^mu reproduces the pipelines' σ grid; a command-line run
(full and LoRA) exports files diffusers reloads and samples to the trained latents."""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.errors import ConfigError
from diffgrpo.models.diffusers_adapter import (
    DiffusersFlowPolicy,
    PolicyOptions,
    build_diffusers_policy,
    detect_pipeline,
)
from diffgrpo.models.pipelines import flux2
from diffgrpo.samplers.flow_sde import sigma_grid
from diffgrpo.samplers.rollout import sample_trajectories
from tests.helpers.pipelines import PROMPTS
from tests.helpers.tensors import flat_grad

T, RES, SEQ = 3, 32, 48
LATENT = (16, 4, 4)  # 4 VAE channels 2×2-patchified; VAE factor 4 → 32 px / 8
COMMON = ["log.progress=false", "log.save_images=false", "reward.weights={jpeg_incompressibility: 1.0}",
          f"sampler.num_steps={T}", "train.prompts_per_batch=2", "train.group_size=2", "model.name=diffusers",
          f"model.resolution={RES}", f"model.max_sequence_length={SEQ}", "eval.seeds_per_prompt=1"]


def _tokenizer():
    """A character tokenizer whose chat template renders the user turns (the system turn of [dev] is left out, so
    the prompt is not truncated away at a tiny max_sequence_length)."""
    import string

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1}
    for c in string.ascii_lowercase + string.digits + " .,!?'-<>|/":
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    t = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    t.chat_template = ("{% for m in messages %}{% if m['role'] != 'system' %}<|{{ m['role'] }}|>"
                       "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                       "{% for c in m['content'] %}{{ c['text'] }}{% endfor %}{% endif %}{% endif %}{% endfor %}")
    return t


def _components(guidance_embeds: bool):
    from diffusers import (
        AutoencoderKLFlux2,
        FlowMatchEulerDiscreteScheduler,
        Flux2Transformer2DModel,
    )

    torch.manual_seed(0)
    tr = Flux2Transformer2DModel(in_channels=16, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=48, timestep_guidance_channels=32,
                                 axes_dims_rope=(2, 2, 2, 2), guidance_embeds=guidance_embeds)
    vae = AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * 3, up_block_types=("UpDecoderBlock2D",) * 3,
                             block_out_channels=(8, 8, 16), layers_per_block=1, latent_channels=4, norm_num_groups=4,
                             sample_size=RES)
    vae.bn.running_mean.normal_(0, 0.5)  # the decoding must undo the batch norm
    vae.bn.running_var.uniform_(0.5, 2.0)
    # the published scheduler: dynamic shifting with the exponential time shift (mu from the pipeline)
    sched = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, time_shift_type="exponential")
    return tr, vae, sched


def _dev_pipeline():
    from diffusers import Flux2Pipeline
    from transformers import (
        Mistral3Config,
        Mistral3ForConditionalGeneration,
        MistralConfig,
        PixtralVisionConfig,
    )

    tr, vae, sched = _components(guidance_embeds=True)
    text = Mistral3ForConditionalGeneration(Mistral3Config(  # 31 hidden states: the pipeline stacks 10, 20, 30
        text_config=MistralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=30,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=8),
        vision_config=PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                          num_attention_heads=2, image_size=32, patch_size=8, head_dim=8),
        spatial_merge_size=2))
    return Flux2Pipeline(scheduler=sched, vae=vae, text_encoder=text, tokenizer=_tokenizer(), transformer=tr)


def _klein_pipeline(is_distilled: bool = False):
    from diffusers import Flux2KleinPipeline
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tr, vae, sched = _components(guidance_embeds=False)
    text = Qwen3ForCausalLM(Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=27,
                                        num_attention_heads=2, num_key_value_heads=1, head_dim=8))  # 9, 18, 27
    return Flux2KleinPipeline(scheduler=sched, vae=vae, text_encoder=text, tokenizer=_tokenizer(), transformer=tr,
                              is_distilled=is_distilled)


class _Dirs(dict):
    """variant → a saved tiny pipeline directory, built on first use (the default run builds [klein] only)."""

    def __init__(self, factory):
        super().__init__()
        self.factory = factory

    def __missing__(self, name):
        d = self.factory.mktemp(f"tiny-flux2-{name}")
        {"dev": _dev_pipeline, "klein": _klein_pipeline}[name]().save_pretrained(str(d))
        (d / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
        self[name] = d
        return d


@pytest.fixture(scope="module")
def pipe_dirs(tmp_path_factory):
    return _Dirs(tmp_path_factory)


def _load(d):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(str(d))
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _noise():
    return torch.randn(len(PROMPTS), *LATENT, generator=torch.Generator().manual_seed(0))


def _pipeline_sample(pipe, x, g, output_type="latent"):
    """The pipeline's own sampling from noise x (our layout); → (final latents in our layout, its output)."""
    final = {}

    def keep(p, i, t, kw):  # the packed latents (B, h·w, C) after the last step
        final["z"] = kw["latents"]
        return {}

    with torch.no_grad():
        out = pipe(prompt=list(PROMPTS), num_inference_steps=T, guidance_scale=g, latents=x.clone(), height=RES,
                   width=RES, max_sequence_length=SEQ, output_type=output_type, callback_on_step_end=keep).images
    return flux2.unpack(final["z"], *LATENT[1:]), out


def _our_latents(pol, pipe, x):
    """The library's ODE rollout on the grid the pipeline's last call used (its scheduler's σ, ending at 0)."""
    sigmas = pipe.scheduler.sigmas.float()
    with torch.no_grad():
        return sample_trajectories(pol, pol.encode(PROMPTS), x, sigmas, kernel={"sde_type": "ode"})["xs"][:, -1]


@pytest.mark.parametrize("variant,g", [pytest.param("dev", 4.0, marks=pytest.mark.slow), ("klein", 4.0),
                                       pytest.param("klein", 1.0, marks=pytest.mark.slow)],
                         ids=["dev-embedded-guidance", "klein-cfg", "klein-no-cfg"])
def test_rollout_reproduces_the_pipeline_sampling(pipe_dirs, variant, g):
    """FLUX.2's conventions (patchified latents as tokens, 4-axis ids, σ timestep, stacked LM features; [dev]'s
    embedded guidance, [klein]'s true CFG with the empty negative prompt) in the adapter: same σ grid and noise →
    the pipeline's latents and decoded images."""
    pipe = _load(pipe_dirs[variant])
    pol = DiffusersFlowPolicy(pipe.transformer, options=PolicyOptions(max_sequence_length=SEQ, guidance_scale=g),
                              latent_shape=LATENT, pipeline=pipe)
    assert detect_pipeline(pipe.transformer) == ("flux2" if variant == "dev" else "flux2_klein")
    assert pol.uses_cfg == (variant == "klein" and g != 1.0)
    x = _noise()
    z_pipe, images = _pipeline_sample(pipe, x, g, output_type="pt")
    ours = _our_latents(pol, pipe, x)
    assert float((z_pipe - _pipeline_sample(pipe, x, g + 2.0)[0]).abs().max()) > 1e-3  # guidance matters here
    err = float((ours - z_pipe).abs().max())
    assert err < 1e-5, err
    img_err = float((pol.decode(ours) - images).abs().max())
    print(f"flux2 {variant} g={g}: max |ours − pipeline| latents {err:.2e}, images {img_err:.2e}")
    assert img_err < 1e-5, img_err
    # the σ grid: the pipeline's exponential time shift with mu(h·w, T) is the library's shift e^mu
    shift = flux2.empirical_shift(RES, T, pipe.vae_scale_factor)
    torch.testing.assert_close(sigma_grid(T, shift), pipe.scheduler.sigmas.float(), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_lora_gradient_reaches_the_adapter_and_distilled_klein_needs_no_guidance(pipe_dirs, tmp_path,
                                                                                  monkeypatch):
    pipe = _load(pipe_dirs["klein"])
    options = PolicyOptions(max_sequence_length=SEQ, lora_rank=2, guidance_scale=3.0, gradient_checkpointing=True)
    pol = DiffusersFlowPolicy(pipe.transformer, options=options, latent_shape=LATENT, pipeline=pipe)
    names = list(pol.named_trainable_parameters())
    assert names and all("lora_" in n for n in names)
    assert any("single_transformer_blocks" in n for n in names)  # the single-stream blocks are adapted too
    for n, p in pol.named_trainable_parameters().items():
        if "lora_B" in n:
            p.data.normal_(0, 0.1)
    v = pol.velocity(_noise(), torch.tensor([0.9, 0.5, 0.2]), pol.encode(PROMPTS))
    (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum().backward()
    assert flat_grad(pol.trainable_parameters()).abs().sum() > 0
    d = tmp_path / "distilled"
    _klein_pipeline(is_distilled=True).save_pretrained(str(d))
    cfg = RunConfig.from_overrides([*COMMON, f"model.pretrained={d}", "model.guidance_scale=4.0"])
    from diffusers import DiffusionPipeline

    def no_load(*a, **k):
        raise AssertionError("the pipeline was loaded before the check")

    with monkeypatch.context() as mp, pytest.raises(ConfigError, match="model.guidance_scale"):
        mp.setattr(DiffusionPipeline, "from_pretrained", no_load)  # read from model_index.json before loading
        build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    with pytest.raises(ConfigError, match="model.guidance_scale"):  # a loaded pipeline (a hub id)
        flux2.check_guidance(_load(d).config, 4.0)
    flux2.check_guidance(_load(d).config, 1.0)
    wrong = RunConfig.from_overrides([*COMMON, f"model.pretrained={pipe_dirs['klein']}", "model.pipeline=flux2"])
    with pytest.raises(ConfigError, match="model.pipeline: value 'flux2' does not match"):  # would drop [klein]'s CFG
        build_diffusers_policy(wrong, progress=False, log=lambda *a: None)


@pytest.mark.slow
@pytest.mark.parametrize("lora", [4, 0], ids=["lora", "full"])
@pytest.mark.parametrize("variant", ["dev", "klein"])
def test_cli_run_exports_what_diffusers_reloads_and_samples(pipe_dirs, tmp_path, variant, lora):
    from diffusers import Flux2Transformer2DModel
    from safetensors.torch import load_file

    from diffgrpo.cli.app import main

    d, run, g = pipe_dirs[variant], tmp_path / "run", 4.0
    assert main(["train", *COMMON, f"model.pretrained={d}", f"model.guidance_scale={g}", f"model.lora_rank={lora}",
                 "train.lr=0.05" if lora else "train.lr=0.002", "train.num_iterations=2",
                 f"train.prompts_file={d / 'prompts.txt'}", f"eval.prompts_file={d / 'prompts.txt'}",
                 f"log.output_dir={run}"]) == 0
    out = tmp_path / "export"
    assert main(["export", str(run), "--out", str(out)]) == 0
    cfg = RunConfig.from_yaml(str(run / "config.yaml"), [])
    assert cfg.model.pipeline == "auto"
    trained = build_diffusers_policy(cfg, progress=False, log=lambda *a: None)
    trained.load_state_dict(load_file(str(run / "weights.safetensors")))
    x = _noise()
    pipe = _load(d)
    before, _ = _pipeline_sample(pipe, x, g)  # also sets the scheduler's grid
    reference = _our_latents(trained, pipe, x)
    assert float((before - reference).abs().max()) > 1e-4  # training moved it
    if lora:
        pipe.load_lora_weights(str(out))
    else:
        pipe.transformer = Flux2Transformer2DModel.from_pretrained(str(out))
    after, images = _pipeline_sample(pipe, x, g, output_type="pt")
    err = float((after - reference).abs().max())
    img_err = float((images - trained.decode(reference)).abs().max())
    print(f"flux2 {variant} {'lora' if lora else 'full'}: max |pipeline − trained| latents {err:.2e}, "
          f"images {img_err:.2e}")
    assert err < 1e-4 and img_err < 1e-4, (err, img_err)


@pytest.mark.parametrize("family,ok", [("flux2", False), ("flux2_klein", True)])
def test_negative_prompt_is_refused_for_the_guidance_distilled_dev_only(family, ok):
    """[dev] has no negative branch (a one-line ConfigError before anything loads); [klein] guides with one."""
    args = [*COMMON, "model.pretrained=org/flux2", f"model.pipeline={family}", "model.negative_prompt=blurry"]
    if ok:
        assert RunConfig.from_overrides(args).model.pipeline == family
    else:
        with pytest.raises(ConfigError, match="model.negative_prompt: FLUX is guidance-distilled"):
            RunConfig.from_overrides(args)
