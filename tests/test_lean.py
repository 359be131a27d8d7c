"""LeanGRPO's recompute-free engines (retain, reweight): exact against recompute on the first update, waves,
inner-epoch fallback, counters, per-sample gradients, and world size 2 == world size 1."""
import os
import socket
import tempfile

import pytest
import torch

from diffgrpo import distributed
from diffgrpo.engines import ENGINES
from diffgrpo.engines._per_sample import PerSampleGrads, per_sample_grads_loop
from diffgrpo.engines.recompute import RecomputeEngine
from diffgrpo.engines.retain import RETAIN_KEY, retained_velocity
from diffgrpo.engines.reweight import REWEIGHT_KEY
from diffgrpo.losses import aggregation_weights
from diffgrpo.types import Rollout
from tests.conftest import TINY, flat_grad, perturb, rel_err

TOL = 1e-5


def _engine_vs_recompute(tr):
    ro = tr.rollout()
    stats = tr.backward(ro, 0)
    g = flat_grad(tr.params)
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.ctx, ro, 0)
    return ro, stats, g, flat_grad(tr.params)


CASES = [
    [],
    ["loss.beta=0.1"],
    ["model.guidance_scale=3.0"],
    ["model.guidance_scale=3.0", "loss.beta=0.05"],
    ["advantage.std_mode=global", "steps.mode=random", "steps.fraction=0.5"],
    ["steps.mode=first_fraction", "steps.fraction=0.5", "loss.aggregation=sample_mean"],
    ["steps.mode=window", "steps.window_size=2", "advantage.baseline=leave_one_out", "advantage.clip=0.5"],
]


@pytest.mark.parametrize("engine", ["retain", "reweight"])
@pytest.mark.parametrize("overrides", CASES, ids=lambda o: ",".join(o) or "default")
def test_first_update_equals_recompute(make_trainer, engine, overrides):
    tr = make_trainer(f"engine.name={engine}", *overrides)
    beta = any(o.startswith("loss.beta") for o in overrides)
    if beta:
        perturb(tr)
    ro, stats, g, g_ref = _engine_vs_recompute(tr)
    assert g_ref.norm() > 0
    assert rel_err(g, g_ref) < TOL
    assert stats.metrics["fallback_recompute"] == 0.0
    assert stats.metrics["trained_pairs"] == int(ro.selected.sum())
    if beta:
        assert stats.metrics["kl"] > 0


def test_kl_gradient_is_included(make_trainer):
    """With θ ≠ θ_ref the β·KL term changes the gradient, and both engines follow recompute there."""
    grads = {}
    for beta in (0.0, 0.5):
        tr = make_trainer("engine.name=reweight", f"loss.beta={beta}", "model.guidance_scale=1.0")
        if beta:
            perturb(tr)
        else:
            tr2 = make_trainer("engine.name=reweight", "loss.beta=0.5")  # same init, then same perturbation
            tr.policy.load_state_dict(tr2.policy.state_dict())
            perturb(tr)
        _, _, g, g_ref = _engine_vs_recompute(tr)
        assert rel_err(g, g_ref) < TOL
        grads[beta] = g
    assert rel_err(grads[0.5], grads[0.0]) > 1e-3


def test_retain_counters_and_release(make_trainer):
    tr = make_trainer("engine.name=retain")
    c0 = dict(tr.policy.counters)
    ro = tr.rollout()
    B, T = ro.batch_size, ro.num_steps
    n_pairs = int(ro.selected.sum())
    # the rollout ran the selected pairs' forwards with grad and nothing else extra
    assert tr.policy.counters["forwards_grad"] - c0["forwards_grad"] == n_pairs
    assert tr.policy.counters["forwards_nograd"] - c0["forwards_nograd"] == B * T - n_pairs
    store = ro.extras[RETAIN_KEY]
    k = 2
    idx = ro.selected[:, k].nonzero().flatten()[:2]
    v = retained_velocity(ro, k, idx)
    assert v.requires_grad
    torch.testing.assert_close(v.detach(), ro.velocities[idx, k])
    stats = tr.backward(ro)
    assert stats.retained_graphs == T - 1  # one batched graph per selected step
    assert stats.backward_calls == 1
    assert stats.sample_backwards == n_pairs
    assert stats.forwards_grad == 0 and stats.forwards_nograd == 0  # no recompute forward
    assert "rollout_extra" in stats.seconds
    assert store.released and store.items == []
    with pytest.raises(KeyError):
        retained_velocity(ro, k, idx)


