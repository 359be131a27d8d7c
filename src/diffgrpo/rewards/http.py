"""``http``: a reward served elsewhere (a VLM judge on other GPUs, a scoring service), called over HTTP.

Each call POSTs JSON batches of at most ``batch_size`` samples to ``url``::

    {"prompts": [str, ...], "metadata": [{...}, ...],
     "images": ["<base64 PNG>", ...]          # image runs: one PNG per sample (video: one per frame, "frames")
     "completions": [str, ...]}               # text runs

and reads back ``{"scores": [float, ...]}`` (or a bare JSON list), one number per sample; ``null`` marks a sample
the server could not score (it becomes NaN: excluded from its group). A score must be a JSON number within
float32's range (at most 3.4e38 in magnitude, the rewards' precision: a larger one, ``1e308`` or ``Infinity``,
would become inf) and an integer of at most :data:`MAX_INT_DIGITS` digits (a longer one is refused unparsed);
either is a one-line RewardError saying so, never a dropped sample. A request that fails (connection refused,
no complete reply within ``timeout`` seconds, HTTP 5xx or 429) is tried again up to ``attempts`` times in all, with
a short backoff; ``timeout`` bounds each attempt as a whole (a reply trickling in ends at it). A 4xx other than 429,
a redirect (never followed: the payload and the token go to ``url`` only), a reply larger than
:data:`MAX_REPLY_BYTES`, a reply that is not JSON or has the wrong length, or the last failed attempt is a one-line
RewardError naming the URL. Standard library only (``http.client``, through the remote sandbox's bounded
request); the images are encoded with Pillow.
"""
from __future__ import annotations

import base64
import io
import json
import math
import time

import numpy as np
import torch
from PIL import Image

from ..errors import RewardError
from ..sandbox.remote import RemoteFailure, ReplyTooLarge, exchange
from .loading import batches, to_uint8_hwc


def png_base64(image: np.ndarray) -> str:
    """An (H, W, 3) uint8 array → base64 text of its PNG."""
    buf = io.BytesIO()
    Image.fromarray(image).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


def encode_samples(samples) -> dict:
    """The batch's samples as JSON: ``images`` (B base64 PNGs) for (B, C, H, W) in [0, 1], ``frames`` (B lists of
    F PNGs) for video (B, C, F, H, W), ``completions`` for strings."""
    if torch.is_tensor(samples):
        if samples.dim() == 5:  # (B, C, F, H, W)
            frames = samples.permute(0, 2, 1, 3, 4)  # (B, F, C, H, W)
            return {"frames": [[png_base64(a) for a in to_uint8_hwc(v)] for v in frames]}
        return {"images": [png_base64(a) for a in to_uint8_hwc(samples)]}
    return {"completions": [str(s) for s in samples]}


MAX_INT_DIGITS = 64  # of an integer in a reply (float32's largest is 39 digits); Python's own limit is 4300
FLOAT32_MAX = 3.4028234663852886e38


class _TooLong(ValueError):
    pass


def _bounded_int(text: str) -> int:
    """json's ``parse_int``: an integer of at most :data:`MAX_INT_DIGITS` digits (a longer one is refused before
    Python converts it)."""
    digits = len(text.lstrip("-"))
    if digits > MAX_INT_DIGITS:
        raise _TooLong(f"an integer of {digits} digits (at most {MAX_INT_DIGITS} are read)")
    return int(text)


def _number(url: str, i: int, s) -> float:
    """Score ``i`` of a reply → a float (NaN for ``null``), or a one-line RewardError saying what is refused."""
    if s is None:
        return math.nan
    if not isinstance(s, (int, float)) or isinstance(s, bool):
        raise RewardError(f"reward 'http' at {url}: score {s!r} is not a number")
    if abs(s) > FLOAT32_MAX:  # inf too (JSON's Infinity, or 1e400)
        raise RewardError(f"reward 'http' at {url}: score {i} ({float(s):.4g}) is beyond float32's range (±3.4e38, "
                          "the rewards' precision); the server must scale its scores")
    return float(s)


