"""Whole-config validation: every per-field check again, the checks that look at this machine (device, launcher,
logging packages, output directory) and the key ownership, then the family's rules (``Family.check_config``:
``flow/rules.py``, ``dllm/rules.py``, which run the engine's own ``check_config``). Raises ConfigError before
anything loads. Names no family's or engine's option: those rules live beside the code that reads the keys."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

from . import config
from .config import (
    FAMILY_TITLES,
    MAX_SAMPLES_PER_ITERATION,
    MODEL_FAMILIES,
    DistConfig,
    LogConfig,
    RunConfig,
    changed_keys,
    check_fields,
    owner_of,
)
from .configvalues import one_line
from .data_sources import check_prompts
from .distributed import launched_world_size
from .errors import ConfigError
from .families import FAMILIES
from .run import trackers

# What a config is validated for: the command that will use it. Every purpose runs every check but these two.
PURPOSES = {
    "train": "a run that trains (the default): the prompt sources load, an editing model's prompts name sources",
    "sample": "diffgrpo sample: the prompt sources load; an editing model takes its sources from --image",
    "export": "diffgrpo export: no prompt is read, so only a shipped set's name is checked (a moved run's data "
              "files need not be at hand)",
    "print": "diffgrpo print-config without --check-data: as export",
}


def validate(cfg: RunConfig, purpose: str = "train") -> None:
    """Every per-field check again (types, choices, ranges, finiteness: a config may have been built or edited in
    Python), then the checks that span fields or look at this machine, for ``purpose`` (:data:`PURPOSES`: whether
    the prompt sources must load, ``data_sources.reads_data``, and whether an editing model's prompt files must
    name its sources). Raises ConfigError before anything loads."""
    if purpose not in PURPOSES:
        raise ValueError(f"validate: purpose {purpose!r} is not one of {list(PURPOSES)}")
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"config: value of type {type(cfg).__name__} is not a RunConfig")
    check_fields(cfg)
    config.apply_task(cfg)  # a config built in Python gets its task's keys as the command line's does
    family = family_of(cfg.model.name)
    _validate_family(cfg, family)
    t = cfg.train
    if t.prompts_per_batch * t.group_size > MAX_SAMPLES_PER_ITERATION:
        raise ConfigError(f"train.prompts_per_batch: value {t.prompts_per_batch} is out of range with "
                          f"train.group_size={t.group_size} ({t.prompts_per_batch * t.group_size} samples per "
                          f"iteration); prompts_per_batch × group_size must be <= {MAX_SAMPLES_PER_ITERATION}")
    if t.warmup_iterations > t.num_iterations:
        raise ConfigError(f"train.warmup_iterations: value {t.warmup_iterations} is more than train.num_iterations="
                          f"{t.num_iterations}: the learning rate would never reach train.lr; choose at most "
                          f"{t.num_iterations} (0 = no warmup)")
    if not t.prompt_column.strip():
        raise ConfigError("train.prompt_column: value '' is empty; name the prompt field (default 'prompt')")
    for key in ("train.prompts_file", "eval.prompts_file"):
        sec, name = key.split(".")
        spec = getattr(getattr(cfg, sec), name)
        if spec:  # exists, is UTF-8, parses, has the prompt column and at least one prompt (see check_prompts)
            check_prompts(spec, key=key, column=t.prompt_column, purpose=purpose)
    _validate_device(cfg.model.device)
    _validate_dist(cfg.dist.mode)
    _validate_logging(cfg.log)
    FAMILIES[family].check_config(cfg, purpose)
    _validate_memory(cfg)


def family_of(model_name: str) -> str:
    """The family (a key of ``families.FAMILIES``) that trains ``model.name=model_name``."""
    return MODEL_FAMILIES[model_name]


def applies(cfg: RunConfig, key: str) -> bool:
    """Whether the dotted ``key`` is read for ``cfg``'s model (its family's key, or every family's)."""
    return owner_of(cfg, key) in ("any", family_of(cfg.model.name))


