"""One GRPO iteration of a flow-matching model, written out top to bottom: what ``Trainer.step()`` does for the
default configuration (engine ``recompute``, every step but the last trained, no KL term, one update per rollout),
with the library's functions and nothing hidden behind the family or the engine.

    plan        P prompts × G samples each (a group), group ids, the initial noise x_0 (B, *S), the trained steps
    sample      T steps of the flow SDE from σ = 1 to 0; each step's x_k, v_k and log p(x_{k+1} | x_k) kept, no grad
    score       decode x_T to images; the configured rewards, weighted and summed
    advantages  group-relative: (r − its group's mean) / (its group's std + eps), clipped
    weights     every trained (sample, step) pair weighs 1 / (number of trained pairs)   (loss.aggregation=mean)
    backward    step by step: the velocity again WITH grad at the stored (x_k, σ_k), the new log-prob of the
                stored x_{k+1}, the PPO-clipped ratio to the rollout's × advantage × weight, backward
    update      clip the gradient's norm, one AdamW step

Run it on the built-in model (a pretrained tiny SD3-style transformer on digit prompts, CPU is enough)::

    python examples/one_iteration.py train.prompts_per_batch=4 train.group_size=4

tests/test_one_iteration.py checks that it updates the weights exactly as ``Trainer.step()`` does.
"""
from __future__ import annotations

import sys

import torch

from diffgrpo import RunConfig
from diffgrpo.advantages import group_advantages
from diffgrpo.data import digit_prompt, prompt_digit
from diffgrpo.engines import select_steps
from diffgrpo.losses import aggregate, aggregation_weights, policy_loss
from diffgrpo.models.tiny import build_tiny_policy
from diffgrpo.rewards import compute_rewards, make_rewards
from diffgrpo.samplers import flow_sde
from diffgrpo.samplers.rollout import sample_trajectories
from diffgrpo.trainer import lr_factor

# what this reading version leaves out: each key at its default value
DEFAULTS = {"engine.name": "recompute", "loss.beta": 0.0, "loss.trust_region": "clip", "loss.ratio_norm": False,
            "train.num_inner_epochs": 1, "train.ema_decay": 0.0, "train.prompts_file": "", "model.compile": False,
            "model.mixed_precision": "no", "sampler.shared_prefix": False, "sampler.tail_solver": "full",
            "steps.ode_outside": False, "steps.window_shift_every": 0, "advantage.per_reward_norm": False,
            "reward.background": False}


def check(cfg: RunConfig) -> None:
    """Refuse a configuration this file does not write out (the Trainer runs every one)."""
    for key, default in DEFAULTS.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) != default:
            raise ValueError(f"examples/one_iteration.py writes out {key}={default!r} only (use the Trainer)")


