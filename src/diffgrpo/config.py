"""Run configuration schema: one dataclass per component, composed into :class:`RunConfig`, and its parser.

Sources, applied in order: defaults → YAML file → dotted overrides (``engine.name=jagg``). Every value is
checked against its field's type, allowed values and range; unknown keys fail with a did-you-mean hint.
Errors are :class:`ConfigError` with a one-line message naming the key, the value and what is allowed.

Which family reads a key is field metadata (``_f(family=...)``, else the section's ``FAMILY``); which engine
reads an ``engine.*`` key is declared on the engine (``config_keys``). The rules that span fields live beside
the code that reads the keys (``flow/rules.py``, ``dllm/rules.py``, each engine's ``check_config``) and run from
:func:`diffgrpo.validation.validate`, which :meth:`RunConfig.from_overrides` calls. The sections themselves are
:mod:`diffgrpo.schema`. This module imports nothing of the package but the sections, the error types, one
file helper and the parser's leaves.
"""
from __future__ import annotations

import dataclasses
import functools
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from . import yamlio
from .configvalues import coerce, parse_value, yaml_problem
from .errors import ConfigError, suggest
from .fileio import read_utf8
from .schema import (  # noqa: F401 (the sections and tables, re-exported: the schema is read from here)
    FAMILY_TITLES,
    MAX_SAMPLES_PER_ITERATION,
    MODEL_FAMILIES,
    RENAMED,
    TASK_DEFAULTS,
    AdvantageConfig,
    DACAConfig,
    DistConfig,
    DiversityConfig,
    DLLMConfig,
    EngineConfig,
    EvalConfig,
    LogConfig,
    LossConfig,
    ModelConfig,
    PretrainConfig,
    RewardConfig,
    SamplerConfig,
    StepsConfig,
    TrainConfig,
    _f,
)


@dataclass
class RunConfig:
    seed: int = _f(0)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dllm: DLLMConfig = field(default_factory=DLLMConfig)
    daca: DACAConfig = field(default_factory=DACAConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    diversity: DiversityConfig = field(default_factory=DiversityConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_overrides(cls, overrides: list[str] | None = None, base: RunConfig | None = None, *,
                       purpose: str = "train") -> RunConfig:
        """Defaults (or ``base``) with ``key=value`` overrides; values are parsed as YAML scalars/lists; validated
        for ``purpose`` (``validation.PURPOSES``)."""
        cfg = from_dict(cls, to_dict(base)) if base is not None else cls()  # deep copy
        vars(cfg)["_written"] = set(written(base)) if base is not None else set()  # the base's, not every key
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value (e.g. engine.name=recompute)")
            key, raw = item.split("=", 1)
            key = key.strip()
            _walk(cfg, key)  # an unknown key is reported before its value is parsed
            set_path(cfg, key, parse_value(key, raw) if raw.strip() else "")
        apply_task(cfg)
        _validate(cfg, purpose)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None, *, purpose: str = "train") -> RunConfig:
        p = Path(path)
        if not _is_file(p):
            raise ConfigError(f"--config: file {str(p)!r} does not exist")
        text = read_utf8(p, "--config")
        try:
            data = yamlio.load(text, f"--config: file {str(p)!r}") or {}
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - YAMLError, or a constructor's ValueError (e.g. a bad date)
            raise ConfigError(f"--config: file {str(p)!r} is not valid YAML ({yaml_problem(e)}); fix the syntax "
                              f"there") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
        return cls.from_overrides(overrides, base=from_dict(cls, data), purpose=purpose)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)



# ---------------------------------------------------------------------- generic helpers
def to_dict(obj) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):  # a name too long, an embedded NUL byte
        return False



@functools.cache
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _walk(cfg, dotted: str):
    """Resolve a dotted key → (owner dataclass, field, its type, entry name or None for ``reward.weights.<name>``).
    Unknown keys fail with a did-you-mean hint."""
    parts = dotted.split(".")
    obj, path = cfg, []
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            where = ".".join(path) or "the top level"
            full = ".".join(path + [part])
            if full in RENAMED:
                raise ConfigError(f"{full} was renamed {RENAMED[full]}; set {RENAMED[full]} instead")
            raise ConfigError(f"unknown config key {full!r}{suggest(part, names)}; keys under {where}: {names}")
        path.append(part)
        fld = next(f for f in dataclasses.fields(obj) if f.name == part)
        tp = _hints(type(obj))[part]
        if i == len(parts) - 1:
            return obj, fld, tp, None
        child = getattr(obj, part)
        if isinstance(child, dict) and i == len(parts) - 2:  # reward.weights.<name>
            return obj, fld, tp, parts[-1]
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(path)} is not a section")
        obj = child


