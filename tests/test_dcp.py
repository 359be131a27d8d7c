"""Sharded checkpoints (torch.distributed.checkpoint) under FSDP2 on two gloo ranks, CPU: a run killed after a
checkpoint and resumed equals the uninterrupted run (weights, AdamW state, EMA); a two-rank checkpoint loads into
one process and a one-process checkpoint into two FSDP2 ranks, each equal to the state that was saved; while the
two ranks save, every tensor materialised on a rank is measured (a dispatch mode sees every op's output) and none
is the full size of a sharded optimizer tensor, unlike the full gather of ``train.checkpoint_format=files``.
One process: the sharded format resumes bit for bit, and a damaged shard file is detected and skipped."""
import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from diffgrpo import RunConfig, distributed
from diffgrpo.run.checkpoint import is_complete, latest_complete, list_checkpoints
from diffgrpo.run.job import resume
from tests.helpers.distributed import free_port, leave_gloo
from tests.helpers.tiny import TINY

COMMON = [*TINY, "seed=0", "engine.name=recompute", "train.group_size=4", "train.prompts_per_batch=2",
          "loss.beta=0.1", "train.lr=1e-2", "eval.seeds_per_prompt=1", "train.ema_decay=0.9",
          "steps.mode=first_fraction", "steps.fraction=0.5", "dist.backend=gloo", "model.num_layers=2"]


def _make(out: str, *overrides: str):
    from diffgrpo import Trainer
    from diffgrpo.models.tiny import build_tiny_policy

    cfg = RunConfig.from_overrides([*COMMON, f"log.output_dir={out}", *overrides])
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    return Trainer(cfg, policy=policy, log=lambda *a: None)


def _scramble(tr) -> None:
    """Move every weight and the EMA away from the initial state, so only a real load restores them."""
    with torch.no_grad():
        for p in tr.params:
            p.add_(1.0)
        for t in (tr.ema.shadow.values() if tr.ema is not None else []):
            t.add_(1.0)


def _full_state(tr) -> dict:
    """Full tensors (a collective under FSDP2) of the weights, the optimizer state and the EMA."""
    return distributed.to_full({"params": [p.detach().clone() for p in tr.params],
                                "optim": tr.optimizer.state_dict()["state"],
                                "ema": {k: v.clone() for k, v in tr.ema.shadow.items()}})


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank; a waiting collective's result (AsyncCollectiveTensor) as the tensor."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return getattr(t, "elem", t)


def _ptr(t: torch.Tensor) -> int | None:
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass with no storage of its own
        return None


class _Largest(TorchDispatchMode):
    """Measures the floating-point tensors the ops of this process produce (a DTensor: its local shard only): the
    largest one (views included) and the bytes of new storage, a bound on what was allocated (views of an input
    and storages counted once are left out). The uint8 buffers of DCP's object collectives (pickled save plans:
    their size follows the number of tensors, not the tensors' sizes) are recorded apart."""

    def __init__(self):
        super().__init__()
        self.largest, self.total, self.largest_bytes_buffer = 0, 0, 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_ptr(_local(t)) for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            local = _local(t)
            if not local.is_floating_point():
                self.largest_bytes_buffer = max(self.largest_bytes_buffer, local.numel() * local.element_size())
                continue
            self.largest = max(self.largest, local.numel() * local.element_size())
            ptr = _ptr(local)
            if ptr is None:
                self.total += local.numel() * local.element_size()
            elif ptr not in inputs and ptr not in self._seen:
                self._seen.add(ptr)
                self.total += local.untyped_storage().nbytes()
        return out