def _validate_family(cfg: RunConfig, family: str) -> None:
    """A key set to a non-default value that the chosen model family never reads is an error, not a no-op."""
    for key in changed_keys(cfg, RunConfig()):
        owner = owner_of(cfg, key)
        if owner not in ("any", family):
            models = sorted((m for m, f in MODEL_FAMILIES.items() if f == owner), key=list(MODEL_FAMILIES).index)
            raise ConfigError(f"{key}: does not apply to model.name={cfg.model.name} (the {family} family); it is "
                              f"read only for {FAMILY_TITLES[owner]} (model.name in {models}); remove it")


def _validate_memory(cfg: RunConfig) -> None:
    """Mixed precision and FSDP2 memory options that cannot work together."""
    m, d = cfg.model, cfg.dist
    if m.mixed_precision == "fp16" and m.dtype == "float16":
        raise ConfigError("model.mixed_precision: value 'fp16' needs float32 weights (model.dtype=float32): the "
                          "gradient scaler cannot unscale float16 gradients; or use model.mixed_precision=bf16")
    if m.mixed_precision == "fp16" and d.mode == "fsdp2":
        raise ConfigError("model.mixed_precision: value 'fp16' is not supported with dist.mode=fsdp2 (the gradient "
                          "scaler's inf check is per rank); use dist.fsdp_param_dtype=bfloat16")
    for key in ("fsdp_param_dtype", "fsdp_cpu_offload"):
        if getattr(d, key) != getattr(DistConfig(), key) and d.mode != "fsdp2":
            raise ConfigError(f"dist.{key}: applies only to dist.mode=fsdp2 (dist.mode={d.mode}); set "
                              f"dist.mode=fsdp2 or remove it")


def _validate_dist(mode: str) -> None:
    """dist.mode=none under a launcher that started several processes would run each as an independent rank-0 run
    (same outputs, N-fold work): refused before the process group or any model exists."""
    world = launched_world_size()
    if mode == "none" and world > 1:
        raise ConfigError(f"dist.mode: value 'none' with WORLD_SIZE={world} (torchrun) would run {world} independent "
                          "copies of the same run; set dist.mode=ddp or dist.mode=fsdp2 (or leave it auto), or launch "
                          "without torchrun")


def _validate_device(value: str) -> None:
    """model.device must name a device this machine has: auto, cpu, cuda / cuda:N (N < the GPU count) or mps."""
    allowed = "choose 'cpu', 'cuda', 'cuda:N' or 'mps', or 'auto' (the accelerator when there is one)"
    if value == "auto":  # resolved by the Trainer (distributed.resolve_device) to a device this machine has
        return
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"model.device: value {value!r} is not a torch device; {allowed}") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device: value {value!r} is not available: torch.cuda.is_available() is false "
                              f"(no GPU, no driver, or a CPU-only torch build); use model.device=cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"model.device: value {value!r} is out of range; this machine has {n} CUDA "
                              f"device(s): cuda:0 .. cuda:{n - 1}")
        return
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"model.device: value {value!r} is not available: torch.backends.mps.is_available() "
                              f"is false; use model.device=cpu")
        return
    raise ConfigError(f"model.device: value {value!r} is not supported; {allowed}")


def _importable(name: str) -> bool:
    """Whether ``import name`` can find the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _validate_logging(log: LogConfig) -> None:
    trackers.check_config(log)  # log.trackers names, and their packages
    if log.output_dir:
        _validate_output_dir(log.output_dir)


def _validate_output_dir(value: str) -> None:
    """The run directory must be a directory we can write in, or creatable under one."""
    key = "log.output_dir"
    try:
        p = Path(value)
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{key}: value {value!r} is an existing file, not a directory; choose a directory "
                                  f"path")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: value {value!r} is not writable (no write permission); choose a "
                                  f"directory you can write to")
            return
        parent = p.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{key}: value {value!r} cannot be created: {str(parent)!r} is a file; choose a "
                              f"directory path")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: value {value!r} cannot be created: no write permission in {str(parent)!r}; "
                              f"choose a directory you can write to")
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{key}: value {value!r} is not a usable path ({one_line(e)})") from None


config.install_validator(validate)

__all__ = ["PURPOSES", "applies", "family_of", "validate"]
