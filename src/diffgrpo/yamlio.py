"""A strict YAML loader for configs and ``key=value`` overrides: YAML 1.2 core scalars, text kept as typed, no
duplicate keys, bounded aliases.

  load(text, source)   the document as Python data, or a one-line ConfigError naming ``source``:
                       - scalars resolve as YAML 1.2's core schema does: ``true``/``false`` (any case) are
                         booleans, ``null``/``~``/empty are None, ``[-+]?[0-9]+`` / ``0o…`` / ``0x…`` integers (``010``
                         is ten), floats as ``1.5``, ``1e-3``, ``.5``, ``.inf``, ``.nan``; everything else is text
                         (``on``, ``no``, ``12:30``, ``2024-01-01``), so YAML 1.1's sexagesimal, octal and yes/no
                         readings never apply;
                       - every integer and float also remembers the text it was written as (``text_of``): a string
                         field given ``001`` gets "001", not "1";
                       - a key given twice in one mapping is refused (never "last wins");
                       - a document whose aliases expand to more than ``MAX_NODES`` nodes, or nested more than
                         ``MAX_DEPTH`` levels, is refused before it is built (a few hundred bytes of nested aliases can
                         otherwise expand to gigabytes; a deep nest overflows whatever walks it);
                       - tags other than the core ones (``!!python/...``) are refused, as ``yaml.safe_load`` does.
  safe_load(text)      ``yaml.safe_load`` (YAML 1.1 scalars) with the same bound on aliases, for files the library
                       only shows (a run's ``config.yaml`` in ``report``): a document past the bound, or nested too
                       deep to parse, raises :class:`TooLarge` (a ``yaml.YAMLError``)
  text_of(v)           the text a number was written as (``v`` itself for anything else)
  plain(v)             ``v`` with the remembered numbers turned into plain ``int``/``float``, recursively
  echo(v)              ``v`` as error messages show it (plain; an overflowed number as typed)
  short(v)             ``repr(v)`` cut to ``MAX_ECHO`` characters, for error messages that echo a value
"""
from __future__ import annotations

import math
import re
from typing import ClassVar

import yaml

from .errors import ConfigError

MAX_NODES = 100_000  # nodes of a document once its aliases are expanded
MAX_ECHO = 200  # characters of a value echoed in an error message
MAX_DEPTH = 64  # levels of nested lists / mappings (deeper ones would overflow the stack of whatever walks them)


class YInt(int):
    """An integer that remembers the text it was written as."""

    text: str

    def __new__(cls, value: int, text: str):
        obj = super().__new__(cls, value)
        obj.text = text
        return obj


class YFloat(float):
    """A float that remembers the text it was written as."""

    text: str

    def __new__(cls, value: float, text: str):
        obj = super().__new__(cls, value)
        obj.text = text
        return obj


_BOOL = re.compile(r"^(?:true|false)$", re.IGNORECASE)
_NULL = re.compile(r"^(?:~|null|Null|NULL|)$")
_INT = re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$")
_FLOAT = re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)"
                    r"|\.(?:nan|NaN|NAN))$")


class _Loader(yaml.SafeLoader):
    """SafeLoader with the YAML 1.2 core resolvers only (see the module docstring)."""

    yaml_implicit_resolvers: ClassVar[dict] = {}

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                try:
                    hash(key)
                except TypeError:
                    raise yaml.constructor.ConstructorError(None, None, f"unhashable key {short(key)}",
                                                            key_node.start_mark) from None
                if key in seen:
                    mark = key_node.start_mark
                    raise ConfigError(f"duplicate key {short(plain(key))} at line {mark.line + 1} (first at line "
                                      f"{seen[key] + 1}); give each key once")
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


def _bool(loader, node):
    return loader.construct_scalar(node).lower() == "true"


def _int(loader, node):
    text = loader.construct_scalar(node)
    base = 16 if text[:2] in ("0x",) else 8 if text[:2] == "0o" else 10
    return YInt(int(text[2:] if base != 10 else text, base), text)


def _float(loader, node):
    text = loader.construct_scalar(node)
    low = text.lower()
    value = float(low.replace(".inf", "inf").replace(".nan", "nan"))
    return YFloat(value, text)


