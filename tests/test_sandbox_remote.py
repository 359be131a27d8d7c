"""The remote sandbox's client against a service that misbehaves (slow, failing, malformed; a local HTTP server on
127.0.0.1 that stops by itself), and a sandbox of any backend that cannot run a program: neither a pass nor a
fail (retried, then NaN, counted, and a run whose sandbox keeps failing stops in one line)."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

import diffgrpo.sandbox as sb
from diffgrpo.config import RunConfig
from diffgrpo.errors import RewardError
from diffgrpo.models.hf_masked_lm import MaskedLMPolicy, tiny_bert
from diffgrpo.rewards.verifiers import build_verify_code
from diffgrpo.sandbox import Limits, LocalBackend, Program, RemoteBackend, SandboxPool, SandboxUnavailable
from diffgrpo.tasks import VOCAB, get_task
from diffgrpo.tasks.code import CodeToy
from diffgrpo.trainer import Trainer
from diffgrpo.validation import validate

SRC = str(Path(sb.__file__).parents[2])
GOOD = Program("def f(x):\n    return 2 * x", ["assert f(2) == 4", "assert f(3) == 5"])


def _run_code(code: str, timeout: float) -> dict:
    out = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=timeout,
                         check=False)
    return {"status": "Finished", "return_code": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


class _Service(BaseHTTPRequestHandler):
    """``mode`` (the server's): ok, slow_body, slow_head, 503, not_json, huge, no_result, fail_some (503 for a
    program whose code holds FAIL; the start-up probe and the others run), fail_after_probe (only the probe runs)."""

    def do_POST(self):
        srv = self.server
        srv.calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        mode, probe = srv.mode, "'assert x == 1'" in body["code"]
        if mode == "slow_head":
            for ch in b"HTTP/1.1 200 OK\r\n":
                if not self._send(bytes([ch])):
                    return
                time.sleep(0.3)
            return
        if mode == "503" and srv.calls <= srv.fail_first or mode == "503" and not srv.fail_first or (
                mode == "fail_some" and "FAIL" in body["code"]) or (mode == "fail_after_probe" and not probe):
            return self._reply(503, b"busy")
        if mode in ("not_json", "huge", "no_result"):
            data = {"not_json": b"<html>oops</html>", "huge": b" " * (8 << 20),
                    "no_result": json.dumps({"status": "SandboxError", "message": "no worker"}).encode()}[mode]
            return self._reply(200, data)
        data = json.dumps({"status": "Success", "run_result": _run_code(body["code"], body["run_timeout"])}).encode()
        if mode != "slow_body":
            return self._reply(200, data)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for i in range(len(data)):  # one byte every 0.3 s: each read returns, the request never ends
            if not self._send(data[i:i + 1]):
                return
            time.sleep(0.3)

    def _send(self, b: bytes) -> bool:
        try:
            self.wfile.write(b)
            self.wfile.flush()
            return time.monotonic() < self.server.stop_at  # a bounded server: it stops by itself
        except OSError:
            return False

    def _reply(self, code: int, data: bytes):
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._send(data)

    def log_message(self, *a):
        pass


def _serve(mode: str, fail_first: int = 0):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Service)
    srv.daemon_threads = True
    srv.mode, srv.fail_first, srv.calls, srv.stop_at = mode, fail_first, 0, time.monotonic() + 60
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def serve():
    started = []

    def start(mode, fail_first=0):
        srv, url = _serve(mode, fail_first)
        started.append(srv)
        return srv, url

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


# ---------------------------------------------------------------------------------------------- H4: a slow service
@pytest.mark.parametrize("mode", ["slow_body", "slow_head"])
def test_a_slow_reply_ends_at_the_request_deadline(serve, mode):
    _, url = serve(mode)
    t0 = time.monotonic()
    r = RemoteBackend(url, slack_s=1.0).run(GOOD, Limits(timeout_s=1.0))
    took = time.monotonic() - t0
    assert took < 4.0, took  # timeout_s + slack_s, not a read timeout renewed by every byte
    assert r.infra and r.hung and r.passed == [False, False] and "within" in r.stderr, r


def test_a_closed_pool_ends_a_slow_request_at_once(serve):
    _, url = serve("slow_body")
    pool = SandboxPool(RemoteBackend(url, slack_s=60.0), Limits(timeout_s=60.0), workers=1, log=lambda *a: None)
    threading.Timer(1.0, pool.close).start()
    t0 = time.monotonic()
    r = pool.run(GOOD)
    assert time.monotonic() - t0 < 4.0 and r.status == "cancelled", r


TRAINER_LIKE = textwrap.dedent("""
    import signal, sys
    sys.path.insert(0, sys.argv[2])
    from diffgrpo.sandbox import Limits, Program, RemoteBackend, SandboxPool
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(s))  # the trainer's: finish the iteration, then stop
    pool = SandboxPool(RemoteBackend(sys.argv[1], slack_s=2.0), Limits(timeout_s=2.0), workers=2, log=print)
    print("ready", flush=True)
    while not stop:
        rs = pool.run_many([Program("x = 1", ["assert x == 1"]) for _ in range(4)])
    print("stopped", sorted({r.status for r in rs}), flush=True)
