"""Reliability of what reaches the run from outside it: the ``http`` reward and the remote sandbox against a server
that redirects, trickles, floods or answers nonsense (a local HTTP server on 127.0.0.1 that stops by itself); a
plug-in reward that changes the working directory; editing sources that are malformed, truncated, of a deep
pixel type or rotated by EXIF; the decoded-source cache's memory; ``sample`` / ``export`` of a plug-in run."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

import diffgrpo.rewards.http as http_reward
from diffgrpo.errors import RewardError
from diffgrpo.sandbox import SandboxError
from diffgrpo.sandbox.backends import choose


class _Handler(BaseHTTPRequestHandler):
    """The server's ``mode``: scores (one score per prompt), redirect (302 to ``server.target``), trickle (a reply
    one byte every 0.2 s), flood (``server.size`` bytes of JSON), remote_* (a sandbox service's malformed reply).
    Every request's path and Authorization header is recorded in ``server.seen``."""

    def do_POST(self):
        srv = self.server
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        srv.seen.append((self.command, self.path, self.headers.get("Authorization")))
        mode = srv.mode
        if mode == "redirect":
            self.send_response(302)
            self.send_header("Location", srv.target)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if mode.startswith("remote_"):
            return self._reply({"remote_deep": b"[" * 50_000, "remote_status": b'{"run_result": {"status": ["x"]}}',
                                "remote_stdout": b'{"run_result": {"status": "Finished", "stdout": 7}}'}[mode])
        n = len(json.loads(body)["prompts"]) if body else 1
        data = json.dumps({"scores": [0.5] * n}).encode()
        if mode == "flood":
            data = b"[" + b" " * (srv.size - 2) + b"]"
        if mode != "trickle":
            return self._reply(data)
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for i in range(len(data)):  # each read returns within the socket's timeout; the reply never ends in time
            if not self._send(data[i:i + 1]):
                return
            time.sleep(0.2)

    do_GET = do_POST

    def _send(self, b: bytes) -> bool:
        try:
            self.wfile.write(b)
            self.wfile.flush()
            return time.monotonic() < self.server.stop_at
        except OSError:
            return False

    def _reply(self, data: bytes):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self._send(data)

    def log_message(self, *a):
        pass


@pytest.fixture
def serve():
    started = []

    def start(mode: str, **attrs):
        srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        srv.daemon_threads = True
        srv.mode, srv.seen, srv.stop_at = mode, [], time.monotonic() + 8  # a bounded server: it stops by itself
        for k, v in attrs.items():
            setattr(srv, k, v)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        started.append(srv)
        return srv, f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in started:
        srv.shutdown()
        srv.server_close()


X = torch.rand(2, 3, 4, 4)


# ----------------------------------------------------------------------------------------------- the http reward
def test_m1_the_token_never_follows_a_redirect_to_another_origin(serve):
    other, other_url = serve("scores")
    first, url = serve("redirect", target=f"{other_url}/steal")
    with pytest.raises(RewardError, match="redirect") as e:
        http_reward.http(url=f"{url}/score", token="s3cret", attempts=1, timeout=5.0)(X, ["a", "b"], [{}, {}])
    assert "\n" not in str(e.value) and "s3cret" not in str(e.value)
    assert first.seen == [("POST", "/score", "Bearer s3cret")]  # the configured address got the token
    assert all(auth is None for *_, auth in other.seen)  # the other origin never did (nor anything at all)
    assert other.seen == []


def test_m2_the_timeout_bounds_the_whole_request_not_each_read(serve, monkeypatch):
    monkeypatch.setattr(http_reward, "BACKOFF", 0.0)
    srv, url = serve("trickle")
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="after 2 attempts \\(timeout 0.6 s each\\)") as e:
        http_reward.http(url=f"{url}/score", attempts=2, timeout=0.6)(X, ["a", "b"], [{}, {}])
    took = time.monotonic() - t0
    assert took < 2 * 0.6 + 1.0, took  # two attempts of 0.6 s each, not as long as the server trickles
    assert "no complete reply within 0.6 s" in str(e.value) and len(srv.seen) == 2


def test_m3_a_reply_larger_than_the_cap_is_refused_in_one_line_unread(serve, monkeypatch):
    monkeypatch.setattr(http_reward, "MAX_REPLY_BYTES", 1 << 20, raising=False)
    srv, url = serve("flood", size=8 << 20)
    with pytest.raises(RewardError, match=f"a reply larger than {1 << 20} bytes") as e:
        http_reward.http(url=f"{url}/score", attempts=3, timeout=10.0)(X, ["a", "b"], [{}, {}])
    assert "\n" not in str(e.value) and len(srv.seen) == 1  # refused at once, not asked again
    srv.size = (1 << 20) - 1  # a reply just under the cap is read whole (and judged: a list of no scores)
    with pytest.raises(RewardError, match="expected .*got 0 scores"):
        http_reward.http(url=f"{url}/score", attempts=1, timeout=10.0)(X, ["a", "b"], [{}, {}])


# ------------------------------------------------------------------------------------- the remote sandbox's probe
@pytest.mark.parametrize("mode", ["remote_deep", "remote_status", "remote_stdout"])
def test_m4_the_remote_probe_refuses_a_malformed_reply_in_one_line(serve, mode):
    _, url = serve(mode)
    with pytest.raises(SandboxError, match="sandbox backend 'remote' cannot run a trivial program here") as e:
        choose("remote", url=url)
    assert "\n" not in str(e.value)
