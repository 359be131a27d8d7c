"""A thin distributed layer: one trainer for 1 or N processes.

Everything here is a no-op at world size 1 (no process group). Under ``torchrun`` (or any launcher that sets
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) :func:`init_from_env` creates the default process group.

  info()                  → WorldInfo(rank, world_size, local_rank)
  shutdown()              destroy the default process group (registered at exit when init_from_env creates it)
  launched_world_size()   WORLD_SIZE set by the launcher (1 without one), before any process group exists
  resolve_mode(mode, W)   dist.mode "auto" → "ddp" under a launcher with W > 1 processes, "none" in one process
  resolve_device(v, lr)   model.device "auto" → cuda:<local rank> / cuda / mps / cpu (explicit values unchanged)
  all_gather(t)           → (world·n, …) concatenation of every rank's (n, …) tensor (same n on every rank)
  all_reduce_mean_(t)     in-place mean over ranks; every call is counted in ``COUNTERS["allreduce"]``
  add_mean_grad_(ps, g)   .grad += rank-mean of a flat gradient made outside autograd: ONE all-reduce (DDP) or
                          ONE reduce-scatter into the FSDP2 shards (counted in ``COUNTERS["reduce_scatter"]``)
  sharded(params)         whether the parameters are FSDP2 shards (DTensors)
  no_sync(module)         context suppressing DDP's gradient all-reduce (nullcontext without DDP)
  wrap_ddp(module)        DistributedDataParallel at world size > 1, the module itself otherwise
  wrap_fsdp2(module)      FSDP2: ``fully_shard`` on every transformer block, then on the root (in place)
  wrap(module, mode)      "ddp" / "fsdp2" / "none" → the module that forwards must go through
  reshard(module)         FSDP2: register the sharded parameters again (the root keeps unsharded ones after forward)
  all_reduce_sum(t)       sum over ranks (not counted: statistics, not gradients)
  all_gather_object(o)    list of every rank's picklable object
  first_set(v)            the lowest rank's non-None ``v``, on every rank (a stop signal any rank received)
  to_full(obj)            DTensor leaves (FSDP2 shards) of a nested state dict → full tensors (collective)
  full_model_state(m)     the whole unsharded state dict of ``m`` on rank 0, on the CPU, gathered one tensor at a
                          time (``get_model_state_dict``, full + CPU offload; {} on the other ranks): end-of-run
                          exports of an FSDP2 run
  sharded_state(m, opt)   model + optimizer state as DCP sees it (``get_state_dict``): this rank's shards only
  save_sharded(t, d)      ``dcp.save`` of a tensor tree into directory d: every rank writes its own shards
  load_sharded(m, opt, …) ``dcp.load`` into this process's layout (any world size: DCP reshards), then
                          ``set_state_dict``; ``load_sharded_model(m, d)`` the weights alone
  seed_for(seed, rank)    per-rank seed of a stream that must differ across ranks

Gradient scale: DDP and FSDP2 both AVERAGE gradients over ranks, so a loss that must equal the one-process
loss on the union of the ranks' samples is built with world-size-scaled weights (see ``Trainer.finish_rollout``).
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import warnings
from typing import NamedTuple

import torch
import torch.distributed as dist

from .errors import ConfigError
from .types import DTYPES

COUNTERS = {"allreduce": 0, "reduce_scatter": 0}  # gradient collectives issued through this module (per process)


class WorldInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def info() -> WorldInfo:
    """Rank, world size and local rank of this process (0, 1, 0 without a process group)."""
    if not is_initialized():
        return WorldInfo(0, 1, 0)
    return WorldInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank())))


def init_from_env(backend: str | None = None, timeout: float | None = None) -> WorldInfo:
    """Create the default process group when launched by torchrun (WORLD_SIZE > 1); otherwise do nothing.
    ``timeout`` (seconds): a collective that a stalled rank never joins fails after it (torch's default: 30 min)."""
    if is_initialized():
        return info()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        kw = {} if timeout is None else {"timeout": datetime.timedelta(seconds=float(timeout))}
        dist.init_process_group(backend=backend, **kw)
        atexit.register(shutdown)  # every rank, the non-writers too, tears its group down before the interpreter ends
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    return info()


def shutdown() -> None:
    """Destroy the default process group, if any (registered at exit by :func:`init_from_env`): a group left to the
    interpreter's teardown can abort the process after a complete run (gloo's and NCCL's threads outlive Python)."""
    if is_initialized():
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to tear down cleanly
            dist.destroy_process_group()


def launched_world_size() -> int:
    """The number of processes a launcher (torchrun) started: WORLD_SIZE, or 1 without one (or if unreadable)."""
    try:
        return max(int(os.environ.get("WORLD_SIZE", "1")), 1)
    except ValueError:
        return 1


def resolve_mode(mode: str, world_size: int) -> str:
    """The data-parallel mode a run uses: ``auto`` is ``ddp`` when ``world_size`` > 1 processes were launched and
    ``none`` in one process; explicit modes are kept (validation.validate refuses ``none`` with world_size > 1)."""
    if mode == "auto":
        return "ddp" if world_size > 1 else "none"
    return mode


def resolve_device(value: str, local_rank: int | None = None) -> str:
    """The torch device ``model.device`` names. ``auto``: the accelerator when there is one: ``cuda:<local_rank>``
    under a launcher (``local_rank`` given) or ``cuda`` in one process when CUDA is available, else ``mps`` when
    available, else ``cpu``. Any other value is returned unchanged (validation.validate checks it)."""
    if value != "auto":
        return value
    if torch.cuda.is_available():
        if local_rank is None:
            return "cuda"
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise ConfigError(f"model.device=auto: LOCAL_RANK={local_rank} but this machine has {n} CUDA device(s); "
                             f"launch at most {n} processes per node or set model.device")
        return f"cuda:{local_rank}"
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        return "mps"
    return "cpu"


def launched_local_rank() -> int | None:
    """LOCAL_RANK under a launcher with WORLD_SIZE > 1, None in one process."""
    if launched_world_size() <= 1:
        return None
    try:
        return int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError:
        return 0


def all_gather(t: torch.Tensor) -> torch.Tensor:
    """(n, …) on every rank → (world·n, …) in rank order. Identity at world size 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def all_reduce_mean_(t: torch.Tensor) -> torch.Tensor:
    """Average ``t`` over ranks in place (DDP's gradient convention) and count the call. No-op at world 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return t
    COUNTERS["allreduce"] += 1
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    t.div_(dist.get_world_size())
    return t


def sharded(params: list[torch.Tensor]) -> bool:
    """Whether ``params`` are FSDP2 shards (DTensors over several ranks)."""
    if not params or not is_initialized() or dist.get_world_size() == 1:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(params[0], DTensor)


def add_mean_grad_(params: list[torch.Tensor], flat: torch.Tensor) -> None:
    """``p.grad += `` the rank-mean of ``flat`` (P,), this rank's gradient of ``params`` flattened in order.

    For gradients formed outside autograd (``reweight`` combines per-trajectory buffers), which DDP's bucket
    hooks and FSDP2's post-backward reduce-scatters never see, so the sync is done here with ONE collective:
    an all-reduce for plain (replicated) parameters, or, for FSDP2's sharded DTensor parameters, one
    reduce-scatter that leaves each rank only the rows it owns. Existing ``.grad`` must already be synced.
    At world size 1 it only adds ``flat``."""
    if sharded(params):
        parts = _reduce_scatter_mean(params, flat)
    else:
        all_reduce_mean_(flat)
        parts = [g.view_as(p).to(p.dtype, copy=True)  # a bf16 model's gradient in bf16
                 for p, g in zip(params, flat.split([p.numel() for p in params]))]
    for p, g in zip(params, parts):
        p.grad = g if p.grad is None else p.grad + g


def _reduce_scatter_mean(params: list[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """FSDP2 layout (``Shard(0)``, split like ``torch.chunk``: rank r owns rows r·c … r·c+c−1, c = ⌈d₀/W⌉, the
    last ranks possibly fewer or none). Every parameter's gradient is padded to W·c rows so that rank r's rows
    of all parameters form the r-th of W equal segments; one reduce-scatter then hands each rank its segment.
    → this rank's averaged shard of each parameter's gradient, as a DTensor like the parameter."""
    from torch.distributed.tensor import DTensor, Shard

    W = dist.get_world_size()
    segments, rows = [], []
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"expected FSDP2's Shard(0) parameters, got {p.placements}")
        c = -(-p.shape[0] // W)
        padded = g.new_zeros(W * c, *p.shape[1:])
        padded[:p.shape[0]] = g.view(p.shape)
        segments.append(padded.view(W, -1))  # row r: rank r's rows of this parameter (zero padded)
        rows.append(c)
    send = torch.cat(segments, dim=1).flatten()  # (W·S,) rank-major
    mine = send.new_empty(send.numel() // W)
    COUNTERS["reduce_scatter"] += 1
    dist.reduce_scatter_tensor(mine, send, op=dist.ReduceOp.SUM)
    mine.div_(W)
    out = []
    for p, seg, c in zip(params, mine.split([s.shape[1] for s in segments]), rows):
        local = seg.view(c, *p.shape[1:])[:p.to_local().shape[0]]  # drop this rank's padding rows
        out.append(DTensor.from_local(local.to(p.dtype).contiguous(), p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride()))
    return out


def no_sync(module) -> contextlib.AbstractContextManager:
    """DDP's ``no_sync`` for a wrapped module, FSDP2's ``set_requires_gradient_sync(False)``, else a no-op."""
    if hasattr(module, "no_sync"):
        return module.no_sync()
    if hasattr(module, "set_requires_gradient_sync"):
        @contextlib.contextmanager
        def _fsdp():
            module.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                module.set_requires_gradient_sync(True)
        return _fsdp()
    return contextlib.nullcontext()


def wrap_ddp(module: torch.nn.Module, **kw) -> torch.nn.Module:
    """DistributedDataParallel around ``module`` at world size > 1; the module itself otherwise."""
    if not is_initialized() or dist.get_world_size() == 1:
        return module
    return torch.nn.parallel.DistributedDataParallel(module, **kw)


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Σ over ranks (a new tensor). Identity at world size 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return t
    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_gather_object(obj) -> list:
    """[obj of rank 0, obj of rank 1, …]. [obj] at world size 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def first_set(value):
    """The value of the lowest rank whose ``value`` is not None, on every rank (None: no rank's). ``value`` at
    world size 1."""
    return next((v for v in all_gather_object(value) if v is not None), None)


def seed_for(seed: int, rank: int) -> int:
    """Seed of a per-rank stream (initial and SDE noise): rank 0 keeps ``seed``, so one process is unchanged."""
    return seed + 1000 * rank


BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")  # diffusers/transformers names


def transformer_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks FSDP2 shards one by one (every ``nn.ModuleList`` named in ``BLOCK_LISTS``)."""
    out = []
    for name in BLOCK_LISTS:
        blocks = getattr(module, name, None)
        if isinstance(blocks, torch.nn.ModuleList):
            out.extend(blocks)
    return out


def wrap_fsdp2(module: torch.nn.Module, *, param_dtype: torch.dtype | str | None = None,
               cpu_offload: bool = False, **kw) -> torch.nn.Module:
    """FSDP2 in place: ``fully_shard`` on each transformer block (one all-gather per block in forward and
    backward, one reduce-scatter per block), then on the root for the remaining parameters. Returns
    ``module`` (now an ``FSDPModule``: parameters are sharded DTensors, ``set_requires_gradient_sync`` exists).
    Build optimizers AFTER wrapping. No-op at world size 1.

    ``param_dtype`` (e.g. ``torch.bfloat16`` or ``"bfloat16"``): a ``MixedPrecisionPolicy`` that all-gathers and
    computes in that dtype and reduce-scatters gradients in float32; the sharded parameters, their gradients and
    the optimizer state stay float32. ``cpu_offload``: a ``CPUOffloadPolicy`` (shards, gradients and optimizer state on the CPU; each
    block's parameters are copied to the device for its all-gather)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return module
    fully_shard_each([*transformer_blocks(module), module], param_dtype=param_dtype, cpu_offload=cpu_offload, **kw)
    return module


def fully_shard_each(modules: list[torch.nn.Module], *, param_dtype: torch.dtype | str | None = None,
                     cpu_offload: bool = False, **kw) -> None:
    """``fully_shard`` each module in order (blocks before the module holding them) on one mesh over all ranks, with
    the policies of :func:`wrap_fsdp2`. A collective; call under a process group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import (
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        fully_shard,
    )

    if isinstance(param_dtype, str):  # dist.fsdp_param_dtype
        param_dtype = DTYPES[param_dtype]
    if param_dtype is not None and param_dtype != torch.float32:
        kw.setdefault("mp_policy", MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32))
    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"  # also "cpu:gloo,cuda:nccl"
    if cpu_offload:  # pinned host memory for the copies to the GPU (there is none to pin for on a CPU run)
        kw.setdefault("offload_policy", CPUOffloadPolicy(pin_memory=device_type == "cuda"))
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for m in modules:
        fully_shard(m, mesh=mesh, **kw)


def reshard(module) -> None:
    """Register FSDP2's sharded parameters on ``module`` again (freeing unsharded copies; no communication).
    No-op for anything that is not an FSDP2 module (DDP, None)."""
    if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
        module.reshard()


def wrap(module: torch.nn.Module, mode: str) -> torch.nn.Module:
    """The module forwards must go through for ``mode`` in {"none", "ddp", "fsdp2"}."""
    if mode == "ddp":
        return wrap_ddp(module, broadcast_buffers=False)
    if mode == "fsdp2":
        return wrap_fsdp2(module)
    if mode == "none":
        return module
    raise ValueError(f"dist.mode must be one of ['none', 'ddp', 'fsdp2'], got {mode!r}")


def to_full(obj):
    """Replace every DTensor in a nested dict/list with its full tensor (a collective: call on every rank)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor()
    if isinstance(obj, dict):
        return {k: to_full(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_full(v) for v in obj)
    return obj


def full_model_state(module: torch.nn.Module, *, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The full state dict of ``module`` (FSDP2 shards gathered; names as ``module.state_dict()``) on rank 0, on the
    CPU; an empty dict on the other ranks. ``get_model_state_dict`` with ``full_state_dict`` and ``cpu_offload``
    gathers one tensor at a time and moves it to rank 0's host memory, so no device ever holds the whole model.
    ``trainable_only``: frozen parameters left out (a LoRA run's base weights). A collective: call on every rank."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=trainable_only)
    return get_model_state_dict(module, options=opts)


def _tensor_tree(obj) -> bool:
    """Whether a nested dict holds tensors only (what a safetensors-backed DCP checkpoint can store)."""
    if isinstance(obj, dict):
        return all(_tensor_tree(v) for v in obj.values())
    return isinstance(obj, torch.Tensor)


def _untied(msd: dict) -> dict:
    """A model state dict with every tied weight once (the first name of tensors sharing memory, e.g. a masked
    LM's input embedding and output projection): safetensors refuses shared memory, and loading the kept name
    fills the tied one. Empty tensors (a rank holding no rows of a shard) are never taken for tied ones."""
    out, seen = {}, set()
    for k, v in msd.items():
        local = v.to_local() if hasattr(v, "to_local") else v
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(local.shape))
        if local.numel() and key in seen:
            continue
        seen.add(key)
        out[k] = v
    return out


def sharded_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, list[dict]]:
    """The trainable state of ``module`` and ``optimizer`` as ``torch.distributed.checkpoint.state_dict.get_state_dict``
    gives it: keyed by parameter name (FQN), frozen parameters left out, and under FSDP2 each tensor a DTensor
    holding this rank's shard only (no gather), tied weights once. → (``{"model": {fqn: tensor}, "optim": {fqn: {"step",
    "exp_avg", …}}}``, the optimizer's param_groups: plain numbers and names, stored as JSON)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    msd, osd = get_state_dict(module, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    tensors = {"model": _untied(msd), "optim": {k: dict(v) for k, v in osd["state"].items()}}
    if not _tensor_tree(tensors):
        raise TypeError("the optimizer state holds non-tensor values; sharded checkpoints store tensors only")
    return tensors, [dict(g) for g in osd["param_groups"]]


@contextlib.contextmanager
def _one_process_quiet():
    """DCP in one process warns that it assumes one process: silenced (that is the intent)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to")
        yield


def _dcp_load(tensors: dict, directory) -> None:
    """``dcp.load`` in place into ``tensors`` (this process's layout) from a :func:`save_sharded` directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    with _one_process_quiet():
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(directory)), no_dist=not is_initialized())


def save_sharded(tensors: dict, directory) -> None:
    """``dcp.save`` of a nested dict of tensors (DTensor shards included) into ``directory`` as safetensors files,
    one per rank, each holding the rank's shards and their offsets (a JSON header: nothing is pickled); replicated
    tensors are written once. A collective under a process group; works in one process too."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    with _one_process_quiet():
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(directory), save_distributed=True),
                 no_dist=not is_initialized())


def load_sharded(module: torch.nn.Module, optimizer: torch.optim.Optimizer, directory, param_groups: list[dict],
                 extra: dict | None = None) -> None:
    """Load a :func:`save_sharded` checkpoint of :func:`sharded_state` (plus ``extra``, a nested dict of tensors
    loaded in place, e.g. the EMA) into ``module`` and ``optimizer`` as this process lays them out: FSDP2 shards of
    any world size or plain tensors in one process (DCP reads the parts of the saved shards each local tensor
    covers), then ``set_state_dict``. A collective under a process group."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    tensors, _ = sharded_state(module, optimizer)  # the layout to fill (initialises the optimizer's state)
    if extra:
        tensors.update(extra)
    _dcp_load(tensors, directory)
    groups = [dict(g) for g in param_groups]
    for g in groups:  # JSON turned tuples (betas) into lists
        g.update({k: tuple(v) for k, v in g.items() if isinstance(v, list) and k != "params"})
    # strict=False: frozen weights (a LoRA run's base model) are not in the checkpoint; every trainable one is
    # (dcp.load above raises on a key the checkpoint lacks)
    set_state_dict(module, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optim"], "param_groups": groups},
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def load_sharded_model(module: torch.nn.Module, directory) -> None:
    """The weights alone of a :func:`save_sharded` checkpoint into ``module`` (e.g. for an export: no optimizer is
    built): ``dcp.load`` of the ``model`` entries into this process's layout, then ``set_model_state_dict``."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    opts = StateDictOptions(ignore_frozen_params=True)
    tensors = {"model": _untied(get_model_state_dict(module, options=opts))}
    _dcp_load(tensors, directory)
    set_model_state_dict(module, tensors["model"], options=StateDictOptions(ignore_frozen_params=True, strict=False))


def gather_groups(rewards: torch.Tensor, group_ids: torch.Tensor, *,
                  spread: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's rewards (B,) and group ids (B,) → (W·B,) each, in rank order, for group statistics over whole
    groups. Local layout (``spread`` False): each rank's ids are made unique by offsetting them by rank·B; spread:
    a group's ids are the same on every rank already. Identity at world size 1."""
    if not is_initialized() or dist.get_world_size() == 1:
        return rewards, group_ids
    offset = 0 if spread else dist.get_rank() * len(group_ids)
    return all_gather(rewards.float()), all_gather(group_ids + offset)


def rank_rows(group_ids: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rows of this rank's share of every group (the spread layout): rank r keeps members r·m/W … (r+1)·m/W−1
    of each group of m samples (groups in order of first appearance). → (B/W,) long."""
    rows = []
    for g in dict.fromkeys(group_ids.tolist()):
        members = (group_ids == g).nonzero().flatten()
        if len(members) % world:
            raise ValueError(f"group {g} has {len(members)} samples, not a multiple of the world size {world}")
        m = len(members) // world
        rows.append(members[rank * m:(rank + 1) * m])
    return torch.cat(rows)


__all__ = ["COUNTERS", "WorldInfo", "info", "init_from_env", "shutdown", "launched_world_size", "launched_local_rank",
           "resolve_mode", "resolve_device", "all_gather", "gather_groups", "rank_rows",
           "all_gather_object", "all_reduce_mean_",
           "add_mean_grad_", "all_reduce_sum", "no_sync", "reshard", "sharded", "wrap", "wrap_ddp", "wrap_fsdp2", "fully_shard_each",
           "transformer_blocks", "to_full", "full_model_state", "seed_for", "is_initialized", "sharded_state", "save_sharded",
           "load_sharded", "load_sharded_model"]
