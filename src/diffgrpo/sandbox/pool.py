"""Running many programs: :class:`SandboxPool` runs at most ``workers`` programs at once on one backend in daemon
threads; an interrupt (KeyboardInterrupt, a second SIGTERM in the trainer) kills every running program's group
before it propagates, and :meth:`SandboxPool.close` kills them too. :func:`make_sandbox` builds a pool on a backend
checked to start here (``backends.choose``).

A program the sandbox could not run (it never started, the service failed: ``Result.infra``) is retried
(``retries``), then returned as such: neither a pass nor a fail.

Cost: one interpreter start per completion (measured in ``docs/code_and_math.md``), all its tests in that one
process. Exactness: the score is the fraction of the tests whose code ran without an exception (an assert that
holds); a solution can fake results from inside its own process (as in every in-process runner), it cannot
reach the caller, its files, the network or other processes.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from .backends import choose
from .process import Limits, Program, Result, kill_all

_WARNED: set[str] = set()
_WANTED = {"local": ("netns", "pidns", "nocaps", "landlock", "seccomp"), "bwrap": ("nocaps", "seccomp")}


def _warn_once(backend: str, confined: tuple[str, ...], log) -> None:
    missing = [s for s in _WANTED.get(backend, ()) if not any(c.startswith(s) for c in confined)]
    key = f"{backend}:{','.join(missing)}"
    if missing and key not in _WARNED:
        _WARNED.add(key)
        what = {"netns": "no network namespace (not root): the seccomp filter alone refuses sockets other than "
                         "AF_UNIX", "landlock": "no Landlock in this kernel: files readable by this uid are "
                         "readable by the code", "seccomp": "no seccomp filter on this architecture: "
                         "new processes are bounded by RLIMIT_NPROC only (not enforced for root), and sockets, other "
                            "processes' limits, host settings and bpf are refused only by the missing capabilities",
                "pidns": "no pid namespace: other processes of this uid are visible (their limits, priority and "
                         "scheduling are refused by the seccomp filter)",
                "nocaps": "capabilities could not be dropped"}
        log(f"warning: sandbox backend {backend!r}: " + "; ".join(what[m] for m in missing)
            + " (see docs/code_and_math.md)")


@dataclass
class SandboxPool:
    """At most ``workers`` programs at once, each on ``backend`` with ``limits``."""
    backend: object
    limits: Limits = field(default_factory=Limits)
    workers: int = 4
    log: object = print
    retries: int = 2

    def __post_init__(self):
        self._cancel = threading.Event()

    def run_many(self, programs: list[Program]) -> list[Result]:
        """Run every program (daemon worker threads, ``workers`` at a time) → results in order. An interrupt in
        the calling thread kills every running program and propagates."""
        results: list[Result | None] = [None] * len(programs)
        it = iter(range(len(programs)))
        lock = threading.Lock()

        def work():
            while not self._cancel.is_set():
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                results[i] = self._run_retried(programs[i])

        threads = [threading.Thread(target=work, daemon=True, name=f"sandbox-{k}")
                   for k in range(max(1, min(self.workers, len(programs))))]
        for t in threads:
            t.start()
        try:
            for t in threads:
                while t.is_alive():
                    t.join(0.1)
        except BaseException:
            self.close()
            raise
        out = [r if r is not None else Result([False] * len(p.tests), "cancelled") for r, p in zip(results, programs)]
        for r in out:
            if r.confined:
                _warn_once(self.backend.name, r.confined, self.log)
                break
        return out

    def _run_retried(self, program: Program) -> Result:
        """One program; a sandbox that could not run it (``Result.infra``) is tried again, at most ``retries``
        times, 0.5 s, 1 s, … apart, unless it ran to its deadline (it would hang again) or the pool is closed."""
        for attempt in range(self.retries + 1):
            try:
                r = self.backend.run(program, self.limits, self._cancel)
            except Exception as e:  # noqa: BLE001 - a backend's failure is a failure to run, not the program's
                r = Result([False] * len(program.tests), "error", stderr=f"{type(e).__name__}: {e}")
            if not r.infra or r.hung or attempt == self.retries or self._cancel.wait(0.5 * (attempt + 1)):
                return r
        return r

    def run(self, program: Program) -> Result:
        return self.run_many([program])[0]

    def close(self) -> None:
        """Stop: no new program starts, every running one is killed."""
        self._cancel.set()
        kill_all()

    def reopen(self) -> None:
        self._cancel.clear()


def make_sandbox(backend: str = "auto", *, workers: int = 0, url: str = "", limits: Limits | None = None,
                 log=print, key: str = "sandbox") -> SandboxPool:
    """A pool on ``backend`` (one of :data:`~diffgrpo.sandbox.backends.BACKENDS`), checked by running one trivial
    program; ``workers`` 0 = the CPUs this process may use. Raises a one-line SandboxError naming the backend when
    it cannot start."""
    limits = limits or Limits()
    chosen = choose(backend, url=url, limits=limits, key=key, log=log)
    return SandboxPool(chosen, limits, workers or max(1, len(os.sched_getaffinity(0))), log)


__all__ = ["SandboxPool", "make_sandbox"]