""")


def test_the_first_sigterm_ends_a_run_on_a_slow_service(serve, tmp_path):
    """A trainer-like process whose handler finishes the current iteration: with a slow service the iteration
    ends at the requests' deadline (4 s here), so the first SIGTERM ends the process in seconds."""
    _, url = serve("slow_body")
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER_LIKE)
    p = subprocess.Popen([sys.executable, str(script), url, SRC], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        time.sleep(1.0)
        t0 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
        assert time.monotonic() - t0 < 12.0 and p.returncode == 0, (out, err[-2000:])
        assert "stopped ['error']" in out, out
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


# ---------------------------------------------------------------------------------------------- H5: infra failures
@pytest.mark.parametrize("mode", ["503", "not_json", "huge", "no_result"])
def test_a_failing_service_is_an_infra_failure_not_a_fail(serve, mode):
    srv, url = serve(mode)
    pool = SandboxPool(RemoteBackend(url, slack_s=5.0), Limits(timeout_s=5.0), workers=1, retries=2,
                       log=lambda *a: None)
    r = pool.run(GOOD)
    assert r.infra and r.status == "error" and r.stderr.startswith("remote sandbox:"), r
    assert srv.calls == 3  # tried, then retried twice


def test_a_transient_failure_is_retried_and_then_scores(serve):
    srv, url = serve("503", fail_first=2)
    r = SandboxPool(RemoteBackend(url), Limits(timeout_s=5.0), workers=1, log=lambda *a: None).run(GOOD)
    assert r.status == "ok" and r.passed == [True, False] and srv.calls == 3, r


class _Counting:
    name = "local"

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def run(self, *a):
        self.calls += 1
        return self.inner.run(*a)


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/true"])
def test_a_process_that_cannot_start_is_an_infra_failure(python):
    """It cannot be started at all, or it ends before its harness said a word: not a fail of the program."""
    backend = _Counting(LocalBackend(python=python))
    r = SandboxPool(backend, Limits(timeout_s=5.0), workers=1, retries=1, log=lambda *a: None).run(GOOD)
    assert r.infra and backend.calls == 2, r
    ok = LocalBackend().run(Program("raise SystemExit(3)", ["assert True"]), Limits(timeout_s=5.0))
    assert ok.status == "ok" and not ok.infra and ok.passed == [False]  # the program's own exit is a fail


def test_a_partial_outage_scores_nan_counts_it_and_goes_on(serve):
    _, url = serve("fail_some")
    task = CodeToy()
    task.scorer.use(SandboxPool(RemoteBackend(url), Limits(timeout_s=5.0), workers=2, retries=1,
                                log=lambda *a: None))
    exs = task.instances("train")[:4]
    answers = [e.answer for e in exs]
    answers[1] = answers[1].replace("</answer>", " + 0*len('FAIL')</answer>")
    out = task.rewards(answers, exs)
    assert math.isnan(out["reward"][1]) and math.isnan(out["correct"][1]), out
    assert [out["reward"][i].item() for i in (0, 2, 3)] == [1.0, 1.0, 1.0]
    assert out["sandbox_infra_failures"].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert task.scorer.infra_failures == 1
    fn = build_verify_code(backend="remote", url=url, workers=1)  # the registry reward: NaN the same way
    scores = fn(["def f(x):\n    return x", "def f(x):\n    return x  # FAIL"], ["", ""],
                [{"test_list": ["assert f(1) == 1"]}] * 2)
    assert scores[0] == 1.0 and math.isnan(scores[1])


def test_a_sandbox_that_keeps_failing_stops_the_run_in_one_line(serve):
    """Every program of a call (after the retries) → SandboxUnavailable, a RewardError: one line, exit 1; and at
    least half of them in 3 calls in a row."""
    _, url = serve("fail_some")
    task = CodeToy()
    task.scorer.use(SandboxPool(RemoteBackend(url), Limits(timeout_s=5.0), workers=2, retries=0,
                                log=lambda *a: None))
    exs = task.instances("train")[:2]
    bad = [e.answer.replace("</answer>", " + 0*len('FAIL')</answer>") for e in exs]
    half = [bad[0], exs[1].answer]
    for _ in range(2):
        assert math.isnan(task.rewards(half, exs)["reward"][0])
    assert task.rewards([exs[0].answer, exs[1].answer], exs)["reward"].tolist() == [1.0, 1.0]  # a good call resets
    for _ in range(2):
        assert math.isnan(task.rewards(half, exs)["reward"][0])
    with pytest.raises(SandboxUnavailable, match="at least half in 3 calls in a row"):
        task.rewards(half, exs)
    with pytest.raises(SandboxUnavailable) as e:
        CodeToy.rewards(_fresh(task), bad, exs)
    assert isinstance(e.value, RewardError) and "\n" not in str(e.value) and "could not run 2 of 2" in str(e.value)


def _fresh(task):
    task.scorer.failing_calls = 0
    return task


def test_a_trainer_on_a_failing_service_stops_with_the_reason(serve):
    """dllm.sandbox=remote on a service that answers the start-up probe and then fails: the first rollout
    stops with SandboxUnavailable (the CLI prints it in one line and exits 1)."""
    _, url = serve("fail_after_probe")
    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "dllm.task=code_toy", "dllm.sandbox=remote",
                                    f"dllm.sandbox_url={url}", "dllm.sandbox_workers=2", "dllm.sandbox_timeout=5",
                                    "train.prompts_per_batch=2", "train.group_size=2", "log.progress=false",
                                    "log.save_images=false", "dllm.eval_size=2"])
    validate(cfg)
    torch.manual_seed(0)
    task = get_task("code_toy")
    net = tiny_bert(len(VOCAB), max_positions=task.prompt_length + task.gen_length, hidden_size=32,
                    num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    tr = Trainer(cfg, policy=MaskedLMPolicy(net, vocab=VOCAB, keep_reference=False), log=lambda *a: None)
    tr.family.task.scorer.pool.retries = 0
    tr.family.task.slip = lambda ex: None
    texts = [e.answer for e in tr.family.task.instances("train")[:4]]
    with pytest.raises(SandboxUnavailable, match=r"sandbox \(remote\) could not run"):
        tr.family.rewards(texts, tr.family.task.instances("train")[:4])
