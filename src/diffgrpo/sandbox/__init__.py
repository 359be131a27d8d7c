"""Run untrusted Python code against tests: every program is hostile input.

  process.py   one program in a confined process: :class:`Limits`, :class:`Program`, :class:`Result`, its own
               session and process group, bounded outputs, the kill at the deadline, :func:`kill_all`
  backends.py  the backends (``local``, ``bwrap``, ``remote``; ``auto`` = bwrap when it starts here, else local)
               and the choice among them, each checked by running one trivial program
  pool.py      many programs at once: :class:`SandboxPool`, :func:`make_sandbox`
  harness.py   what runs inside: the program confines itself, then runs the code and each test
"""
from __future__ import annotations

from . import backends, pool, process
from .backends import BACKENDS, BwrapBackend, LocalBackend, RemoteBackend, SandboxError, choose, find_bwrap
from .pool import SandboxPool, make_sandbox
from .process import HARNESS_SOURCE, Limits, Program, Result, kill_all, parse_report

__all__ = [
    "BACKENDS",
    "HARNESS_SOURCE",
    "BwrapBackend",
    "Limits",
    "LocalBackend",
    "Program",
    "RemoteBackend",
    "Result",
    "SandboxError",
    "SandboxPool",
    "backends",
    "choose",
    "find_bwrap",
    "kill_all",
    "make_sandbox",
    "parse_report",
    "pool",
    "process",
]
