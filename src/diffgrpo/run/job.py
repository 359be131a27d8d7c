"""The job around the training loop: the run directory and its lock, resume, signals, the schedule of evaluations
and checkpoints, and the outputs (metrics, sample grids, weights, the exported model, curves, summary).

``Trainer.train`` runs :class:`Job`; the loop itself (``Trainer.step``) knows nothing of files. Only rank 0
writes; every rank trains, evaluates and takes part in the collectives (checkpoints, the run directory's name).
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from filelock import FileLock, Timeout
from safetensors.torch import save_file

from .. import distributed, guards, threads
from ..console import Progress, running_calls, signal_note
from ..errors import TrainingError
from ..fileio import atomic_write, run_root
from ..media import SampleTable, caption_of, grid_title, side_by_side
from . import checkpoint, rundir
from .runlog import MetricsWriter, plot_curves, read_metrics, save_grid
from .saved_config import check_checkpoint
from .trackers import requested


def resume(trainer, out: Path) -> bool:
    """Load the newest complete checkpoint of ``out`` and drop metric rows written after it. Without one, the
    run restarts from iteration 0 (its earlier log is kept as ``metrics.restarted.jsonl``)."""
    ckpt = checkpoint.latest_complete(out, log=trainer.log)
    if ckpt is None:
        trainer.log(f"no complete checkpoint in {out}; restarting the run from iteration 0")
        if trainer.world.rank == 0 and (out / "metrics.jsonl").exists():
            os.replace(out / "metrics.jsonl", out / "metrics.restarted.jsonl")
        distributed.all_gather_object(None)  # the other ranks wait for the move
        return False
    check_checkpoint(ckpt, trainer.cfg)  # its own iteration, format and run (state.json is not hashed)
    try:
        trainer.load_state(checkpoint.load_checkpoint(ckpt))
    except TrainingError:
        raise
    except Exception as e:  # noqa: BLE001 - a DCP or safetensors error of a damaged checkpoint, on one line
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise TrainingError(f"checkpoint {ckpt} cannot be loaded ({type(e).__name__}: {first}); delete it to resume "
                            "from an earlier one") from None
    if not trainer.weights_finite():
        raise TrainingError(f"checkpoint {ckpt} holds non-finite weights; delete it to resume from an earlier one")
    # a resume may change the learning rate (the checkpoint holds the old one): it becomes the schedule's base lr
    checkpoint.set_base_lr(trainer.optimizer, trainer.scheduler, trainer.cfg.train.lr)
    rows = [r for r in read_metrics(out / "metrics.jsonl", log=trainer.log) if r.get("iteration", 0) <= trainer.iteration]
    if trainer.world.rank == 0:
        atomic_write(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    trainer.log(f"resumed from {ckpt} (iteration {trainer.iteration})")
    return True


class Job:
    """One ``train`` call of a trainer: ``run(resume)`` → the summary ``{"start", "end"}`` (+ ``"interrupted"``)."""

    def __init__(self, trainer):
        self.trainer, self.cfg, self.log = trainer, trainer.cfg, trainer.log
        self.lead = trainer.world.rank == 0  # only rank 0 writes files
        self.saved_at = -1  # iteration of the last checkpoint written or loaded
        self.stop_signal = None
        self.watch = guards.Watch(self.cfg.train, log=lambda *a: self.log(*a))  # train.on_hacking, keep_best

    def run(self, resume_run: bool = False) -> dict[str, float]:
        """The whole job in the run directory, which is locked for the run's life (a second run or resume of it is
        refused). SIGINT/SIGTERM finish the current iteration, save a checkpoint and return."""
        out = rundir.make(self.cfg, self.trainer.world)
        rundir.claim(out, self.cfg, resume_run, lead=self.lead)  # a run directory, its data files unchanged
        lock = FileLock(str(out / ".lock"))
        if self.lead:  # rank 0 holds it for the whole job
            try:
                lock.acquire(timeout=0)
            except Timeout:
                raise TrainingError(f"log.output_dir: {str(out)!r} is in use by another run (its lock file "
                                    f"{out / '.lock'} is held); wait for it to end or choose another directory") from None
            except OSError as e:  # e.g. a symlink planted at .lock: never followed
                raise TrainingError(f"log.output_dir: cannot lock {str(out / '.lock')!r} ({e.strerror})") from None
        try:
            with run_root(out):  # no write or delete below out goes through a planted symlinked folder
                rundir.sweep(out, log=self.log) if self.lead else None  # a killed run's temporary files
                return self._run(out, resume_run)
        finally:
            if lock.is_locked:
                lock.release()

    def _run(self, out: Path, resume_run: bool) -> dict[str, float]:
        cfg, tr = self.cfg, self.trainer
        resumed = resume(tr, out) if resume_run else False
        if resumed:
            self.saved_at = tr.iteration
        elif distributed.all_gather_object((out / "metrics.jsonl").exists())[0]:
            raise TrainingError(f"log.output_dir: {str(out)!r} already holds a run; resume it with "
                                "--resume or choose another directory")
        if self.lead:  # a resumed run's config carries the overrides it was resumed with
            atomic_write(out / "config.yaml", cfg.to_yaml())
        writer = (MetricsWriter(out, requested(cfg.log), config=cfg.to_dict())
                  if self.lead else _NullWriter())
        self.log(f"run directory: {out}")
        with writer:  # closed once, after the end evaluation, or on a signal or an error
            outcome = self._loop(out, resumed, writer)
        if "interrupted" in outcome:
            return outcome
        self.log(f"eval at end:   {_fmt(outcome['end'])}")
        return self._outputs(out, outcome)

    def _outputs(self, out: Path, summary: dict) -> dict:
        """Final weights (and EMA), the exported model, the reward curve and ``summary.json`` (rank 0)."""
        tr = self.trainer
        full = (distributed.full_model_state(tr.family.network(), trainable_only=self.cfg.model.lora_rank > 0)
                if tr.dist_mode == "fsdp2" and tr.world.world_size > 1 else None)  # FSDP2: onto rank 0's CPU
        weights = tr.policy.state_dict(full) if self.lead else None
        ema_weights = distributed.to_full(tr.ema.state_dict()) if tr.ema is not None else None
        if not self.lead:
            return summary
        atomic_write(out / "weights.safetensors", lambda tmp: save_file(weights, str(tmp)))
        if ema_weights is not None:
            atomic_write(out / "weights_ema.safetensors", lambda tmp: save_file(ema_weights, str(tmp)))
        tr.policy.export(out, weights if full is not None else None)  # the library's own format: LoRA for load_lora_weights, or a from_pretrained directory
        if self.cfg.log.save_images:
            rows = read_metrics(out / "metrics.jsonl", log=self.log)
            keys = ("reward",) + tuple(k for k in summary["end"] if k.startswith("eval/rewards/"))
            plot_curves(rows, out / "reward_curve.png", keys, title="reward (train) and held-out eval")
        atomic_write(out / "summary.json", json.dumps(summary, indent=2))
        return summary

    def _evaluate(self, out: Path, writer, tag: str) -> dict:
        """One held-out evaluation: its row, the sample table, and the grids (``samples_<tag>.png``)."""
        cfg, it = self.cfg, self.trainer.iteration
        self.log(f"evaluating ({tag}, iteration {it}) ...")
        table = SampleTable(out, it, save_media=cfg.log.save_images) if self.lead else None
        row, images = self.trainer.evaluate(table)
        row["iteration"] = it
        self.watch.judge(row, run_dir=out, lead=self.lead, weights=self.trainer.eval_weights,  # guards, keep_best
                         base=self.trainer.family.guards if tag == "start" else None)
        writer.write(row)
        samples = table.close() if table is not None else []  # samples/eval_<iteration>.jsonl
        writer.log_table(samples, it)
        if images is not None:
            reward = row.get("eval/reward")
            caption = (f"iteration {it}{f' ({tag})' if tag in ('start', 'end') else ''}: "
                       f"mean held-out reward {'n/a' if reward is None else f'{reward:.4f}'}")
            nrow = cfg.eval.seeds_per_prompt * 2
            writer.log_images(images, it, nrow=nrow, caption=caption)
            if self.lead and cfg.log.save_images:
                save_grid(images, out / f"samples_{tag}.png", nrow=nrow,
                          captions=[caption_of(r) for r in samples[:len(images)]], title=grid_title(tag, it))
                if tag == "end":
                    side_by_side(out / "samples_start.png", out / "samples_end.png", out / "samples_start_end.png",
                                 vertical=True)
        return row

    def _save(self) -> None:
        self.trainer.save_checkpoint()
        self.saved_at = self.trainer.iteration

    def _loop(self, out: Path, resumed: bool, writer) -> dict:
        """Start evaluation, the iterations (an evaluation every ``eval.every``), checkpoints and the end
        evaluation. Returns ``{"start", "end"}`` rows, plus ``"interrupted"`` when a signal stopped the run."""
        cfg, tr = self.cfg, self.trainer
        rows = read_metrics(out / "metrics.jsonl", log=self.log) if resumed else []
        evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
        if resumed:  # the start evaluation's row and the base model's statistics
            self.watch.resume(evals[0] if evals else None, out, tr.family.guards, evals)
        first = evals[0] if evals else self._evaluate(out, writer, "start")
        last_eval, start_iteration = (evals[-1] if evals else first), tr.iteration
        self.log(f"eval at start: {_fmt(first)}")  # (on_hacking=stop and a guard out at the start: no iteration)
        handlers = ({sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
                    if threading.current_thread() is threading.main_thread() else {})
        bar = Progress(cfg.train.num_iterations, tr.iteration, enabled=self.lead, bar=cfg.log.progress,
                       every=cfg.log.every, log=self.log)
        trained = 0  # iterations of this call whose update was applied
        try:
            while tr.iteration < cfg.train.num_iterations and not (self.watch.inconsistent or self.watch.stop):
                row = self.watch.consistency(tr.step())  # train.on_inconsistency: warn, or stop after this iteration
                trained += row.get("skipped_updates", 0) < cfg.train.num_inner_epochs
                writer.write(row)
                bar.update(row)
                if cfg.eval.every and tr.iteration % cfg.eval.every == 0 and tr.iteration < cfg.train.num_iterations:
                    last_eval = self._evaluate(out, writer, str(tr.iteration))
                    if self.watch.stop:  # train.on_hacking=stop and a guard fell
                        break
                stop = self._share_stop()  # every rank acts on this agreed value only (a later signal: next time)
                if (cfg.train.save_every and tr.iteration % cfg.train.save_every == 0) or stop is not None:
                    self._save()
                if stop is not None:
                    self.log(f"stopped by signal {stop} after iteration {tr.iteration}; "
                             f"continue with: diffgrpo train --resume {out}")
                    return {"start": first, "end": last_eval, "interrupted": int(stop)}
            bar.close()
            if tr.iteration > start_iteration and not trained and tr.bad_updates:  # (fp16 loss-scale skips are not bad)
                raise TrainingError(f"no update was applied in iterations {start_iteration + 1}..{tr.iteration} (each "
                                    "was skipped: see the warnings above); the run trained nothing")
            if cfg.train.save_every and self.saved_at != tr.iteration:  # "train N more" resumes from here
                self._save()
            ended = bool(evals and evals[-1].get("iteration") == tr.iteration)
            if not self.watch.stop and (tr.iteration > start_iteration or not ended):
                last_eval = self._evaluate(out, writer, "end")  # (a resumed finished run holds its end evaluation)
        finally:
            bar.close()
            threads.restore_handlers(handlers)
        return {"start": first, "end": last_eval, **self.watch.summary()}  # "stopped", "best" (guards)

    def _share_stop(self):
        """→ the signal any rank received, agreed by every rank after the same iteration (one small collective; a
        signal after the agreement waits for the next one), or None: go on."""
        shared = distributed.first_set(self.stop_signal)
        if shared is not None and self.stop_signal is None:
            self.stop_signal, self._stop_time = shared, time.monotonic()
        return shared

    def _on_signal(self, signum, frame):
        if self.stop_signal is not None:  # second signal: stop now, unless it is the first one delivered twice
            if time.monotonic() - self._stop_time < 1.0:  # (within 1 s: to the process group, then the process)
                return
            threads.note_signal(signum)  # a KeyboardInterrupt from a signal, not from a reward
            raise KeyboardInterrupt
        self.stop_signal, self._stop_time = signum, time.monotonic()
        signal_note(f"received signal {signum}{running_calls()}: finishing the current iteration, then saving a "
                    "checkpoint")


def _fmt(row: dict) -> str:
    """The eval values of ``row``; a null (the metrics log's record of a non-finite value, read back) is n/a."""
    return ", ".join(f"{k}={'n/a' if v is None else f'{v:.4f}'}" for k, v in row.items() if k.startswith("eval/"))


class _NullWriter:
    """The metrics writer of ranks > 0: write, log_images, log_table and close do nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


__all__ = ["Job", "resume"]
