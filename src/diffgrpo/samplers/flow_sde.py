"""Flow-matching transition kernels with exact Gaussian log-probs.

Convention: x_σ = (1−σ)·x₀ + σ·ε (σ = 1 noise, σ = 0 data); the network predicts v ≈ ε − x₀.
One stateless function, :func:`step`, both samples (``prev_sample=None``) and scores (``prev_sample`` given),
so rollout and every gradient engine evaluate the same density. σ is a tensor argument (no hidden step
index) and all math runs in float32.

Kernels (Δ = σ − σ_next > 0, dt = −Δ), each a Gaussian N(μ, s²I):
  flow_sde  (FlowGRPO)  ε = a·sqrt(σ/(1−σ̃)), σ̃ = σ_next if σ == 1 else σ;
                        μ = x + dt·[v + ε²/(2σ)·(x + (1−σ)v)],  s = ε·sqrt(Δ)
  dance_sde (DanceGRPO) same mean with ε ≡ a;                    s = a·sqrt(Δ)
  flash_sde (Flash-GRPO) same mean with ε = a·(σ_min + (σ_max − σ_min)·σ), linear in σ, where σ_max = σ₁ and
                        σ_min = σ_T are the grid's entries at indices 1 and T (``sigma_bounds``; 0 on a grid
                        ending at 0); s = ε·sqrt(Δ). a = 1 is the released kernel (Shredded-Pork/Flash-GRPO,
                        flow_grpo/diffusers_patch/wan2_1_pipeline_with_logprob2.py, ``sde_step_with_logprob``)
  cps       (coefficient-preserving) s = σ_next·sin(aπ/2);
                        μ = (1−σ_next)·x̂₀ + sqrt(σ_next² − s²)·ε̂,  x̂₀ = x − σv, ε̂ = x + (1−σ)v
  ode                   μ = x + dt·v, s = 0 (diffusers' FlowMatchEulerDiscreteScheduler.step)
The final step into σ_next = 0 is deterministic for every kernel (s = 0, the sample is the mean): it is never
trained, and keeps the returned sample free of injected noise.

Cost: a handful of elementwise ops; no network call.
"""
from __future__ import annotations

import math

import torch

from ..types import StepOut

SDE_TYPES = ("flow_sde", "dance_sde", "flash_sde", "cps", "ode")
LOGPROB_REDUCTIONS = ("mean", "sum")
_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


def sigma_grid(num_steps: int, shift: float = 1.0, device=None) -> torch.Tensor:
    """Decreasing grid (T+1,) from 1 to 0: a linspace warped by σ' = sσ / (1 + (s−1)σ)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    s = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float32, device=device)
    return shift * s / (1 + (shift - 1) * s)


def sigma_bounds(sigmas: torch.Tensor) -> tuple[float, float]:
    """(σ_max, σ_min) = (σ₁, σ_T) of a grid (T+1,) σ₀ > … > σ_T: the bounds of ``flash_sde``'s noise scale."""
    if sigmas.numel() < 2:
        raise ValueError(f"a σ grid has T+1 >= 2 entries, got {sigmas.numel()}")
    return float(sigmas[1]), float(sigmas[-1])


def _per_sample(value, ref: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar / (B,) σ to (B, 1, …, 1) matching ``ref`` (B, *S), float32."""
    t = torch.as_tensor(value, dtype=torch.float32, device=ref.device)
    if t.dim() == 0:
        t = t.expand(ref.shape[0])
    return t.reshape(-1, *([1] * (ref.dim() - 1)))


def _noise_scale(sigma: torch.Tensor, sigma_next: torch.Tensor, sde_type: str, noise_level: float,
                 bounds: tuple[float, float] | None) -> torch.Tensor:
    """ε of the flow_sde-mean kernels (shape of ``sigma``): FlowGRPO's, DanceGRPO's constant, Flash-GRPO's linear."""
    if sde_type == "flow_sde":
        sig_tilde = torch.where(sigma >= 1, sigma_next, sigma)
        return noise_level * torch.sqrt(sigma / (1 - sig_tilde))
    if sde_type == "flash_sde":
        if bounds is None:
            raise ValueError("sde_type 'flash_sde' needs sigma_bounds=(σ_max, σ_min), the grid's σ₁ and σ_T "
                             "(flow_sde.sigma_bounds(sigmas))")
        s_max, s_min = (float(b) for b in bounds)
        return noise_level * (s_min + (s_max - s_min) * sigma)
    return torch.full_like(sigma, float(noise_level))


def kernel_coefficients(sigma, sigma_next, *, sde_type: str, noise_level: float,
                        sigma_bounds: tuple[float, float] | None = None):
    """Affine form of the mean, μ = c_x·x + c_v·v, and the std s, as broadcastable float32 tensors.

    Returned shapes follow ``sigma`` (any shape). Useful to engines that need ∂μ/∂v = c_v in closed form.
    ``sigma_bounds`` (σ_max, σ_min): the grid's σ₁ and σ_T, read by ``flash_sde`` only (required there).
    """
    sigma = torch.as_tensor(sigma, dtype=torch.float32)
    sigma_next = torch.as_tensor(sigma_next, dtype=torch.float32, device=sigma.device)
    delta = sigma - sigma_next
    dt = -delta
    final = sigma_next <= 0
    if sde_type == "ode":
        c_x, c_v, std = torch.ones_like(sigma), dt, torch.zeros_like(sigma)
    elif sde_type in ("flow_sde", "dance_sde", "flash_sde"):
        eps = _noise_scale(sigma, sigma_next, sde_type, noise_level, sigma_bounds)
        eps = torch.where(final, torch.zeros_like(eps), eps)
        k = eps**2 / (2 * sigma)
        c_x = 1 + dt * k
        c_v = dt * (1 + k * (1 - sigma))
        std = eps * torch.sqrt(delta)
    elif sde_type == "cps":
        std = sigma_next * math.sin(noise_level * math.pi / 2)
        eps_coef = torch.sqrt(torch.clamp(sigma_next**2 - std**2, min=0.0))
        # μ = (1−σ')(x − σv) + e(x + (1−σ)v)
        c_x = (1 - sigma_next) + eps_coef
        c_v = -(1 - sigma_next) * sigma + eps_coef * (1 - sigma)
    else:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    std = torch.where(final, torch.zeros_like(std), std)
    return c_x, c_v, std


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, reduce: str = "mean") -> torch.Tensor:
    """log N(sample; mean, std²·I), reduced over non-batch dims. sample, mean (B, *S); std (B,) > 0 → (B,)."""
    s = std.reshape(-1, *([1] * (sample.dim() - 1)))
    lp = -((sample - mean) ** 2) / (2 * s**2) - torch.log(s) - _LOG_SQRT_2PI
    lp = lp.flatten(1)
    if reduce == "mean":
        return lp.mean(1)
    if reduce == "sum":
        return lp.sum(1)
    raise ValueError(f"log-prob reduce must be one of {LOGPROB_REDUCTIONS}, got {reduce!r}")


