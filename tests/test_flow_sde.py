"""The step function: closed-form densities, diffusers equivalence, batching, kernel algebra."""
import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from diffgrpo.samplers import flow_sde
from diffgrpo.samplers.flow_sde import kernel_coefficients, sigma_grid, step

KERNELS = ["flow_sde", "dance_sde", "cps"]


def _inputs(B=5, shape=(1, 4, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, *shape, generator=g), torch.randn(B, *shape, generator=g), g


def test_sigma_grid_shift_and_endpoints():
    s = sigma_grid(10, shift=3.0)
    assert s.shape == (11,) and s[0] == 1 and s[-1] == 0
    assert torch.all(s[1:] < s[:-1])
    lin = torch.linspace(1, 0, 11)
    torch.testing.assert_close(s, 3 * lin / (1 + 2 * lin))


@pytest.mark.parametrize("sde_type", KERNELS)
@pytest.mark.parametrize("reduce", ["mean", "sum"])
def test_log_prob_is_closed_form_gaussian(sde_type, reduce):
    x, v, g = _inputs()
    sig, sig_next = torch.tensor(0.7), torch.tensor(0.55)
    out = step(v, sig, sig_next, x, generator=g, sde_type=sde_type, noise_level=0.7, reduce=reduce)
    d = x[0].numel()
    # independent closed form, per sample, in float64
    for i in range(x.shape[0]):
        s = float(out.std[i])
        diff = (out.prev_sample[i] - out.mean[i]).double()
        per_elem = -diff**2 / (2 * s * s) - math.log(s) - 0.5 * math.log(2 * math.pi)
        want = per_elem.sum() if reduce == "sum" else per_elem.sum() / d
        assert abs(float(out.log_prob[i]) - float(want)) < 1e-4 * max(1.0, abs(float(want)))
    # the same density via torch.distributions
    dist = torch.distributions.Normal(out.mean, out.std.view(-1, 1, 1, 1))
    lp = dist.log_prob(out.prev_sample).flatten(1)
    torch.testing.assert_close(out.log_prob, lp.mean(1) if reduce == "mean" else lp.sum(1), rtol=1e-5, atol=1e-4)


def test_flow_sde_matches_flowgrpo_formula():
    """μ and s as in FlowGRPO's sde_step_with_logprob, including σ̃ = σ_1 at σ = 1."""
    x, v, g = _inputs()
    a = 0.7
    grid = sigma_grid(10, 3.0)
    for k in (0, 3):
        sig, nxt = grid[k], grid[k + 1]
        sig_max = grid[1]
        std_dev_t = a * torch.sqrt(sig / (1 - torch.where(sig == 1, sig_max, sig)))
        dt = nxt - sig
        mean = x * (1 + std_dev_t**2 / (2 * sig) * dt) + v * (1 + std_dev_t**2 * (1 - sig) / (2 * sig)) * dt
        out = step(v, sig, nxt, x, generator=g, sde_type="flow_sde", noise_level=a)
        torch.testing.assert_close(out.mean, mean)
        torch.testing.assert_close(out.std, (std_dev_t * torch.sqrt(-dt)).expand(x.shape[0]))


def test_dance_sde_matches_score_form():
    """DanceGRPO writes the mean through the score −(x − (1−σ)x̂₀)/σ²; same kernel, constant η."""
    x, v, g = _inputs()
    eta, sig, nxt = 0.3, torch.tensor(0.8), torch.tensor(0.6)
    x0 = x - sig * v
    score = -(x - x0 * (1 - sig)) / sig**2
    dsigma = nxt - sig
    mean = x + dsigma * v + (-0.5 * eta**2 * score) * dsigma
    out = step(v, sig, nxt, x, generator=g, sde_type="dance_sde", noise_level=eta)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, torch.full((x.shape[0],), eta * math.sqrt(0.2)))


def test_cps_mean_and_std():
    x, v, g = _inputs()
    a, sig, nxt = 0.5, torch.tensor(0.8), torch.tensor(0.6)
    s = nxt * math.sin(a * math.pi / 2)
    mean = (1 - nxt) * (x - sig * v) + torch.sqrt(nxt**2 - s**2) * (x + (1 - sig) * v)
    out = step(v, sig, nxt, x, generator=g, sde_type="cps", noise_level=a)
    torch.testing.assert_close(out.mean, mean)
    torch.testing.assert_close(out.std, s.expand(x.shape[0]))


def test_ode_equals_diffusers_scheduler_step():
    sched = FlowMatchEulerDiscreteScheduler(shift=3.0)
    sched.set_timesteps(8)
    x, v, _ = _inputs()
    for i, t in enumerate(sched.timesteps):
        want = sched.step(v, t, x, return_dict=False)[0]
        got = step(v, sched.sigmas[i], sched.sigmas[i + 1], x, sde_type="ode").prev_sample
        torch.testing.assert_close(got, want)
        x = want


