"""The Trainer under data parallelism (two gloo processes on CPU): one DDP or FSDP2 update on 2 ranks equals
one update on 1 rank on the union of the same samples, for the recompute engine and LeanGRPO's recompute-free
retain / reweight, in both group layouts; JAGG, single_step and LoRA against themselves in one process; a rank
whose samples all drop out still syncs; masked diffusion LMs under DDP; gradient collectives per optimizer step
are counted; ranks draw different noise."""
import os
import tempfile

import pytest
import torch
import torch.distributed as dist

from diffgrpo import RunConfig, distributed
from diffgrpo.config import ConfigError
from diffgrpo.distributed import rank_rows
from diffgrpo.engines.single_step import SingleStepState
from diffgrpo.types import FlowTrajectory, Rollout, TokenTrajectory
from tests.helpers.distributed import free_port
from tests.helpers.tensors import rel_err
from tests.helpers.tiny import TINY

LR = 1e-2
ENGINES = ("recompute", "retain", "reweight")
CASES = [(engine, mode, layout) for engine in ENGINES for mode in ("ddp", "fsdp2") for layout in ("local", "spread")]
IDS = ["-".join(case) for case in CASES]
# a rank whose samples all drop out of the loss (rank 1's group: equal rewards under filter_zero_std, or non-finite
# rewards) must still run its planned calls, or the other rank's gradient collectives wait for it forever
DROPS = {"zero_std": ["advantage.filter_zero_std=true"], "nonfinite": []}
DROP_CASES = [(engine, mode, drop) for engine in ENGINES for mode in ("ddp", "fsdp2") for drop in DROPS]
DROP_IDS = ["-".join(case) for case in DROP_CASES]
# engines with their own estimator (JAGG's windows, Flash-GRPO's one step per group with global rectification) and
# a LoRA adapter: two ranks must equal the same configuration in one process on the union of the samples
OWN = {"jagg": ["engine.name=jagg", "engine.window=2"], "single_step": ["engine.name=single_step"],
       "lora": ["engine.name=recompute", "model.lora_rank=4"]}
OWN_CASES = [(label, mode, layout) for label in OWN for mode in ("ddp", "fsdp2") for layout in ("local", "spread")]
OWN_IDS = ["-".join(case) for case in OWN_CASES]
# masked diffusion LMs under DDP: base method, layout, DACA plug-ins / options; micro-batches of 2 rows make several
# backwards per update (synced once). "drop": rank 1's only group has equal rewards under filter_zero_std.
DLLM_CASES = {"diffu-local": ("diffu_grpo", "local", ["loss.beta=0.04"]),
              "coupled-spread-sml-dps": ("coupled_grpo", "spread", ["daca.likelihood=sml", "daca.dps_score=entropy",
                                                                     "daca.dps_mix=0.5"]),
              "random_mask-local-sml-chain": ("random_mask", "local", ["daca.likelihood=sml", "daca.sml_strata=3"]),
              "diffu-local-drop": ("diffu_grpo", "local", ["advantage.filter_zero_std=true"])}
DLLM_KEEP = ("selected", "trained", "rewards", "group_ids", "advantages", "loss_weights")
DLLM_TRAJ = ("sequences", "log_probs", "masks", "mask_weights", "ref_log_probs", "token_weights", "strata", "groups")
COMMON = ["train.group_size=4", "train.prompts_per_batch=2", "loss.beta=0.1", "train.max_grad_norm=0", f"train.lr={LR}",
          "eval.seeds_per_prompt=1"]
# DDP: per-trajectory random steps (rows of one step split into a grad and a no-grad forward). FSDP2 all-gathers on
# every network call, so it needs the same steps on every trajectory (Trainer._check_world refuses random ones).
STEPS = {"ddp": ["steps.mode=random", "steps.fraction=0.5"],
         "fsdp2": ["steps.mode=first_fraction", "steps.fraction=0.5"]}