def _scores(url: str, reply: bytes, n: int) -> list[float]:
    try:
        data = json.loads(reply, parse_int=_bounded_int)
    except _TooLong as e:
        raise RewardError(f"reward 'http' at {url}: the reply holds {e}; a score is a number within float32's "
                          "range") from None
    except ValueError:
        raise RewardError(f"reward 'http' at {url}: the reply is not JSON ({reply[:80]!r})") from None
    scores = data.get("scores") if isinstance(data, dict) else data
    if not isinstance(scores, list) or len(scores) != n:
        what = f"{len(scores)} scores" if isinstance(scores, list) else f"a {type(scores).__name__}"
        raise RewardError(f"reward 'http' at {url}: expected {{\"scores\": [{n} numbers]}}, got {what}")
    return [_number(url, i, s) for i, s in enumerate(scores)]


BACKOFF = 0.5  # seconds before the second attempt, doubling, at most 4 s
MAX_REPLY_BYTES = 64 << 20  # a reply's body: far above any batch's scores; a larger one is refused unread
REDIRECTS = (301, 302, 303, 307, 308)


def _refused(url: str, status: int, reason: str, head: dict) -> str | None:
    """Why a reply of ``status`` is refused without another attempt, or None when it may be retried."""
    if status in REDIRECTS:  # never followed: the body (and the token) go to ``url`` only
        where = " ".join(str(head.get("location", "")).split())[:120]
        return (f"HTTP {status} {reason}, a redirect to {where!r}; redirects are not followed: set "
                "reward.options.http.url to the address that scores")
    if status != 429 and status < 500:
        return f"HTTP {status} {reason} (not retried: the request itself is refused)"
    return None


def post(url: str, payload: dict, *, timeout: float, attempts: int, headers: dict | None = None) -> bytes:
    """POST ``payload`` as JSON; → the reply body. Each attempt ends within ``timeout`` seconds as a whole (connect,
    send, the reply's headers and body), its body at most :data:`MAX_REPLY_BYTES`; no redirect is followed.
    Retries transient failures (see the module docstring)."""
    body = json.dumps(payload, default=str).encode()  # metadata values JSON cannot hold: as text
    last = ""
    for attempt in range(1, attempts + 1):
        try:
            status, reason, head, reply = exchange(url, body, time.monotonic() + timeout, MAX_REPLY_BYTES,
                                                   headers=headers)
        except ReplyTooLarge:
            raise RewardError(f"reward 'http' at {url}: a reply larger than {MAX_REPLY_BYTES} bytes "
                              "(rewards.http.MAX_REPLY_BYTES); not read further") from None
        except RemoteFailure as e:
            last = " ".join(str(e).split())[:160]
        else:
            if status == 200:
                return reply
            last = f"HTTP {status} {reason}"
            refused = _refused(url, status, reason, head)
            if refused:
                raise RewardError(f"reward 'http' at {url}: {refused}") from None
        if attempt < attempts:
            time.sleep(min(BACKOFF * 2 ** (attempt - 1), 4.0))
    raise RewardError(f"reward 'http' at {url}: {last} after {attempts} attempt{'s' if attempts > 1 else ''} "
                      f"(timeout {timeout:g} s each)")


def http(device=None, *, url: str, timeout: float = 60.0, attempts: int = 3, batch_size: int = 64, token: str = ""):
    """The ``http`` reward for ``url`` (``device`` is unused: the server scores). ``token``: sent as
    ``Authorization: Bearer <token>``."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}

    def score(samples, prompts, metadata=None) -> torch.Tensor:
        B = len(prompts)
        metadata = list(metadata) if metadata is not None else [{} for _ in range(B)]
        out: list[float] = []
        for sl in batches(B, batch_size):
            part = samples[sl] if torch.is_tensor(samples) else list(samples)[sl]
            payload = {"prompts": list(prompts)[sl], "metadata": [dict(m) for m in metadata[sl]],
                       **encode_samples(part)}
            out.extend(_scores(url, post(url, payload, timeout=timeout, attempts=attempts, headers=headers),
                               sl.stop - sl.start))
        return torch.tensor(out, dtype=torch.float32)
    score.__name__ = score.__qualname__ = "http"
    return score


__all__ = ["FLOAT32_MAX", "MAX_INT_DIGITS", "encode_samples", "http", "png_base64", "post"]