def step(
    model_out: torch.Tensor,
    sigma,
    sigma_next,
    x: torch.Tensor,
    *,
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    noise: torch.Tensor | None = None,
    sde_type: str = "flow_sde",
    noise_level: float = 0.7,
    reduce: str = "mean",
    cps_flowgrpo_compat: bool = False,
    sigma_bounds: tuple[float, float] | None = None,
) -> StepOut:
    """One transition of the flow kernel ``sde_type``; samples when ``prev_sample`` is None, else scores it.

    model_out (B, *S) velocity v; x (B, *S) state at σ; sigma, sigma_next scalar or (B,);
    noise (B, *S) optional standard normal to use instead of drawing from ``generator``.
    Returns StepOut(prev_sample (B,*S) float32, log_prob (B,), mean (B,*S), std (B,)).
    Where std == 0 (ode, final step) the sample is the mean and log_prob is 0.
    ``cps_flowgrpo_compat`` reproduces FlowGRPO's CPS "log-prob" −mean((x'−μ)²), which is not a density.
    ``sigma_bounds`` (σ_max, σ_min) = ``sigma_bounds(grid)``: ``flash_sde``'s noise-scale bounds (others ignore it).
    """
    v = model_out.float()
    x = x.float()
    sig = _per_sample(sigma, x)
    sig_next = _per_sample(sigma_next, x)
    c_x, c_v, std = kernel_coefficients(sig, sig_next, sde_type=sde_type, noise_level=noise_level,
                                        sigma_bounds=sigma_bounds)
    mean = c_x * x + c_v * v  # (B, *S)
    std_b = std.reshape(-1)  # (B,)
    if prev_sample is None:
        if noise is None:
            noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev_sample = mean + std * noise.float()
    prev_sample = prev_sample.float()
    stochastic = std_b > 0
    if cps_flowgrpo_compat:
        log_prob = -((prev_sample.detach() - mean) ** 2).flatten(1).mean(1)
    else:
        safe_std = torch.where(stochastic, std_b, torch.ones_like(std_b))
        log_prob = gaussian_log_prob(prev_sample.detach(), mean, safe_std, reduce)
    log_prob = torch.where(stochastic, log_prob, torch.zeros_like(log_prob))
    return StepOut(prev_sample, log_prob, mean, std_b)


def gaussian_kl(mean: torch.Tensor, ref_mean: torch.Tensor, std: torch.Tensor, *, flowgrpo_compat: bool = False,
                sigma=None, sigma_next=None) -> torch.Tensor:
    """KL(N(μ, s²I) ‖ N(μ_ref, s²I)) per element, averaged over non-batch dims: mean((μ−μ_ref)²)/(2s²). → (B,)

    ``flowgrpo_compat`` divides by 2(s/√Δ)² instead, as FlowGRPO's code does (needs σ, σ_next).
    Where s == 0 the KL is 0.
    """
    sq = ((mean - ref_mean) ** 2).flatten(1).mean(1)
    var = std**2
    if flowgrpo_compat:
        delta = torch.as_tensor(sigma, dtype=torch.float32, device=mean.device) - torch.as_tensor(
            sigma_next, dtype=torch.float32, device=mean.device)
        var = var / delta.reshape(-1)
    safe = torch.where(var > 0, var, torch.ones_like(var))
    return torch.where(var > 0, sq / (2 * safe), torch.zeros_like(sq))
