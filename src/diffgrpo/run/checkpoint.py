"""Crash-safe checkpoints: a run killed at any point resumes from the last complete checkpoint.

Layout under ``<run_dir>/checkpoints/``:
  iter_000012/            one directory per checkpoint, written to a temporary directory and renamed into place
    trainable.safetensors policy's trainable weights
    ema.safetensors       EMA of the trainable weights (when enabled); reference, family.safetensors alike
    optimizer.pt          optimizer state (tensors and plain containers only: loads with weights_only=True)
    rng.pt                RNG states of every generator in use (same)
    lora/                 LoRA runs: the adapter in diffusers format (written by the policy; load_lora_weights)
    state.json            iteration counter, resolved config, every file's size and SHA-256 under its path
                          relative to the checkpoint directory, subdirectories included (checked on load)
  latest.json             manifest naming the newest complete checkpoint, replaced atomically

Sharded checkpoints (``state.json`` says ``"format": "dcp"``; written by every rank at once, see
:func:`save_sharded_checkpoint`) hold instead of ``trainable.safetensors`` / ``ema.safetensors`` / ``optimizer.pt``:
    dcp/                  ``torch.distributed.checkpoint`` files: one safetensors file per rank with that rank's
                          shards of the weights, the optimizer state and the EMA (a JSON header records each
                          shard's offsets, so any number of processes can load them: DCP reshards)
    trainer.json          the optimizer's param_groups and the learning-rate schedule's state
  Every file DCP writes is checksummed in ``state.json`` like the others.

Nothing is ever unpickled beyond tensors and plain containers (``torch.load(weights_only=True)``).
A checkpoint directory whose files do not match its ``state.json`` (truncated mid-write, or damaged at the same
size) is skipped and the previous one is used. Every file is written into a fresh temporary directory that is
renamed into place, so a symlink planted in the run directory is never written through.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.api import CheckpointException

from .. import distributed
from ..config import RunConfig
from ..errors import TrainingError
from ..fileio import atomic_write, check_below, share_tree, temp_dir

_DIR_RE = re.compile(r"^iter_(\d{6,})$")


@dataclass
class RunState:
    """Everything a run continues from bit for bit: one checkpoint's content, and what ``Trainer.state`` captures.

    ``rng``: torch's global stream and the family's streams (``{"torch", "family"}``; the family's include its
    prompt sampler's position), with every rank's under ``"per_rank"`` when several ranks saved. ``optimizer``: the
    optimizer's state with the learning-rate schedule's under ``"lr_scheduler"``. ``extra``: ``bad_updates`` and,
    under fp16, the loss scaler (``grad_scaler``). A sharded (DCP) checkpoint holds no tensors here: ``sharded``
    names its ``dcp/`` directory and ``trainer_state`` the optimizer's param groups and the schedule."""

    iteration: int
    rng: dict
    trainable: dict[str, torch.Tensor] | None = None
    optimizer: dict | None = None
    ema: dict[str, torch.Tensor] | None = None
    extra: dict = field(default_factory=dict)
    config: dict = field(default_factory=dict)
    sharded: Path | None = None
    trainer_state: dict | None = None
    reference: dict[str, torch.Tensor] | None = None  # GARDO's adaptive KL reference (diversity.gardo_ref_every)
    family: dict[str, torch.Tensor] | None = None  # the family's own tensors (family.extra_state: a value network)


def sha256(path: Path) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_checkpoint(run_dir: Path, iteration: int, *, trainable: dict[str, torch.Tensor], optimizer: dict,
                    rng: dict[str, torch.Tensor], config: dict, ema: dict[str, torch.Tensor] | None = None,
                    extra: dict | None = None, keep_last: int = 2, write_files: Callable[[Path], None] | None = None,
                    reference: dict[str, torch.Tensor] | None = None, family: dict | None = None) -> Path:
    """Write checkpoint ``iteration`` atomically, update the manifest, prune to the newest ``keep_last``.
    ``write_files(directory)`` adds files of its own (e.g. the policy's ``lora/``) to the checkpoint before it is
    checksummed and renamed into place."""
    root = Path(run_dir) / "checkpoints"
    check_below(root / "latest.json")  # a planted checkpoints/ link: refused, never written into or pruned
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = temp_dir(f".tmp_iter_{iteration:06d}.", root)
    try:
        for name, part in (("trainable", trainable), ("ema", ema), ("reference", reference), ("family", family)):
            if part is not None:  # the EMA, GARDO's reference, the family's tensors: when the run keeps them
                save_file({k: v.detach().contiguous().cpu() for k, v in part.items()}, str(tmp / f"{name}.safetensors"))
        torch.save(optimizer, tmp / "optimizer.pt")
        torch.save(rng, tmp / "rng.pt")
        if write_files is not None:
            write_files(tmp)
        _seal(tmp, {"iteration": iteration, "config": config, "extra": extra or {}})
    except Exception as e:  # a full disk or a file-size limit: the earlier checkpoints stay as they were
        shutil.rmtree(tmp, ignore_errors=True)
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TrainingError(f"cannot write checkpoint {iteration} into {root} ({msg}); the earlier checkpoints "
                            "are intact: free space and resume the run") from None
    return _publish(run_dir, tmp, final, iteration, keep_last)


def _publish(run_dir: Path, tmp: Path, final: Path, iteration: int, keep_last: int) -> Path:
    """Rename the sealed temporary directory into place, point the manifest at it, prune to ``keep_last``."""
    root = final.parent
    check_below(final / "state.json")
    if final.is_symlink():
        final.unlink()
    elif final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    atomic_write(root / "latest.json", json.dumps({"latest": final.name, "iteration": iteration}))
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _seal(tmp: Path, state: dict) -> None:
    """fsync every file of ``tmp``, then write ``state.json`` with each file's size and SHA-256."""
    share_tree(tmp)  # the umask's modes (safetensors writes 0600)
    paths = sorted(p for p in tmp.rglob("*") if p.is_file() and not p.is_symlink())
    for p in paths:  # flush file contents before the rename makes the checkpoint visible
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    files = {p.relative_to(tmp).as_posix(): {"size": p.stat().st_size, "sha256": sha256(p)} for p in paths}
    atomic_write(tmp / "state.json", json.dumps({**state, "files": files}, indent=1))


def save_sharded_checkpoint(run_dir: Path, iteration: int, *, write_shards: Callable[[Path], None],
                            trainer_state: dict, rng: dict[str, torch.Tensor], config: dict, extra: dict | None = None,
                            keep_last: int = 2, write_files: Callable[[Path], None] | None = None) -> Path:
    """A sharded checkpoint, written by every rank (a collective; also fine in one process): rank 0 makes the
    temporary directory and shares its name, every rank runs ``write_shards(<tmp>/dcp)`` (``dcp.save`` of its own
    shards), then rank 0 adds ``trainer.json`` (``trainer_state``: JSON-able), ``rng.pt``, ``write_files``' files,
    checksums every file, writes ``state.json`` and renames the directory into place as :func:`save_checkpoint`
    does. Needs a file system every rank sees. A failure on any rank raises TrainingError on every rank and leaves
    the earlier checkpoints intact."""
    lead = distributed.info().rank == 0
    root = Path(run_dir) / "checkpoints"
    final = root / f"iter_{iteration:06d}"
    tmp, error = None, None
    if lead:
        try:
            check_below(root / "latest.json")
            root.mkdir(parents=True, exist_ok=True)
            tmp = temp_dir(f".tmp_iter_{iteration:06d}.", root)
        except (OSError, TrainingError) as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
    tmp, error = distributed.all_gather_object((tmp, error))[0]
    if error is None:
        try:
            write_shards(tmp / "dcp")  # collective: DCP itself reports a failure on any rank to every rank
        except Exception as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
    if error is None and lead:
        try:
            atomic_write(tmp / "trainer.json", json.dumps(trainer_state))
            torch.save(rng, tmp / "rng.pt")
            if write_files is not None:
                write_files(tmp)
            _seal(tmp, {"iteration": iteration, "format": "dcp", "config": config, "extra": extra or {}})
        except Exception as e:
            error = str(e).splitlines()[0] if str(e) else type(e).__name__
    error = next((e for e in distributed.all_gather_object(error) if e is not None), None)
    if error is not None:
        if lead and tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise TrainingError(f"cannot write checkpoint {iteration} into {root} ({error}); the earlier checkpoints "
                            "are intact: free space and resume the run")
    out = _publish(run_dir, tmp, final, iteration, keep_last) if lead else final
    distributed.all_gather_object(None)  # no rank goes on (e.g. to read it) before it is in place
    return out


def states_equal(a, b) -> bool:
    """Equality of two RNG states (tensors, or plain containers of them)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(states_equal(x, y) for x, y in zip(a, b))
    return a == b


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not) in iteration order."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _DIR_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_complete(ckpt: Path) -> bool:
    """True when ``state.json`` parses and every file it lists exists with the recorded size and SHA-256
    (checkpoints of earlier versions record sizes only)."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        for name, rec in state["files"].items():
            parts = Path(name).parts  # a path relative to the checkpoint (flat names in earlier versions)
            if not parts or Path(name).is_absolute() or any(q in ("..", ".") for q in parts):
                return False
            f = ckpt / name
            if any((ckpt.joinpath(*parts[:i])).is_symlink() for i in range(1, len(parts) + 1)) or not f.is_file():
                return False
            size, digest = (rec, None) if isinstance(rec, int) else (rec["size"], rec["sha256"])
            if f.stat().st_size != size or (digest is not None and sha256(f) != digest):
                return False
        return True
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_complete(run_dir: Path, log=print) -> Path | None:
    """The newest complete checkpoint; incomplete newer ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if is_complete(ckpt):
            return ckpt
        log(f"warning: checkpoint {ckpt} is incomplete or damaged (its files do not match state.json); "
            "using an earlier one")
    return None


def load_checkpoint(ckpt: Path) -> RunState:
    """The :class:`RunState` of checkpoint ``ckpt``; safe loading only. A sharded checkpoint gives ``sharded``: its
    ``dcp/`` directory, and ``trainer_state`` (``trainer.json``) instead of the tensors (``trainable``,
    ``optimizer``, ``ema`` None): they are loaded into the live model and optimizer by ``distributed.load_sharded``,
    laid out for however many processes load them."""
    state = json.loads((ckpt / "state.json").read_text())
    common = {"iteration": int(state["iteration"]), "config": state["config"], "extra": state.get("extra", {}),
              "rng": torch.load(ckpt / "rng.pt", weights_only=True)}
    if state.get("format") == "dcp":
        return RunState(**common, sharded=ckpt / "dcp",
                        trainer_state=json.loads((ckpt / "trainer.json").read_text()))
    optional = {k: load_file(str(ckpt / f"{k}.safetensors")) if (ckpt / f"{k}.safetensors").is_file() else None
                for k in ("ema", "reference", "family")}  # the EMA, GARDO's reference, the family's: when kept
    return RunState(**common, trainable=load_file(str(ckpt / "trainable.safetensors")), **optional,
                    optimizer=torch.load(ckpt / "optimizer.pt", weights_only=True))


# ---------------------------------------------------------------------- a trainer's run state
def sharded_format(cfg: RunConfig, dist_mode: str) -> bool:
    """Whether checkpoints are DCP-sharded (``train.checkpoint_format``; auto: under dist.mode=fsdp2)."""
    fmt = cfg.train.checkpoint_format
    return fmt == "dcp" or (fmt == "auto" and dist_mode == "fsdp2")


def rng_state(trainer) -> dict:
    """torch's and the family's RNG states; with several ranks also every rank's (a collective)."""
    rng = {"torch": torch.get_rng_state(), "family": trainer.family.rng_state()}
    if trainer.world.world_size > 1:  # a collective: every rank's streams, restored per rank on resume
        rng["per_rank"] = distributed.all_gather_object(rng)
    return rng


def capture(trainer) -> RunState:
    """The trainer's full state as full tensors (FSDP2 shards are gathered: a collective)."""
    extra = {"bad_updates": trainer.bad_updates,  # fp16: the loss scale and its growth tracker (json)
             **({"grad_scaler": trainer.grad_scaler.state_dict()} if trainer.grad_scaler is not None else {})}
    ref = None
    if getattr(trainer, "adaptive_ref", None) is not None:
        ref, extra["reference"] = trainer.adaptive_ref.state(trainer.policy)
    rng = rng_state(trainer)
    full = distributed.to_full({
        "trainable": dict(trainer.policy.state_dict()),
        "optimizer": {**trainer.optimizer.state_dict(), "lr_scheduler": trainer.scheduler.state_dict()},
        "ema": trainer.ema.state_dict() if trainer.ema is not None else None, "rng": rng})
    return RunState(iteration=trainer.iteration, extra=extra, config=trainer.cfg.to_dict(), reference=ref, **full,
                    family=trainer.family.extra_state())


def save(trainer, run_dir: Path) -> Path:
    """Write the trainer's checkpoint into ``run_dir`` (rank 0 writes files; every rank writes its DCP shards)."""
    if sharded_format(trainer.cfg, trainer.dist_mode):
        return _save_sharded(trainer, run_dir)
    st = capture(trainer)  # on every rank (collectives); rank 0 writes
    if trainer.world.rank > 0:
        return run_dir
    return save_checkpoint(run_dir, st.iteration, trainable=st.trainable, optimizer=st.optimizer, rng=st.rng,
                           config=st.config, ema=st.ema, extra=st.extra, keep_last=trainer.cfg.train.keep_checkpoints,
                           write_files=lambda d: trainer.policy.save_checkpoint_files(d, st.trainable),
                           reference=st.reference, family=st.family)


def _save_sharded(trainer, run_dir: Path) -> Path:
    """Every rank writes its own shards of the weights, the optimizer state and the EMA (``dcp.save``): no rank
    gathers them. Only a LoRA adapter (small) is gathered, for the checkpoint's diffusers-format ``lora/``."""
    tensors, groups = distributed.sharded_state(trainer.family.network(), trainer.optimizer)
    if trainer.ema is not None:
        tensors["ema"] = dict(trainer.ema.shadow)
    rng = rng_state(trainer)
    adapter = distributed.to_full(trainer.policy.state_dict()) if trainer.cfg.model.lora_rank > 0 else None
    return save_sharded_checkpoint(
        run_dir, trainer.iteration, write_shards=lambda d: distributed.save_sharded(tensors, d),
        trainer_state={"param_groups": groups, "lr_scheduler": trainer.scheduler.state_dict(),
                       "ema": trainer.ema is not None},
        rng=rng, config=trainer.cfg.to_dict(), extra={"bad_updates": trainer.bad_updates},
        keep_last=trainer.cfg.train.keep_checkpoints,
        write_files=None if adapter is None else (lambda d: trainer.policy.save_checkpoint_files(d, adapter)))


def restore(trainer, st: RunState) -> None:
    """Load ``st`` into the trainer: weights, optimizer, schedule, EMA, every RNG stream, counters, scaler."""
    if st.sharded is not None:  # DCP: into this process's layout, whatever the saving world size was
        sched = _load_sharded(trainer, st)
    else:
        if trainer.dist_mode == "fsdp2" and trainer.world.world_size > 1:
            raise TrainingError("this checkpoint holds full tensors (train.checkpoint_format=files), which "
                                "dist.mode=fsdp2 cannot load; resume it with dist.mode=ddp or in one process")
        opt = dict(st.optimizer)
        sched = opt.pop("lr_scheduler", None)
        try:  # another model size or LoRA layout: one line, not the state dicts' key lists
            trainer.policy.load_state_dict(st.trainable)
            trainer.optimizer.load_state_dict(opt)
        except (KeyError, ValueError, RuntimeError) as e:
            msg = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TrainingError(f"cannot load checkpoint {st.iteration} into this run (a different model or "
                                f"trainable set?): {msg[:200]}") from None
    if sched is not None:
        trainer.scheduler.load_state_dict(sched)
    else:  # checkpoints before schedules: every update so far ran at a constant lr
        trainer.scheduler.last_epoch = int(st.iteration) * trainer.cfg.train.num_inner_epochs
    if trainer.ema is not None and st.sharded is None:
        if st.ema is None:
            raise TrainingError("checkpoint has no EMA state but train.ema_decay > 0")
        trainer.ema.load_state_dict(st.ema)
    rng, world = st.rng, trainer.world
    if len(rng.get("per_rank", [])) == world.world_size:
        rng = rng["per_rank"][world.rank]
    elif world.world_size > 1 and "family" in rng:  # resharded onto another number of ranks
        rng = _resharded_rng(trainer, rng)
    # earlier versions kept the flow streams at the top level, and the dLLM's own under "family"
    trainer.family.set_rng_state({**{k: v for k, v in rng.items() if k not in ("torch", "family", "per_rank")},
                                  **rng.get("family", {})})
    torch.set_rng_state(rng["torch"])
    trainer.iteration = int(st.iteration)
    trainer.bad_updates = int(st.extra.get("bad_updates", 0))
    if trainer.grad_scaler is not None and "grad_scaler" in st.extra:
        trainer.grad_scaler.load_state_dict(st.extra["grad_scaler"])
    trainer.family.load_extra_state(st.family)  # e.g. a value network
    if getattr(trainer, "adaptive_ref", None) is not None and st.reference is not None:
        trainer.adaptive_ref.load(trainer.policy, st.reference, st.extra.get("reference", {}))


def _load_sharded(trainer, st: RunState) -> dict | None:
    """Weights, optimizer state and EMA of a sharded checkpoint (a collective). → the schedule's state."""
    ts = st.trainer_state
    if trainer.ema is not None and not ts.get("ema"):
        raise TrainingError("checkpoint has no EMA state but train.ema_decay > 0")
    extra = {"ema": dict(trainer.ema.shadow)} if trainer.ema is not None else None  # loaded in place
    try:
        distributed.load_sharded(trainer.family.network(), trainer.optimizer, st.sharded, ts["param_groups"], extra)
    except (KeyError, ValueError, RuntimeError, CheckpointException) as e:
        raise TrainingError(f"cannot load the sharded checkpoint {st.sharded.parent} into this run (a "
                            f"different model or trainable set?): {str(e).splitlines()[0] if str(e) else e!r}"
                            ) from None
    return ts.get("lr_scheduler")


def _resharded_rng(trainer, rng: dict) -> dict:
    """This rank's streams when the checkpoint was written by another number of ranks (a collective). A stream
    the fresh trainers seeded alike on every rank (e.g. a group's shared noise, torch's global state) is
    shared: every rank continues saved rank 0's. A stream seeded per rank (e.g. sampling noise) continues
    saved rank r's on rank r, and stays freshly seeded (``seed_for``) on a rank the saving run did not have,
    so the ranks never draw the same noise."""
    saved = rng.get("per_rank") or [rng]
    mine = {"torch": torch.get_rng_state(), "family": trainer.family.rng_state()}
    fresh = distributed.all_gather_object(mine)
    r = trainer.world.rank

    def pick(now, get):
        if all(states_equal(get(f), now) for f in fresh):  # seeded alike on every rank: shared
            return get(saved[0])
        return get(saved[r]) if r < len(saved) else now

    family = {k: pick(v, lambda d, k=k: d["family"][k]) if all(k in d["family"] for d in saved) else v
              for k, v in mine["family"].items()}
    return {"torch": pick(mine["torch"], lambda d: d["torch"]), "family": family}


def set_base_lr(optimizer: torch.optim.Optimizer, scheduler, lr: float) -> None:
    """Make ``lr`` the schedule's base learning rate, at the schedule's current update (a resume may change it)."""
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    for group, fn in zip(optimizer.param_groups, scheduler.lr_lambdas):
        group["initial_lr"] = lr
        group["lr"] = lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


__all__ = ["RunState", "capture", "is_complete", "latest_complete", "list_checkpoints", "load_checkpoint", "restore",
           "save", "save_checkpoint", "save_sharded_checkpoint", "set_base_lr", "sha256", "states_equal"]
