"""Flash-GRPO's σ-linear kernel (``sampler.sde_type=flash_sde``): the released trainer's rectification table
re-derived from it, its noise scale at the grid's ends, its density, every engine on it, single_step's weights."""
from __future__ import annotations

import math

import pytest
import torch

from diffgrpo.config import EngineConfig
from diffgrpo.engines import ENGINES, FORWARD_ENGINES
from diffgrpo.engines.single_step import SingleStepEngine, rectification_factor, rectification_weights
from diffgrpo.samplers import flow_sde
from diffgrpo.samplers.flow_sde import kernel_coefficients, sigma_bounds, sigma_grid, step

# Shredded-Pork/Flash-GRPO @ 421101378e8811aa7460ada34a3b76ac7b53c9f7, scripts/train_wanx2_1_flash.py line 984:
# the trainer's hard-coded per-timestep loss scale for 20 steps at shift 3 (its `value_dict`, int(1000·σ) →
# 1/(√Δ/s_t + s_t·√Δ·(1−σ)/(2σ)), s_t = σ_min + (σ_max − σ_min)·σ), the first 10 steps (its candidate steps).
RELEASED = {999: 7.4770, 982: 7.0414, 963: 6.6112, 944: 6.1867, 922: 5.7682, 899: 5.3559, 874: 4.9502,
            847: 4.5513, 817: 4.1596, 785: 3.7754}


def released_grid(num_steps: int = 20, shift: float = 3.0, train_timesteps: int = 1000) -> torch.Tensor:
    """The release's σ grid (T+1,): Wan 2.1's UniPC flow sigmas as diffusers set them then — 1 − linspace(1, 1/N,
    T+1) reversed, its 0 dropped, shifted, and a final 0 appended (``sigmas[1]`` = σ_max, ``sigmas[-1]`` = 0)."""
    s = (1 - torch.linspace(1, 1 / train_timesteps, num_steps + 1, dtype=torch.float64)).flip(0)[:-1]
    s = shift * s / (1 + (shift - 1) * s)
    return torch.cat([s, s.new_zeros(1)])


def _weights(grid: torch.Tensor, sde_type: str, a: float, steps: int = 10) -> torch.Tensor:
    """Normalised rectification weights (1/c)/mean(1/c) over the first ``steps`` steps of ``grid`` → (steps,)."""
    c = rectification_factor(grid[:steps], grid[1:steps + 1], sde_type=sde_type, noise_level=a,
                             sigma_bounds=sigma_bounds(grid))
    return rectification_weights(c, torch.ones(steps, dtype=torch.bool)).double()


# ---------------------------------------------------------------------- the released table
def test_released_rectification_table_is_rederived():
    grid = released_grid()
    keys = [int(t) for t in (grid[:10] * 1000).tolist()]
    assert keys == list(RELEASED)  # the table's timesteps pin the grid it was computed on
    c = rectification_factor(grid[:10], grid[1:11], sde_type="flash_sde", noise_level=1.0,
                             sigma_bounds=sigma_bounds(grid))  # (10,)
    derived = (1 / c).double()
    ref = torch.tensor(list(RELEASED.values()), dtype=torch.float64)
    print("\nFlash-GRPO rectification table, 20 steps, shift 3 (t: released / derived / |diff|)")
    for t, r, d in zip(keys, ref.tolist(), derived.tolist()):
        print(f"  {t:4d}  {r:.4f}  {d:.5f}  {abs(r - d):.1e}")
    err = float((derived - ref).abs().max())
    print(f"  max |diff| = {err:.2e}")
    assert err < 1e-4
    # the trainer's normalisation (value · 1/mean(value)) is rectification_weights'
    torch.testing.assert_close(_weights(grid, "flash_sde", 1.0), ref / ref.mean(), rtol=1e-5, atol=0)


def test_library_grid_gives_the_released_weights():
    """sigma_grid(20, 3) (σ₀ = 1 exactly) against the release's grid: the normalised weights agree to 1e-3."""
    mine, rel = _weights(sigma_grid(20, 3.0).double(), "flash_sde", 1.0), _weights(released_grid(), "flash_sde", 1.0)
    assert float((mine / rel - 1).abs().max()) < 1e-3
    assert 1.9 < float(mine.max() / mine.min()) < 2.1  # the high-noise step weighs about twice the 10th


