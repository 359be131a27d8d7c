"""``diffgrpo train`` (a new run, or ``--resume RUN_DIR|auto``) and ``diffgrpo pretrain`` (the built-in models)."""
from __future__ import annotations

import os
import time
from pathlib import Path

from ..console import end_summary
from ..errors import ConfigError
from ..fileio import read_jsonl
from ..run import rundir, saved_config
from .hub import check_hub
from .resolve import load_cfg, threads


def resume_dir(args) -> Path | None:
    """--resume RUN_DIR, or --resume auto: log.output_dir if given, else the newest unfinished run in runs/."""
    if not args.resume:
        return None
    if args.resume != "auto":
        run = Path(args.resume)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--resume: {str(run)!r} is not a run directory (no config.yaml)")
        return run
    cfg = load_cfg(args)
    if cfg.log.output_dir:
        return Path(cfg.log.output_dir) if (Path(cfg.log.output_dir) / "config.yaml").is_file() else None
    runs = [d for d in Path("runs").glob("*") if (d / "checkpoints").is_dir() and not (d / "summary.json").exists()]
    return max(runs, key=lambda d: d.stat().st_mtime) if runs else None


def _config(args, run: Path | None):
    """The run's resolved config then the overrides (a resume), or the command line's config (a new run)."""
    if run is None:
        if args.resume == "auto":
            print("--resume auto: no unfinished run found; starting a new one")
        return load_cfg(args)
    if args.config:
        raise ConfigError("--config: cannot be combined with --resume (the run's own config.yaml is used); "
                          "pass changes as key=value overrides")
    return saved_config.load(run, list(args.overrides), command="--resume")


def _prepare_output(cfg, resumed: bool) -> None:
    """Before any model loads: the run directory checked (or a new one made), its data files unchanged."""
    if not cfg.log.output_dir:
        return
    rundir.check(cfg.log.output_dir, cfg, resume=resumed)
    if int(os.environ.get("RANK", "0")) == 0:
        try:
            Path(cfg.log.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log.output_dir: cannot create {cfg.log.output_dir!r} ({e.strerror})") from None


def cmd_train(args) -> int:
    from ..trainer import Trainer

    t0 = time.perf_counter()
    run = resume_dir(args)
    cfg = _config(args, run)
    threads(cfg)
    check_hub(cfg)  # a hub model that cannot be had fails here, in one line, before any model loads
    _prepare_output(cfg, run is not None)
    trainer = Trainer(cfg)
    summary = trainer.train(resume=run is not None)
    if trainer.world.rank > 0:  # torchrun: rank 0 reports
        return 0
    if summary.get("interrupted"):  # the shell's convention, so schedulers and `&&` see the preemption
        print(f"interrupted by signal {summary['interrupted']}; resume with: diffgrpo train --resume "
              f"{cfg.log.output_dir}")
        return 128 + int(summary["interrupted"])
    if summary.get("stopped"):  # train.on_hacking=stop: a guard fell
        best = summary.get("best")
        print(f"stopped: {summary['stopped']}" + (f"; best checkpoint ({best['metric']}={best['value']:.4f} at "
                                                  f"iteration {best['iteration']}) in {cfg.log.output_dir}/best"
                                                  if best else ""))
        return 3
    if summary.get("inconsistent"):  # train.on_inconsistency=stop: rollout and update disagree; outputs written
        print(f"stopped: {summary['inconsistent']}")
        return 4
    rows = read_jsonl(Path(cfg.log.output_dir) / "metrics.jsonl", log=lambda *a: None)
    for line in end_summary(Path(cfg.log.output_dir), summary, wall_seconds=time.perf_counter() - t0, train_rows=rows):
        print(line)
    return 0


def cmd_pretrain(args) -> int:
    """A built-in model (``model.name``: the image model of ``train.task`` with, for digits, its reward classifier;
    or a built-in masked / block-diffusion LM of ``dllm.task``; ``--task T`` = ``dllm.task=T`` on the masked LM unless
    model.name names another built-in LM): pretrained once and cached. Any other model is refused in one line."""
    from ..cache import cache_root
    from ..models import POLICIES
    from ..rewards.image import load_classifier
    from .runtime import TINY_MODELS

    if getattr(args, "task", None):  # --task: a built-in LM of that task (the masked LM unless one is named)
        named = any(o.split("=", 1)[0].strip() == "model.name" for o in args.overrides)
        args.overrides = [*([] if named else ["model.name=tiny_mlm"]), *args.overrides, f"dllm.task={args.task}"]
    cfg = load_cfg(args)
    threads(cfg)
    name = cfg.model.name
    if name not in TINY_MODELS:
        raise ConfigError(f"model.name: value {name!r} is not a built-in model; diffgrpo pretrain builds one of "
                          f"{list(TINY_MODELS)} (a hub model is fetched with diffgrpo download)")
    POLICIES[name](cfg, progress=cfg.log.progress)  # loads the cached model, pretraining and caching it when absent
    root = cache_root(cfg.model.cache_dir)
    if name != "tiny":
        print(f"built-in {name} model for task {cfg.dllm.task!r} cached in {root}")
        return 0
    if cfg.train.task != "digits":  # the shapes task's reward is a checker: nothing to train
        print(f"built-in {cfg.train.task} model cached in {root}")
        return 0
    _, acc = load_classifier(cfg.model.image_size, cfg.model.cache_dir)
    print(f"built-in model and reward classifier cached in {root}")
    print(f"digit_alignment classifier held-out accuracy: {acc:.4f}")
    return 0


__all__ = ["cmd_pretrain", "cmd_train", "resume_dir"]
