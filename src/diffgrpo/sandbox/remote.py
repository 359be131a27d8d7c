"""The ``remote`` sandbox backend: a SandboxFusion-style HTTP service (``POST {url}/run_code`` with ``{"code",
"language": "python", "run_timeout", "memory_limit_MB"}``, reading ``run_result.stdout``). The service isolates;
the client bounds each request as a whole (connect, send, headers and body together end at one deadline,
``timeout_s + slack_s``, however slowly the reply trickles in), bounds the reply's size, ends a request at once
when the pool is cancelled, and tells a program that failed from a service that could not run it (status
``error``: a refused connection, HTTP != 200, a malformed or oversized reply, a service error, no harness output,
the deadline).
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.parse

from .process import HARNESS_SOURCE, Limits, Program, Result, SandboxError, make_job, parse_report


class RemoteFailure(Exception):
    """The service could not run the program (one line)."""


def _watch(socks: list, deadline: float, cancelled, done: threading.Event) -> None:
    """Shut the request's socket at ``deadline`` or when ``cancelled`` is set, whichever comes first: every
    blocked read or write of the request then returns at once."""
    while not done.wait(0.05):
        if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
            for sock in socks:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            return


def _failure(e: BaseException, deadline: float, left: float, cancelled) -> RemoteFailure:
    if cancelled is not None and cancelled.is_set():
        return RemoteFailure("cancelled")
    if time.monotonic() >= deadline - 0.01:
        return RemoteFailure(f"no complete reply within {left:.1f} s")
    return e if isinstance(e, RemoteFailure) else RemoteFailure(f"{type(e).__name__}: {e}")


class ReplyTooLarge(RemoteFailure):
    """The reply's body is larger than the cap (not worth asking again)."""