KEEP = ("group_ids", "selected", "rewards", "advantages", "loss_weights")
TRAJ = ("xs", "velocities", "log_probs", "noise", "sigmas")
# the entry points gradient syncs go through: the library's own (all_reduce, reduce_scatter_tensor) and FSDP2's
# post-backward reduce-scatter (reduce_scatter_single in torch 2.13, reduce_scatter_tensor in earlier ones)
COLLECTIVES = ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single")


def _full(t: torch.Tensor) -> torch.Tensor:
    return distributed.to_full(t).detach().clone()


def _count_collectives(counts: dict) -> None:
    """Count every call of the COLLECTIVES in this process (``counts[name] += 1``); DDP's own bucket all-reduces
    run in C++ and are counted by a comm hook instead (``counts["ddp_bucket"]``)."""
    for name in COLLECTIVES:
        orig = getattr(dist, name, None)
        if orig is not None:
            def counted(*a, _orig=orig, _name=name, **kw):
                counts[_name] += 1
                return _orig(*a, **kw)
            setattr(dist, name, counted)


def _drop_rank1_rewards(drop: str, rank: int):
    """The trainer's reward function, with rank 1's rewards made equal (zero_std) or NaN (nonfinite)."""
    from diffgrpo.flow import family as trainer

    score = trainer.compute_rewards

    def patched(*a, **kw):
        rewards, comps = score(*a, **kw)
        if rank == 1:
            rewards = torch.full_like(rewards, 0.5 if drop == "zero_std" else float("nan"))
        return rewards, comps
    return patched


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from datetime import timedelta

    from diffgrpo import Trainer
    from diffgrpo.flow import family as trainer
    from diffgrpo.models.tiny import build_tiny_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # a collective one rank never joins fails after the timeout instead of hanging the test run
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    counts = dict.fromkeys((*COLLECTIVES, "ddp_bucket"), 0)
    bucket_all_reduce = dist.all_reduce  # DDP's hook below: not counted as an explicit all-reduce
    _count_collectives(counts)

    def ddp_bucket_hook(state, bucket):  # DDP's default: average the bucket over ranks
        counts["ddp_bucket"] += 1
        fut = bucket_all_reduce(bucket.buffer().div_(world), async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    compute_rewards = trainer.compute_rewards
    for case in CASES + DROP_CASES + OWN_CASES:  # one process group, one fresh trainer per case
        dropping = case in DROP_CASES
        engine, mode, layout = (*case[:2], "local") if dropping else case
        extra = DROPS[case[2]] if dropping else OWN.get(engine, [])
        if engine in OWN:  # a label, its overrides name the engine
            extra, engine = OWN[engine], OWN[engine][0].split("=")[1]
        trainer.compute_rewards = _drop_rank1_rewards(case[2], rank) if dropping else compute_rewards
        cfg = RunConfig.from_overrides([*TINY, "seed=0", f"engine.name={engine}", *COMMON, *STEPS[mode], *extra,
                                        f"dist.mode={mode}", f"dist.group_layout={layout}", "dist.backend=gloo"])
        torch.manual_seed(0)
        policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
        tr = Trainer(cfg, policy=policy, log=lambda *a: None)
        assert tr.world == (rank, world, rank)
        if mode == "ddp":
            tr.dp_module.register_comm_hook(None, ddp_bucket_hook)
        else:  # as Trainer.train does: its no-grad forwards leave FSDP2's root unsharded (its parameters swapped)
            tr.evaluate()
        counts.update(dict.fromkeys(counts, 0))
        ro = tr.rollout()  # retain keeps graphs, reweight back-propagates here (gradient sync off)
        in_rollout = dict(counts)
        counts.update(dict.fromkeys(counts, 0))
        stats, info = tr.update(ro)  # the engine's backward (gradient sync once) + one AdamW step
        torch.save({"grads": [_full(p.grad) for p in tr.params], "params": [_full(p) for p in tr.params],
                    "grad_norm": info["grad_norm"], "backward_calls": stats.backward_calls, "prompts": ro.prompts,
                    "cond": ro.traj.cond, "batch_rewards": ro.batch_rewards, "comm_rollout": in_rollout,
                    "comm_update": dict(counts), "allreduce_calls": stats.allreduce_calls,
                    "fsdp_units": len(distributed.transformer_blocks(tr.dp_module)) + 1,  # blocks + root
                    "engine_state": ro.traj.engine_state if engine == "single_step" else None,  # planned k
                    **{k: getattr(ro, k) for k in KEEP}, **{k: getattr(ro.traj, k) for k in TRAJ}},
                   os.path.join(out_dir, f"{'-'.join(case)}-rank{rank}.pt"))
    trainer.compute_rewards = compute_rewards
    _dllm_cases(rank, world, out_dir, counts, ddp_bucket_hook)
    refused = []  # FSDP2 with per-trajectory random steps is refused before any collective could mismatch
    for steps in (["steps.mode=random"], ["steps.mode=window", "steps.window_start=-1"],
                  ["engine.name=jagg", "engine.window=2", "engine.jagg_frac=0.5"],
                  ["engine.name=jagg", "engine.window=2", "engine.jagg_min_score=0.5"], ["model.name=tiny_mlm"]):
        flow = steps != ["model.name=tiny_mlm"]
        try:
            Trainer(RunConfig.from_overrides([*(TINY + COMMON if flow else []), *steps, "dist.mode=fsdp2"]),
                    policy=policy)
            refused.append("")
        except ConfigError as e:
            refused.append(str(e))
    torch.save(refused, os.path.join(out_dir, f"refused-rank{rank}.pt"))
    torch.distributed.destroy_process_group()


def _dllm_cases(rank, world, out_dir, counts, ddp_bucket_hook):
    """One rollout + update of the tiny masked diffusion LM per DLLM_CASES entry, under DDP."""
    from tests.helpers.tiny import make_dllm_trainer

    for name, (method, layout, extra) in DLLM_CASES.items():
        tr = make_dllm_trainer("dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8",
                               f"dllm.method={method}", "engine.micro_batch_size=2", "train.lr=3e-3", *extra,
                               "dist.mode=ddp", f"dist.group_layout={layout}", "dist.backend=gloo")
        tr.dp_module.register_comm_hook(None, ddp_bucket_hook)
        if name.endswith("drop") and rank == 1:  # rank 1's group: all rewards equal, so it drops out
            score = tr.family.task.rewards
            tr.family.task.rewards = lambda texts, ex, score=score: {**score(texts, ex),
                                                                     "reward": torch.full((len(texts),), 0.25)}
        counts.update(dict.fromkeys(counts, 0))
        ro = tr.rollout()
        in_rollout = dict(counts)
        counts.update(dict.fromkeys(counts, 0))
        stats, _ = tr.update(ro)
        torch.save({"grads": [p.grad.detach().clone() for p in tr.params], "prompts": ro.prompts,
                    "comm_rollout": in_rollout, "comm_update": dict(counts), "backward_calls": stats.backward_calls,
                    "batch_rewards": ro.batch_rewards, **{k: getattr(ro, k) for k in DLLM_KEEP},
                    "traj": {k: getattr(ro.traj, k) for k in DLLM_TRAJ}},
                   os.path.join(out_dir, f"dllm-{name}-rank{rank}.pt"))


@pytest.fixture(scope="module")
def two_rank_results():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, free_port(), d), nprocs=2, join=True)
        load = lambda name: torch.load(os.path.join(d, name), weights_only=False)  # noqa: E731
        out = {case: [load(f"{'-'.join(case)}-rank{r}.pt") for r in range(2)]
               for case in CASES + DROP_CASES + OWN_CASES}
        out["refused"] = [load(f"refused-rank{r}.pt") for r in range(2)]
        out.update({name: [load(f"dllm-{name}-rank{r}.pt") for r in range(2)] for name in DLLM_CASES})
        yield out