for _tag, _rx, _first in (("bool", _BOOL, "tTfF"), ("null", _NULL, ["~", "n", "N", ""]),
                          ("int", _INT, "-+0123456789"), ("float", _FLOAT, "-+0123456789.")):
    _Loader.add_implicit_resolver(f"tag:yaml.org,2002:{_tag}", _rx, list(_first))
_Loader.add_constructor("tag:yaml.org,2002:bool", _bool)
_Loader.add_constructor("tag:yaml.org,2002:int", _int)
_Loader.add_constructor("tag:yaml.org,2002:float", _float)
_Loader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)


def _expanded_size(node, memo: dict) -> int:
    """Nodes of ``node`` with every alias expanded (an aliased node counted at each use)."""
    key = id(node)
    if key in memo:
        return memo[key]
    memo[key] = 1  # a recursive structure counts once per cycle
    if isinstance(node, yaml.SequenceNode):
        n = 1 + sum(_expanded_size(v, memo) for v in node.value)
    elif isinstance(node, yaml.MappingNode):
        n = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        n = 1
    memo[key] = n
    return n


def _height(node, memo: dict) -> int:
    """Levels of nested sequences / mappings under ``node``, aliases followed; a node inside itself (``&a [*a]``)
    is :class:`TooLarge` (it would build a structure no walk ends on)."""
    key = id(node)
    if key in memo and memo[key] is None:
        raise TooLarge("it contains itself (an alias inside its own anchor)")
    if key not in memo:
        memo[key] = None  # being visited
        children = [c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode) else \
            node.value if isinstance(node, yaml.SequenceNode) else []
        memo[key] = 1 + max((_height(c, memo) for c in children), default=0)
    return memo[key]


class TooLarge(yaml.YAMLError):
    """A document whose aliases expand past ``MAX_NODES`` nodes, or nested too deep to parse."""


def _bounded(loader):
    """The document of ``loader`` (None when empty), refused with :class:`TooLarge` before it is built when its
    aliases expand past ``MAX_NODES`` nodes or it is nested too deep."""
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size, depth = _expanded_size(node, {}), _height(node, {})
    except RecursionError:
        raise TooLarge("it is nested too deep to read") from None
    if depth > MAX_DEPTH:
        raise TooLarge(f"it is nested {depth} levels deep (more than {MAX_DEPTH})")
    if size > MAX_NODES:
        raise TooLarge(f"its aliases expand to {size} nodes (more than {MAX_NODES}); write the values out instead")
    try:
        return loader.construct_document(node)
    except RecursionError:
        raise TooLarge("it is nested too deep to read") from None


def load(text: str, source: str = "value"):
    """``text`` as data under the rules of the module docstring; ``source`` names it in errors."""
    loader = _Loader(text)
    try:
        return _bounded(loader)
    except TooLarge as e:
        raise ConfigError(f"{source}: {e}") from None
    except ConfigError as e:  # a duplicate key
        raise ConfigError(f"{source}: {e}") from None
    finally:
        loader.dispose()


def safe_load(text: str):
    """``yaml.safe_load(text)`` with the alias and depth bounds of :func:`load` (:class:`TooLarge` past them)."""
    loader = yaml.SafeLoader(text)
    try:
        return _bounded(loader)
    finally:
        loader.dispose()


def text_of(value):
    """The text a number was written as; any other value unchanged."""
    return getattr(value, "text", value) if isinstance(value, (YInt, YFloat)) else value


def plain(value):
    """``value`` with YInt/YFloat (also inside lists, tuples and dicts) as plain int/float."""
    if isinstance(value, YInt):
        return int(value)
    if isinstance(value, YFloat):
        return float(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    return value


def echo(value):
    """``value`` as an error message shows it: plain, but a number that overflowed (``1e999``) as it was typed."""
    if isinstance(value, YFloat) and not math.isfinite(value) and value.text.lower().lstrip("+-") not in (
            ".inf", ".nan"):
        return value.text
    return plain(value)


def short(value) -> str:
    """``repr(value)``, at most ``MAX_ECHO`` characters (a long one ends in ``…`` and its length)."""
    text = repr(value)
    return text if len(text) <= MAX_ECHO else f"{text[:MAX_ECHO]}… ({len(text)} characters)"


__all__ = ["MAX_ECHO", "MAX_NODES", "TooLarge", "YFloat", "YInt", "echo", "load", "plain", "safe_load", "short",
           "text_of"]
