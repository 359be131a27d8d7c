"""Trust-region options of the flow step loss: Flow-DPPO's exact per-step Gaussian KL mask and GRPO-Guard's ratio
normalisation, against hand computations; the default loss is unchanged."""
from __future__ import annotations

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.config import ConfigError
from diffgrpo.engines.base import EngineContext, step_loss
from diffgrpo.losses import (
    gaussian_step_kl,
    kl_mask_loss,
    normalized_log_ratio,
    policy_loss,
    ppo_clip_loss,
)
from diffgrpo.samplers import flow_sde
from diffgrpo.validation import validate
from tests.helpers.tensors import flat_grad, perturb, rel_err


def _gauss_logp(x, mu, s):
    """Mean-reduced Gaussian log-density written out: mean(−(x−μ)²/(2s²) − log s − log √(2π))."""
    s = s.view(-1, *([1] * (x.dim() - 1)))
    log_2pi = torch.log(torch.tensor(2 * torch.pi))
    return (-(x - mu) ** 2 / (2 * s ** 2) - torch.log(s) - 0.5 * log_2pi).flatten(1).mean(1)


def test_gaussian_step_kl_is_the_exact_kl():
    g = torch.Generator().manual_seed(0)
    mu, mu_old = torch.randn(3, 2, 4, 4, generator=g), torch.randn(3, 2, 4, 4, generator=g)
    s = torch.tensor([0.1, 0.5, 2.0])
    D = 2 * 4 * 4
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(mu_old, s.view(-1, 1, 1, 1).expand_as(mu)),
        torch.distributions.Normal(mu, s.view(-1, 1, 1, 1).expand_as(mu))).flatten(1).sum(1)  # (3,)
    torch.testing.assert_close(gaussian_step_kl(mu, mu_old, s, "sum"), ref)
    torch.testing.assert_close(gaussian_step_kl(mu, mu_old, s, "mean"), ref / D)


def test_kl_mask_drops_only_steps_outside_the_region_moving_away():
    r = torch.tensor([1.2, 0.8, 1.2, 0.8, 1.2, 0.8, 1.2, 0.8])
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, 1.0, -1.0, -1.0])
    kl = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.01, 0.01, 0.01, 0.01])
    lp_old = torch.zeros(8)
    loss, ratio, masked = kl_mask_loss(torch.log(r), lp_old, adv, kl, bound=0.1)
    # outside (KL 0.5 ≥ 0.1): A>0 & r>1 and A<0 & r<1 move away → dropped; the corrective ones pass; inside: all pass
    assert masked.tolist() == [True, False, False, True, False, False, False, False]
    torch.testing.assert_close(loss, torch.where(masked, torch.zeros(8), -adv * r))
    torch.testing.assert_close(ratio, r)
    lp = torch.log(r).requires_grad_(True)
    kl_mask_loss(lp, lp_old, adv, kl, 0.1)[0].sum().backward()
    assert lp.grad[masked].abs().max() == 0 and (lp.grad[~masked] != 0).all()


def test_normalized_log_ratio_centres_and_rescales_the_log_ratio():
    """For x' = μ_old + s·ε: (ℓ_θ − ℓ_old + KL)·s = mean(ε·(μ_θ − μ_old)) exactly; over many ε its mean is 0
    while the raw log-ratio's is −KL, and its spread no longer depends on s."""
    g = torch.Generator().manual_seed(1)
    n, S = 4000, (1, 4, 4)
    for s_val in (0.05, 0.5):
        s = torch.full((n,), s_val)
        mu_old = torch.randn(1, *S, generator=g).expand(n, *S)
        mu = mu_old + 0.1 * torch.randn(1, *S, generator=g)
        eps = torch.randn(n, *S, generator=g)
        x = mu_old + s_val * eps
        lp, lp_old = _gauss_logp(x, mu, s), _gauss_logp(x, mu_old, s)
        kl = gaussian_step_kl(mu, mu_old, s, "mean")
        z = normalized_log_ratio(lp, lp_old, kl, s)
        torch.testing.assert_close(z, (eps * (mu - mu_old)).flatten(1).mean(1), rtol=1e-4, atol=1e-6)
        assert abs(float((lp - lp_old).mean() + kl[0])) < 0.1 * float(kl[0])  # raw: mean −KL
        assert abs(float(z.mean())) < 4 * float(z.std()) / n ** 0.5  # normalised: mean 0
        expect_sd = float(((mu - mu_old)[0] ** 2).sum().sqrt()) / (16)  # std of mean(ε·Δμ) = |Δμ|/D
        assert abs(float(z.std()) - expect_sd) < 0.05 * expect_sd


