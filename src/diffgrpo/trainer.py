"""The GRPO training loop, one iteration top to bottom (``Trainer.step``):

    collect   the family plans, samples, decodes, scores and weights a batch (``Family.collect``; an engine may
              already accumulate the first update's gradient while sampling, e.g. Retain's waves)
    update    ``train.num_inner_epochs`` times: zero ``.grad`` → ``Family.backward`` (its engine / likelihood
              method fills ``.grad``) → non-finite guard → clip → optimizer step → EMA
    log       TRL-style metrics and the engine's counters

The loop knows nothing of pixels or tokens: a *family* (``family.Family``; ``FAMILIES`` below) owns everything
model-specific, and every family is driven the same way. ``Trainer.rollout()`` runs a family's rollout,
``Trainer.backward(rollout)`` fills ``.grad`` (no optimizer step), ``Trainer.step()`` runs one iteration,
``Trainer.train()`` runs the whole job with evaluation, logging, checkpoints and outputs.
"""
from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from safetensors.torch import save_file
from torch.distributed.checkpoint.api import CheckpointException
from tqdm.auto import tqdm

from . import distributed, guards
from .checkpoint import latest_complete, load_checkpoint, save_checkpoint, save_sharded_checkpoint, states_equal
from .config import MODEL_FAMILIES, RunConfig, validate
from .dllm.family import DLLMFamily
from .ema import EMA
from .errors import ConfigError, TrainingError
from .family import Family, Sync
from .fileio import atomic_write
from .flow.family import FlowFamily
from .media import SampleTable, caption_of, side_by_side
from .models import POLICIES
from .runlog import MetricsWriter, plot_curves, read_metrics, save_grid
from .types import EngineStats, Rollout

FAMILIES: dict[str, type] = {"flow": FlowFamily, "dllm": DLLMFamily}  # config.MODEL_FAMILIES maps model.name here


