"""The sandbox against attacks on the machine beyond the program's own process: other processes' limits, priority
and affinity, host settings, the kernel log, bpf, pathname Unix sockets. Each runs on every backend this machine
can start: ``local``, ``bwrap``, and ``auto`` as if bwrap were absent (local, chosen by the fallback); each
asserts that the attack failed inside AND that its target is unchanged outside."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import diffgrpo.sandbox as sb
import diffgrpo.sandbox.backends as sb_backends
from diffgrpo.sandbox import BwrapBackend, Limits, LocalBackend, Program

KINDS = ["local", "auto_without_bwrap"] + (["bwrap"] if sb.find_bwrap() else [])
FAST = Limits(timeout_s=6.0, test_s=2.0, memory_mb=256)
SRC = str(Path(sb.__file__).parents[2])


def _backend(kind: str, monkeypatch=None, log=None):
    if kind == "bwrap":
        return BwrapBackend()
    if kind == "local":
        return LocalBackend()
    monkeypatch.setattr(sb_backends, "find_bwrap", lambda: None)
    return sb_backends.choose("auto", log=log or (lambda *a: None))


@pytest.fixture(params=KINDS)
def backend(request, monkeypatch):
    return _backend(request.param, monkeypatch)


def test_auto_without_bwrap_falls_back_to_local_and_says_so_once(monkeypatch):
    lines: list[str] = []
    monkeypatch.setattr(sb_backends, "_FELL_BACK", set())
    for _ in range(2):
        assert isinstance(_backend("auto_without_bwrap", monkeypatch, lines.append), LocalBackend)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "'local'" in lines[0] and "bwrap" in lines[0] and "does not confine" in lines[0], lines[0]


# ---------------------------------------------------------------------------------------------- other processes
STAND_IN = r"""
import json, os, resource, sys
sys.path.insert(0, sys.argv[2])
import diffgrpo.sandbox.backends as sbb
from diffgrpo.sandbox import BwrapBackend, Limits, LocalBackend, Program
kind = sys.argv[1]
if kind == "auto_without_bwrap":
    sbb.find_bwrap = lambda: None
backend = {"local": LocalBackend, "bwrap": BwrapBackend}.get(kind, lambda: sbb.choose("auto", log=lambda *a: None))()
me = os.getpid()
def state():
    return {"cpu": resource.prlimit(me, resource.RLIMIT_CPU), "nofile": resource.prlimit(me, resource.RLIMIT_NOFILE),
            "as": resource.prlimit(me, resource.RLIMIT_AS), "nice": os.getpriority(os.PRIO_PROCESS, me),
            "pgrp_nice": os.getpriority(os.PRIO_PGRP, os.getpgid(me)), "cpus": sorted(os.sched_getaffinity(me))}
before = state()
attack = '''
import os, resource
reached = []
def attempt(name, fn):
    try:
        fn()
        reached.append(name)
    except OSError:
        pass
for pid in {os.getppid(), PARENT} - {0, os.getpid()}:
    attempt(f"cpu {pid}", lambda: resource.prlimit(pid, resource.RLIMIT_CPU, (1, 1)))
    attempt(f"nofile {pid}", lambda: resource.prlimit(pid, resource.RLIMIT_NOFILE, (3, 3)))
    attempt(f"as {pid}", lambda: resource.prlimit(pid, resource.RLIMIT_AS, (1 << 20, 1 << 20)))
    attempt(f"nice {pid}", lambda: os.setpriority(os.PRIO_PROCESS, pid, 19))
    attempt(f"pgrp nice {pid}", lambda: os.setpriority(os.PRIO_PGRP, pid, 19))
    attempt(f"affinity {pid}", lambda: os.sched_setaffinity(pid, {0}))
    attempt(f"scheduler {pid}", lambda: os.sched_setscheduler(pid, os.SCHED_IDLE, os.sched_param(0)))
'''.replace("PARENT", str(me))
r = backend.run(Program(attack, ["assert reached == [], reached"]), Limits(timeout_s=6.0))
print(json.dumps({"passed": r.passed, "status": r.status, "unchanged": state() == before, "before": before,
                  "after": state(), "stderr": r.stderr[-500:]}), flush=True)
