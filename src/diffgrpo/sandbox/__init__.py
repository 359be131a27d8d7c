"""Run untrusted Python code against tests: every program is hostile input.

  process.py   one program in a confined process: :class:`Limits`, :class:`Program`, :class:`Result`, its own
               session and process group, bounded outputs, the kill at the deadline, :func:`kill_all`
  backends.py  the backends (``local``, ``bwrap``, ``remote``; ``auto`` = bwrap when it starts here, else local)
               and the choice among them, each checked by running one trivial program
  remote.py    the ``remote`` backend's client: one deadline per request, cancellable, service failures told apart
  pool.py      many programs at once: :class:`SandboxPool`, :func:`make_sandbox`
  harness.py   what runs inside: the program confines itself, then runs the code and each test
"""
from __future__ import annotations

from . import backends, pool, process, remote
from .backends import BACKENDS, BwrapBackend, LocalBackend, choose, find_bwrap
from .pool import SandboxPool, make_sandbox
from .process import HARNESS_SOURCE, Limits, Program, Result, SandboxError, SandboxUnavailable, kill_all, parse_report
from .remote import RemoteBackend

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
    "SandboxUnavailable",
    "backends",
    "choose",
    "find_bwrap",
    "kill_all",
    "make_sandbox",
    "parse_report",
    "pool",
    "process",
    "remote",
]