class Trainer:
    def __init__(self, cfg: RunConfig | None = None, *, policy=None, log=print):
        self.cfg = cfg = cfg or RunConfig()
        validate(cfg)  # also for configs built in Python rather than read by RunConfig.from_overrides
        self.log = log
        if cfg.model.cache_dir:
            os.environ["DIFFGRPO_CACHE"] = cfg.model.cache_dir
        # data parallel (torchrun): process group before the model (sets the CUDA device); rank > 0 is silent.
        # dist.mode=auto is ddp when a launcher started several processes (validate refused none there)
        self.dist_mode = distributed.resolve_mode(cfg.dist.mode, max(distributed.launched_world_size(),
                                                                     distributed.info().world_size))
        self.world = (distributed.init_from_env(cfg.dist.backend or None, cfg.dist.timeout)
                      if self.dist_mode != "none" else distributed.WorldInfo(0, 1, 0))
        if self.world.rank > 0:
            self.log = log = _silent
        # model.device=auto → this rank's accelerator (or cpu), resolved once: the policy factories and the saved
        # config see the device the run uses
        cfg.model.device = distributed.resolve_device(
            cfg.model.device, self.world.local_rank if self.world.world_size > 1 else None)
        family_cls = FAMILIES[MODEL_FAMILIES[cfg.model.name]]
        check_world(cfg, self.world)
        family_cls.check_world(cfg, self.world)
        torch.manual_seed(cfg.seed)
        self.policy = policy if policy is not None else POLICIES[cfg.model.name](
            cfg, progress=cfg.log.progress and self.world.rank == 0, log=log)
        self.device = torch.device(self.policy.device)
        self.family: Family = family_cls(cfg, self.policy, self.world, log=lambda *a: self.log(*a))
        self.dp_module = None  # the DDP / FSDP2 wrapper the policy's forwards go through (None in one process)
        if self.world.world_size > 1:  # FSDP2 shards in place: build the optimizer after
            self.dp_module = (distributed.wrap_fsdp2(  # mixed precision / CPU offload: dist.fsdp_*
                self.family.network(), param_dtype=cfg.dist.fsdp_param_dtype,
                cpu_offload=cfg.dist.fsdp_cpu_offload) if self.dist_mode == "fsdp2"
                else distributed.wrap(self.family.network(), self.dist_mode))
            self.policy.forward_module = self.dp_module
        self.params = list(self.policy.trainable_parameters())
        t = cfg.train
        self.optimizer = torch.optim.AdamW(self.params, lr=t.lr, weight_decay=t.weight_decay,
                                           betas=(t.adam_beta1, t.adam_beta2))
        # stepped once per optimizer update; spans num_iterations × num_inner_epochs updates
        total, warmup = t.num_iterations * t.num_inner_epochs, t.warmup_iterations * t.num_inner_epochs
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda u: lr_factor(u, t.lr_schedule, warmup, total))
        sync = Sync(params=self.params)
        if self.dp_module is not None:  # gradient sync only on an engine's last backward; Σ over ranks
            sync.no_sync = lambda: distributed.no_sync(self.dp_module)
            sync.all_reduce = distributed.all_reduce_sum
        self.family.connect(sync)
        self.ema = EMA(self.policy.named_trainable_parameters(), t.ema_decay) if t.ema_decay > 0 else None
        # fp16: a loss scaler; the flow policy scales the gradient at the transformer's output (every engine)
        self.grad_scaler = torch.amp.GradScaler(self.device.type) if cfg.model.mixed_precision == "fp16" else None
        if self.grad_scaler is not None:
            self.policy.grad_scaler = self.grad_scaler
        self.iteration = 0
        self.bad_updates = 0  # consecutive skipped updates (non-finite gradient, or nothing to train)
        self._stop_signal = None
        self._saved_at = -1  # iteration of the last checkpoint written or loaded
        self.watch = guards.Watch(t, log=lambda *a: self.log(*a))  # train.on_hacking, train.keep_best

    # ------------------------------------------------------------------ one iteration
    def rollout(self, prompts: list | None = None, group_ids: torch.Tensor | None = None) -> Rollout:
        """Sample, decode, score and weight one batch (a fresh training batch by default), in one piece."""
        return self.family.rollout(prompts, group_ids)

    def backward(self, rollout: Rollout, epoch: int = 0) -> EngineStats:
        """Zero the grads and let the family's engine fill ``.grad`` for this rollout (no optimizer step)."""
        self.optimizer.zero_grad(set_to_none=True)
        return self.family.backward(rollout, epoch)

    def update(self, rollout: Rollout, first_stats: EngineStats | None = None) -> tuple[EngineStats, dict[str, float]]:
        """``num_inner_epochs`` optimizer updates on one rollout. Returns the merged stats and update metrics.

        ``first_stats``: the first update's gradient is already in ``.grad`` (rollout waves) with these stats.
        An update is skipped when its gradient is not finite, and so is the rollout when no rank has a sample to
        train (every reward non-finite, or every group filtered out); ``train.max_bad_updates`` skipped updates
        in a row stop the run, and so do non-finite weights after an update (TrainingError)."""
        total = EngineStats()
        info = {"grad_norm": 0.0, "skipped_updates": 0, "learning_rate": self.optimizer.param_groups[0]["lr"]}
        trains = self._trains(rollout)
        for epoch in range(self.cfg.train.num_inner_epochs):
            stats = first_stats if (epoch == 0 and first_stats is not None) else self.backward(rollout, epoch)
            total.engine = stats.engine
            if self.grad_scaler is not None and trains:
                self.grad_scaler.unscale_(self.optimizer)  # before the norm and the clip
            norm = self._grad_norm()
            total.merge(stats)
            info["grad_norm"] = norm
            if epoch == 0:
                info.update({f"first_epoch/{k}": v for k, v in stats.metrics.items()})
            if trains and not math.isfinite(norm) and self._scaler_overflow(info):
                continue  # fp16 overflow: the scaler lowered the scale; not a bad update
            if not trains or not torch.isfinite(torch.tensor(norm)):
                why = ("no sample could be trained (every reward non-finite, or every group filtered out)"
                       if not trains else "non-finite loss/gradient")
                self._skip(why, info)
                if not trains:
                    break
                continue
            self.bad_updates = 0
            if self.cfg.train.max_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(self.params, self.cfg.train.max_grad_norm)
            if self.grad_scaler is not None:
                self.grad_scaler.step(self.optimizer)  # unscaled already; steps (the gradient is finite)
                self.grad_scaler.update()
                info["loss_scale"] = self.grad_scaler.get_scale()
            else:
                self.optimizer.step()
            self.scheduler.step()
            if not self._weights_finite():
                raise TrainingError(f"stopping: the weights are non-finite after the update of iteration "
                                    f"{self.iteration + 1} (train.lr={self.cfg.train.lr}); the last checkpoint holds "
                                    "the weights before it")
            if self.ema is not None:
                self.ema.update()
        return total, info

    def _scaler_overflow(self, info: dict) -> bool:
        """fp16: a non-finite gradient is an overflow of the loss scale while the scale is still >= 1: the scaler
        halves it, the update is skipped and it does not count as a bad update. Below 1 the gradient is non-finite
        by itself, and the update counts as bad (False)."""
        if self.grad_scaler is None:
            return False
        self.grad_scaler.update()  # found inf in unscale_: scale × backoff
        scale = self.grad_scaler.get_scale()
        info["loss_scale"] = scale
        if scale < 1.0:
            return False
        info["skipped_updates"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        self.log(f"fp16: gradient overflow at iteration {self.iteration + 1}; update skipped, loss scale now {scale:g}")
        return True

    def _skip(self, why: str, info: dict) -> None:
        """Count a skipped update; ``train.max_bad_updates`` in a row stop the run."""
        self.bad_updates += 1
        info["skipped_updates"] += 1
        self.optimizer.zero_grad(set_to_none=True)
        limit = self.cfg.train.max_bad_updates
        self.log(f"warning: update skipped at iteration {self.iteration + 1}: {why} ({self.bad_updates} in a row, "
                 f"limit train.max_bad_updates={limit})")
        if self.bad_updates >= limit:
            raise TrainingError(f"stopping: {self.bad_updates} consecutive updates were skipped ({why}; "
                                f"train.max_bad_updates={limit})")

    @staticmethod
    def _trains(rollout: Rollout) -> bool:
        """Whether some rank has a finite reward and a unit to train in this rollout (the same on every rank)."""
        return bool(torch.isfinite(rollout.batch_rewards).any()) and rollout.advantage_stats["trained_units"] > 0

    def _grad_norm(self) -> float:
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:  # sharded DTensor grads
            norms = [distributed.to_full(p.grad.detach().norm()) for p in self.params if p.grad is not None]
            return float(torch.stack(norms).norm()) if norms else 0.0
        grads = [p.grad.detach().flatten() for p in self.params if p.grad is not None]
        return float(torch.cat(grads).norm()) if grads else 0.0

    def step(self) -> dict[str, float]:
        """One GRPO iteration: collect a batch, ``num_inner_epochs`` updates, metrics (TRL-style names)."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)  # an engine may accumulate the first update while sampling
        ro, first = self.family.collect()
        stats, info = self.update(ro, first_stats=first)
        self.iteration += 1
        r = ro.batch_rewards[torch.isfinite(ro.batch_rewards)]  # every rank's rewards when data parallel
        return {"iteration": self.iteration, "reward": float(r.mean()) if len(r) else float("nan"),
                "reward_std": float(r.std()) if len(r) > 1 else 0.0,
                **{f"rewards/{n}/{s}": x for n, v in ro.reward_components.items() for s, x in _mean_std(v).items()},
                **({"loss": info["first_epoch/loss"]} if "first_epoch/loss" in info else {}),
                "frac_reward_zero_std": ro.advantage_stats["frac_reward_zero_std"],
                "adv_clip_frac": ro.advantage_stats["adv_clip_frac"],
                "kl": stats.metrics.get("kl", 0.0), "clip_ratio": stats.metrics.get("clip_ratio", 0.0),
                "ratio_mean": stats.metrics.get("ratio_mean", 1.0), **info,
                "forwards_grad": stats.forwards_grad, "forwards_nograd": stats.forwards_nograd,
                "sample_backwards": stats.sample_backwards, "peak_memory_bytes": stats.peak_memory_bytes,
                "time/rollout": ro.timings["rollout"], "time/sample": ro.timings["sample"],
                "time/reward": ro.timings["reward"], "time/train": stats.seconds.get("train", 0.0),
                "time/iteration": time.perf_counter() - t0}

    def evaluate(self, table=None) -> tuple[dict[str, float], torch.Tensor | None]:
        """Held-out evaluation by the family, with the EMA weights when ``train.ema_decay`` > 0; ``table`` (a
        ``media.SampleTable``, rank 0) receives one row per sample."""
        if self.ema is None:
            return self.family.evaluate(table)
        with self.ema.swapped_in():
            return self.family.evaluate(table)

    # ------------------------------------------------------------------ checkpoints and the whole job
    def run_dir(self) -> Path:
        """The run directory; by default a new ``runs/<timestamp>`` (made exclusively, so runs started in the same
        second get distinct directories: ``-2``, ``-3``, …), rank 0's for every rank."""
        if not self.cfg.log.output_dir:
            name = None
            if self.world.rank == 0:
                stamp = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
                stamp.parent.mkdir(parents=True, exist_ok=True)
                for n in range(1, 1000):
                    cand = stamp if n == 1 else stamp.with_name(f"{stamp.name}-{n}")
                    try:
                        cand.mkdir()
                        name = str(cand)
                        break
                    except FileExistsError:
                        continue
            self.cfg.log.output_dir = distributed.all_gather_object(name)[0]
        p = Path(self.cfg.log.output_dir)
        if self.world.rank == 0:
            try:
                p.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise ConfigError(f"log.output_dir: cannot create {str(p)!r} ({e.strerror})") from None
        return p

    # ------------------------------------------------------------------ checkpoints
    def state(self) -> dict:
        """Everything needed to continue bit-for-bit: weights, optimizer, EMA, RNG states, counters."""
        rng = self._rng_state()
        return distributed.to_full({  # FSDP2 shards → full tensors (a collective; identity otherwise)
            "trainable": dict(self.policy.state_dict()),
            "optimizer": {**self.optimizer.state_dict(), "lr_scheduler": self.scheduler.state_dict()},
            "ema": self.ema.state_dict() if self.ema is not None else None,
            "rng": rng,
            "extra": {"bad_updates": self.bad_updates,  # fp16: the loss scale and its growth tracker (json)
                      **({"grad_scaler": self.grad_scaler.state_dict()} if self.grad_scaler is not None else {})},
        })

    def load_state(self, ck: dict) -> None:
        if ck.get("sharded") is not None:  # DCP: into this process's layout, whatever the saving world size was
            sched = self._load_sharded(ck)
        else:
            if self.dist_mode == "fsdp2" and self.world.world_size > 1:
                raise TrainingError("this checkpoint holds full tensors (train.checkpoint_format=files), which "
                                    "dist.mode=fsdp2 cannot load; resume it with dist.mode=ddp or in one process")
            self.policy.load_state_dict(ck["trainable"])
            opt = dict(ck["optimizer"])
            sched = opt.pop("lr_scheduler", None)
            self.optimizer.load_state_dict(opt)
        if sched is not None:
            self.scheduler.load_state_dict(sched)
        else:  # checkpoints before schedules: every update so far ran at a constant lr
            self.scheduler.last_epoch = int(ck["iteration"]) * self.cfg.train.num_inner_epochs
        if self.ema is not None and ck.get("sharded") is None:
            if ck.get("ema") is None:
                raise TrainingError("checkpoint has no EMA state but train.ema_decay > 0")
            self.ema.load_state_dict(ck["ema"])
        rng = ck["rng"]
        if len(rng.get("per_rank", [])) == self.world.world_size:
            rng = rng["per_rank"][self.world.rank]
        elif self.world.world_size > 1 and "family" in rng:  # resharded onto another number of ranks
            rng = self._resharded_rng(rng)
        # earlier versions kept the flow streams at the top level, and the dLLM's own under "family"
        self.family.set_rng_state({**{k: v for k, v in rng.items() if k not in ("torch", "family", "per_rank")},
                                   **rng.get("family", {})})
        torch.set_rng_state(rng["torch"])
        self.iteration = int(ck["iteration"])
        self.bad_updates = int(ck.get("extra", {}).get("bad_updates", 0))
        if self.grad_scaler is not None and "grad_scaler" in ck.get("extra", {}):
            self.grad_scaler.load_state_dict(ck["extra"]["grad_scaler"])

    def sharded_checkpoints(self) -> bool:
        """Whether checkpoints are DCP-sharded (``train.checkpoint_format``; auto: under dist.mode=fsdp2)."""
        fmt = self.cfg.train.checkpoint_format
        return fmt == "dcp" or (fmt == "auto" and self.dist_mode == "fsdp2")

    def _rng_state(self) -> dict:
        """torch's and the family's RNG states; with several ranks also every rank's (a collective)."""
        rng = {"torch": torch.get_rng_state(), "family": self.family.rng_state()}
        if self.world.world_size > 1:  # a collective: every rank's streams, restored per rank on resume
            rng["per_rank"] = distributed.all_gather_object(rng)
        return rng

    def _save_sharded(self) -> Path:
        """Every rank writes its own shards of the weights, the optimizer state and the EMA (``dcp.save``): no rank
        gathers them. Only a LoRA adapter (small) is gathered, for the checkpoint's diffusers-format ``lora/``."""
        tensors, groups = distributed.sharded_state(self.family.network(), self.optimizer)
        if self.ema is not None:
            tensors["ema"] = dict(self.ema.shadow)
        rng = self._rng_state()
        adapter = distributed.to_full(self.policy.state_dict()) if self.cfg.model.lora_rank > 0 else None
        out = self.run_dir()
        self._saved_at = self.iteration
        return save_sharded_checkpoint(
            out, self.iteration, write_shards=lambda d: distributed.save_sharded(tensors, d),
            trainer_state={"param_groups": groups, "lr_scheduler": self.scheduler.state_dict(),
                           "ema": self.ema is not None},
            rng=rng, config=self.cfg.to_dict(), extra={"bad_updates": self.bad_updates},
            keep_last=self.cfg.train.keep_checkpoints,
            write_files=None if adapter is None else (lambda d: self.policy.save_checkpoint_files(d, adapter)))

    def _load_sharded(self, ck: dict) -> dict | None:
        """Weights, optimizer state and EMA of a sharded checkpoint (a collective). → the schedule's state."""
        ts = ck["trainer_state"]
        if self.ema is not None and not ts.get("ema"):
            raise TrainingError("checkpoint has no EMA state but train.ema_decay > 0")
        extra = {"ema": dict(self.ema.shadow)} if self.ema is not None else None  # loaded in place
        try:
            distributed.load_sharded(self.family.network(), self.optimizer, ck["sharded"], ts["param_groups"], extra)
        except (KeyError, ValueError, RuntimeError, CheckpointException) as e:
            raise TrainingError(f"cannot load the sharded checkpoint {ck['sharded'].parent} into this run (a "
                                f"different model or trainable set?): {str(e).splitlines()[0] if str(e) else e!r}"
                                ) from None
        return ts.get("lr_scheduler")

    def _resharded_rng(self, rng: dict) -> dict:
        """This rank's streams when the checkpoint was written by another number of ranks (a collective). A stream
        the fresh trainers seeded alike on every rank (e.g. a group's shared noise, torch's global state) is
        shared: every rank continues saved rank 0's. A stream seeded per rank (e.g. sampling noise) continues
        saved rank r's on rank r, and stays freshly seeded (``seed_for``) on a rank the saving run did not have,
        so the ranks never draw the same noise."""
        saved = rng.get("per_rank") or [rng]
        mine = {"torch": torch.get_rng_state(), "family": self.family.rng_state()}
        fresh = distributed.all_gather_object(mine)
        r = self.world.rank

        def pick(now, get):
            if all(states_equal(get(f), now) for f in fresh):  # seeded alike on every rank: shared
                return get(saved[0])
            return get(saved[r]) if r < len(saved) else now

        family = {k: pick(v, lambda d, k=k: d["family"][k]) if all(k in d["family"] for d in saved) else v
                  for k, v in mine["family"].items()}
        return {"torch": pick(mine["torch"], lambda d: d["torch"]), "family": family}

    def save_checkpoint(self) -> Path:
        if self.sharded_checkpoints():
            return self._save_sharded()
        st = self.state()  # on every rank (collectives); rank 0 writes
        self._saved_at = self.iteration
        if self.world.rank > 0:
            return self.run_dir()
        return save_checkpoint(self.run_dir(), self.iteration, trainable=st["trainable"], optimizer=st["optimizer"],
                               rng=st["rng"], config=self.cfg.to_dict(), ema=st["ema"], extra=st["extra"],
                               keep_last=self.cfg.train.keep_checkpoints,
                               write_files=lambda d: self.policy.save_checkpoint_files(d, st["trainable"]))

    def _resume(self, out: Path) -> bool:
        """Load the newest complete checkpoint of ``out`` and drop metric rows written after it. Without one, the
        run restarts from iteration 0 (its earlier log is kept as ``metrics.restarted.jsonl``)."""
        ckpt = latest_complete(out, log=self.log)
        if ckpt is None:
            self.log(f"no complete checkpoint in {out}; restarting the run from iteration 0")
            if self.world.rank == 0 and (out / "metrics.jsonl").exists():
                os.replace(out / "metrics.jsonl", out / "metrics.restarted.jsonl")
            distributed.all_gather_object(None)  # the other ranks wait for the move
            return False
        self.load_state(load_checkpoint(ckpt))
        if not self._weights_finite():
            raise TrainingError(f"checkpoint {ckpt} holds non-finite weights; delete it to resume from an earlier one")
        # a resume may change the learning rate (the checkpoint holds the old one): it becomes the schedule's base lr
        self._set_base_lr(self.cfg.train.lr)
        self._saved_at = self.iteration
        rows = [r for r in read_metrics(out / "metrics.jsonl", log=self.log) if r.get("iteration", 0) <= self.iteration]
        if self.world.rank == 0:
            atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
        self.log(f"resumed from {ckpt} (iteration {self.iteration})")
        return True

    def _set_base_lr(self, lr: float) -> None:
        """Make ``lr`` the schedule's base learning rate, at the schedule's current update."""
        sch = self.scheduler
        sch.base_lrs = [lr] * len(self.optimizer.param_groups)
        for group, fn in zip(self.optimizer.param_groups, sch.lr_lambdas):
            group["initial_lr"] = lr
            group["lr"] = lr * fn(sch.last_epoch)
        sch._last_lr = [group["lr"] for group in self.optimizer.param_groups]

    def _weights_finite(self) -> bool:
        norms = [p.detach().float().norm() for p in self.params]
        if self.cfg.dist.mode == "fsdp2" and self.world.world_size > 1:  # sharded DTensors
            norms = [distributed.to_full(n) for n in norms]
        return bool(torch.isfinite(torch.stack(norms)).all()) if norms else True

    def _on_signal(self, signum, frame):
        if self._stop_signal is not None:  # second signal: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum
        self.log(f"received signal {signum}: finishing the current iteration, then saving a checkpoint")

    # ------------------------------------------------------------------ the whole job
    def train(self, resume: bool = False) -> dict[str, float]:
        """Run ``train.num_iterations`` iterations with evaluation, logging, checkpoints and outputs in the run
        directory, which is locked for the run's life (a second run or resume of it is refused). ``resume``:
        continue from the run directory's newest complete checkpoint. SIGINT/SIGTERM finish the current
        iteration, save a checkpoint and return (``summary["interrupted"]`` = the signal number)."""
        out = self.run_dir()
        lock = FileLock(str(out / ".lock"))
        if self.world.rank == 0:  # rank 0 holds it for the whole job
            try:
                lock.acquire(timeout=0)
            except Timeout:
                raise TrainingError(f"log.output_dir: {str(out)!r} is in use by another run (its lock file "
                                    f"{out / '.lock'} is held); wait for it to end or choose another directory") from None
            except OSError as e:  # e.g. a symlink planted at .lock: never followed
                raise TrainingError(f"log.output_dir: cannot lock {str(out / '.lock')!r} ({e.strerror})") from None
        try:
            return self._train(out, resume)
        finally:
            if lock.is_locked:
                lock.release()

    def _train(self, out: Path, resume: bool) -> dict[str, float]:
        cfg = self.cfg
        resumed = self._resume(out) if resume else False
        lead = self.world.rank == 0  # only rank 0 writes files; every rank trains and evaluates
        if not resumed:
            if distributed.all_gather_object((out / "metrics.jsonl").exists())[0]:
                raise TrainingError(f"log.output_dir: {str(out)!r} already holds a run; resume it with "
                                    "--resume or choose another directory")
            if lead:
                atomic_write(out / "config.yaml", cfg.to_yaml())
        elif lead:  # the resumed run's config, with the overrides it was resumed with
            atomic_write(out / "config.yaml", cfg.to_yaml())
        writer = (MetricsWriter(out, tensorboard=cfg.log.tensorboard, wandb=cfg.log.wandb, config=cfg.to_dict())
                  if lead else _NullWriter())
        self.log(f"run directory: {out}")
        with writer:  # closed once, after the end evaluation, or on a signal or an error
            outcome = self._loop(out, resumed, writer)
        if "interrupted" in outcome:
            return outcome
        first, last_eval = outcome["start"], outcome["end"]
        self.log(f"eval at end:   {_fmt(last_eval)}")
        weights = distributed.to_full(self.policy.state_dict())  # a collective under FSDP2
        ema_weights = self.ema.state_dict() if self.ema is not None else None
        if not lead:
            return {"start": first, "end": last_eval, **self.watch.summary()}
        atomic_write(out / "weights.safetensors", lambda tmp: save_file(weights, str(tmp)))
        if self.ema is not None:
            atomic_write(out / "weights_ema.safetensors", lambda tmp: save_file(ema_weights, str(tmp)))
        self.policy.export(out)  # the library's own format: LoRA for load_lora_weights, or a from_pretrained directory
        if cfg.log.save_images:
            rows = read_metrics(out / "metrics.jsonl", log=self.log)
            keys = ("reward",) + tuple(k for k in last_eval if k.startswith("eval/rewards/"))
            plot_curves(rows, out / "reward_curve.png", keys, title="reward (train) and held-out eval")
        summary = {"start": first, "end": last_eval, **self.watch.summary()}  # "stopped", "best" (guards)
        atomic_write(out / "summary.json", json.dumps(summary, indent=2))
        return summary

    def _loop(self, out: Path, resumed: bool, writer) -> dict:
        """Start evaluation, the iterations (an evaluation every ``eval.every``), checkpoints and the end
        evaluation. Returns ``{"start", "end"}`` rows, plus ``"interrupted"`` when a signal stopped the run."""
        cfg = self.cfg
        lead = self.world.rank == 0

        def do_eval(tag: str) -> dict:
            table = SampleTable(out, self.iteration, save_media=cfg.log.save_images) if lead else None
            row, images = self.evaluate(table)
            row["iteration"] = self.iteration
            self.watch.judge(row, run_dir=out, lead=lead, weights=lambda: distributed.to_full(
                self.ema.state_dict() if self.ema is not None else self.policy.state_dict()))
            if tag == "start" and lead:
                self.family.guards.save_base(out)  # the base model's feature statistics, for resumes
            writer.write(row)
            samples = table.close() if table is not None else []  # samples/eval_<iteration>.jsonl
            writer.log_table(samples, self.iteration)
            if images is not None:
                reward = row.get("eval/reward")
                caption = (f"iteration {self.iteration}{f' ({tag})' if tag in ('start', 'end') else ''}: "
                           f"mean held-out reward {'n/a' if reward is None else f'{reward:.4f}'}")
                writer.log_images(images, self.iteration, nrow=cfg.eval.seeds_per_prompt * 2, caption=caption)
                if lead and cfg.log.save_images:
                    save_grid(images, out / f"samples_{tag}.png", nrow=cfg.eval.seeds_per_prompt * 2,
                              captions=[caption_of(r) for r in samples[:len(images)]])
                    if tag == "end":
                        side_by_side(out / "samples_start.png", out / "samples_end.png", out / "samples_start_end.png")
            return row

        rows = read_metrics(out / "metrics.jsonl", log=self.log) if resumed else []
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        if resumed:
            self.family.guards.load_base(out)
            self.watch.resume(evals[0] if evals else None, out)
        first = evals[0] if evals else do_eval("start")
        last_eval = evals[-1] if evals else first
        start_iteration = self.iteration
        self.log(f"eval at start: {_fmt(first)}")
        handlers = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                handlers[sig] = signal.signal(sig, self._on_signal)
        self._stop_signal = None
        bar = tqdm(total=cfg.train.num_iterations, initial=self.iteration, desc="GRPO",
                   disable=not (cfg.log.progress and lead))
        try:
            while self.iteration < cfg.train.num_iterations:
                row = self.step()
                writer.write(row)
                bar.update(1)
                bar.set_postfix(reward=f"{row['reward']:.3f}", it_s=f"{row['time/iteration']:.1f}s")
                if cfg.eval.every and self.iteration % cfg.eval.every == 0 and self.iteration < cfg.train.num_iterations:
                    last_eval = do_eval(str(self.iteration))
                    if self.watch.stop:  # train.on_hacking=stop and a guard fell
                        break
                if (cfg.train.save_every and self.iteration % cfg.train.save_every == 0) or self._stop_signal:
                    self.save_checkpoint()
                if self._stop_signal is not None:
                    self.log(f"stopped by signal {self._stop_signal} after iteration {self.iteration}; "
                             f"continue with: diffgrpo train --resume {out}")
                    return {"start": first, "end": last_eval, "interrupted": int(self._stop_signal)}
            bar.close()
            if cfg.train.save_every and self._saved_at != self.iteration:  # "train N more" resumes from here
                self.save_checkpoint()
            ended = bool(evals and evals[-1].get("iteration") == self.iteration)
            if not self.watch.stop and (self.iteration > start_iteration or not ended):
                last_eval = do_eval("end")  # (a resumed finished run already holds its end evaluation)
        finally:
            bar.close()
            for sig, h in handlers.items():
                signal.signal(sig, h)
        return {"start": first, "end": last_eval}


def check_world(cfg: RunConfig, world) -> None:
    """Every rank must hold the same number of samples (all-gathers) and whole shares of the batch."""
    W, t = world.world_size, cfg.train
    if W == 1:
        return
    if cfg.dist.group_layout == "spread" and t.group_size % W:
        raise ConfigError(f"dist.group_layout=spread: train.group_size={t.group_size} must be a multiple of "
                          f"the world size {W}")
    if cfg.dist.group_layout == "local" and t.prompts_per_batch % W:
        raise ConfigError(f"dist.group_layout=local: train.prompts_per_batch={t.prompts_per_batch} must be a "
                          f"multiple of the world size {W}")


def lr_factor(update: int, schedule: str, warmup: int, total: int) -> float:
    """Multiplier of ``train.lr`` at optimizer update ``update`` (0-based) of ``total``: a linear warmup over the
    first ``warmup`` updates ((u+1)/warmup), then constant, cosine or linear decay to 0 at ``total``."""
    if update < warmup:
        return (update + 1) / warmup
    if schedule == "constant":
        return 1.0
    p = min(max((update - warmup) / max(total - warmup, 1), 0.0), 1.0)
    return 0.5 * (1.0 + math.cos(math.pi * p)) if schedule == "cosine" else 1.0 - p


def _mean_std(v: torch.Tensor) -> dict[str, float]:
    """Mean and standard deviation of the finite entries of a reward component."""
    f = v[torch.isfinite(v)]
    return {"mean": float(f.mean()), "std": float(f.std()) if len(f) > 1 else 0.0}


def _fmt(row: dict) -> str:
    return ", ".join(f"{k}={v:.4f}" for k, v in row.items() if k.startswith("eval/"))


class _NullWriter:
    """The metrics writer of ranks > 0."""

    def write(self, row: dict) -> None:
        pass

    def log_images(self, images: torch.Tensor, step: int, nrow: int, caption: str) -> None:
        pass

    def log_table(self, rows: list, step: int) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _silent(*args, **kwargs) -> None:
    """The log function of ranks > 0."""


__all__ = ["FAMILIES", "Trainer", "TrainingError", "check_world", "lr_factor"]