def exchange(url: str, body: bytes, deadline: float, cap: int, cancelled=None,
             headers: dict | None = None) -> tuple[int, str, dict[str, str], bytes]:
    """POST ``body`` as JSON to ``url`` (no redirect followed) → (status, reason, the reply's headers with lower-case
    names, its body of at most ``cap`` bytes), all of it before ``deadline`` (time.monotonic()); RemoteFailure
    otherwise (ReplyTooLarge past ``cap``)."""
    u = urllib.parse.urlsplit(url)
    left = deadline - time.monotonic()
    kind = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
    conn = kind(u.hostname, u.port, timeout=max(0.01, left))
    socks: list = []  # the connected socket (the connection forgets it once the reply says it will close)
    done = threading.Event()
    threading.Thread(target=_watch, args=(socks, deadline, cancelled, done), daemon=True,
                     name="sandbox-remote-deadline").start()
    try:
        conn.connect()
        socks.append(conn.sock)
        target = u.path or "/"
        conn.request("POST", target + (f"?{u.query}" if u.query else ""), body,
                     {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        data = bytearray()
        while chunk := resp.read1(65536):
            data += chunk
            if len(data) > cap:
                raise ReplyTooLarge(f"a reply larger than {cap} bytes")
        if time.monotonic() >= deadline - 0.01 or (cancelled is not None and cancelled.is_set()):
            raise RemoteFailure("cut")  # the socket was shut under the read: the reply is not complete
        return resp.status, resp.reason, {k.lower(): v for k, v in resp.getheaders()}, bytes(data)
    except (RemoteFailure, http.client.HTTPException, OSError, ValueError) as e:
        raise _failure(e, deadline, left, cancelled) from None
    finally:
        done.set()
        conn.close()
        for sock in socks:
            sock.close()


def post_bounded(url: str, body: bytes, deadline: float, cap: int, cancelled=None) -> bytes:
    """POST ``body`` as JSON to ``url`` → the reply's body (HTTP 200, at most ``cap`` bytes), all of it before
    ``deadline`` (time.monotonic()); RemoteFailure otherwise."""
    status, reason, _, data = exchange(url, body, deadline, cap, cancelled)
    if status != 200:
        raise RemoteFailure(f"HTTP {status} {reason}")
    return data


def read_reply(raw: bytes, token: str, n: int, limits: Limits) -> Result:
    """A service's reply → :class:`Result`; RemoteFailure when it is malformed (not JSON, nested too deeply, fields
    of the wrong type) or says the service failed."""
    try:
        return _read_reply(raw, token, n, limits)
    except (TypeError, ValueError, RecursionError, AttributeError) as e:  # whatever shape the service sent
        raise RemoteFailure(f"a malformed reply ({type(e).__name__}: {' '.join(str(e).split())[:80]})") from None


def _text(rr: dict, field: str, limit: int) -> str:
    v = rr.get(field)
    if v is not None and not isinstance(v, str):
        raise TypeError(f"run_result.{field} is a {type(v).__name__}, not a string")
    return (v or "")[:limit]


def _read_reply(raw: bytes, token: str, n: int, limits: Limits) -> Result:
    try:
        reply = json.loads(raw)
    except ValueError:
        raise RemoteFailure("a reply that is not JSON") from None
    rr = reply.get("run_result") if isinstance(reply, dict) else None
    if not isinstance(rr, dict) or reply.get("status") == "SandboxError":
        raise RemoteFailure(f"a reply without a run result ({str(raw[:120])})")
    out = _text(rr, "stdout", limits.output_bytes)
    status = rr.get("status")
    status = {"Finished": "ok", "TimeLimitExceeded": "timeout"}.get(status) if isinstance(status, str) else None
    if status is None:
        raise RemoteFailure(f"run status {str(rr.get('status'))[:60]!r}")
    if status == "ok" and f"{token} confined" not in out:
        raise RemoteFailure("the program finished without the harness's first line (it did not run)")
    passed, _, loaded = parse_report(out, token, n)
    code = rr.get("return_code")
    if code is not None and (not isinstance(code, int) or isinstance(code, bool)):
        raise TypeError(f"run_result.return_code is a {type(code).__name__}, not an integer")
    return Result(passed, status, code, out, _text(rr, "stderr", limits.output_bytes), 0.0, ("remote",), False,
                  loaded)


class RemoteBackend:
    """Client of a SandboxFusion-style service at ``url`` (``POST {url}/run_code``); a request ends at most
    ``slack_s`` seconds after the program's own ``timeout_s``."""

    name = "remote"

    def __init__(self, url: str, slack_s: float = 10.0):
        if not url.startswith(("http://", "https://")):
            raise SandboxError(f"sandbox backend 'remote': url {url!r} is not an http(s) URL; set the sandbox url "
                               "option, e.g. http://127.0.0.1:8080")
        self.url, self.slack_s = url.rstrip("/"), slack_s

    def code_for(self, job: dict) -> str:
        """The code sent: the harness, told to report on stdout without confining itself (the service does)."""
        body = HARNESS_SOURCE.rsplit('\nif __name__ == "__main__":', 1)[0]  # the functions, not the entry point
        return body + f"\nrun({job!r}, 1)\n"  # plain dicts, lists, strings and numbers: a literal

    def run(self, program: Program, limits: Limits, cancelled=None) -> Result:
        job = make_job(program, limits, confine=False)
        body = json.dumps({"code": self.code_for(job), "language": "python", "run_timeout": limits.timeout_s,
                           "memory_limit_MB": limits.memory_mb}).encode()
        t0 = time.monotonic()
        n = len(job["tests"])
        try:
            raw = post_bounded(self.url + "/run_code", body, t0 + limits.timeout_s + self.slack_s,
                               4 * limits.output_bytes + 65536, cancelled)
            r = read_reply(raw, job["token"], n, limits)
        except RemoteFailure as e:
            status = "cancelled" if cancelled is not None and cancelled.is_set() else "error"
            return Result([False] * n, status, stderr=f"remote sandbox: {e}", wall_s=time.monotonic() - t0,
                          hung=str(e).startswith("no complete reply"))
        r.wall_s = time.monotonic() - t0
        return r


__all__ = ["RemoteBackend", "RemoteFailure", "ReplyTooLarge", "exchange", "post_bounded", "read_reply"]