def _assert_ranks_have_one_process_gradient(parts: list[dict], tr) -> None:
    """Every rank's synced gradient equals the one-process gradient ``tr`` holds (which is non-zero)."""
    g1 = torch.cat([p.grad.flatten() for p in tr.params])
    assert g1.norm() > 0
    for p in parts:
        assert rel_err(torch.cat([g.flatten() for g in p["grads"]]), g1) < 1e-5


def _union_rollout(parts: list[dict], gids: torch.Tensor, engine_state=None) -> Rollout:
    """The ranks' rollouts as one batch (rank order), before advantages: what one process would have sampled."""
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    traj = FlowTrajectory(cond={k: torch.cat([p["cond"][k] for p in parts]) for k in parts[0]["cond"]},
                          sigmas=parts[0]["sigmas"], xs=cat("xs"), velocities=cat("velocities"),
                          log_probs=cat("log_probs"), noise=cat("noise"), engine_state=engine_state)
    return Rollout(prompts=[q for p in parts for q in p["prompts"]], group_ids=gids, traj=traj,
                   selected=cat("selected"), rewards=cat("rewards"))


@pytest.mark.parametrize("engine,mode,layout", CASES, ids=IDS)
def test_two_ranks_equal_one_rank(two_rank_results, make_trainer, engine, mode, layout):
    """Same samples, one update: every rank ends with the same gradient and weights, equal to the one-process
    recompute update (the exact gradient) on the union of the ranks' samples (advantages and the loss normaliser
    computed over the union)."""
    parts = two_rank_results[(engine, mode, layout)]
    B = len(parts[0]["prompts"])
    assert B == 4  # 2 prompts × 4 samples over 2 ranks
    for a, b in zip(parts[0]["params"], parts[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    # the union as one batch: local layout's per-rank group ids made distinct as the trainer does
    gids = torch.cat([p["group_ids"] + (0 if layout == "spread" else r * B) for r, p in enumerate(parts)])
    assert gids.unique().numel() == 2
    torch.testing.assert_close(parts[0]["batch_rewards"], cat("rewards"))
    tr = make_trainer("engine.name=recompute", *COMMON)
    ro = _union_rollout(parts, gids)
    tr.family.weigh(ro)
    torch.testing.assert_close(ro.advantages, cat("advantages"))  # group statistics over the whole group
    torch.testing.assert_close(ro.loss_weights, cat("loss_weights") / 2)  # × W on each rank, averaged by DDP/FSDP2
    _, info = tr.update(ro)
    _assert_ranks_have_one_process_gradient(parts, tr)
    for p in parts:
        assert abs(p["grad_norm"] - info["grad_norm"]) < 1e-5 * info["grad_norm"]
    # The weights: AdamW's first step lr·g/(|g|+eps) is ill-conditioned where |g| ~ eps (a float rounding of g,
    # well within the 1e-5 above, moves θ by up to a sizeable fraction of lr; recompute-free engines round
    # differently), so they are compared with the one-process AdamW step taken on the ranks' gradient, which the
    # lines above tie to the exact one-process gradient.
    ref = make_trainer("engine.name=recompute", *COMMON)
    for q, g in zip(ref.params, parts[0]["grads"]):
        q.grad = g.clone()
    ref.optimizer.step()
    for a, b in zip(parts[0]["params"], ref.params):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-6)
    moved = sum(float((a - b.detach()).abs().max()) for a, b in zip(parts[0]["params"], make_trainer().params))
    assert moved > 1e-3  # the optimizer step did change the weights


@pytest.mark.parametrize("engine,mode,drop", DROP_CASES, ids=DROP_IDS)
def test_rank_whose_samples_all_drop_out_still_syncs(two_rank_results, make_trainer, engine, mode, drop):
    """Rank 1's only group drops out of the loss (equal rewards with filter_zero_std, or non-finite rewards).
    It still runs its planned steps with loss weight 0, so both ranks join the one gradient sync and end with
    the one-process gradient of the union, in which that group drops out the same way."""
    parts = two_rank_results[(engine, mode, drop)]
    busy, idle = parts
    assert float(busy["loss_weights"].abs().sum()) > 0
    assert bool(idle["selected"].any()) and float(idle["loss_weights"].abs().sum()) == 0
    assert float(idle["advantages"].abs().sum()) == 0
    for p in parts:
        got = _update_syncs(p)
        assert got == _expected_collectives(engine, mode, p["fsdp_units"])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    B = len(busy["prompts"])
    gids = torch.cat([p["group_ids"] + r * B for r, p in enumerate(parts)])  # local layout: ids unique per rank
    tr = make_trainer("engine.name=recompute", *COMMON, *DROPS[drop])
    ro = _union_rollout(parts, gids)
    tr.family.weigh(ro)
    assert not bool(ro.selected[B:].any())  # one process drops rank 1's group from the selection itself
    torch.testing.assert_close(ro.loss_weights, cat("loss_weights") / 2)
    tr.update(ro)
    _assert_ranks_have_one_process_gradient(parts, tr)


@pytest.mark.parametrize("label,mode,layout", OWN_CASES, ids=OWN_IDS)
def test_two_ranks_equal_one_rank_for_jagg_single_step_and_lora(two_rank_results, make_trainer, label, mode, layout):
    """JAGG and Flash-GRPO's single_step are not the exact gradient, so two ranks are compared with the same
    engine in one process on the union of the ranks' samples: equal gradients, one gradient sync per step.
    single_step in the spread layout: both ranks train the same step for a group (iso-temporal across ranks),
    and the rectification is normalised over both ranks' samples. A LoRA adapter (frozen base weights sharded
    or replicated beside it) trains the same adapter gradient as one process."""
    parts = two_rank_results[(label, mode, layout)]
    engine = OWN[label][0].split("=")[1]
    B = len(parts[0]["prompts"])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    gids = torch.cat([p["group_ids"] + (0 if layout == "spread" else r * B) for r, p in enumerate(parts)])
    state = None
    if engine == "single_step":
        k = torch.cat([p["engine_state"].k for p in parts])  # (2B,)
        state = SingleStepState(k=k)
        for g in gids.unique():
            assert k[gids == g].unique().numel() == 1  # one trained step per group, on both ranks
    tr = make_trainer(*COMMON, *STEPS[mode], *OWN[label])
    ro = _union_rollout(parts, gids, engine_state=state)
    tr.family.weigh(ro)
    torch.testing.assert_close(ro.loss_weights, cat("loss_weights") / 2)
    tr.update(ro)
    _assert_ranks_have_one_process_gradient(parts, tr)
    for p in parts:
        got = _update_syncs(p)
        # LoRA's adapters sit in the attention of the one transformer block; the root unit holds only frozen
        # weights, so FSDP2 has nothing to reduce-scatter for it
        units = 1 if label == "lora" else p["fsdp_units"]
        assert got == _expected_collectives(engine, mode, units)


def _update_syncs(part: dict) -> dict:
    """Gradient collectives one rank made in its update, by kind (FSDP2's reduce-scatter under either name)."""
    c = part["comm_update"]
    return {"ddp_bucket": c["ddp_bucket"], "all_reduce": c["all_reduce"],
            "reduce_scatter": c["reduce_scatter_tensor"] + c["reduce_scatter_single"]}


def _expected_collectives(engine: str, mode: str, units: int) -> dict:
    """Gradient collectives of one optimizer step on one rank. DDP: one bucket all-reduce for the one synced
    backward (the tiny transformer's gradient fits DDP's first, 1 MiB, bucket); FSDP2: one reduce-scatter per
    fully_shard unit. reweight forms its gradient outside autograd, so neither wrapper sees it: the library
    syncs it itself with ONE all-reduce (DDP) or ONE reduce-scatter of every unit's rows at once (FSDP2)."""
    exp = dict.fromkeys(("ddp_bucket", "all_reduce", "reduce_scatter"), 0)
    if engine == "reweight":
        exp["all_reduce" if mode == "ddp" else "reduce_scatter"] = 1
    elif mode == "ddp":
        exp["ddp_bucket"] = 1
    else:
        exp["reduce_scatter"] = units
    return exp


@pytest.mark.parametrize("engine,mode,layout", CASES, ids=IDS)
def test_gradient_sync_once_per_step(two_rank_results, engine, mode, layout):
    """No gradient collective during the rollout (retain keeps graphs, reweight back-propagates under no_sync),
    then exactly one sync per optimizer step: recompute's several backwards sync only on the last one, retain's
    one backward through the kept graphs syncs once, reweight's buffers are synced by one library collective."""
    units = 2  # FSDP2 units of the tiny model: its one transformer block (model.num_layers=1) + the root
    for p in two_rank_results[(engine, mode, layout)]:
        assert sum(p["comm_rollout"].values()) == 0, p["comm_rollout"]
        got = _update_syncs(p)
        # FSDP2 shards the block and the root separately; DDP wraps the whole transformer as one module (it
        # exposes no blocks) and never reduce-scatters
        assert p["fsdp_units"] == (units if mode == "fsdp2" else 1)
        assert got == _expected_collectives(engine, mode, units)
        if engine == "reweight":
            assert p["allreduce_calls"] == 1  # EngineStats counts the library's one collective
        elif engine == "recompute":
            assert p["backward_calls"] >= 3  # syncing every backward would multiply the counts above
        else:
            assert p["backward_calls"] == 1


def test_fsdp2_refuses_per_trajectory_random_steps(two_rank_results):
    """FSDP2 collectives need the same network calls on every rank; random steps per trajectory differ, and so do
    JAGG's windows routed to the exact path by score."""
    for random_steps, random_window, jagg_frac, jagg_min_score, dllm in two_rank_results["refused"]:
        assert "dist.mode=fsdp2" in random_steps and "steps.mode=random" in random_steps
        assert "steps.mode=window with window_start=-1" in random_window
        assert "engine.jagg_frac=0.5" in jagg_frac and "engine.jagg_min_score=0.5" in jagg_min_score
        assert "masked diffusion LMs" in dllm and "dist.mode=ddp" in dllm


@pytest.mark.parametrize("layout", ["local", "spread"])
def test_ranks_draw_different_noise(two_rank_results, layout):
    """Spread: both ranks hold the same prompts (a share of every group) but different initial and SDE noise.
    Local: each rank samples its own groups, again with its own noise stream."""
    p0, p1 = two_rank_results[("recompute", "ddp", layout)]
    if layout == "spread":
        assert p0["prompts"] == p1["prompts"]
        assert torch.equal(p0["group_ids"], p1["group_ids"])
    assert (p0["xs"][:, 0] - p1["xs"][:, 0]).abs().min() > 0  # every initial noise differs
    assert not torch.allclose(p0["noise"], p1["noise"])
    assert not torch.allclose(p0["xs"][:, -1], p1["xs"][:, -1])


def test_rank_rows_split_every_group():
    gids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert rank_rows(gids, 0, 2).tolist() == [0, 1, 4, 5]
    assert rank_rows(gids, 1, 2).tolist() == [2, 3, 6, 7]
    with pytest.raises(ValueError, match="multiple"):
        rank_rows(gids, 0, 3)


def test_single_process_ignores_dist_section(make_trainer):
    """Without WORLD_SIZE > 1 the dist section changes nothing: no wrapper, one-process seeds."""
    os.environ.pop("WORLD_SIZE", None)
    a = make_trainer("dist.mode=ddp", "dist.group_layout=spread")
    b = make_trainer()
    assert a.dp_module is None and a.world.world_size == 1
    assert torch.equal(a.family.plan().x0, b.family.plan().x0)
    with pytest.raises(ConfigError, match="dist.mode"):
        RunConfig.from_overrides(["dist.mode=fsdp1"])


@pytest.mark.parametrize("name", list(DLLM_CASES))
def test_dllm_two_ranks_equal_one_rank(two_rank_results, name):
    """Masked diffusion LMs under DDP: advantages over whole groups (all-gathered rewards), the token-mean
    normaliser over both ranks' trained tokens, and one gradient sync after several backwards give every rank
    the one-process gradient on the union of the ranks' samples (same masks, strata and DPS weights)."""
    from diffgrpo.advantages import group_advantages
    from diffgrpo.losses import aggregation_weights
    from tests.helpers.tiny import make_dllm_trainer

    method, layout, extra = DLLM_CASES[name]
    parts = two_rank_results[name]
    B = len(parts[0]["prompts"])
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    gids = torch.cat([p["group_ids"] + (0 if layout == "spread" else r * B) for r, p in enumerate(parts)])
    if layout == "spread":
        assert parts[0]["prompts"] == parts[1]["prompts"]  # a share of every group on each rank
    else:  # one whole group per rank
        assert all(p["group_ids"].unique().numel() == 1 and len(set(p["prompts"])) == 1 for p in parts)
    assert gids.unique().numel() == 2  # 2 prompts × 4 samples over 2 ranks
    torch.testing.assert_close(parts[0]["batch_rewards"], cat("rewards"))
    tr = make_dllm_trainer("dllm.task=sudoku", "dllm.block_length=8", "dllm.diffusion_steps=8",
                           f"dllm.method={method}", "engine.micro_batch_size=2", "train.lr=3e-3", *extra)
    fam, a = tr.family, tr.cfg.advantage
    adv, _ = group_advantages(cat("rewards"), gids, std_mode=fam.std_mode, baseline=fam.baseline, clip=a.clip,
                              eps=a.eps)
    torch.testing.assert_close(cat("advantages"), adv)
    trained = cat("trained")
    if name.endswith("drop"):  # rank 1 trains nothing, yet runs every row at weight 0 (it joins the one sync)
        assert not bool(parts[1]["trained"].any()) and bool(parts[0]["trained"].any())
        assert bool(parts[1]["selected"].all(1).any()) and float(parts[1]["loss_weights"].abs().sum()) == 0
    lw = aggregation_weights(trained, tr.cfg.loss.aggregation)
    torch.testing.assert_close(cat("loss_weights") / 2, lw)  # × W on each rank, averaged by DDP
    tj = parts[0]["traj"]
    fields = {k: (tj[k] if k == "groups" or tj[k] is None else torch.cat([p["traj"][k] for p in parts]))
              for k in DLLM_TRAJ}
    traj = TokenTrajectory(prompt_length=fields["sequences"].shape[1] - tr.family.gen_length, records={}, **fields)
    ro = Rollout(prompts=parts[0]["prompts"] + parts[1]["prompts"], group_ids=gids, traj=traj, selected=trained,
                 trained=trained, rewards=cat("rewards"), advantages=adv, loss_weights=lw)
    tr.optimizer.zero_grad(set_to_none=True)
    stats = tr.backward(ro)
    _assert_ranks_have_one_process_gradient(parts, tr)
    for p in parts:
        assert sum(p["comm_rollout"].values()) == 0  # the rollout's all-gathers are not counted collectives
        assert p["comm_update"]["ddp_bucket"] == 1 and p["comm_update"]["all_reduce"] == 0  # one sync
        assert p["backward_calls"] > 1  # several backwards (micro-batches × strata), synced only on the last
    assert stats.backward_calls >= 1
