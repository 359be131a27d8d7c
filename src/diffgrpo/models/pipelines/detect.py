"""Which row of the pipeline table a transformer or a loaded pipeline is."""
from __future__ import annotations

from torch import nn

from . import PIPELINES
from .spec import PipelineSpec


def detect_pipeline(transformer: nn.Module) -> str:
    """The first row (``model.pipeline``) whose transformer class is ``transformer``'s (or one of its bases)."""
    for key, row in PIPELINES.items():
        if row.matches(transformer):
            return key
    raise ValueError(f"unsupported transformer class {type(transformer).__name__}; supported: "
                     f"{sorted({r.transformer_class for r in PIPELINES.values()})}")


def pipeline_of(pipe) -> str:
    """The row of a loaded pipeline: the one of its pipeline class that takes its transformer, else by the
    transformer alone."""
    cls = type(pipe).__name__
    same = [k for k, r in PIPELINES.items() if r.pipeline_class == cls and r.matches(pipe.transformer)]
    return same[0] if same else detect_pipeline(pipe.transformer)


def resolve_row(row: PipelineSpec | str, transformer: nn.Module) -> PipelineSpec:
    """A row, or its key ("auto" / "": detected from ``transformer``)."""
    if isinstance(row, PipelineSpec):
        return row
    key = detect_pipeline(transformer) if row in ("", "auto") else row
    if key not in PIPELINES:
        raise ValueError(f"unknown pipeline {row!r}; choose one of {sorted(PIPELINES)}")
    return PIPELINES[key]


__all__ = ["detect_pipeline", "pipeline_of", "resolve_row"]
