"""A config field's value from what the user typed: ``parse_value`` reads an override's text as YAML (through the
strict :mod:`diffgrpo.yamlio` loader) and ``coerce`` checks a value against the field's annotated type and its
metadata (choices, ``lo``/``hi``/``gt`` bounds, ``path``), returning the coerced value or raising a one-line
:class:`ConfigError` naming the key, the value and what is allowed. Pure functions; the schema lives in
:mod:`diffgrpo.config`.
"""
from __future__ import annotations

import datetime
import math
import os
import typing

from . import yamlio
from .errors import ConfigError


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def show_key(key: str) -> str:
    """A key as written in messages: plain when it is printable without spaces, else its repr (one line)."""
    return key if key.isprintable() and not any(c.isspace() for c in key) else repr(key)


def yaml_problem(e: Exception) -> str:
    """``line L, column C: problem`` of a YAML parse error (one line); other errors by their message."""
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if problem is None:
        return one_line(f"{type(e).__name__}: {e}")
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + one_line(problem)


def split_overrides(text: str) -> list[str]:
    """``key=value,key=value`` (a benchmark variant's overrides) → the overrides, split at the commas outside
    brackets and braces, so a list value stays whole: ``diversity.method=[diversegrpo,drift],loss.beta=0.3`` → two."""
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch in "[{") - (ch in "]}")
        if ch == "," and depth <= 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts if p.strip()]


def parse_value(key: str, raw: str):
    """An override's value as YAML (a scalar, list or mapping); a syntax error names the key."""
    try:
        return yamlio.load(raw, show_key(key))
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - YAMLError, or a constructor's ValueError (e.g. 2024-13-45)
        raise ConfigError(f"{show_key(key)}: value {raw!r} is not valid YAML ({yaml_problem(e)}); give a scalar, a list "
                          f"[a, b] or a mapping {{k: v}}, quoting text that contains YAML syntax") from None



SCALARS = (str, int, float, bool, type(None), datetime.date)


def range_text(lo, hi, gt) -> str:
    if gt is not None:
        return f"must be > {gt}"
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    if lo is not None:
        return f"must be >= {lo}"
    if hi is not None:
        return f"must be <= {hi}"
    return "must be finite"


def _as_bool(value) -> bool:
    """A bool from a bool, a 0 / 1 int or a word (true/false, 1/0, yes/no, on/off); TypeError otherwise."""
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no", "on", "off"):
        value = value.lower() in ("true", "1", "yes", "on")
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):  # 1 / 0 are ints
        value = bool(value)
    if not isinstance(value, bool):
        raise TypeError
    return value


def _as_int(value) -> int:
    """An int from an int, a whole float or a string of one (not a bool)."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise TypeError
    if not isinstance(value, (int, float, str)):
        raise TypeError
    return int(value)


def _as_float(value) -> float:
    """A float from a number or a string of one (not a bool)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError
    return float(value)


def _as_str(value, meta) -> str:
    """Text from a scalar as it was typed, a list of scalars joined by commas, or a YAML boolean read back as the
    word meant (one of the field's choices when one fits); a path field's ``~`` expanded."""
    value = yamlio.text_of(value)  # a number as it was typed: 001 stays "001"
    if value is None:
        value = ""
    if isinstance(value, bool):  # YAML 1.1 reads no / yes / true / off as booleans: the word was meant
        words = ("true", "yes", "on") if value else ("false", "no", "off")
        value = next((w for w in words if w in (meta.get("choices") or ())), words[0])
    if isinstance(value, (list, tuple)):
        if not all(isinstance(v, SCALARS) for v in value):
            raise TypeError
        value = ",".join(str(yamlio.text_of(v)) for v in value)
    if not isinstance(value, SCALARS):
        raise TypeError
    value = str(value)
    if meta.get("path") and value.startswith("~"):
        try:
            value = os.path.expanduser(value)
        except (ValueError, OSError):  # e.g. an embedded NUL byte: refused by the path checks
            pass
    return value


def _as_option_maps(key: str, value) -> dict:
    """``{name: {option: value}}`` (reward.options): a mapping of mappings, the names as strings."""
    if not isinstance(value, dict):
        raise TypeError
    value = {str(k): v for k, v in value.items()}
    for k, v in value.items():
        if not isinstance(v, dict):
            raise ConfigError(f"{show_key(f'{key}.{k}')}: value {v!r} must be a mapping of options, "
                              "e.g. {batch_size: 8}")
    return value


def _as_weights(key: str, value) -> dict:
    """``{name: number}``: a mapping of finite numbers (not bools), the names as strings."""
    if not isinstance(value, dict):
        raise TypeError
    value = {str(k): v for k, v in value.items()}
    for k, v in value.items():
        entry = show_key(f"{key}.{k}")
        if not isinstance(v, (int, float)) or isinstance(v, bool):
            raise ConfigError(f"{entry}: weight {v!r} must be a number")
        if not math.isfinite(v):
            raise ConfigError(f"{entry}: weight {v!r} must be a finite number")
    return value


def _as_list(value) -> list:
    """A list of scalars; a single number or string is a list of one."""
    if isinstance(value, (int, float, str)) and not isinstance(value, bool):
        value = [value]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, SCALARS) for v in value):
        raise TypeError
    return list(value)


def _as_type(key: str, value, tp, origin, meta):
    """``value`` as the annotated type ``tp`` (``origin``: its unsubscripted form); TypeError, ValueError or
    OverflowError when it is not one, a ConfigError naming the entry for a bad entry of a mapping."""
    if origin is bool:
        return _as_bool(value)
    if origin is int:
        return _as_int(value)
    if origin is float:
        return _as_float(value)
    if origin is str:
        return _as_str(value, meta)
    if origin is dict and typing.get_args(tp)[1:] == (dict,):  # {name: {option: value}}: reward.options
        return _as_option_maps(key, value)
    if origin is dict:
        return _as_weights(key, value)
    if origin is list:
        return _as_list(value)
    return value


def _check_allowed(key: str, value, meta) -> None:
    """The coerced ``value`` against the field's choices and bounds (``lo`` <=, ``hi`` >=, ``gt`` >)."""
    choices, lo, hi, gt = meta.get("choices"), meta.get("lo"), meta.get("hi"), meta.get("gt")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: value {yamlio.short(value)} is not allowed; choose one of {list(choices)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: value {value!r} is not a finite number; {range_text(lo, hi, gt)}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be <= {hi}")
    if gt is not None and not value > gt:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be > {gt}")


def coerce(key: str, value, tp, meta):
    """Check ``value`` against the annotated type ``tp`` and the field's metadata; return the coerced value."""
    origin = typing.get_origin(tp) or tp
    try:
        coerced = _as_type(key, value, tp, origin, meta)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{key}: value {yamlio.short(yamlio.echo(value))} is not a valid {origin.__name__}"
                          ) from None
    coerced = yamlio.plain(coerced)
    _check_allowed(key, coerced, meta)
    return coerced


__all__ = ["SCALARS", "coerce", "one_line", "parse_value", "range_text", "show_key", "yaml_problem"]
