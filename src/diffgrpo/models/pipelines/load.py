"""Loading a diffusers pipeline for ``model.name=diffusers``: the local directory and its rows' rules checked before
anything loads, ``from_pretrained``, the row it is (``model.pipeline``, or detected), and its rules after."""
from __future__ import annotations

import json
from pathlib import Path

from ...config import ModelConfig
from ...errors import ConfigError
from ...types import DTYPES
from . import PIPELINES
from .detect import pipeline_of
from .spec import pipeline_has
from .wan import check_experts


def _is_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


def _check_local(p: Path, m: ModelConfig) -> None:
    """Before loading a local pipeline directory: it is one, and its model_index.json passes the rules of the row
    of its pipeline class."""
    if not (p / "model_index.json").is_file():
        raise ConfigError(f"model.pretrained: {str(p)!r} is not a diffusers pipeline directory "
                          "(no model_index.json)")
    try:
        index = json.loads((p / "model_index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    index = index if isinstance(index, dict) else {}
    check_experts(m, has_two=pipeline_has(index, "transformer_2"))  # before loading anything
    for name, row in PIPELINES.items():
        if row.pipeline_class == index.get("_class_name"):
            row.check(name, index, m, None)


def _load(m: ModelConfig):
    from diffusers import DiffusionPipeline

    try:
        pipe = DiffusionPipeline.from_pretrained(m.pretrained, dtype=DTYPES[m.dtype])
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.pretrained: cannot load a diffusers pipeline from {m.pretrained!r} "
                          f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None
    if getattr(pipe, "transformer", None) is None:
        raise ConfigError(f"model.pretrained: {m.pretrained!r} has no transformer component "
                          f"({type(pipe).__name__} is not a flow-matching transformer pipeline)")
    pipe.set_progress_bar_config(disable=True)
    return pipe


def load_pipeline(m: ModelConfig):
    """→ (the pipeline at ``m.pretrained``, its row's key); every rule of the row checked."""
    if not m.pretrained:
        raise ConfigError("model.pretrained: required for model.name=diffusers (a local pipeline directory or hub id)")
    if _is_local(m.pretrained):
        _check_local(Path(m.pretrained).expanduser(), m)
    pipe = _load(m)
    name = pipeline_of(pipe) if m.pipeline == "auto" else m.pipeline
    check_experts(m, has_two=getattr(pipe, "transformer_2", None) is not None)
    PIPELINES[name].check(name, getattr(pipe, "config", {}), m, pipe.transformer)
    return pipe, name


__all__ = ["load_pipeline"]