"""


@pytest.mark.parametrize("kind", KINDS)
def test_other_processes_limits_priority_and_affinity_are_out_of_reach(kind, tmp_path):
    """The completion aims at its caller (a stand-in parent in its own session, so that a failure cannot reach
    pytest): RLIMIT_CPU/NOFILE/AS, nice (process and group), affinity, scheduler."""
    script = tmp_path / "parent.py"
    script.write_text(STAND_IN)
    out = subprocess.run([sys.executable, str(script), kind, SRC], capture_output=True, text=True, timeout=60,
                         start_new_session=True, check=False)
    assert out.returncode == 0, (out.returncode, out.stdout, out.stderr[-2000:])
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["passed"] == [True] and got["status"] == "ok", got
    assert got["unchanged"], got


# ---------------------------------------------------------------------------------------------- the kernel, the host
KERNEL = textwrap.dedent("""
    import ctypes, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    try:
        socket.sethostname("pwned")
        hostname = True
    except OSError:
        hostname = False
    buf = ctypes.create_string_buffer(4096)
    klog = libc.klogctl(3, buf, 4096)  # SYSLOG_ACTION_READ_ALL
    try:
        os.open("/dev/kmsg", os.O_RDONLY)
        kmsg = True
    except OSError:
        kmsg = False
    attr = ctypes.create_string_buffer(bytes([2, 0, 0, 0, 4, 0, 0, 0, 4, 0, 0, 0, 1, 0, 0, 0]), 128)  # ARRAY 4/4 x1
    bpf = libc.syscall({"x86_64": 321, "aarch64": 280}[os.uname().machine], 0, attr, 128)  # BPF_MAP_CREATE
""")


def test_host_settings_kernel_log_and_bpf_are_refused(backend):
    host = socket.gethostname()
    r = backend.run(Program(KERNEL, ["assert not hostname", "assert klog < 0", "assert not kmsg", "assert bpf < 0"]),
                    FAST)
    assert r.passed == [True, True, True, True], (r.status, r.stderr[-1000:])
    assert socket.gethostname() == host


def test_pathname_unix_sockets_cannot_be_reached(backend, tmp_path):
    """A stream and a datagram socket, world-writable, in a world-readable directory: nothing connects, nothing
    arrives."""
    os.chmod(tmp_path, 0o777)
    stream_path, dgram_path = str(tmp_path / "s.sock"), str(tmp_path / "d.sock")
    stream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        stream.bind(stream_path)
        stream.listen(4)
        dgram.bind(dgram_path)
        for p in (stream_path, dgram_path):
            os.chmod(p, 0o777)
        stream.settimeout(0.3)
        dgram.settimeout(0.3)
        code = textwrap.dedent(f"""
            import socket
            reached = []
            try:
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.connect({stream_path!r})
                s.sendall(b"hi")
                reached.append("stream")
            except OSError:
                pass
            try:
                socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"hi", {dgram_path!r})
                reached.append("dgram")
            except OSError:
                pass
            try:
                a, b = socket.socketpair()  # a pair reaches nothing outside: it stays allowed
                a.sendall(b"x")
                pair = b.recv(1) == b"x"
            except OSError:
                pair = False
        """)
        r = backend.run(Program(code, ["assert reached == []", "assert pair"]), FAST)
        assert r.passed == [True, True], (r.status, r.stderr[-1000:])
        with pytest.raises(socket.timeout):
            stream.accept()
        with pytest.raises(socket.timeout):
            dgram.recv(16)
    finally:
        stream.close()
        dgram.close()


def test_local_confinement_steps_are_reported(backend):
    """What the local backend applies on this machine (root here: namespaces; any uid: no capabilities)."""
    r = backend.run(Program("x = 1", ["assert x == 1"]), FAST)
    assert r.all_passed and {"nocaps", "seccomp", "no_new_privs"} <= set(r.confined), r.confined
    if backend.name == "local" and os.geteuid() == 0:
        assert {"netns", "pidns", "tmpfs"} <= set(r.confined), r.confined
