"""Launching does the right thing by default: dist.mode=auto is DDP under torchrun (WORLD_SIZE > 1) and one process
otherwise, an explicit dist.mode=none under torchrun is one line before anything loads, and model.device=auto
is the accelerator when there is one."""
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from diffgrpo import RunConfig, Trainer, distributed
from diffgrpo.distributed import resolve_device, resolve_mode
from diffgrpo.errors import ConfigError
from diffgrpo.models import POLICIES
from tests.helpers.distributed import free_port, leave_gloo, subprocess_env, torchrun
from tests.helpers.tiny import FAST_CLI, TINY


# ------------------------------------------------------------------------------------------ model.device=auto
@pytest.mark.parametrize("cuda, count, mps, local_rank, expected", [
    (True, 8, False, 3, "cuda:3"),  # torchrun on a GPU node: this rank's GPU
    (True, 2, True, None, "cuda"),  # one process: the current CUDA device, CUDA before MPS
    (False, 0, True, None, "mps"),
    (False, 0, True, 1, "mps"),
    (False, 0, False, None, "cpu"),
    (False, 0, False, 1, "cpu"),  # torchrun on CPUs (gloo)
])
def test_resolve_device_picks_the_accelerator(monkeypatch, cuda, count, mps, local_rank, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)
    assert resolve_device("auto", local_rank) == expected
    for explicit in ("cpu", "cuda:1", "mps"):  # explicit values are kept (validate checks them)
        assert resolve_device(explicit, local_rank) == explicit


def test_resolve_device_refuses_more_ranks_than_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=2 but this machine has 2 CUDA device\(s\)"):
        resolve_device("auto", 2)


def test_default_config_is_auto_and_a_trainer_uses_the_cpu_here(make_trainer):
    cfg = RunConfig()
    assert cfg.model.device == "auto" and cfg.dist.mode == "auto"
    assert RunConfig.from_overrides(["model.device=auto"]).model.device == "auto"  # validate allows it
    assert not torch.cuda.is_available()  # this test's premise: a CPU machine
    tr = make_trainer()
    assert tr.device == torch.device("cpu") and tr.cfg.model.device == "cpu"  # resolved into the run's config
    assert tr.dist_mode == "none" and tr.dp_module is None and tr.world.world_size == 1


# ------------------------------------------------------------------------------------------ dist.mode
def test_resolve_mode():
    assert resolve_mode("auto", 1) == "none" and resolve_mode("auto", 8) == "ddp"
    assert [resolve_mode(m, 8) for m in ("none", "ddp", "fsdp2")] == ["none", "ddp", "fsdp2"]