def test_policy_loss_defaults_are_ppo_clip_bit_for_bit():
    g = torch.Generator().manual_seed(2)
    lp, lp_old = torch.randn(16, generator=g) * 1e-3, torch.randn(16, generator=g) * 1e-3
    adv = torch.randn(16, generator=g)
    for a, b in zip(policy_loss(lp, lp_old, adv, 1e-4), ppo_clip_loss(lp, lp_old, adv, 1e-4)):
        assert torch.equal(a, b)
    ctx = EngineContext(policy=None, kernel={})
    assert (ctx.trust_region, ctx.ratio_norm) == ("clip", False)
    cfg = RunConfig()
    assert (cfg.loss.trust_region, cfg.loss.ratio_norm, cfg.loss.clip_range) == ("clip", False, 1e-4)


def test_default_step_loss_is_the_clipped_surrogate(make_trainer):
    """The engines' step loss with the default options equals the clipped surrogate written out by hand."""
    tr = make_trainer("loss.beta=0")
    ro = tr.rollout()
    perturb(tr, 0.05)
    ctx = tr.family.ctx
    k = 1
    idx = ro.selected[:, k].nonzero().flatten()
    v = tr.policy.velocity(ro.traj.xs[idx, k], ro.traj.sigmas[k].expand(len(idx)),
                           {c: t[idx] for c, t in ro.traj.cond.items()})
    total, terms = step_loss(ctx, ro, idx, k, v)
    out = flow_sde.step(v, ro.traj.sigmas[k], ro.traj.sigmas[k + 1], ro.traj.xs[idx, k],
                        prev_sample=ro.traj.xs[idx, k + 1], **ctx.kernel)
    r = torch.exp(out.log_prob - ro.traj.log_probs[idx, k])
    a = ro.advantages[idx]
    per = torch.maximum(-a * r, -a * r.clamp(1 - ctx.clip_range, 1 + ctx.clip_range))
    torch.testing.assert_close(total, (per * ro.loss_weights[idx, k]).sum())


def _hand_pairs(tr, ro, grad=False):
    """Per selected (i, k): the step outputs at the current θ and the rollout policy's mean, float32."""
    rows = []
    kern = tr.family.ctx.kernel
    for k in range(ro.traj.num_steps):
        idx = ro.selected[:, k].nonzero().flatten()
        if len(idx) == 0:
            continue
        sig, nxt = ro.traj.sigmas[k], ro.traj.sigmas[k + 1]
        with torch.set_grad_enabled(grad):
            cond = {c: t[idx] for c, t in ro.traj.cond.items()}
            v = tr.policy.velocity(ro.traj.xs[idx, k], sig.expand(len(idx)), cond)
            out = flow_sde.step(v, sig, nxt, ro.traj.xs[idx, k], prev_sample=ro.traj.xs[idx, k + 1], **kern)
        mu_old = flow_sde.step(ro.traj.velocities[idx, k], sig, nxt, ro.traj.xs[idx, k],
                               prev_sample=ro.traj.xs[idx, k + 1], **kern).mean
        rows.append(dict(idx=idx, k=k, lp=out.log_prob, lp_old=ro.traj.log_probs[idx, k], mean=out.mean, mu_old=mu_old,
                         s=out.std, adv=ro.advantages[idx], w=ro.loss_weights[idx, k]))
    return rows