def test_other_kernels_weights_differ_on_that_grid():
    """dance_sde (η 0.3–1.0) and flow_sde (a 0.7) rectify the same steps 12–20 % and 88 % differently."""
    grid = sigma_grid(20, 3.0).double()
    flash = _weights(grid, "flash_sde", 1.0)
    diff = {f"{t} {a}": float((_weights(grid, t, a) / flash - 1).abs().max())
            for t, a in [("dance_sde", 0.3), ("dance_sde", 0.5), ("dance_sde", 0.7), ("dance_sde", 1.0),
                         ("flow_sde", 0.7)]}
    print("\nmax relative difference of normalised weights from flash_sde's (sigma_grid(20, 3), steps 0–9):",
          {k: round(v, 3) for k, v in diff.items()})
    assert all(0.11 < diff[f"dance_sde {a}"] < 0.21 for a in (0.3, 0.5, 0.7, 1.0))
    assert 0.85 < diff["flow_sde 0.7"] < 0.92


# ---------------------------------------------------------------------- kernel properties
def test_noise_scale_is_linear_between_the_grid_bounds():
    """ε(σ) = s/√Δ: σ_max at σ = 1, σ_min + (σ_max − σ_min)·σ at σ₁ and σ_T; a scales it; σ_T = 0 on a grid to 0."""
    grid = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.1])  # a grid that stops short of 0: σ_min = σ_T = 0.1
    s_max, s_min = sigma_bounds(grid)
    assert (s_max, s_min) == (pytest.approx(0.8), pytest.approx(0.1))
    for a in (1.0, 0.5):
        for k in (0, 1, 3):  # σ₀ = 1, σ₁, σ_{T−1}
            _, _, std = kernel_coefficients(grid[k], grid[k + 1], sde_type="flash_sde", noise_level=a,
                                            sigma_bounds=(s_max, s_min))
            eps = float(std) / math.sqrt(float(grid[k] - grid[k + 1]))
            assert eps == pytest.approx(a * (s_min + (s_max - s_min) * float(grid[k])), rel=1e-6)
        assert eps > a * s_min
    # ε at σ_T itself (towards a next σ below it) is σ_min, at σ₁ it is σ_min + (σ_max − σ_min)·σ₁
    _, _, std = kernel_coefficients(grid[4], torch.tensor(0.05), sde_type="flash_sde", noise_level=1.0,
                                    sigma_bounds=(s_max, s_min))
    assert float(std) / math.sqrt(0.05) == pytest.approx(s_min + (s_max - s_min) * 0.1, rel=1e-6)
    g20 = sigma_grid(20, 3.0)
    assert sigma_bounds(g20) == (float(g20[1]), 0.0)
    _, _, std = kernel_coefficients(g20[1], g20[2], sde_type="flash_sde", noise_level=1.0, sigma_bounds=sigma_bounds(g20))
    assert float(std) == pytest.approx(float(g20[1]) ** 2 * math.sqrt(float(g20[1] - g20[2])), rel=1e-6)


def test_mean_std_and_log_prob_against_the_released_formula_and_a_gaussian_density():
    g = torch.Generator().manual_seed(0)
    x, v = torch.randn(4, 2, 3, 3, generator=g), torch.randn(4, 2, 3, 3, generator=g)
    grid = sigma_grid(20, 3.0)
    bounds = sigma_bounds(grid)
    for k in (0, 4, 9):
        sig, nxt = float(grid[k]), float(grid[k + 1])
        out = step(v, sig, nxt, x, generator=g, sde_type="flash_sde", noise_level=1.0, sigma_bounds=bounds)
        eps = bounds[1] + (bounds[0] - bounds[1]) * sig  # written out independently, in float64
        dt = nxt - sig
        xd, vd = x.double(), v.double()
        mean = xd * (1 + eps**2 / (2 * sig) * dt) + vd * (1 + eps**2 * (1 - sig) / (2 * sig)) * dt
        std = eps * math.sqrt(-dt)
        torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.std.double(), torch.full((4,), std, dtype=torch.float64), rtol=1e-6, atol=0)
        dens = torch.distributions.Normal(mean, std).log_prob(out.prev_sample.double()).flatten(1).mean(1)
        torch.testing.assert_close(out.log_prob.double(), dens, rtol=1e-5, atol=1e-4)
        again = step(v, sig, nxt, x, prev_sample=out.prev_sample, sde_type="flash_sde", noise_level=1.0,
                     sigma_bounds=bounds)  # scoring its own sample with the same function
        torch.testing.assert_close(again.log_prob, out.log_prob)
    final = step(v, grid[-2], grid[-1], x, sde_type="flash_sde", noise_level=1.0, sigma_bounds=bounds)
    assert float(final.std.abs().max()) == 0 and float(final.log_prob.abs().max()) == 0


def test_flash_sde_without_bounds_is_refused():
    x = torch.zeros(1, 1, 2, 2)
    with pytest.raises(ValueError, match="sigma_bounds"):
        step(x, 0.5, 0.4, x, sde_type="flash_sde", noise_level=1.0)


