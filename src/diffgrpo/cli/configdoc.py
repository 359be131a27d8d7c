"""The config reference, generated from the schema: every key with its type, default, allowed values or range and
doc string (``diffgrpo print-config --docs``, and ``docs/config.md``, which a test keeps equal to it); and the
keys a config changes from the defaults (``diffgrpo print-config --changed``).
"""
from __future__ import annotations

import dataclasses
import inspect
import typing

import yaml

from ..config import RunConfig, apply_task

HEADER = ("# Config reference\n\n"
          "Every key of a run, by section: `diffgrpo train section.key=value`, or the same nesting in a YAML file "
          "(`--config FILE`).\nGenerated from the field docs by `diffgrpo print-config --docs > docs/config.md` "
          "(a test checks that this page is up to date).\n")


def _type_name(tp) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _allowed(meta: dict) -> str:
    if meta.get("choices"):
        return " \\| ".join(f"`{c}`" for c in meta["choices"])
    parts = []
    if meta.get("gt") is not None:
        parts.append(f"> {meta['gt']}")
    if meta.get("lo") is not None:
        parts.append(f">= {meta['lo']}")
    if meta.get("hi") is not None:
        parts.append(f"<= {meta['hi']}")
    return ", ".join(parts)


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _default(value) -> str:
    if value == "" or value is None:
        return '`""`' if value == "" else "`null`"
    return f"`{yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix('...').strip()}`"


def rows(obj=None, prefix: str = ""):
    """(section doc | None, [(key, type, default, allowed, doc), ...]) per section, in schema order."""
    obj = obj or RunConfig()
    hints = typing.get_type_hints(type(obj))
    top, sections = [], []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            doc = inspect.getdoc(type(value)) if type(value).__doc__ else None
            if doc and doc.startswith(f"{type(value).__name__}("):  # dataclass's generated signature
                doc = None
            sub = [(f"{prefix}{f.name}.{g.name}", _type_name(typing.get_type_hints(type(value))[g.name]),
                    _default(getattr(value, g.name)), _allowed(dict(g.metadata)), g.metadata.get("doc", ""))
                   for g in dataclasses.fields(value)]
            sections.append((f.name, doc, sub))
        else:
            top.append((f"{prefix}{f.name}", _type_name(hints[f.name]), _default(value), _allowed(dict(f.metadata)),
                        f.metadata.get("doc", "")))
    return ([("top level", None, top)] if top else []) + sections


def reference_markdown() -> str:
    """The whole reference as Markdown (one table per section)."""
    out = [HEADER]
    for name, doc, items in rows():
        out.append(f"\n## `{name}`\n" if name != "top level" else "\n## top level\n")
        if doc:
            out.append(_cell(doc) + "\n")
        out.append("\n| key | type | default | allowed | doc |\n|---|---|---|---|---|")
        for key, tp, default, allowed, text in items:
            out.append(f"| `{key}` | {tp} | {default} | {allowed} | {_cell(text)} |")
    return "\n".join(out) + "\n"


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and dataclasses.is_dataclass(getattr(RunConfig(), k, None)) and not prefix:
            out.update(_flat(v, f"{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def task_defaults(model_name: str, task: str) -> RunConfig:
    """The defaults of a config of ``model_name`` and ``train.task``: with the keys that task sets
    (``config.apply_task``), ``model.name`` and ``train.task`` themselves at their defaults."""
    default = RunConfig()
    default.model.name, default.train.task = model_name, task
    apply_task(default)
    default.model.name, default.train.task = RunConfig().model.name, RunConfig().train.task
    return default


def changed(cfg: RunConfig) -> dict:
    """The keys of ``cfg`` whose values differ from the defaults, nested by section (a YAML ``--config`` file that
    reproduces ``cfg``). The keys its ``train.task`` sets (``config.apply_task``) count as defaults."""
    base, now = _flat(task_defaults(cfg.model.name, cfg.train.task).to_dict()), _flat(cfg.to_dict())
    out: dict = {}
    for key, value in now.items():
        if base.get(key) != value:
            sec, _, name = key.partition(".")
            if name:
                out.setdefault(sec, {})[name] = value
            else:
                out[sec] = value
    return out


__all__ = ["changed", "reference_markdown", "rows", "task_defaults"]
