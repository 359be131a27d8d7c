"""Reliability of what reaches the run from outside it: the ``http`` reward and the remote sandbox against a server
that redirects, trickles, floods or answers nonsense (a local HTTP server on 127.0.0.1 that stops by itself); a
plug-in reward that changes the working directory; editing sources that are malformed, truncated, of a deep
pixel type or rotated by EXIF; the decoded-source cache's memory; ``sample`` / ``export`` of a plug-in run."""
from __future__ import annotations

import io
import json
import threading
import time
from collections import OrderedDict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

import diffgrpo.rewards.http as http_reward
from diffgrpo import sources
from diffgrpo.data_sources import load_prompts
from diffgrpo.errors import ConfigError, RewardError
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


# ------------------------------------------------------------------------------------------ editing source images
def _edit_file(d, value) -> str:
    f = d / "edits.jsonl"
    f.write_text(json.dumps({"prompt": "make it blue", "image": value}) + "\n")
    return str(f)


@pytest.mark.parametrize("value", [{"bytes": "aGVsbG8="}, {"bytes": [1, 2]}, {"bytes": {"a": 1}}, {"bytes": None}])
def test_m6_an_image_field_holding_no_file_bytes_is_refused_in_one_line(tmp_path, value):
    with pytest.raises(ConfigError, match="train.prompts_file: .*record 1 field 'image'.* not an image file's bytes") as e:
        load_prompts(_edit_file(tmp_path, value))
    assert "\n" not in str(e.value)


