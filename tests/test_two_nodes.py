"""Two nodes of one process each (``torchrun --nnodes 2 --nproc_per_node 1``, c10d rendezvous on 127.0.0.1), DDP
and FSDP2 on gloo: train, a SIGTERM to one node's worker stops both nodes after the same iteration with one
checkpoint, the run resumes to its end on two nodes, exports, and only global rank 0 wrote the run directory."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from diffgrpo.run.checkpoint import latest_complete
from tests.helpers.distributed import free_port, subprocess_env
from tests.helpers.tiny import FAST_CLI


def _node(port: int, run_id: str, args: list[str]) -> subprocess.Popen:
    """One node's agent: ``torchrun --nnodes 2 --nproc_per_node 1`` meeting the other at 127.0.0.1:port."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", run_id,
           "--local_addr", "127.0.0.1",
           "-m", "diffgrpo.cli", *args]
    return subprocess.Popen(cmd, env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _both(args: list[str], *, timeout: float = 400) -> tuple[list[int], list[str]]:
    """Both nodes run ``args`` to their end: (exit codes, outputs)."""
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    nodes = [_node(port, run_id, args) for _ in range(2)]
    try:
        texts = [n.communicate(timeout=timeout)[0] for n in nodes]
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    return [n.returncode for n in nodes], texts


def _worker(agent: int) -> int | None:
    """The pid of the worker below torchrun agent ``agent`` (its child with a RANK in its environment)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent and any(e.startswith(b"RANK=") for e in env):
            return int(d.name)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_two_nodes_train_stop_on_one_node_resume_and_export(tmp_path, mode):
    out = tmp_path / "run"
    common = [*FAST_CLI, f"dist.mode={mode}", "dist.backend=gloo", "dist.timeout=120", "train.save_every=0",
              "train.checkpoint_format=dcp", "eval.every=0", "log.save_images=false"]
    port, run_id = free_port(), uuid.uuid4().hex[:8]
    nodes = [_node(port, run_id, ["train", *common, "train.num_iterations=200", f"log.output_dir={out}"])
             for _ in range(2)]
    try:
        deadline, metrics = time.time() + 400, out / "metrics.jsonl"
        while time.time() < deadline and all(n.poll() is None for n in nodes) and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.1)  # the start evaluation and two iterations: inside the training loop
        worker = _worker(nodes[1].pid)
        assert worker is not None and all(n.poll() is None for n in nodes)
        os.kill(worker, signal.SIGTERM)  # the second node's worker only
        texts = [n.communicate(timeout=240)[0] for n in nodes]  # neither agent waits out a dead peer
    finally:
        for n in nodes:
            if n.poll() is None:
                os.killpg(n.pid, signal.SIGKILL)
    text = "\n".join(texts)
    assert "stopped by signal 15 after iteration" in text, text[-4000:]  # rank 0, on the other node's signal
    assert "DistBackendError" not in text and "Connection closed" not in text, text[-4000:]  # no desync
    ckpt = latest_complete(out, log=lambda *a: None)
    assert ckpt is not None, text[-4000:]
    stopped = json.loads((ckpt / "state.json").read_text())["iteration"]
    assert 2 <= stopped < 200, text[-4000:]

    codes, texts = _both(["train", "--resume", str(out), f"train.num_iterations={stopped + 2}"])
    assert codes == [0, 0], "\n".join(texts)[-4000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    its = [r["iteration"] for r in rows if "reward" in r]
    assert its == list(range(1, stopped + 3))  # one writer: every iteration once, in order
    assert (out / "summary.json").is_file() and not list(out.rglob("*.tmp*"))

    p = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "export", str(out), "--out", str(tmp_path / "model")],
                       env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert any((tmp_path / "model").iterdir())
