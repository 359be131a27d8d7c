"""LoRA on the built-in tiny flow model (model.name=tiny, model.lora_rank > 0): only the adapter trains, every
engine's first-update gradient stays exact, the KL reference is the base model, checkpoints hold the adapter."""
import pytest
import torch

from diffgrpo.engines._per_sample import PerSampleGrads
from diffgrpo.engines.jagg import JaggEngine
from diffgrpo.engines.recompute import RecomputeEngine
from diffgrpo.engines.single_step import SingleStepEngine
from diffgrpo.run.job import resume
from tests.helpers.tensors import flat_grad, rel_err

TOL = 1e-5
LORA = ["model.lora_rank=4", "model.lora_alpha=8"]


def _set_lora_b(tr, scale=0.05, seed=7):
    """Move B off peft's zero init, so that θ ≠ θ_ref (KL > 0) and the gradient w.r.t. A is not zero."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in tr.policy.named_trainable_parameters().items():
            if "lora_B" in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))


def _lora_grad(tr, which):
    return torch.cat([p.grad.flatten() for n, p in tr.policy.named_trainable_parameters().items() if which in n])


def _probe(pol, n=3):
    """A no-grad velocity of ``pol`` at fixed inputs (a function: call it again after the weights change)."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, *pol.latent_shape, generator=g)
    cond = pol.encode([f"a handwritten digit {d}" for d in range(n)])

    @torch.no_grad()
    def v():
        return pol.velocity(x, torch.full((n,), 0.6), cond)

    return v


def _flat(params) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in params])


def test_only_the_adapter_trains(make_trainer):
    tr = make_trainer(*LORA, "loss.beta=0.1")
    pol = tr.policy
    named = pol.named_trainable_parameters()
    # one (A, B) pair per targeted Linear, rank 4: r·(in + out) weights each; nothing else trains
    from peft.tuners.lora import LoraLayer

    adapted = {n: m for n, m in pol.transformer.named_modules() if isinstance(m, LoraLayer)}
    expected = sum(4 * (m.in_features + m.out_features) for m in adapted.values())
    assert sum(p.numel() for p in tr.params) == expected == sum(p.numel() for p in named.values())
    assert {id(p) for p in tr.params} == {id(p) for p in named.values()} and all("lora_" in n for n in named)
    assert not any(p.requires_grad for p in pol._encoder.__self__.parameters())  # the frozen prompt encoder
    assert expected < sum(p.numel() for p in pol.transformer.parameters()) // 10
    # default targets: SD3's joint-attention projections (one block, context_pre_only: no to_add_out)
    assert {n.split("attn.")[1] for n in adapted} == {"to_q", "to_k", "to_v", "to_out.0",
                                                     "add_q_proj", "add_k_proj", "add_v_proj"}
    assert pol._ref is None  # KL reference = adapter disabled, no frozen copy
    sd = pol.state_dict()
    assert len(sd) == len(named) and all("lora_" in k for k in sd)
    # the fast per-sample-gradient path (reweight) covers every adapter weight with one Linear owner each,
    # and hooks no frozen base layer
    psg = PerSampleGrads(pol, tr.params)
    assert psg.supported() and len(psg.owners) == len(tr.params)
    assert all(isinstance(m, torch.nn.Linear) and m.weight.requires_grad for m in psg.owners)
    # explicit targets
    tq = make_trainer("model.lora_rank=2", "model.lora_target_modules=to_q, to_v")
    assert {n.split("attn.")[1].split(".lora_")[0] for n in tq.policy.named_trainable_parameters()} == {"to_q", "to_v"}


@pytest.mark.parametrize("engine", ["retain", "reweight"])
@pytest.mark.parametrize("overrides", [[], ["loss.beta=0.1"], ["model.guidance_scale=3.0"],
                                       ["model.guidance_scale=3.0", "loss.beta=0.05"]],
                         ids=lambda o: ",".join(o) or "default")
def test_lora_first_update_equals_recompute(make_trainer, engine, overrides):
    tr = make_trainer(f"engine.name={engine}", *LORA, *overrides)
    beta = any(o.startswith("loss.beta") for o in overrides)
    _set_lora_b(tr)
    ro = tr.rollout()
    stats = tr.backward(ro, 0)
    g = flat_grad(tr.params)
    assert _lora_grad(tr, "lora_A").abs().max() > 0  # B ≠ 0: A gets a gradient too
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, 0)
    g_ref = flat_grad(tr.params)
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) < TOL
    assert stats.metrics["fallback_recompute"] == 0.0
    if beta:
        assert stats.metrics["kl"] > 0
    if engine == "reweight":  # the fast path: one batched backward per step and term, not one per sample
        assert stats.backward_calls == int(ro.selected.any(0).sum()) * (2 if beta else 1)