def test_reweight_counters(make_trainer):
    tr = make_trainer("engine.name=reweight", "loss.beta=0.1")
    ro = tr.rollout()
    B, T = ro.batch_size, ro.num_steps
    stats = tr.backward(ro)
    assert stats.grad_buffers == 2 * B  # policy-gradient and KL buffer per trajectory
    assert stats.backward_calls == 2 * (T - 1)  # one batched backward per step and term
    assert stats.sample_backwards == 2 * int(ro.selected.sum())
    assert stats.forwards_grad == 0
    assert stats.allreduce_calls == 0  # world size 1
    assert stats.metrics["grad_buffer_bytes"] == 2 * B * sum(p.numel() for p in tr.params) * 4
    assert ro.extras[REWEIGHT_KEY].released


@pytest.mark.parametrize("engine", ["retain", "reweight"])
def test_dropped_samples_are_excluded(make_trainer, monkeypatch, engine):
    """An invalid reward (and zero-std filtering) drops a trajectory after its buffers/graphs were made."""
    import diffgrpo.trainer as trainer_mod

    real = trainer_mod.compute_rewards

    def nan_first(*a, **k):
        r, comps = real(*a, **k)
        r = r.clone()
        r[1] = float("nan")
        return r, comps

    monkeypatch.setattr(trainer_mod, "compute_rewards", nan_first)
    tr = make_trainer(f"engine.name={engine}", "advantage.filter_zero_std=true")
    ro, stats, g, g_ref = _engine_vs_recompute(tr)
    assert not ro.selected[1].any()
    assert rel_err(g, g_ref) < TOL


@pytest.mark.parametrize("engine", ["retain", "reweight"])
def test_inner_epoch_falls_back_to_recompute(make_trainer, engine):
    tr = make_trainer(f"engine.name={engine}", "train.num_inner_epochs=2", "loss.clip_range=0.01")
    ro = tr.rollout()
    tr.backward(ro, 0)
    tr.optimizer.step()
    stats = tr.backward(ro, 1)
    g = flat_grad(tr.params)
    assert stats.metrics["fallback_recompute"] == 1.0
    assert stats.forwards_grad == int(ro.selected.sum())
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.ctx, ro, 1)
    assert rel_err(g, flat_grad(tr.params)) < 1e-12
    assert stats.metrics["ratio_max_dev"] > 0  # θ moved: this is a genuine later epoch
    # the whole iteration through the trainer runs too
    row = make_trainer(f"engine.name={engine}", "train.num_inner_epochs=2").step()
    assert row["skipped_updates"] == 0 and row["first_epoch/fallback_recompute"] == 0.0


@pytest.mark.parametrize("aggregation", ["mean", "sample_mean"])
def test_waves_equal_one_wave(make_trainer, aggregation):
    """Waves of one group each accumulate exactly the whole-batch first-update gradient (whole-batch
    normalisation), which is what one wave (== recompute, test above) gives on the same samples."""
    tr = make_trainer("engine.name=retain", "engine.wave_size=1", "train.prompts_per_batch=3",
                      "steps.mode=random", "steps.fraction=0.5", f"loss.aggregation={aggregation}")
    ro, stats = tr.rollout_in_waves(1)
    g = flat_grad(tr.params)
    assert stats.metrics["waves"] == 3.0
    assert stats.retained_graphs == 3 * (ro.num_steps - 1)
    assert ro.batch_size == 9
    torch.testing.assert_close(ro.loss_weights, aggregation_weights(ro.selected, aggregation))
    tr.optimizer.zero_grad(set_to_none=True)
    RecomputeEngine().backward(tr.ctx, ro, 0)
    assert rel_err(g, flat_grad(tr.params)) < TOL
    # the trainer's step uses the waves
    row = tr.step()
    assert row["first_epoch/waves"] == 3.0 and row["skipped_updates"] == 0


