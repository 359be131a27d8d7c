"""Forward-process engines ``nft`` (DiffusionNFT) and ``awm`` (Advantage Weighted Matching): the loss and its
gradient against an independent computation on a tiny model, the direction of an update (high-advantage samples'
flow-matching loss falls relative to low-advantage ones'), zero advantages, LoRA, the config keys, and two gloo
ranks (DDP, FSDP2) against one process on the union of their samples."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch

from diffgrpo import RunConfig
from diffgrpo.config import ConfigError
from diffgrpo.engines._forward import ForwardState, grid_times, stratified_grid_times
from diffgrpo.validation import validate
from tests.helpers.distributed import leave_gloo
from tests.helpers.tensors import flat_grad, rel_err
from tests.helpers.tiny import TINY

SHIFT_OLD = 0.05  # how far the hand-set θ_old sits from θ


# ---------------------------------------------------------------------- independent references
def _units(tr, ro):
    """Every trained unit as float64 tensors: rows i, t, u = ε − x_0, x_t, aggregation weight, advantage."""
    st = ro.traj.engine_state
    K = st.idx.shape[1]
    rows, cols = ro.selected[:, :K].nonzero(as_tuple=True)
    t = ro.traj.sigmas[st.idx[rows, cols]].double()
    x0 = ro.traj.xs[rows, -1].double()
    eps = st.noise[rows, cols].double()
    tt = t.view(-1, 1, 1, 1)
    return dict(rows=rows, t=t, u=eps - x0, x_t=((1 - tt) * x0 + tt * eps), w=ro.loss_weights[rows, cols].double(),
                adv=ro.advantages[rows].double())


def _velocity(tr, units, ro, grad=False):
    with torch.set_grad_enabled(grad):
        cond = {k: v[units["rows"]] for k, v in ro.traj.cond.items()}
        return tr.policy.velocity(units["x_t"].float(), units["t"].float(), cond).double()


def _nft_hand_loss(v, v_old, units, beta=1.0, c=5.0):
    """(c/β)·Σ w·[r·t·|v⁺−u|²/|v⁺−u|₁ + (1−r)·t·|v⁻−u|²/|v⁻−u|₁] (means over elements; the adaptive weight
    written in velocity space: x̂_0 − x_0 = t·(u − v))."""
    r = (units["adv"].clamp(-c, c) / c + 1) / 2
    vp, vn = beta * v + (1 - beta) * v_old, (1 + beta) * v_old - beta * v
    dims = (1, 2, 3)

    def ell(q):
        d = q - units["u"]
        return units["t"] * (d ** 2).mean(dims) / d.detach().abs().mean(dims)

    return (units["w"] * (r * ell(vp) + (1 - r) * ell(vn)) * c / beta).sum()


def _set_old(tr, scale=SHIFT_OLD, seed=3):
    """θ_old = θ + noise, held by the engine; returns the old values."""
    g = torch.Generator().manual_seed(seed)
    eng = tr.family.engine
    eng.old.values = [p.detach() + scale * torch.randn(p.shape, generator=g) for p in tr.params]
    eng.old.current = False
    return eng.old.values


def _swap_in(params, values):
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, v in zip(params, values):
            p.copy_(v)
    return saved


# ---------------------------------------------------------------------- the loss and its gradient
def test_nft_loss_and_gradient_equal_hand_computation(make_trainer):
    tr = make_trainer("engine.name=nft", "engine.micro_batch_size=4")
    ro = tr.rollout()
    assert ro.advantages.abs().sum() > 0
    old = _set_old(tr)
    stats = tr.backward(ro)
    g_engine = flat_grad(tr.params)
    units = _units(tr, ro)
    saved = _swap_in(tr.params, old)
    v_old = _velocity(tr, units, ro)
    _swap_in(tr.params, saved)
    for p in tr.params:
        p.grad = None
    v = _velocity(tr, units, ro, grad=True)
    loss = _nft_hand_loss(v, v_old, units)
    loss.backward()
    assert abs(stats.metrics["loss"] - loss.item()) < 1e-5 * abs(loss.item())
    assert rel_err(g_engine, flat_grad(tr.params)) < 1e-4
    # counters: K units per sample, one grad forward + backward each, one θ_old forward each
    n = int(ro.selected.sum())
    assert n == ro.batch_size * int(0.99 * ro.traj.num_steps)
    assert (stats.forwards_grad, stats.sample_backwards, stats.forwards_nograd) == (n, n, n)


def test_awm_gradient_and_inner_epoch_loss_equal_hand_computation(make_trainer):
    tr = make_trainer("engine.name=awm", "engine.awm_clip_range=0.02", "engine.micro_batch_size=5")
    ro = tr.rollout()
    stats = tr.backward(ro, 0)
    g_engine = flat_grad(tr.params)
    units = _units(tr, ro)
    a_hat = units["adv"].clamp(-5, 5) / 5
    for p in tr.params:
        p.grad = None
    v = _velocity(tr, units, ro, grad=True)
    e0 = ((v - units["u"]) ** 2).mean((1, 2, 3))
    (units["w"] * a_hat * e0).sum().backward()  # r = 1: ∇L = Σ w·Â·∇e
    assert rel_err(g_engine, flat_grad(tr.params)) < 1e-4
    assert abs(stats.metrics["loss"] - float(-(units["w"] * a_hat).sum())) < 1e-6
    assert stats.metrics["ratio_max_dev"] == 0.0
    assert stats.forwards_grad == stats.sample_backwards == int(ro.selected.sum()) == ro.batch_size * 6 > 0
    # an inner epoch after θ moved: r = exp(e_old − e_new), PPO-clipped at 0.02
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in tr.params:
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    stats1 = tr.backward(ro, 1)
    e1 = ((_velocity(tr, units, ro) - units["u"]) ** 2).mean((1, 2, 3))
    r = torch.exp(e0.detach() - e1)
    per = torch.maximum(-a_hat * r, -a_hat * r.clamp(0.98, 1.02))
    assert stats1.metrics["clip_ratio"] > 0  # the clip is exercised
    assert abs(stats1.metrics["loss"] - float((units["w"] * per).sum())) < 1e-5


@pytest.mark.parametrize("name", ["nft", "awm"])
def test_update_lowers_flow_matching_loss_of_high_advantage_samples(make_trainer, name):
    """One gradient step: Σ_i A_i·Δe_i < 0 (first order: −η·|Σ A_i ∇e_i|²·const), and the mean change of the
    flow-matching error e on the units of positive-advantage samples is below that of negative-advantage ones."""
    tr = make_trainer(f"engine.name={name}")
    ro = tr.rollout()
    units = _units(tr, ro)
    e_before = ((_velocity(tr, units, ro) - units["u"]) ** 2).mean((1, 2, 3))
    tr.backward(ro)
    with torch.no_grad():
        for p in tr.params:
            p.sub_(1e-3 * p.grad)
    e_after = ((_velocity(tr, units, ro) - units["u"]) ** 2).mean((1, 2, 3))
    de = e_after - e_before
    adv = units["adv"]
    assert float((adv * de).sum()) < 0
    assert float(de[adv > 0].mean()) < float(de[adv < 0].mean())
    assert float(de[adv > 0].mean()) < 0 < float(de[adv < 0].mean())


@pytest.mark.parametrize("name", ["nft", "awm"])
def test_zero_advantages_give_zero_gradient(make_trainer, name):
    tr = make_trainer(f"engine.name={name}")
    ro = tr.rollout()
    tr.backward(ro)
    g_ref = flat_grad(tr.params).norm()
    assert g_ref > 0
    ro.advantages = torch.zeros_like(ro.advantages)
    tr.backward(ro)
    assert float(flat_grad(tr.params).norm()) <= 1e-7 * float(g_ref)


def test_nft_zero_advantage_pulls_towards_old_policy(make_trainer):
    """r = 1/2 with θ_old ≠ θ: the gradient is 2β²·w·(v_θ − v_old)-shaped, a step moves v_θ towards v_old."""
    tr = make_trainer("engine.name=nft")
    ro = tr.rollout()
    ro.advantages = torch.zeros_like(ro.advantages)
    old = _set_old(tr)
    units = _units(tr, ro)
    saved = _swap_in(tr.params, old)
    v_old = _velocity(tr, units, ro)
    _swap_in(tr.params, saved)
    gap0 = float(((_velocity(tr, units, ro) - v_old) ** 2).mean())
    tr.backward(ro)
    with torch.no_grad():
        for p in tr.params:
            p.sub_(1e-3 * p.grad)
    assert float(((_velocity(tr, units, ro) - v_old) ** 2).mean()) < gap0


# ---------------------------------------------------------------------- the old policy, LoRA, CFG
def test_nft_old_policy_ema_schedule_and_restore(make_trainer):
    """collect(): θ_old = θ first (no old forward), then θ_old ← d·θ_old + (1−d)·θ with d = min(rate·n, max);
    the rollout and the old forwards leave θ exactly as it was."""
    tr = make_trainer("engine.name=nft", "engine.old_decay_rate=0.3", "engine.old_decay_max=0.5")
    eng = tr.family.engine
    ro, _ = tr.family.collect()
    assert eng.old.current
    theta0 = [p.detach().clone() for p in tr.params]
    stats, _ = tr.update(ro)
    assert stats.forwards_nograd == 0  # θ_old = θ: v_old is the detached v_θ
    theta1 = [p.detach().clone() for p in tr.params]
    ro, _ = tr.family.collect()
    assert eng.old.last_decay == pytest.approx(0.3) and not eng.old.current
    for o, a, b in zip(eng.old.values, theta0, theta1):
        torch.testing.assert_close(o, 0.3 * a + 0.7 * b)
    tr.backward(ro)
    for p, b in zip(tr.params, theta1):
        assert torch.equal(p.detach(), b)
    tr.update(ro)
    tr.family.collect()
    assert eng.old.last_decay == pytest.approx(0.5)  # capped


@pytest.mark.parametrize("name", ["nft", "awm"])
def test_lora_trains_only_the_adapter_and_matches_hand_gradient(make_trainer, name):
    tr = make_trainer(f"engine.name={name}", "model.lora_rank=4")
    assert all("lora" in n for n in tr.policy.named_trainable_parameters())
    ro = tr.rollout()
    tr.backward(ro)
    g_engine = flat_grad(tr.params)
    assert g_engine.norm() > 0
    units = _units(tr, ro)
    for p in tr.params:
        p.grad = None
    v = _velocity(tr, units, ro, grad=True)
    if name == "nft":
        loss = _nft_hand_loss(v, v.detach(), units)
    else:
        loss = (units["w"] * (units["adv"].clamp(-5, 5) / 5) * ((v - units["u"]) ** 2).mean((1, 2, 3))).sum()
    loss.backward()
    assert rel_err(g_engine, flat_grad(tr.params)) < 1e-4


def test_training_forwards_are_cfg_free(make_trainer):
    """Under true CFG (guidance 3) the engine's forwards run the conditional branch alone: one network input per
    unit, and the gradient equals the one of the same model without guidance on the same rollout."""
    tr = make_trainer("engine.name=awm", "model.guidance_scale=3.0")
    assert tr.policy.uses_cfg
    ro = tr.rollout()
    stats = tr.backward(ro)
    assert stats.sample_backwards == int(ro.selected.sum())  # × 1, not × 2
    g_cfg = flat_grad(tr.params)
    tr.policy.guidance_scale = 1.0
    tr.family.ctx.forward_mult = 1
    tr.backward(ro)
    assert rel_err(g_cfg, flat_grad(tr.params)) < 1e-6
    assert tr.policy.guidance_scale == 1.0


# ---------------------------------------------------------------------- planning and config
def test_timestep_draws():
    g = torch.Generator().manual_seed(0)
    idx = grid_times(10, 4, 9, g)  # per sample: distinct grid indices 0 … 9
    assert idx.shape == (4, 9) and all(len(set(r.tolist())) == 9 for r in idx) and int(idx.max()) <= 9
    assert not all(torch.equal(idx[0], r) for r in idx[1:])  # independent permutations
    s = stratified_grid_times(10, 3, 6, 0.9, g)  # strata of 1 … 9: [1,2) [2,3) [3,5) [5,6) [6,7) [7,9)
    lo, hi = torch.tensor([1, 2, 3, 5, 6, 7]), torch.tensor([1, 2, 4, 5, 6, 8])
    assert bool(((s >= lo) & (s <= hi)).all()) and torch.equal(s[0], s[1])


def test_plan_uses_ode_rollout_and_k_units(make_trainer):
    tr = make_trainer("engine.name=nft", "engine.forward_timesteps=3")
    ro = tr.rollout()
    assert isinstance(ro.traj.engine_state, ForwardState)
    assert bool((ro.traj.noise == 0).all())  # deterministic ODE at every step (engine.forward_rollout=ode)
    assert ro.selected[:, :3].all() and not ro.selected[:, 3:].any()
    tr2 = make_trainer("engine.name=awm", "engine.forward_rollout=sampler")
    assert bool((tr2.rollout().traj.noise != 0).any())  # the sampler's SDE kernel


def test_config_keys_and_errors():
    validate(RunConfig.from_overrides(["engine.name=nft", "sampler.sde_type=ode"]))
    validate(RunConfig.from_overrides(["engine.name=awm"]))
    cases = {("engine.name=recompute", "sampler.sde_type=ode"): "sampler.sde_type",
             ("engine.name=recompute", "engine.nft_beta=0.5"): "engine.nft_beta: does not apply",
             ("engine.name=awm", "engine.nft_beta=0.5"): "engine.nft_beta: does not apply",
             ("engine.name=nft", "engine.awm_weighting=t"): "engine.awm_weighting: does not apply",
             ("engine.name=nft", "steps.mode=random"): "steps.mode: does not apply",
             ("engine.name=awm", "loss.clip_range=0.2"): "engine.awm_clip_range",
             ("engine.name=nft", "engine.forward_timesteps=11"): "engine.forward_timesteps",
             ("engine.name=nft", "engine.nft_beta=0"): "engine.nft_beta",
             ("engine.name=awm", "engine.adv_clip=-1"): "engine.adv_clip",
             ("engine.name=awm", "engine.awm_weighting=huber"): "engine.awm_weighting"}
    for ov, msg in cases.items():
        with pytest.raises(ConfigError) as e:
            validate(RunConfig.from_overrides(list(ov)))
        assert msg in str(e.value) and "\n" not in str(e.value)


# ---------------------------------------------------------------------- two gloo ranks
DIST = [(name, mode) for name in ("nft", "awm", "dgpo") for mode in ("ddp", "fsdp2")]
DIST_COMMON = ["train.group_size=4", "train.prompts_per_batch=2", "loss.beta=0.1", "train.max_grad_norm=0",
               "train.lr=1e-2", "eval.seeds_per_prompt=1", "engine.forward_timesteps=3"]
DIST_EXTRA = {"nft": ["engine.old_decay_rate=0.3"], "awm": [], "dgpo": []}


def _dist_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    from diffgrpo import Trainer, distributed
    from diffgrpo.models.tiny import build_tiny_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    full = lambda t: distributed.to_full(t).detach().clone()  # noqa: E731
    for name, mode in DIST:
        cfg = RunConfig.from_overrides([*TINY, "seed=0", f"engine.name={name}", *DIST_COMMON, *DIST_EXTRA[name],
                                        f"dist.mode={mode}",
                                        "dist.backend=gloo"])
        torch.manual_seed(0)
        policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
        tr = Trainer(cfg, policy=policy, log=lambda *a: None)
        ro, _ = tr.family.collect()
        tr.update(ro)  # iteration 1 (θ_old = θ); iteration 2 below has θ_old ≠ θ (nft)
        params = [full(p) for p in tr.params]
        ro, _ = tr.family.collect()
        old = tr.family.engine.old.values if name == "nft" else None
        stats = tr.backward(ro)
        st = ro.traj.engine_state
        torch.save({"grads": [full(p.grad) for p in tr.params], "params": params,
                    "old": None if old is None else [full(o) for o in old], "prompts": ro.prompts,
                    "cond": ro.traj.cond, "xs": ro.traj.xs, "sigmas": ro.traj.sigmas, "selected": ro.selected,
                    "rewards": ro.rewards, "group_ids": ro.group_ids, "loss_weights": ro.loss_weights,
                    "idx": st.idx, "noise": st.noise, "forwards_nograd": stats.forwards_nograd},
                   os.path.join(out_dir, f"{name}-{mode}-rank{rank}.pt"))
    leave_gloo()


@pytest.fixture(scope="module")
def two_rank_forward():
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_dist_worker, args=(2, port, d), nprocs=2, join=True)
        yield {case: [torch.load(os.path.join(d, f"{'-'.join(case)}-rank{r}.pt"), weights_only=False)
                      for r in range(2)] for case in DIST}


@pytest.mark.parametrize("name,mode", DIST, ids=["-".join(c) for c in DIST])
def test_two_ranks_equal_one_process_on_the_union(two_rank_forward, make_trainer, name, mode):
    """Second iteration (nft: θ_old ≠ θ, swapped into DDP's replicas / FSDP2's shards): each rank's synced
    gradient equals the one-process gradient of the same engine on the union of both ranks' samples and units."""
    from diffgrpo.types import FlowTrajectory, Rollout

    parts = two_rank_forward[(name, mode)]
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    B = len(parts[0]["prompts"])
    gids = torch.cat([p["group_ids"] + r * B for r, p in enumerate(parts)])
    tr = make_trainer(f"engine.name={name}", *DIST_COMMON, *DIST_EXTRA[name])
    with torch.no_grad():
        for q, v in zip(tr.params, parts[0]["params"]):
            q.copy_(v)
    if name == "nft":
        assert parts[0]["forwards_nograd"] > 0  # the θ_old forwards ran
        tr.family.engine.old.values = [o.clone() for o in parts[0]["old"]]
        tr.family.engine.old.current = False
    traj = FlowTrajectory(cond={k: torch.cat([p["cond"][k] for p in parts]) for k in parts[0]["cond"]},
                          sigmas=parts[0]["sigmas"], xs=cat("xs"), velocities=torch.zeros(0), log_probs=torch.zeros(0),
                          noise=torch.zeros(0), engine_state=ForwardState(idx=cat("idx"), noise=cat("noise")))
    ro = Rollout(prompts=[q for p in parts for q in p["prompts"]], group_ids=gids, traj=traj,
                 selected=cat("selected"), rewards=cat("rewards"))
    tr.family.weigh(ro)
    torch.testing.assert_close(ro.loss_weights, cat("loss_weights") / 2)
    tr.backward(ro)
    g1 = flat_grad(tr.params)
    assert g1.norm() > 0
    for p in parts:
        assert rel_err(torch.cat([g.flatten().double() for g in p["grads"]]), g1) < 1e-5
