"""Two gloo ranks against one process: spawning the ranks, a rank's training step saved (its synced gradient, the
weights it was taken at and the rollout it was taken on), and the one-process gradient on the union of both
ranks' rollouts compared with each rank's."""
from __future__ import annotations

from pathlib import Path

import torch

from .distributed import free_port
from .tensors import flat_grad, rel_err


def spawn_two(worker, *args) -> None:
    """``worker(rank, 2, port, *args)`` on two spawned processes sharing a free local port."""
    import torch.multiprocessing as mp

    mp.spawn(worker, args=(2, free_port(), *args), nprocs=2, join=True)


def save_step(tr, path: str, **extra) -> None:
    """Collect and update once (θ leaves the reference: non-zero margins at the second iteration), then collect
    and backward: the full gradients (zeros where a weight got none), the weights before that backward, the
    rollout's tensors and how many trained weights are sharded (DTensors), with ``extra``, to ``path``."""
    from diffgrpo import distributed

    ro, _ = tr.family.collect()
    tr.update(ro)
    params = [distributed.to_full(p).detach().clone() for p in tr.params]
    ro, _ = tr.family.collect()
    tr.backward(ro)
    st = ro.traj.engine_state
    grads = [torch.zeros_like(q) if p.grad is None else distributed.to_full(p.grad).detach().clone()
             for p, q in zip(tr.params, params)]
    torch.save({"grads": grads, "params": params, "prompts": ro.prompts, "cond": ro.traj.cond, "xs": ro.traj.xs,
                "sigmas": ro.traj.sigmas, "selected": ro.selected, "rewards": ro.rewards,
                "group_ids": ro.group_ids, "idx": st.idx, "noise": st.noise,
                "sharded": sum(type(p).__name__ == "DTensor" for p in tr.params), "n_params": len(tr.params),
                **extra}, path)


def load_ranks(d: Path, prefix: str = "") -> list[dict]:
    """The two ranks' saved steps ``<prefix>rank<r>.pt`` in ``d``."""
    return [torch.load(d / f"{prefix}rank{r}.pt", weights_only=False) for r in range(2)]


def union_rollout(parts: list[dict], cond=None):
    """One process's rollout of both ranks' units (rank r's groups renumbered after rank r − 1's); ``cond(k)``
    joins the conditioning tensor ``k`` (default: concatenated along the batch)."""
    from diffgrpo.engines._forward import ForwardState
    from diffgrpo.types import FlowTrajectory, Rollout

    def cat(k):
        return torch.cat([p[k] for p in parts])

    join = cond or (lambda k: torch.cat([p["cond"][k] for p in parts]))
    B = len(parts[0]["prompts"])
    traj = FlowTrajectory(cond={k: join(k) for k in parts[0]["cond"]}, sigmas=parts[0]["sigmas"], xs=cat("xs"),
                          velocities=torch.zeros(0), log_probs=torch.zeros(0), noise=torch.zeros(0),
                          engine_state=ForwardState(idx=cat("idx"), noise=cat("noise")))
    return Rollout(prompts=[q for p in parts for q in p["prompts"]],
                   group_ids=torch.cat([p["group_ids"] + r * B for r, p in enumerate(parts)]), traj=traj,
                   selected=cat("selected"), rewards=cat("rewards"))


def assert_ranks_match(tr, ro, parts: list[dict], label: str, tol: float = 1e-5) -> None:
    """At the weights the ranks took their gradient at, weigh and backward ``ro`` in one process: a non-zero
    gradient that each rank's synced one matches (relative error < ``tol``)."""
    with torch.no_grad():
        for q, v in zip(tr.params, parts[0]["params"]):
            q.copy_(v)
    tr.family.weigh(ro)
    tr.backward(ro)
    g1 = flat_grad(tr.params)
    assert g1.norm() > 0
    for r, p in enumerate(parts):
        g = torch.cat([g.flatten().double() for g in p["grads"]])
        err, diff = rel_err(g, g1), float((g - g1).abs().max())
        print(f"{label} rank {r}: rel |rank grad − one process| = {err:.2e}, max abs = {diff:.2e}")
        assert err < tol, err