def test_waves_refuse_global_std(make_trainer):
    # refused when the config is read, before any model is built (ConfigError is a ValueError)
    with pytest.raises(ValueError, match="advantage.std_mode=global"):
        make_trainer("engine.name=retain", "engine.wave_size=1", "advantage.std_mode=global")


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_per_sample_grads_match_one_backward_per_sample(make_trainer, cfg_scale):
    tr = make_trainer(f"model.guidance_scale={cfg_scale}")
    pol = tr.policy
    psg = PerSampleGrads(pol, tr.params)
    assert psg.supported()
    n = 3
    x = torch.randn(n, *pol.latent_shape)
    cond = pol.encode(["a handwritten digit 1", "a handwritten digit 2", "a handwritten digit 3"])
    gout = torch.randn(n, *pol.latent_shape)
    with psg.recording():
        with torch.enable_grad():
            v = pol.velocity(x, torch.full((n,), 0.6), cond)
        G = psg.grads(psg.take(), v, gout, n, retain_graph=True)
    G_ref = per_sample_grads_loop(tr.params, v, gout, retain_graph=False)
    assert rel_err(G.double(), G_ref.double()) < TOL
    assert G.norm(dim=1).min() > 0


def test_registry():
    assert ENGINES["retain"].name == "retain" and ENGINES["reweight"].name == "reweight"


# ---------------------------------------------------------------------------------------------- world size 2
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from diffgrpo import RunConfig, Trainer
    from diffgrpo.models.tiny import build_tiny_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    distributed.init_from_env("gloo")
    assert distributed.info().world_size == world
    cfg = RunConfig.from_overrides([*TINY, "seed=0", "engine.name=reweight", "loss.beta=0.1"])
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    tr = Trainer(cfg, policy=policy, log=lambda *a: None)
    ddp = DDP(policy.transformer, broadcast_buffers=False)
    comm = {"calls": 0}

    def counting_allreduce(state, bucket):  # counts DDP's own gradient all-reduces (must stay 0)
        comm["calls"] += 1
        fut = dist.all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, counting_allreduce)
    policy.forward_module = ddp
    tr.ctx.no_sync = ddp.no_sync
    plan = tr.plan_batch()  # identical on every rank (same seeds); each rank rolls out one group
    sub = tr.split_waves(plan, 1)[rank]
    sub.wave = None  # data parallel: each rank normalises over its own samples, DDP averages the ranks
    tr.gen_noise.manual_seed(100 + rank)
    ro = tr.rollout(plan=sub)
    stats = tr.backward(ro, 0)
    keep = ("group_ids", "xs", "velocities", "log_probs", "noise", "selected", "advantages", "sigmas")
    torch.save({"grad": flat_grad(tr.params), "allreduce_calls": stats.allreduce_calls,
                "counter": distributed.COUNTERS["allreduce"], "ddp_comm_calls": comm["calls"],
                "prompts": ro.prompts, "cond": ro.cond, **{k: getattr(ro, k) for k in keep}},
               os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


def test_world_size_two_equals_world_size_one(make_trainer):
    """Two gloo processes, DDP-wrapped transformer, one group each: the reweight update equals the world-size-1
    exact gradient on the union of the samples, with exactly one gradient all-reduce and no DDP bucket sync."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_ddp_worker, args=(2, _free_port(), d), nprocs=2, join=True)
        parts = [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for p in parts:
        assert p["allreduce_calls"] == 1 and p["counter"] == 1
        assert p["ddp_comm_calls"] == 0
    assert rel_err(parts[0]["grad"], parts[1]["grad"]) < 1e-12  # every rank holds the same gradient
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    tr = make_trainer("engine.name=recompute", "loss.beta=0.1")  # same init as the workers, world size 1
    ro = Rollout(prompts=parts[0]["prompts"] + parts[1]["prompts"], group_ids=cat("group_ids"),
                 cond={k: torch.cat([p["cond"][k] for p in parts]) for k in parts[0]["cond"]},
                 sigmas=parts[0]["sigmas"], xs=cat("xs"), velocities=cat("velocities"), log_probs=cat("log_probs"),
                 noise=cat("noise"), selected=cat("selected"), advantages=cat("advantages"))
    ro.loss_weights = aggregation_weights(ro.selected, "mean")
    assert ro.group_ids.unique().numel() == 2
    tr.backward(ro, 0)
    g1 = flat_grad(tr.params)
    assert g1.norm() > 0
    assert rel_err(parts[0]["grad"], g1) < TOL