# ---------------------------------------------------------------------- through the trainer
@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_every_engine_runs_an_iteration_on_the_kernel(make_trainer, monkeypatch, engine):
    calls: list[tuple] = []
    inner = flow_sde.step

    def spy(*args, **kw):
        calls.append((kw.get("sde_type"), kw.get("sigma_bounds"), kw.get("prev_sample") is not None))
        return inner(*args, **kw)

    monkeypatch.setattr(flow_sde, "step", spy)
    extra = ["engine.forward_rollout=sampler"] if engine in FORWARD_ENGINES else []
    t = make_trainer(f"engine.name={engine}", "sampler.sde_type=flash_sde", "sampler.noise_level=1.0", *extra)
    before = [p.detach().clone() for p in t.params]
    row = t.step()
    bounds = sigma_bounds(t.family.sigmas)
    assert t.family.kernel["sigma_bounds"] == bounds and bounds[0] == float(t.family.sigmas[1])
    flash = [c for c in calls if c[0] == "flash_sde"]
    assert flash and all(c[1] == bounds for c in flash)
    assert any(not scored for _, _, scored in flash)  # the rollout sampled with it
    if engine not in FORWARD_ENGINES:
        assert any(scored for _, _, scored in flash)  # and the update scored with it
    assert math.isfinite(row["loss"]) and all(torch.isfinite(p).all() for p in t.params)
    assert any(not torch.equal(p, q) for p, q in zip(t.params, before))


def test_single_step_weights_on_the_kernel(make_trainer):
    t = make_trainer("engine.name=single_step", "engine.candidate_steps=all", "sampler.sde_type=flash_sde",
                     "sampler.noise_level=1.0", "train.prompts_per_batch=4")
    fam = t.family
    ro = fam.rollout()
    eng = fam.engine
    assert isinstance(eng, SingleStepEngine)
    w = eng.sample_weights(fam.ctx, ro.traj, ro.selected)  # (B,)
    k = eng.trained_steps(ro.traj, ro.selected).tolist()
    s = ro.traj.sigmas.double().tolist()
    s_max, s_min = s[1], s[-1]

    def c(i):  # |∂μ/∂v| / s written out for the σ-linear kernel
        sig, delta = s[i], s[i] - s[i + 1]
        eps = s_min + (s_max - s_min) * sig
        return delta * (1 + eps**2 * (1 - sig) / (2 * sig)) / (eps * math.sqrt(delta))

    inv = torch.tensor([1 / c(i) for i in k], dtype=torch.float64)
    torch.testing.assert_close(w.double(), inv / inv.mean(), rtol=1e-5, atol=0)
    assert len(set(k)) > 1 and float(w.max() / w.min()) > 1.05  # several steps, unequal weights
    off = SingleStepEngine(EngineConfig(name="single_step", candidate_steps="all", rectify=False))
    assert torch.equal(off.sample_weights(fam.ctx, ro.traj, ro.selected), torch.ones_like(w))


# ---------------------------------------------------------------------- the shipped recipe
def test_shipped_wan_flash_config_is_the_released_recipe():
    from pathlib import Path

    from diffgrpo.config import RunConfig
    from diffgrpo.engines.single_step import candidate_steps

    path = Path(__file__).resolve().parents[1] / "src/diffgrpo/configs/wan21_t2v_1.3b_flash_pickscore.yaml"
    assert "Shredded-Pork/Flash-GRPO" in path.read_text()
    cfg = RunConfig.from_yaml(path)
    s, e = cfg.sampler, cfg.engine
    assert (s.sde_type, s.noise_level, s.num_steps, s.shift) == ("flash_sde", 1.0, 20, 3.0)
    assert (e.name, e.rectify) == ("single_step", True)
    assert candidate_steps(e.candidate_steps, s.num_steps) == list(range(10))  # the released table's steps
    assert (cfg.loss.clip_range, cfg.loss.beta, cfg.train.group_size, cfg.train.lr) == (1e-3, 0.0, 8, 1e-4)
    assert (cfg.model.pretrained, cfg.model.num_frames, cfg.model.guidance_scale) == \
        ("Wan-AI/Wan2.1-T2V-1.3B-Diffusers", 81, 4.5)
    assert (cfg.model.lora_rank, cfg.model.lora_alpha, cfg.advantage.std_mode, cfg.advantage.clip) == \
        (16, 32.0, "global", 5.0)
    ref = torch.tensor(list(RELEASED.values()), dtype=torch.float64)
    mine = _weights(sigma_grid(s.num_steps, s.shift).double(), s.sde_type, s.noise_level)
    assert float((mine / (ref / ref.mean()) - 1).abs().max()) < 1e-3