def _worker(rank: int, world: int, port: int, d: str) -> None:
    from datetime import timedelta

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    fsdp = "dist.mode=fsdp2"
    res = {}
    tr = _make(f"{d}/full", fsdp)  # the uninterrupted run: two iterations
    tr.step()
    tr.step()
    res["uninterrupted"] = _full_state(tr)
    tr = _make(f"{d}/killed", fsdp)  # killed after the checkpoint of iteration 1
    tr.step()
    shard_bytes = max(t.to_local().numel() * t.element_size() for s in tr.optimizer.state.values()
                      for t in s.values() if t.dim() > 0)
    full_bytes = max(t.numel() * t.element_size() for s in tr.optimizer.state.values() for t in s.values())
    optim_bytes = sum(t.numel() * t.element_size() for s in tr.optimizer.state.values() for t in s.values())
    with _Largest() as m:
        ckpt = tr.save_checkpoint()
    res["memory"] = {"largest": m.largest, "total": m.total, "shard_bytes": shard_bytes, "full_bytes": full_bytes,
                     "optim_bytes": optim_bytes, "bytes_buffer": m.largest_bytes_buffer}
    with _Largest() as m:  # the same measurement around the full gather of the files format
        tr.state()
    res["memory"]["files_largest"], res["memory"]["files_total"] = m.largest, m.total
    res["saved"] = _full_state(tr)
    res["ckpt"] = str(ckpt)
    del tr
    tr = _make(f"{d}/killed", fsdp)
    _scramble(tr)
    assert resume(tr, tr.run_dir())
    res["resumed_iteration"] = tr.iteration
    tr.step()
    res["resumed"] = _full_state(tr)
    tr = _make(f"{d}/one", fsdp)  # the one-process checkpoint, resharded onto two ranks
    _scramble(tr)
    assert resume(tr, tr.run_dir())
    res["from_one"] = _full_state(tr)
    res["from_one_rng"] = tr.family.rng_state()
    torch.save(res, os.path.join(d, f"rank{rank}.pt"))
    leave_gloo()


@pytest.fixture(scope="module")
def two_ranks():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        one = _make(f"{d}/one", "train.checkpoint_format=dcp")  # one process, sharded format
        one.step()
        one.save_checkpoint()
        saved_one = {**_full_state(one), "rng": one.family.rng_state()}
        mp.spawn(_worker, args=(2, free_port(), d), nprocs=2, join=True)
        yield d, saved_one, [torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=True) for r in range(2)]


def _assert_states(a: dict, b: dict, exact: bool) -> None:
    la, lb = tree_leaves(a), tree_leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        if exact:
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y)


def test_fsdp2_killed_and_resumed_equals_uninterrupted(two_ranks):
    _, _, ranks = two_ranks
    for r in ranks:
        assert r["resumed_iteration"] == 1
        _assert_states(r["resumed"], r["uninterrupted"], exact=False)
    moved = [(a - b).abs().max() for a, b in zip(ranks[0]["uninterrupted"]["params"], ranks[0]["saved"]["params"])]
    assert max(moved) > 0  # the second iteration changed the weights


def test_fsdp2_checkpoint_is_sharded_and_checksummed(two_ranks):
    _, _, ranks = two_ranks
    ckpt = ranks[0]["ckpt"]
    files = json.loads(Path(ckpt, "state.json").read_text())["files"]
    shards = sorted(f for f in files if f.startswith("dcp/"))
    assert len(shards) == 2 and is_complete(Path(ckpt))  # one file per rank, both hashed
    sizes = [files[f]["size"] for f in shards]  # each rank's shards of the weights, the AdamW state and the EMA
    assert max(sizes) < 0.75 * sum(sizes)  # the two ranks' halves (uneven row splits aside), not a full copy each


def test_no_rank_materialises_full_optimizer_state_while_saving(two_ranks):
    _, _, ranks = two_ranks
    for r in ranks:
        m = r["memory"]
        assert m["shard_bytes"] < m["full_bytes"]
        assert m["largest"] <= m["shard_bytes"] < m["full_bytes"]  # never a full sharded tensor
        assert m["total"] < m["optim_bytes"]  # nor allocates the optimizer state's size in all
        assert m["files_largest"] >= m["full_bytes"]  # the measurement sees a full gather when there is one
        assert m["files_total"] >= m["optim_bytes"]
        print(f"rank memory during save (bytes): {m}")


def test_two_rank_checkpoint_resumes_in_one_process(two_ranks):
    d, _, ranks = two_ranks
    tr = _make(f"{d}/killed", "dist.mode=none")
    _scramble(tr)
    assert resume(tr, tr.run_dir()) and tr.iteration == 1
    _assert_states(_full_state(tr), ranks[0]["saved"], exact=True)
    tr.step()  # and it trains on
    assert tr.iteration == 2


