"""Running one program in a confined process: its per-program limits, the job it is handed, the private directory
it starts in, its own session and process group, bounded reading of its outputs and the kill at its deadline.

The caller starts the harness (:mod:`diffgrpo.sandbox.harness`, :data:`HARNESS_SOURCE`) in a new session and
process group with a scrubbed environment, stdin on /dev/null and close_fds; it kills the whole process group at
the wall-clock deadline (``timeout_s``), reads stdout, stderr and the result channel incrementally up to
``output_bytes`` each (the rest is drained and dropped), and removes the private directory afterwards (never
following a link; a caller killed by SIGKILL cannot: the next process to start one removes the folders of dead
owners, named by their pid). Every running program is known (:func:`kill_all` kills them all, from any thread).
"""
from __future__ import annotations

import marshal
import os
import secrets
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError, RewardError

HARNESS_SOURCE = (Path(__file__).parent / "harness.py").read_text()


class SandboxError(ConfigError):
    """A sandbox backend cannot start on this machine (one line, naming the backend)."""


class SandboxUnavailable(RewardError):
    """The sandbox keeps failing to run programs (it is neither the programs' pass nor their fail): the run stops."""


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
    ended by itself), timeout (killed at the deadline), error (the sandbox could not run it: neither a pass nor a
    fail, see :attr:`infra`), cancelled; ``confined``: the confinement steps the program applied; bounded
    stdout/stderr text; ``hung``: an error that ran to its deadline (not worth a retry)."""
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
    hung: bool = False

    @property
    def infra(self) -> bool:
        """The sandbox could not run the program (it never started, or the service failed)."""
        return self.status == "error"

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


def scrubbed_env(home: str) -> dict:
    """The whole environment a program starts with (nothing of the caller's)."""
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
    started = f"{job['token']} confined".encode() in outs["report"]  # written before the solution loads
    status = "cancelled" if cancelled is not None and cancelled.is_set() else (
        "error" if not started else "timeout" if timed_out else "ok")
    err = outs["stderr"].decode("utf-8", "replace")
    if status == "error":
        err = f"the sandbox process ended (exit {proc.returncode}) before its harness started: " + err[-2000:]
    return Result(passed, status, proc.returncode, outs["stdout"].decode("utf-8", "replace"), err,
                  time.monotonic() - t0, confined, truncated, loaded, proc.pid, hung=timed_out and not started)


def make_job(program: Program, limits: Limits, **flags) -> dict:
    """What the harness reads: the program, its limits, a fresh result-channel token and the backend's ``flags``."""
    return {"token": secrets.token_hex(16), "code": program.code, "setup": program.setup,
            "tests": list(program.tests), "limits": limits.as_job(), "parent_pid": os.getpid(), **flags}


PREFIX = "diffgrpo-sandbox-"  # + the owner's pid + "-": a folder whose owner is dead is removed at the next start
_SWEPT: set[str] = set()  # the temporary directories swept by this process


def owner_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts as alive: its folder is not ours to judge)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_stale(tmp: str | None = None) -> list[str]:
    """Remove ``<tmp>/diffgrpo-sandbox-<pid>-*`` folders of this uid whose owner ``pid`` is dead (a caller killed
    by SIGKILL never removes its own); never a link, nor a folder of a live owner → the names removed."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmp))
    except OSError:
        return removed
    for e in entries:
        pid = e.name[len(PREFIX):].split("-", 1)[0]
        if not (e.name.startswith(PREFIX) and pid.isdigit() and e.is_dir(follow_symlinks=False)):
            continue
        try:
            if e.stat(follow_symlinks=False).st_uid != os.getuid() or owner_alive(int(pid)):
                continue
        except OSError:
            continue
        shutil.rmtree(e.path, ignore_errors=True)  # fd-based on Linux: links inside are removed, never followed
        removed.append(e.name)
    return removed


class PrivateDir:
    """``<tmp>/diffgrpo-sandbox-<pid>-*/{job.bin, work/}``, mode 0700, removed on exit without following links;
    the first one a process makes sweeps the folders of dead owners (:func:`sweep_stale`)."""

    def __enter__(self):
        tmp = tempfile.gettempdir()
        if tmp not in _SWEPT:
            _SWEPT.add(tmp)
            sweep_stale(tmp)
        self.root = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-", dir=tmp)
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


__all__ = ["HARNESS_SOURCE", "Limits", "PrivateDir", "Program", "Result", "SandboxError", "SandboxUnavailable",
           "kill_all", "make_job", "owner_alive", "parse_report", "run_process", "scrubbed_env",
           "sweep_stale"]