def test_explicit_none_under_torchrun_is_one_line_before_anything_loads(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(ConfigError) as e:
        RunConfig.from_overrides([*TINY, "dist.mode=none"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("dist.mode: value 'none' with WORLD_SIZE=2")
    assert "dist.mode=ddp" in msg and "dist.mode=fsdp2" in msg and "without torchrun" in msg
    # a config built in Python: the Trainer refuses it before the process group or the model exists
    cfg = RunConfig.from_overrides(TINY)  # auto: accepted under torchrun
    cfg.dist.mode = "none"
    built = []
    monkeypatch.setitem(POLICIES, "tiny", lambda *a, **k: built.append(1))
    with pytest.raises(ConfigError, match="dist.mode: value 'none' with WORLD_SIZE=2"):
        Trainer(cfg, log=lambda *a: None)
    assert not built and not distributed.is_initialized()


def _auto_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    from diffgrpo.models.tiny import build_tiny_policy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    # no dist.mode (auto) and no process group: the Trainer creates it (gloo on CPU) and wraps the model in DDP
    cfg = RunConfig.from_overrides([*TINY, "seed=0", "train.group_size=4", "train.prompts_per_batch=2",
                                    "loss.beta=0.1", "train.max_grad_norm=0", "dist.timeout=120"])
    torch.manual_seed(0)
    policy = build_tiny_policy(cfg, progress=False, log=lambda *a: None, pretrained=False)
    tr = Trainer(cfg, policy=policy, log=lambda *a: None)
    row = tr.step()
    torch.save({"world": tuple(tr.world), "mode": tr.dist_mode, "device": cfg.model.device,
                "ddp": isinstance(tr.dp_module, torch.nn.parallel.DistributedDataParallel),
                "backend": dist.get_backend(), "grads": [p.grad.detach().clone() for p in tr.params],
                "weights": [p.detach().clone() for p in tr.params], "reward": row["reward"]},
               os.path.join(out_dir, f"rank{rank}.pt"))
    leave_gloo()


def test_auto_under_torchrun_trains_as_ddp():
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_auto_worker, args=(2, free_port(), d), nprocs=2, join=True)
        r0, r1 = (torch.load(os.path.join(d, f"rank{r}.pt"), weights_only=False) for r in range(2))
    assert r0["world"] == (0, 2, 0) and r1["world"] == (1, 2, 1)
    assert r0["mode"] == r1["mode"] == "ddp" and r0["ddp"] and r1["ddp"] and r0["backend"] == "gloo"
    assert r0["device"] == r1["device"] == "cpu"
    assert any(g.abs().sum() > 0 for g in r0["grads"])  # an update happened
    for a, b in zip(r0["grads"], r1["grads"]):  # DDP averaged the ranks' gradients: the same on both
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(r0["weights"], r1["weights"]):  # and so the weights after the update
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_resume_and_sample_pick_the_device_again():
    """The saved config records the device used (rank 0's cuda:0 under torchrun): a resume or sample chooses
    this machine's and this rank's device again, unless the command line names one."""
    from diffgrpo.run.saved_config import fresh_device

    assert fresh_device({"model": {"device": "cuda:0"}}, ["train.num_iterations=9"])["model"]["device"] == "auto"
    assert fresh_device({"model": {"device": "cuda:0"}}, ["model.device=cpu"])["model"]["device"] == "cuda:0"


# --------------------------------------------------------------- issue 25, a high one found later: SIGTERM to one rank
def _children_with_rank(parent: int, rank: int) -> list[int]:
    """The pids of the processes below ``parent`` whose environment has RANK=<rank> (torchrun's workers)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            found.append(int(d.name))
    return found


@pytest.mark.slow
def test_sigterm_on_one_rank_stops_every_rank_at_the_same_iteration(tmp_path):
    """SIGTERM to rank 1 only (not torchrun, not rank 0): both ranks stop after the same iteration and write one
    sharded (DCP) checkpoint together; before, rank 1 alone entered the checkpoint's collectives and the job hung."""
    import json

    from diffgrpo.run.checkpoint import latest_complete

    out = tmp_path / "run"
    env = subprocess_env()
    p = subprocess.Popen([*torchrun(2), "-m", "diffgrpo.cli", "train", *FAST_CLI,
                          "dist.mode=ddp", "dist.backend=gloo", "train.num_iterations=200", "train.save_every=0",
                          "train.checkpoint_format=dcp", "eval.every=0", f"log.output_dir={out}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 400
        metrics = out / "metrics.jsonl"
        while time.time() < deadline and p.poll() is None and not (
                metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            time.sleep(0.1)  # the start evaluation and two iterations: inside the training loop
        rank1 = _children_with_rank(p.pid, 1)
        assert p.poll() is None and len(rank1) == 1, (rank1, p.poll())
        os.kill(rank1[0], signal.SIGTERM)
        text = p.communicate(timeout=240)[0]
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    ckpt = latest_complete(out, log=lambda *a: None)
    assert ckpt is not None, text[-3000:]
    state = json.loads((ckpt / "state.json").read_text())
    assert state["format"] == "dcp" and 2 <= state["iteration"] < 200, text[-3000:]
    assert "interrupted by signal 15; resume with" in text, text[-3000:]  # rank 0 stopped on rank 1's signal
    assert "[rank0]: Traceback" not in text and "[rank1]: Traceback" not in text, text[-3000:]
