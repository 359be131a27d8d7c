"""How a user's reward function is called: the two conventions, checked at validation, before any model loads.

  positional (this library's):  ``fn(images, prompts, metadata)`` with the samples (a (B, C, H, W) tensor, or B
                                completion strings), the B prompts and B metadata dicts.
  keywords (TRL's):             ``fn(prompts=..., completions=..., <field>=..., **kwargs)``: the samples arrive as
                                ``completions`` (and, for images, also as ``images``), every metadata field by its
                                name as a list of B values (None where a record lacks it), plus ``reward.options``.

A function takes the keyword convention when it names no ``metadata`` parameter and has ``**kwargs``, a
keyword-only parameter, or a parameter named ``completions``; otherwise the positional one. ``reward.options.<name>``
of a ``module:function`` reward are passed as keyword arguments on every call in both conventions.
:func:`check_signature` refuses, in one line, a function that cannot be called so (missing or unknown
parameters), so a mismatch is not found after the policy has loaded.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping

import torch

from ..errors import ConfigError

SAMPLE_NAMES = ("completions", "images")
_HOW = ("a reward takes (images, prompts, metadata) positionally, or keywords as TRL does: prompts=, completions= "
        "(images= for images), each metadata field by name, **kwargs")


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: called positionally, unchecked
        return None


def convention(fn) -> str:
    """``"keywords"`` (TRL) or ``"positional"`` for ``fn`` (see the module docstring)."""
    sig = _signature(fn)
    if sig is None:
        return "positional"
    params = sig.parameters
    if "metadata" in params:
        return "positional"
    kinds = {p.kind for p in params.values()}
    if inspect.Parameter.VAR_KEYWORD in kinds or inspect.Parameter.KEYWORD_ONLY in kinds or "completions" in params:
        return "keywords"
    return "positional"


def check_signature(name: str, fn, options: Mapping | None = None, *, fields: set[str] | None = None) -> None:
    """A one-line ConfigError unless ``fn`` can be called in its convention with ``options`` as keywords.
    ``fields``: the metadata fields the prompt records carry, when known (else a required parameter may be any
    field name; a record that lacks it gives None)."""
    sig = _signature(fn)
    options = dict(options or {})
    if sig is None:
        return
    key = f"reward.weights: reward {name!r}"
    params = sig.parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if convention(fn) == "positional":
        try:
            sig.bind(None, None, None, **options)
        except TypeError as e:
            raise ConfigError(f"{key} cannot be called as fn(images, prompts, metadata{', ' if options else ''}"
                              f"{', '.join(f'{k}=' for k in options)}) ({e}); {_HOW}") from None
        return
    provided = {"prompts", *SAMPLE_NAMES, *options, *(fields or ())}
    for p in params.values():
        if p.kind is inspect.Parameter.POSITIONAL_ONLY and p.default is p.empty:
            raise ConfigError(f"{key} has a positional-only parameter {p.name!r}; {_HOW}")
        required = p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.default is p.empty
        if required and p.name not in provided and fields is not None:  # unknown fields: any name may be one
            raise ConfigError(f"{key} requires {p.name!r}, which no call provides (keywords given: prompts, "
                              f"completions, images, reward.options and the prompt records' fields "
                              f"{sorted(fields)}); {_HOW}")
    if not var_kw:
        unknown = [k for k in options if k not in params]
        if unknown:
            raise ConfigError(f"reward.options.{name}.{unknown[0]}: reward {name!r} takes no parameter "
                              f"{unknown[0]!r} (and no **kwargs)")


def bind(fn, options: Mapping | None = None) -> Callable:
    """``fn`` as this library calls every reward, ``(images, prompts, metadata) → scores``, with ``options`` bound
    as keywords and, for the keyword convention, the arguments spread by name."""
    options = dict(options or {})
    if convention(fn) == "positional":
        if not options:
            return fn

        def positional(images, prompts, metadata=None):
            return fn(images, prompts, metadata, **options)
        return _named(positional, fn)
    sig = _signature(fn)
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())

    def keywords(images, prompts, metadata=None):
        B = len(prompts)
        metadata = list(metadata) if metadata is not None else [{} for _ in range(B)]
        kw: dict = {}
        for field in dict.fromkeys(k for m in metadata for k in m):  # every field, first-seen order
            if field not in ("prompts", *SAMPLE_NAMES):
                kw[field] = [m.get(field) for m in metadata]
        kw.update(prompts=list(prompts), completions=images)
        if torch.is_tensor(images):
            kw["images"] = images
        kw.update(options)
        if not var_kw:
            kw = {k: v for k, v in kw.items() if k in sig.parameters}
        return fn(**kw)
    return _named(keywords, fn)


def _named(wrapper, fn):
    wrapper.__name__ = getattr(fn, "__name__", "reward")
    wrapper.__qualname__ = getattr(fn, "__qualname__", wrapper.__name__)
    wrapper.__wrapped_reward__ = fn
    return wrapper


__all__ = ["SAMPLE_NAMES", "bind", "check_signature", "convention"]