@pytest.mark.parametrize("sde_type", KERNELS + ["ode"])
def test_final_step_is_deterministic_and_untrained(sde_type):
    x, v, g = _inputs()
    out = step(v, torch.tensor(0.3), torch.tensor(0.0), x, generator=g, sde_type=sde_type)
    torch.testing.assert_close(out.prev_sample, x - 0.3 * v)
    assert torch.all(out.std == 0) and torch.all(out.log_prob == 0)


@pytest.mark.parametrize("sde_type", KERNELS)
def test_batched_equals_per_sample_loop_with_per_sample_sigmas(sde_type):
    x, v, g = _inputs(B=4)
    prev = torch.randn_like(x)
    sig = torch.tensor([1.0, 0.9, 0.5, 0.2])
    nxt = torch.tensor([0.95, 0.7, 0.4, 0.1])
    out = step(v, sig, nxt, x, prev_sample=prev, sde_type=sde_type)
    for i in range(4):
        o = step(v[i:i + 1], sig[i], nxt[i], x[i:i + 1], prev_sample=prev[i:i + 1], sde_type=sde_type)
        torch.testing.assert_close(out.log_prob[i:i + 1], o.log_prob)
        torch.testing.assert_close(out.mean[i:i + 1], o.mean)


@pytest.mark.parametrize("sde_type", KERNELS + ["ode"])
def test_kernel_coefficients_give_the_mean(sde_type):
    x, v, g = _inputs()
    sig, nxt = torch.tensor(0.6), torch.tensor(0.45)
    c_x, c_v, std = kernel_coefficients(sig, nxt, sde_type=sde_type, noise_level=0.6)
    out = step(v, sig, nxt, x, generator=g, sde_type=sde_type, noise_level=0.6)
    torch.testing.assert_close(out.mean, c_x * x + c_v * v)


def test_scoring_own_sample_with_given_noise_reproduces_log_prob():
    x, v, g = _inputs()
    eps = torch.randn_like(x)
    a = step(v, 0.7, 0.6, x, noise=eps)
    b = step(v, 0.7, 0.6, x, prev_sample=a.prev_sample)
    torch.testing.assert_close(a.log_prob, b.log_prob)
    torch.testing.assert_close(a.prev_sample, a.mean + a.std.view(-1, 1, 1, 1) * eps)


def test_log_prob_gradient_flows_to_velocity_only_through_mean():
    x, v, g = _inputs()
    v = v.clone().requires_grad_(True)
    prev = torch.randn_like(x)
    out = step(v, 0.7, 0.6, x, prev_sample=prev, sde_type="flow_sde", noise_level=0.7)
    (gv,) = torch.autograd.grad(out.log_prob.sum(), v)
    c_x, c_v, std = kernel_coefficients(torch.tensor(0.7), torch.tensor(0.6), sde_type="flow_sde", noise_level=0.7)
    d = x[0].numel()
    want = c_v * (prev - out.mean.detach()) / (std**2 * d)
    torch.testing.assert_close(gv, want, rtol=1e-4, atol=1e-6)


def test_gaussian_kl_true_and_compat():
    m, r = torch.randn(3, 2, 2), torch.randn(3, 2, 2)
    std = torch.full((3,), 0.1)
    kl = flow_sde.gaussian_kl(m, r, std)
    torch.testing.assert_close(kl, ((m - r) ** 2).flatten(1).mean(1) / (2 * 0.01))
    kl_c = flow_sde.gaussian_kl(m, r, std, flowgrpo_compat=True, sigma=torch.tensor(0.7), sigma_next=torch.tensor(0.6))
    torch.testing.assert_close(kl_c, kl * 0.1, rtol=1e-4, atol=1e-6)


def test_cps_compat_flag_is_flowgrpo_pseudo_log_prob():
    x, v, g = _inputs()
    prev = torch.randn_like(x)
    out = step(v, 0.7, 0.6, x, prev_sample=prev, sde_type="cps", cps_flowgrpo_compat=True)
    torch.testing.assert_close(out.log_prob, -((prev - out.mean) ** 2).flatten(1).mean(1))


def test_unknown_kernel_and_reduce_are_rejected():
    x, v, _ = _inputs()
    with pytest.raises(ValueError, match="sde_type must be one of"):
        step(v, 0.5, 0.4, x, sde_type="euler")
    with pytest.raises(ValueError, match="reduce must be one of"):
        step(v, 0.5, 0.4, x, reduce="max")