def test_one_process_checkpoint_resumes_on_two_ranks(two_ranks):
    _, saved_one, ranks = two_ranks
    saved_rng = saved_one["rng"]
    for r in ranks:
        _assert_states(r["from_one"], {k: v for k, v in saved_one.items() if k != "rng"}, exact=True)
    # rank 0 continues every saved stream; rank 1 continues the shared one (a group's noise) and keeps its own
    # per-rank streams (sampling noise: the ranks never draw the same noise)
    _assert_states(ranks[0]["from_one_rng"], saved_rng, exact=True)
    assert torch.equal(ranks[1]["from_one_rng"]["group_noise"], saved_rng["group_noise"])
    assert not torch.equal(ranks[1]["from_one_rng"]["noise"], ranks[0]["from_one_rng"]["noise"])


@pytest.mark.parametrize("lora", [[], ["model.lora_rank=4"]], ids=["full", "lora"])
def test_sharded_format_resumes_bitwise_in_one_process(tmp_path, lora):
    ref = _make(str(tmp_path / "ref"), "train.checkpoint_format=dcp", *lora)
    ref.step()
    ref.step()
    tr = _make(str(tmp_path / "run"), "train.checkpoint_format=dcp", "train.keep_checkpoints=3", *lora)
    tr.step()
    tr.save_checkpoint()
    tr.step()
    ckpt = tr.save_checkpoint()
    # LoRA: only the adapter is stored (the frozen base is not), and the checkpoint carries it in diffusers format
    assert (ckpt / "lora" / "pytorch_lora_weights.safetensors").is_file() == bool(lora)
    from safetensors import safe_open

    with safe_open(str(next((ckpt / "dcp").glob("*.safetensors"))), "pt") as f:
        stored = {k[len("model."):] for k in f.keys() if k.startswith("model.")}
    named = dict(tr.family.network().named_parameters())
    assert {n for n, p in named.items() if p.requires_grad} <= stored  # every trained weight …
    assert not {n for n, p in named.items() if not p.requires_grad} & stored  # … and no frozen one
    assert any("lora_" in n for n in stored) == bool(lora)
    again = _make(str(tmp_path / "run"), "train.checkpoint_format=dcp", *lora)
    _scramble(again)
    # a damaged shard of the newest checkpoint (same size) is detected, and the one before is used
    shard = next((list_checkpoints(tmp_path / "run")[-1] / "dcp").glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    assert not is_complete(shard.parent.parent)
    assert latest_complete(tmp_path / "run", log=lambda *a: None) == list_checkpoints(tmp_path / "run")[0]
    assert resume(again, again.run_dir()) and again.iteration == 1
    again.step()
    _assert_states(_full_state(again), _full_state(ref), exact=True)


def _make_mlm(out: str):
    from diffgrpo import Trainer
    from diffgrpo.models.hf_masked_lm import build_tiny_mlm_policy

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "seed=0", "train.prompts_per_batch=2", "train.group_size=4",
                                    "log.progress=false", "dllm.eval_size=8", "train.lr=1e-2",
                                    "train.checkpoint_format=dcp", f"log.output_dir={out}"])
    torch.manual_seed(0)
    return Trainer(cfg, policy=build_tiny_mlm_policy(cfg, progress=False, pretrained=False), log=lambda *a: None)


def test_masked_lm_sharded_checkpoint_resumes_bitwise(tmp_path):
    """The diffusion-LM family through the same sharded path (a masked LM ties its input and output embeddings:
    stored once, both restored)."""
    ref = _make_mlm(str(tmp_path / "ref"))
    ref.step()
    ref.step()
    tr = _make_mlm(str(tmp_path / "run"))
    tr.step()
    tr.save_checkpoint()
    again = _make_mlm(str(tmp_path / "run"))
    with torch.no_grad():
        for p in again.params:
            p.add_(1.0)
    assert resume(again, again.run_dir()) and again.iteration == 1
    again.step()
    for a, b in zip(again.params, ref.params):
        assert torch.equal(a, b)
    sa, sb = again.optimizer.state_dict()["state"], ref.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys() and all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])
