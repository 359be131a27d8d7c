"""The one resolver of ``module:attr`` plug-ins named in the config (rewards, engines, guard rewards and features).

:func:`resolve` splits a spec at its last ``:``, checks that both parts are Python names, imports the module with
the current directory importable (``diffgrpo`` started as a console script does not put it on ``sys.path`` the
way ``python script.py`` does; ``__main__:fn`` names a function of the running script or notebook) and returns
the attribute. A malformed spec, a module that fails to import (whatever it raises) or a missing attribute is a
one-line ConfigError naming the config key; callers word it through the ``malformed`` and ``failed`` templates.

:func:`no_exit` guards a call into user code: ``os._exit`` called in this process while it runs (from any thread)
raises the given error instead of ending the process with no word (a status 0 that reads as success).
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import threading

from .errors import ConfigError

# message templates: {key} the config key, {spec} the spec's repr, {problem} what is malformed, {error} the failure
MALFORMED = "{key}: {spec!r} is not a valid module:attr ({problem})"
FAILED = "{key}: cannot import {spec!r} ({error})"
ERROR_CHARS = 200  # of the import error's message in a ConfigError


def split(spec: str) -> tuple[str, str, str]:
    """``package.module:attr`` → (module, attr, problem); problem is empty when the form is well made."""
    mod, _, attr = spec.rpartition(":")
    if not mod:
        return mod, attr, "the module name is empty"
    if not all(part.isidentifier() for part in mod.split(".")):
        return mod, attr, f"{mod!r} is not a dotted module name"
    if not attr.isidentifier():
        return mod, attr, f"{attr!r} is not a Python name"
    return mod, attr, ""


def import_module(mod: str):
    """``importlib.import_module`` with the current directory importable (appended, so it never shadows an
    installed package)."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)
    return importlib.import_module(mod)


def _one_line(text: object, limit: int = ERROR_CHARS) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def resolve(spec: str, *, key: str, malformed: str = MALFORMED, failed: str = FAILED, hint: str = "") -> object:
    """The object ``spec`` (``package.module:attr``) names, for config key ``key``. Raises a one-line ConfigError:
    ``malformed`` when the spec is not of that form, ``failed`` when the module does not import (any exception it
    raises) or lacks the attribute; ``hint`` (e.g. the registry's names) ends either message."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ConfigError(malformed.format(key=key, spec=spec, problem="no ':' between module and name") + hint)
    mod, attr, problem = split(spec)
    if problem:
        raise ConfigError(malformed.format(key=key, spec=spec, problem=problem) + hint)
    try:
        return getattr(import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 - anything the user's module raises on import
        error = f"{type(e).__name__}: {_one_line(e)}"
        raise ConfigError(failed.format(key=key, spec=spec, error=error) + hint) from None


_GUARD_LOCK = threading.Lock()
_GUARDED: list[tuple[str, type]] = []  # the calls in progress (any thread): (what, error class)
_REAL_EXIT: list = []  # os._exit as it was before the first guard (one entry while guards are in place)


def _guarded_exit(code=0):
    with _GUARD_LOCK:
        guarded = list(_GUARDED)
        real = _REAL_EXIT[0] if _REAL_EXIT else os._exit
        owner = _REAL_EXIT[1] if _REAL_EXIT else None
    if not guarded or os.getpid() != owner:  # a forked child's own exit is its business
        real(code)
    what, error = guarded[-1]
    raise error(f"{what} called os._exit({code!r}), which would end the process at once (status {code!r}, no "
                "checkpoint, no message); it returns or raises an exception instead, so the run stops here")


@contextlib.contextmanager
def no_exit(what: str, error: type = Exception):
    """While the block runs, ``os._exit`` in this process raises ``error`` naming ``what`` (e.g. "reward 'x'")."""
    with _GUARD_LOCK:
        if not _GUARDED:
            _REAL_EXIT[:] = [os._exit, os.getpid()]
            os._exit = _guarded_exit
        _GUARDED.append((what, error))
    try:
        yield
    finally:
        with _GUARD_LOCK:
            _GUARDED.remove((what, error))
            if not _GUARDED and _REAL_EXIT:
                os._exit = _REAL_EXIT[0]
                _REAL_EXIT.clear()


def running() -> list[str]:
    """What the guarded calls in progress are (:func:`no_exit`'s ``what``), oldest first. Takes no lock: safe in a
    signal handler."""
    return [what for what, _ in list(_GUARDED)]


def real_exit(code: int) -> None:
    """``os._exit`` itself, whatever guard is in place."""
    (_REAL_EXIT[0] if _REAL_EXIT else os._exit)(code)


__all__ = ["ERROR_CHARS", "FAILED", "MALFORMED", "import_module", "no_exit", "real_exit", "resolve", "running",
           "split"]