@pytest.mark.parametrize("engine", ["jagg", "single_step"])
def test_lora_jagg_and_single_step_equal_recompute(make_trainer, engine):
    extra = (["engine.window=2"] if engine == "jagg" else ["engine.candidate_steps=all"])
    tr = make_trainer(f"engine.name={engine}", *extra, *LORA, "model.guidance_scale=3.0", "loss.beta=0.05")
    _set_lora_b(tr)
    ro = tr.rollout()
    eng = JaggEngine(tr.cfg.engine) if engine == "jagg" else SingleStepEngine(tr.cfg.engine)
    tr.optimizer.zero_grad(set_to_none=True)
    stats = eng.backward(tr.family.ctx, ro, 0)
    g = flat_grad(tr.params)
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.family.ctx, ro, 0)
    g_ref = flat_grad(tr.params)
    assert g_ref.norm() > 0 and rel_err(g, g_ref) < TOL
    assert stats.metrics["kl"] > 0


def test_reference_is_the_base_model_after_updates(make_trainer):
    base = make_trainer("loss.beta=0.1").policy  # same seed: the same base weights, no adapter
    tr = make_trainer(*LORA, "loss.beta=0.1", "train.lr=0.01")
    pol = tr.policy
    v_base = _probe(base)()
    v_pol = _probe(pol)
    torch.testing.assert_close(v_pol(), v_base, rtol=0, atol=1e-6)  # B = 0: the adapter starts as the identity
    frozen = {n: p.detach().clone() for n, p in pol.transformer.named_parameters() if not p.requires_grad}
    _set_lora_b(tr)
    adapter = [p.detach().clone() for p in tr.params]
    row = tr.step()
    assert row["kl"] > 0 and row["skipped_updates"] == 0
    # every adapter weight with a gradient moved (only the last block's add_q_proj has none: that block drops
    # the text stream's output, so the text queries are dead)
    live = [p.grad.abs().max() > 0 for p in tr.params]
    assert sum(live) == len(tr.params) - 2
    assert all(not torch.equal(a, p) for a, p, g in zip(adapter, tr.params, live) if g)
    assert all(torch.equal(frozen[n], p) for n, p in pol.transformer.named_parameters() if n in frozen)  # base did not
    assert (v_pol() - v_base).abs().max() > 1e-3
    with pol.reference():
        torch.testing.assert_close(v_pol(), v_base, rtol=0, atol=1e-6)
    assert all(p.requires_grad for p in tr.params)  # re-enabled after the block (peft toggles requires_grad)
    assert (v_pol() - v_base).abs().max() > 1e-3


def test_checkpoint_round_trip_restores_the_adapter(make_trainer, tmp_path):
    common = [*LORA, "loss.beta=0.05", "train.lr=0.01", "train.ema_decay=0.5", f"log.output_dir={tmp_path}"]
    tr = make_trainer(*common)
    tr.step()
    ckpt = tr.save_checkpoint()
    from diffgrpo.run.checkpoint import load_checkpoint

    saved = load_checkpoint(ckpt).trainable
    assert set(saved) == set(tr.policy.state_dict()) and all("lora_" in k for k in saved)
    assert sum(v.numel() for v in saved.values()) == sum(p.numel() for p in tr.params)
    tr2 = make_trainer(*common)  # fresh adapter (B = 0) on the same base
    assert not torch.equal(_flat(tr2.params), _flat(tr.params))
    assert resume(tr2, tmp_path) and tr2.iteration == 1
    assert torch.equal(_flat(tr2.params), _flat(tr.params))
    torch.testing.assert_close(_probe(tr2.policy)(), _probe(tr.policy)(), rtol=0, atol=0)
    # the resumed run continues exactly: optimizer, EMA and RNG streams came back too
    tr.step()
    tr2.step()
    assert torch.equal(_flat(tr2.params), _flat(tr.params))
    assert all(torch.equal(tr.ema.shadow[n], tr2.ema.shadow[n]) for n in tr.ema.shadow)
    with pytest.raises(KeyError, match="LoRA"):  # a full-transformer state dict is not an adapter
        tr2.policy.load_state_dict(make_trainer().policy.state_dict())


def test_saving_a_lora_imports_the_pipeline_class_without_a_library_warning():
    """The built-in models save their LoRA through ``StableDiffusion3Pipeline.save_lora_weights``; importing that
    class makes transformers warn once about SigLIP's image processor where torchvision is missing, a line in every
    LoRA run's log that says nothing about the run. ``pipeline_class`` returns the same class without it; the plain
    lookup, in a fresh process, shows the warning is real wherever torchvision is absent."""
    import importlib.util
    import subprocess
    import sys

    def stderr_of(code: str) -> str:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stderr

    ours = stderr_of("from diffgrpo.models.diffusers_adapter import pipeline_class; "
                     "import diffusers; assert pipeline_class('StableDiffusion3Pipeline') is "
                     "diffusers.StableDiffusion3Pipeline")
    assert "torchvision" not in ours, ours
    plain = stderr_of("import diffusers; diffusers.StableDiffusion3Pipeline")
    assert ("requires torchvision" in plain) == (importlib.util.find_spec("torchvision") is None), plain