def test_kl_mask_on_an_inner_epoch_equals_hand_computation(make_trainer):
    tr = make_trainer("loss.trust_region=kl_mask", "loss.kl_mask_bound=1e-6", "steps.mode=first_fraction",
                      "steps.fraction=0.5")
    ro = tr.rollout()
    perturb(tr, 0.05)
    stats = tr.backward(ro, 1)
    total, n_masked, n = 0.0, 0, 0
    for p in _hand_pairs(tr, ro):
        kl = ((p["mean"] - p["mu_old"]) ** 2).flatten(1).mean(1) / (2 * p["s"] ** 2)  # exact KL, mean-reduced
        r = torch.exp(p["lp"] - p["lp_old"])
        drop = (kl >= 1e-6) & (((r > 1) & (p["adv"] > 0)) | ((r < 1) & (p["adv"] < 0)))
        total += float((p["w"] * torch.where(drop, torch.zeros_like(r), -p["adv"] * r)).sum())
        n_masked += int(drop.sum())
        n += len(r)
    assert 0 < n_masked < n  # both branches exercised
    assert abs(stats.metrics["loss"] - total) < 1e-5 * max(abs(total), 1e-3)
    assert abs(stats.metrics["clip_ratio"] - n_masked / n) < 1e-9


def test_kl_mask_first_update_equals_default(make_trainer):
    """On the first update the KL to the rollout policy is 0 < bound: nothing is masked, the gradient is the clip's."""
    g = {}
    for opt in ([], ["loss.trust_region=kl_mask"]):
        tr = make_trainer(*opt)
        tr.backward(tr.rollout())
        g[bool(opt)] = flat_grad(tr.params)
    assert g[False].norm() > 0 and rel_err(g[True], g[False]) < 1e-6


def test_ratio_norm_first_update_gradient_is_step_std_weighted(make_trainer):
    """At θ = θ_old, r̃ = exp(s·(ℓ_θ − ℓ_old + KL)) has ∇r̃ = s·∇ℓ_θ (∇KL = 0 there): the gradient is the default one
    with each step's term scaled by its std s_k."""
    tr = make_trainer("loss.ratio_norm=true")
    ro = tr.rollout()
    tr.backward(ro)
    g_engine = flat_grad(tr.params)
    for q in tr.params:
        q.grad = None
    loss = sum((p["w"] * -p["adv"] * p["s"] * p["lp"]).sum() for p in _hand_pairs(tr, ro, grad=True))
    loss.backward()
    assert g_engine.norm() > 0 and rel_err(g_engine, flat_grad(tr.params)) < 1e-4


def test_ratio_norm_inner_epoch_loss_equals_hand_computation(make_trainer):
    tr = make_trainer("loss.ratio_norm=true", "loss.clip_range=0.01")
    ro = tr.rollout()
    perturb(tr, 0.05)
    stats = tr.backward(ro, 1)
    total = 0.0
    for p in _hand_pairs(tr, ro):
        kl = ((p["mean"] - p["mu_old"]) ** 2).flatten(1).mean(1) / (2 * p["s"] ** 2)
        r = torch.exp((p["lp"] - p["lp_old"] + kl) * p["s"])
        total += float((p["w"] * torch.maximum(-p["adv"] * r, -p["adv"] * r.clamp(0.99, 1.01))).sum())
    assert abs(stats.metrics["loss"] - total) < 1e-5 * max(abs(total), 1e-3)


def test_loss_option_config_errors():
    validate(RunConfig.from_overrides(["loss.trust_region=kl_mask", "loss.kl_mask_bound=1e-4"]))
    validate(RunConfig.from_overrides(["loss.ratio_norm=true", "engine.name=retain"]))
    cases = {("loss.trust_region=kl_mask", "loss.ratio_norm=true"): "loss.ratio_norm",
             ("loss.kl_mask_bound=0.1",): "loss.kl_mask_bound",
             ("loss.trust_region=kl_mask", "loss.clip_range=0.2"): "loss.clip_range",
             ("loss.trust_region=trust",): "loss.trust_region",
             ("loss.ratio_norm=true", "engine.name=reweight"): "engine.name=reweight",
             ("loss.ratio_norm=true", "sampler.sde_type=cps", "sampler.cps_flowgrpo_compat=true"):
                 "cps_flowgrpo_compat",
             ("engine.name=nft", "loss.ratio_norm=true"): "loss.ratio_norm: does not apply",
             ("model.name=tiny_mlm", "loss.trust_region=kl_mask"): "loss.trust_region: does not apply"}
    for ov, msg in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(RunConfig.from_overrides(list(ov)))
        assert msg in str(e.value) and "\n" not in str(e.value), str(e.value)