def _gradient(h: int = 24, w: int = 40) -> np.ndarray:
    """An asymmetric (H, W, 3) uint8 image: each orientation differs."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + 2 * y) % 256], -1).astype(np.uint8)


def test_m7_a_truncated_image_is_refused_at_load_and_by_sample_image(tmp_path, capsys):
    from diffgrpo.cli.app import main

    buf = io.BytesIO()
    Image.fromarray(_gradient()).save(buf, format="PNG")
    (tmp_path / "cut.png").write_bytes(buf.getvalue()[: len(buf.getvalue()) * 2 // 3])
    with pytest.raises(ConfigError, match="record 1 field 'image'.*'cut.png' does not decode whole") as e:
        load_prompts(_edit_file(tmp_path, "cut.png"))
    assert "\n" not in str(e.value)
    rc = main(["sample", "--prompt", "x", "--image", str(tmp_path / "cut.png"), "--out", str(tmp_path / "s.png")])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"error: --image {str(tmp_path / 'cut.png')!r}:") and "does not decode whole" in err, err
    assert err.count("\n") == 1 and not (tmp_path / "s.png").exists()  # refused before any model loads


def test_m8_deep_pixel_types_are_scaled_or_refused_not_clipped(tmp_path):
    g16 = (np.arange(24 * 40).reshape(24, 40) * 68).astype(np.uint16)  # 0 .. 65212
    Image.fromarray(g16).save(tmp_path / "g16.png")
    (rec,) = load_prompts(_edit_file(tmp_path, "g16.png"))
    want = np.rint(g16.astype(np.float64) * 255 / 65535).astype(np.uint8)  # the 16-bit values' top 8 bits, rounded
    got = np.asarray(sources.load_rgb(rec["image"]))
    assert got.shape == (24, 40, 3) and all(np.array_equal(got[..., c], want) for c in range(3))
    f32 = np.linspace(0, 1, 24 * 40, dtype=np.float32).reshape(24, 40)
    Image.fromarray(f32).save(tmp_path / "f.tiff")
    (rec,) = load_prompts(_edit_file(tmp_path, "f.tiff"))
    assert np.array_equal(np.asarray(sources.load_rgb(rec["image"]))[..., 1], np.rint(f32 * 255).astype(np.uint8))
    for name, arr, match in (("i32.tiff", (np.arange(24 * 40).reshape(24, 40) * 9000).astype(np.int32), "32-bit"),
                             ("big.tiff", f32 * 4 - 1, "outside \\[0, 1\\]")):
        Image.fromarray(arr).save(tmp_path / name)
        with pytest.raises(ConfigError, match=f"'{name}' .*{match}") as e:
            load_prompts(_edit_file(tmp_path, name))
        assert "\n" not in str(e.value)


def test_m9_exif_orientation_is_applied_as_diffusers_load_image_applies_it(tmp_path):
    a = _gradient()
    exif = Image.Exif()
    exif[0x0112] = 6  # Orientation: the stored pixels are shown turned 90° clockwise
    Image.fromarray(a).save(tmp_path / "turned.png", exif=exif)
    (rec,) = load_prompts(_edit_file(tmp_path, "turned.png"))
    got = np.asarray(sources.load_rgb(rec["image"]))
    assert np.array_equal(got, np.rot90(a, k=-1))  # (40, 24, 3): turned clockwise
    from diffusers.utils import load_image

    assert np.array_equal(got, np.asarray(load_image(str(tmp_path / "turned.png"))))
    assert sources.as_tensor(rec["image"]).shape == (3, 40, 24)


def test_m10_the_decoded_source_cache_is_bounded_by_bytes(tmp_path, monkeypatch):
    one = 3 * 24 * 40 * 4  # a (3, 24, 40) float32 source
    monkeypatch.setattr(sources, "_DECODED", OrderedDict())
    monkeypatch.setattr(sources, "CACHE_BYTES", 3 * one, raising=False)
    refs = []
    for i in range(6):
        Image.fromarray(np.roll(_gradient(), i, axis=1)).save(tmp_path / f"s{i}.png")
        refs.append(str(tmp_path / f"s{i}.png"))
    for i, r in enumerate(refs):
        t = sources.as_tensor(r)
        assert torch.equal(t, torch.from_numpy(np.roll(_gradient(), i, axis=1)).permute(2, 0, 1).float() / 255)
        assert sum(x.nbytes for x in sources._DECODED.values()) <= 3 * one
    assert list(sources._DECODED) == refs[3:]  # the most recent three, least recently used out first
    Image.fromarray(np.zeros((48, 80, 3), np.uint8)).save(tmp_path / "big.png")
    sources.as_tensor(str(tmp_path / "big.png"))  # larger than the whole cache: decoded, not held
    assert list(sources._DECODED) == refs[3:]


# ------------------------------------------------------------------------------- a plug-in reward that wanders off
WANDER = '''
import os

def reward(images, prompts, metadata):
    os.makedirs({elsewhere!r}, exist_ok=True)
    os.chdir({elsewhere!r})  # a plug-in that changes the working directory on its first call
    return [float(im.mean()) for im in images]
'''


@pytest.fixture(scope="module")
def wandered_run(tmp_path_factory, sd3_dir):
    """A two-iteration CLI run of a tiny SD3 pipeline with ``log.output_dir=run`` (relative) whose only reward, a
    plug-in, ``chdir``s elsewhere (the default reward, digit_alignment, does not fit the model)."""
    import os
    import sys

    from diffgrpo.cli.app import main

    d = tmp_path_factory.mktemp("wander")
    (d / "wander_cwd.py").write_text(WANDER.format(elsewhere=str(d / "elsewhere")))
    cwd, path = os.getcwd(), list(sys.path)
    os.chdir(d)
    try:
        rc = main(["train", "log.progress=false", "log.save_images=false", "sampler.num_steps=3",
                   "train.prompts_per_batch=2", "train.group_size=2", "model.name=diffusers",
                   f"model.pretrained={sd3_dir}", "model.resolution=16", "model.max_sequence_length=8",
                   "model.lora_rank=4", "train.num_iterations=2", "train.save_every=1", "eval.every=0",
                   "eval.seeds_per_prompt=1", f"train.prompts_file={sd3_dir / 'prompts.txt'}",
                   f"eval.prompts_file={sd3_dir / 'prompts.txt'}", "log.output_dir=run",
                   'reward.weights={"wander_cwd:reward": 1.0}'])
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        sys.modules.pop("wander_cwd", None)
    return rc, d


def test_m5_a_plugin_that_changes_directory_leaves_the_outputs_in_the_run_directory(wandered_run):
    rc, d = wandered_run
    assert rc == 0 and (d / "elsewhere").is_dir()  # the plug-in did change the directory
    run = d / "run"
    for name in ("metrics.jsonl", "summary.json", "weights.safetensors", "config.yaml", "checkpoints"):
        assert (run / name).exists(), name
    assert [json.loads(x)["iteration"] for x in (run / "metrics.jsonl").read_text().splitlines()
            if "loss" in json.loads(x)] == [1, 2]
    assert list((d / "elsewhere").iterdir()) == []  # nothing of the run landed where the plug-in went


# ------------------------------------------------------------------------- sample and export of a plug-in's run
def test_m11_sample_and_export_of_a_plugin_run_need_no_reward(wandered_run, tmp_path, capsys):
    """The plug-in (not importable from here) is the run's only reward; neither command scores, so neither needs it
    nor falls back to a reward the run never had."""
    from diffgrpo.cli.app import main

    _, d = wandered_run
    out = tmp_path / "s.png"
    rc = main(["sample", "--weights", str(d / "run"), "--prompt", "a cat", "--num", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 0 and Image.open(out).size[0] > 0, err
    assert "digit_alignment" not in err, err
    rc = main(["export", str(d / "run"), "--out", str(tmp_path / "exported")])
    err = capsys.readouterr().err
    assert rc == 0 and "digit_alignment" not in err, err
    assert "| rewards | wander_cwd:reward (weight 1.0) |" in (tmp_path / "exported" / "README.md").read_text()
