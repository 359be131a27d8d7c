"""The built-in tiny flow model is served by DiffusersFlowPolicy (family sd3) over its SD3 transformer: the same
velocities as a direct ``TinyFlowNet`` call, the pretrained cache built once and reused under an unchanged key,
and the end-of-run exports (``transformer/``, ``lora/``) loadable with diffusers."""
from types import SimpleNamespace

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.models.diffusers_adapter import DiffusersFlowPolicy, PolicyOptions
from diffgrpo.models.tiny import (
    _recipe_key,
    arch_kwargs,
    build_tiny_policy,
    load_or_pretrain,
    tokenize,
)
from diffgrpo.models.words import WordPromptEncoder
from tests.helpers.tiny import TINY

PROMPTS = ["a handwritten digit 3", "digit 7", "the number five"]


def quiet(*a):
    pass


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-cache")


def _cfg(cache, *overrides):
    return RunConfig.from_overrides([*TINY, "seed=0", "pretrain.steps=20", f"model.cache_dir={cache}", *overrides])


def _inputs(pol, n=3):
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, *pol.latent_shape, generator=g), torch.tensor([0.9, 0.5, 0.2])[:n]


@pytest.mark.parametrize("guidance", [1.0, 3.0])
def test_tiny_policy_is_the_diffusers_policy_and_matches_the_net(cache_dir, guidance):
    cfg = _cfg(cache_dir, f"model.guidance_scale={guidance}")
    pol = build_tiny_policy(cfg, progress=False, log=quiet)
    assert isinstance(pol, DiffusersFlowPolicy) and pol.row.name == "sd3"
    assert pol.latent_shape == (1, 8, 8) and pol.device == torch.device("cpu")
    assert pol.uses_cfg == (guidance != 1.0) and pol.negative_prompt == ""
    assert pol.forward_module is pol.transformer and pol._ref is None  # loss.beta = 0: no frozen copy
    text = pol._encoder.__self__  # the frozen prompt encoder, on the policy's device
    assert isinstance(text, WordPromptEncoder) and not any(p.requires_grad for p in text.parameters())
    assert all(p.device == pol.device for p in text.parameters())
    alone, batched = text.encode(PROMPTS[1:2]), text.encode(PROMPTS)  # batch-independent, bit for bit, so the
    assert all(torch.equal(alone[k][0], batched[k][1]) for k in alone)  # per-prompt cache keeps resumes exact
    assert pol.trainable_parameters() == list(pol.transformer.parameters())  # full fine-tune: the transformer
    assert list(pol.named_trainable_parameters()) == [n for n, _ in pol.transformer.named_parameters()]

    # independent reference: the same cached weights, called through TinyFlowNet.forward, CFG by hand
    net = load_or_pretrain(cfg.model, cfg.pretrain, progress=False, log=quiet)
    assert set(pol.state_dict()) == set(net.transformer.state_dict())
    x, sigma = _inputs(pol)
    with torch.no_grad():
        v = pol.velocity(x, sigma, pol.encode(PROMPTS))
        want = net(x, sigma, *net.text(tokenize(PROMPTS)))
        if guidance != 1.0:
            v_u = net(x, sigma, *net.text(tokenize([""] * len(PROMPTS))))
            want = v_u + guidance * (want - v_u)
    assert v.dtype == torch.float32 and v.shape == x.shape
    torch.testing.assert_close(v, want, rtol=1e-5, atol=1e-6)
    n = len(PROMPTS) * (2 if guidance != 1.0 else 1)  # CFG: one batched forward of 2B sample-forwards
    assert pol.counters == {"forwards_grad": 0, "forwards_nograd": n}
    torch.testing.assert_close(pol.decode(torch.tensor([-2.0, -1.0, 0.0, 1.0, 2.0])),
                               torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0]))


def test_reference_is_a_frozen_copy_without_lora(cache_dir):
    pol = build_tiny_policy(_cfg(cache_dir, "loss.beta=0.1", "model.guidance_scale=3.0"), progress=False, log=quiet)
    x, sigma = _inputs(pol)
    cond = pol.encode(PROMPTS)
    with torch.no_grad():
        v0 = pol.velocity(x, sigma, cond)
        for p in pol.trainable_parameters():
            p.add_(0.05 * torch.randn_like(p))
        with pol.reference():
            torch.testing.assert_close(pol.velocity(x, sigma, cond), v0, rtol=0, atol=0)
        assert (pol.velocity(x, sigma, cond) - v0).abs().max() > 1e-3


def test_pretrained_cache_is_built_once_and_reused(tmp_path):
    cfg = _cfg(tmp_path)
    logs = []
    a = build_tiny_policy(cfg, progress=False, log=logs.append)
    assert len(logs) == 1 and "pretraining" in logs[0]
    b = build_tiny_policy(cfg, progress=False, log=logs.append)
    assert len(logs) == 1  # the second build loaded the cached weights
    key = _recipe_key(arch_kwargs(cfg.model), cfg.pretrain)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [f"tiny-flow-{key}"]
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    # the cache key of a fixed recipe is pinned: caches written before stay valid
    arch = dict(image_size=16, patch_size=2, num_layers=2, num_heads=4, head_dim=16, text_dim=32)
    recipe = SimpleNamespace(steps=3000, batch_size=64, lr=1e-3, cond_dropout=0.1, seed=0)
    assert _recipe_key(arch, recipe) == "0b2150c01dfc"


@pytest.mark.parametrize("lora", [False, True], ids=["transformer", "lora"])
def test_save_adapter_reloads_with_diffusers(cache_dir, tmp_path, lora):
    from diffusers import SD3Transformer2DModel

    extra = ["model.lora_rank=4", "model.lora_alpha=8"] if lora else []
    pol = build_tiny_policy(_cfg(cache_dir, "model.guidance_scale=3.0", *extra), progress=False, log=quiet)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # move the trainable weights (LoRA B included) off their initial values
        for p in pol.trainable_parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    d = pol.save_adapter(tmp_path / ("lora" if lora else "transformer"))
    base = build_tiny_policy(_cfg(cache_dir, "model.guidance_scale=3.0"), progress=False, log=quiet)
    x, sigma = _inputs(pol)
    with torch.no_grad():
        v = pol.velocity(x, sigma, pol.encode(PROMPTS))
        v_base = base.velocity(x, sigma, base.encode(PROMPTS))
    if lora:
        assert (d / "pytorch_lora_weights.safetensors").is_file()
        base.transformer.load_lora_adapter(str(d), weight_name="pytorch_lora_weights.safetensors")  # same base
        loaded = base
    else:
        assert (d / "config.json").is_file()
        loaded = DiffusersFlowPolicy(SD3Transformer2DModel.from_pretrained(str(d)), "sd3",
                                     PolicyOptions(guidance_scale=3.0), latent_shape=pol.latent_shape,
                                     encoder=pol._encoder)
    with torch.no_grad():
        v_loaded = loaded.velocity(x, sigma, loaded.encode(PROMPTS))
    assert (v - v_base).abs().max() > 1e-3  # the saved weights matter: the match below is not the base model's
    torch.testing.assert_close(v_loaded, v, rtol=1e-5, atol=1e-6)