def set_path(cfg, dotted: str, value) -> None:
    """Set ``a.b=value`` on nested dataclasses, with type/range checks and did-you-mean on unknown keys.
    A mapping given for a section sets each of its keys by its full dotted name."""
    obj, fld, tp, entry = _walk(cfg, dotted)
    if entry is not None:  # reward.weights.<name>=value
        key = dotted[: -len(entry) - 1]
        setattr(obj, fld.name, coerce(key, {**getattr(obj, fld.name), entry: value}, tp, fld.metadata))
        written(cfg).add(key)
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: is a section; set its keys (e.g. {dotted}.<key>=...)")
        for k, v in value.items():
            set_path(cfg, f"{dotted}.{k}", v)
    else:
        setattr(obj, fld.name, coerce(dotted, value, tp, fld.metadata))
        written(cfg).add(dotted)


def written(cfg) -> set[str]:
    """The dotted keys a command line or a YAML mapping set on ``cfg`` (``set_path``), which its task never replaces;
    a config built in Python and changed by attribute has none."""
    return vars(cfg).setdefault("_written", set())


def apply_task(cfg: RunConfig) -> None:
    """Set the keys of ``TASK_DEFAULTS[cfg.train.task]`` that ``cfg`` leaves at their defaults and that no command
    line or YAML file wrote (:func:`written`: ``pretrain.steps=800`` written out stays 800 under a task whose
    default is 2400; a saved config holds every key, so applying it twice changes nothing). Only the built-in image
    model has tasks: for any other ``model.name`` the validation refuses a task but digits instead."""
    if cfg.model.name != "tiny":
        return
    default, given = RunConfig(), written(cfg)
    for key, value in TASK_DEFAULTS[cfg.train.task].items():
        obj, fld, _, _ = _walk(cfg, key)
        base, _, _, _ = _walk(default, key)
        if key == "eval.guard_rewards":  # a guard reward is held out: never one the config trains on
            value = [n for n in value if not cfg.reward.weights.get(n)]
        if key not in given and getattr(obj, fld.name) == getattr(base, fld.name):
            set_path(cfg, key, value)
            given.discard(key)  # the task's value, not the user's


def from_dict(cls, data: dict):
    """Build ``cls`` from a nested mapping with the same checks as overrides."""
    cfg = cls()
    for k, v in (data or {}).items():
        set_path(cfg, str(k), v)
    return cfg


def check_fields(obj, prefix: str = "") -> None:
    """Re-apply every field's type, choice, range and finiteness check to a dataclass as it is (values set in
    Python skip ``set_path``); stores the coerced value, e.g. an int learning rate as a float."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key, tp, value = prefix + f.name, hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{key}: value {value!r} is not a section; it must be a {tp.__name__}")
            check_fields(value, key + ".")
        else:
            setattr(obj, f.name, coerce(key, value, tp, f.metadata))




# ---------------------------------------------------------------------- key ownership and validation hook
def key_family(section, name: str) -> str:
    """The family ('flow', 'dllm' or 'any') that reads field ``name`` of dataclass ``section``."""
    meta = next(f for f in dataclasses.fields(section) if f.name == name).metadata
    return meta.get("family") or getattr(section, "FAMILY", "any")


def changed_keys(obj, default, prefix: str = "") -> list[str]:
    """Dotted keys whose value in ``obj`` differs from ``default`` (nested dataclasses)."""
    out = []
    for f in dataclasses.fields(obj):
        a, b = getattr(obj, f.name), getattr(default, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(a):
            out += changed_keys(a, b, key + ".")
        elif a != b:
            out.append(key)
    return out


def owner_of(cfg: RunConfig, dotted: str) -> str:
    """The family that reads the dotted key ``dotted`` of ``cfg``."""
    obj, fld, _, _ = _walk(cfg, dotted)
    return key_family(type(obj), fld.name)


_VALIDATORS: list[Callable[[RunConfig, str], None]] = []


def install_validator(fn: Callable[[RunConfig, str], None]) -> None:
    """Set the whole-config check that :meth:`RunConfig.from_overrides` runs (``diffgrpo.validation.validate``,
    installed when the package is imported)."""
    _VALIDATORS[:] = [fn]


def _validate(cfg: RunConfig, purpose: str) -> None:
    if not _VALIDATORS:
        raise RuntimeError("no config validator installed (import diffgrpo.validation)")
    _VALIDATORS[0](cfg, purpose)
