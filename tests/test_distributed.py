"""The Trainer under data parallelism (two gloo processes on CPU): one DDP or FSDP2 update on 2 ranks equals
one update on 1 rank on the union of the same samples, for both group layouts; ranks draw different noise."""
import os
import socket
import tempfile

import pytest
import torch

from diffgrpo import RunConfig, distributed
from diffgrpo.config import ConfigError
from diffgrpo.trainer import rank_rows
from diffgrpo.types import Rollout
from tests.conftest import TINY, rel_err

LR = 1e-2
CASES = [(mode, layout) for mode in ("ddp", "fsdp2") for layout in ("local", "spread")]
COMMON = ["engine.name=recompute", "train.group_size=4", "train.prompts_per_batch=2", "loss.beta=0.1",
          "train.max_grad_norm=0", f"train.lr={LR}", "steps.mode=random", "steps.fraction=0.5"]
KEEP = ("group_ids", "xs", "velocities", "log_probs", "noise", "selected", "rewards", "advantages", "loss_weights",
        "sigmas")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _full(t: torch.Tensor) -> torch.Tensor:
    return distributed.to_full(t).detach().clone()


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from diffgrpo import Trainer
    from diffgrpo.models.tiny import build_tiny_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    for mode, layout in CASES:  # one process group, one fresh trainer per case
        cfg = RunConfig.from_overrides([*TINY, "seed=0", *COMMON, f"dist.mode={mode}", f"dist.group_layout={layout}",
                                        "dist.backend=gloo"])
        torch.manual_seed(0)
        policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
        tr = Trainer(cfg, policy=policy, log=lambda *a: None)
        assert tr.world == (rank, world, rank)
        ro = tr.rollout()
        stats, info = tr.update(ro)  # backward (no_sync on all but the last) + one AdamW step
        torch.save({"grads": [_full(p.grad) for p in tr.params], "params": [_full(p) for p in tr.params],
                    "grad_norm": info["grad_norm"], "backward_calls": stats.backward_calls, "prompts": ro.prompts,
                    "cond": ro.cond, "batch_rewards": ro.extras["batch_rewards"],
                    **{k: getattr(ro, k) for k in KEEP}},
                   os.path.join(out_dir, f"{mode}-{layout}-rank{rank}.pt"))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(2, _free_port(), d), nprocs=2, join=True)
        yield {case: [torch.load(os.path.join(d, f"{case[0]}-{case[1]}-rank{r}.pt"), weights_only=False)
                      for r in range(2)] for case in CASES}


@pytest.mark.parametrize("mode,layout", CASES)
def test_two_ranks_equal_one_rank(two_rank_results, make_trainer, mode, layout):
    """Same samples, one update: every rank ends with the same gradient and weights, equal to the one-process
    update on the union of the ranks' samples (advantages and the loss normaliser computed over the union)."""
    parts = two_rank_results[(mode, layout)]
    B = len(parts[0]["prompts"])
    assert B == 4  # 2 prompts × 4 samples over 2 ranks
    for a, b in zip(parts[0]["params"], parts[1]["params"]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    cat = lambda k: torch.cat([p[k] for p in parts])  # noqa: E731
    # the union as one batch: local layout's per-rank group ids made distinct as the trainer does
    gids = torch.cat([p["group_ids"] + (0 if layout == "spread" else r * B) for r, p in enumerate(parts)])
    assert gids.unique().numel() == 2
    torch.testing.assert_close(parts[0]["batch_rewards"], cat("rewards"))
    tr = make_trainer(*COMMON)
    ro = Rollout(prompts=parts[0]["prompts"] + parts[1]["prompts"], group_ids=gids,
                 cond={k: torch.cat([p["cond"][k] for p in parts]) for k in parts[0]["cond"]},
                 sigmas=parts[0]["sigmas"], xs=cat("xs"), velocities=cat("velocities"), log_probs=cat("log_probs"),
                 noise=cat("noise"), selected=cat("selected"), rewards=cat("rewards"))
    tr.finish_rollout(ro)
    torch.testing.assert_close(ro.advantages, cat("advantages"))  # group statistics over the whole group
    torch.testing.assert_close(ro.loss_weights, cat("loss_weights") / 2)  # × W on each rank, averaged by DDP/FSDP2
    _, info = tr.update(ro)
    g1 = torch.cat([p.grad.flatten() for p in tr.params])
    assert g1.norm() > 0
    for p in parts:
        assert rel_err(torch.cat([g.flatten() for g in p["grads"]]), g1) < 1e-5
        assert abs(p["grad_norm"] - info["grad_norm"]) < 1e-5 * info["grad_norm"]
        for a, b in zip(p["params"], tr.params):
            # AdamW's first step is lr·g/(|g|+eps): where |g| ~ eps, float rounding of g moves θ by a fraction of
            # lr, so weights are compared to 1e-3 of a step (the gradient itself is compared to 1e-5 above)
            torch.testing.assert_close(a, b.detach(), rtol=0, atol=1e-3 * LR)
    moved = sum(float((a - b.detach()).abs().max()) for a, b in zip(parts[0]["params"], make_trainer().params))
    assert moved > 1e-3  # the optimizer step did change the weights


@pytest.mark.parametrize("layout", ["local", "spread"])
def test_ranks_draw_different_noise(two_rank_results, layout):
    """Spread: both ranks hold the same prompts (a share of every group) but different initial and SDE noise.
    Local: each rank samples its own groups, again with its own noise stream."""
    p0, p1 = two_rank_results[("ddp", layout)]
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
    assert torch.equal(a.plan_batch().x0, b.plan_batch().x0)
    with pytest.raises(ConfigError, match="dist.mode"):
        RunConfig.from_overrides(["dist.mode=fsdp1"])