def one_iteration(cfg: RunConfig, policy, log=print) -> dict:
    """One GRPO iteration on ``policy`` (its weights updated in place), with the random streams a new Trainer on
    ``cfg`` starts from. → {"prompts", "rewards" (B,), "advantages" (B,), "loss", "grad_norm"}."""
    check(cfg)
    t, s, dev = cfg.train, cfg.sampler, policy.device
    gen_prompts = torch.Generator().manual_seed(cfg.seed)  # the Trainer's three streams (one process)
    gen_noise = torch.Generator(device=dev).manual_seed(cfg.seed + 1)
    gen_steps = torch.Generator().manual_seed(cfg.seed + 2)
    params = list(policy.trainable_parameters())
    lr = t.lr * lr_factor(0, t.lr_schedule, t.warmup_iterations, t.num_iterations)  # the schedule's first update
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=t.weight_decay, betas=(t.adam_beta1, t.adam_beta2))

    # ---- plan: P prompts drawn with replacement, each G times; every step but the last is trained
    P, G, T = t.prompts_per_batch, t.group_size, s.num_steps
    digits = torch.tensor(t.digits)[torch.randint(len(t.digits), (P,), generator=gen_prompts)]
    prompts = [digit_prompt(int(d)) for d in digits for _ in range(G)]
    group_ids = torch.arange(P).repeat_interleave(G)  # (B,)
    B = len(prompts)
    selected = select_steps(cfg.steps.mode, T, B, fraction=cfg.steps.fraction, window_start=cfg.steps.window_start,
                            window_size=cfg.steps.window_size, generator=gen_steps).to(dev)  # (B, T) bool
    if s.share_noise_in_group:  # one x_0 per group
        x0 = torch.randn(P, *policy.latent_shape, generator=gen_noise, device=dev)[group_ids.to(dev)]
    else:
        x0 = torch.randn(B, *policy.latent_shape, generator=gen_noise, device=dev)  # (B, *S)

    # ---- sample: the SDE from σ_0 = 1 to σ_T = 0, recording every step (no grad)
    sigmas = flow_sde.sigma_grid(T, s.shift, device=dev)  # (T+1,)
    kernel = dict(sde_type=s.sde_type, noise_level=s.noise_level, reduce=s.logprob_reduce,
                  cps_flowgrpo_compat=s.cps_flowgrpo_compat, sigma_bounds=flow_sde.sigma_bounds(sigmas))
    cond = policy.encode(prompts)
    traj = sample_trajectories(policy, cond, x0, sigmas, kernel=kernel, generator=gen_noise, batch_size=s.batch_size)
    xs, old_log_probs = traj["xs"], traj["log_probs"]  # (B, T+1, *S), (B, T)

    # ---- score
    images = policy.decode(xs[:, -1])  # (B, 3, H, W) in [0, 1]
    rewards, _ = compute_rewards(cfg.reward.weights, images, prompts, [{"digit": prompt_digit(p)} for p in prompts],
                                 log=log, rewards=make_rewards(cfg.reward.weights, cfg.reward.options, dev,
                                                               timeout=cfg.reward.timeout))  # (B,)

    # ---- advantages and loss weights (a non-finite reward trains nothing)
    a = cfg.advantage
    valid = torch.isfinite(rewards)
    adv, _ = group_advantages(rewards, group_ids, valid=valid, std_mode=a.std_mode, baseline=a.baseline, clip=a.clip,
                              eps=a.eps, std=a.std)  # (B,)
    keep = valid & (adv != 0) if a.filter_zero_std else valid
    trained = selected & keep.to(dev).unsqueeze(1)  # (B, T)
    weights = aggregation_weights(trained, cfg.loss.aggregation)  # (B, T), Σ = 1 for "mean"
    adv = adv.to(dev)

    # ---- backward: recompute each trained step's velocity with grad; Σ w·L accumulates in .grad
    optimizer.zero_grad(set_to_none=True)
    loss_total = 0.0
    mb = cfg.engine.micro_batch_size
    for k in range(T):
        rows = trained[:, k].nonzero().flatten()  # the trajectories trained at step k
        if not len(rows):
            continue
        for idx in rows.split(mb) if mb > 0 else [rows]:  # engine.micro_batch_size rows at a time
            v = policy.velocity(xs[idx, k], sigmas[k].expand(len(idx)), {n: c[idx] for n, c in cond.items()})
            step = flow_sde.step(v, sigmas[k], sigmas[k + 1], xs[idx, k], prev_sample=xs[idx, k + 1], **kernel)
            loss, _, _ = policy_loss(step.log_prob, old_log_probs[idx, k], adv[idx], cfg.loss.clip_range)  # (n,)
            total = aggregate(loss, weights[idx, k])  # Σ_i w_ik · L_ik
            total.backward()
            loss_total += float((loss.detach() * weights[idx, k]).sum())

    # ---- update
    grad_norm = float(torch.cat([p.grad.flatten() for p in params if p.grad is not None]).norm())
    if t.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)
    optimizer.step()
    return {"prompts": prompts, "rewards": rewards, "advantages": adv, "loss": loss_total, "grad_norm": grad_norm}


def main(argv: list[str]) -> None:
    cfg = RunConfig.from_overrides(argv)
    torch.manual_seed(cfg.seed)
    policy = build_tiny_policy(cfg, progress=False)
    out = one_iteration(cfg, policy)
    print(f"{len(out['prompts'])} samples, reward {float(out['rewards'].mean()):.4f} "
          f"± {float(out['rewards'].std()):.4f}, loss {out['loss']:+.6f}, gradient norm {out['grad_norm']:.4f}")


if __name__ == "__main__":
    main(sys.argv[1:])
