"""Low-severity reliability defects, each checked where it showed: the sandbox's folders of a SIGKILLed caller and
``memfd_create``; the http reward's out-of-range and overlong numbers; a reward's ``os._exit``, leftover non-daemon
thread and SIGTERM to its own process; a FIFO or directory named as an image; ``export --out`` through a link or
into a run's checkpoints; library progress bars in a piped export."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import diffgrpo.sandbox as sb
import diffgrpo.sandbox.process as sb_process
from diffgrpo import RunConfig
from diffgrpo.cli.app import main
from diffgrpo.errors import ConfigError, RewardError
from diffgrpo.rewards.http import _scores
from diffgrpo.sandbox import BwrapBackend, Limits, LocalBackend, Program
from tests.helpers.distributed import subprocess_env
from tests.helpers.runs import copy_run
from tests.helpers.tiny import FAST_CLI

KINDS = ["local"] + (["bwrap"] if sb.find_bwrap() else [])
FAST = Limits(timeout_s=6.0, test_s=2.0, memory_mb=256)


# ---------------------------------------------------------------------------------------------------------- sandbox
def test_a_sigkilled_callers_private_folder_is_removed_at_the_next_start(tmp_path, monkeypatch):
    """A caller killed by SIGKILL leaves its folder; the next process's first program removes it (a link inside is
    removed, its target kept), and leaves a live owner's folder alone."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    code = textwrap.dedent(f"""
        import os, sys, time
        from diffgrpo.sandbox.process import PrivateDir
        d = PrivateDir().__enter__()
        open(os.path.join(d.work, "left.txt"), "w").write("x")
        os.symlink({str(outside)!r}, os.path.join(d.work, "link"))
        print(d.root, flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         env=subprocess_env(TMPDIR=str(tmp)))
    left = Path(p.stdout.readline().strip())
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    p.stdout.close()
    assert left.is_dir() and left.parent == tmp and f"-{p.pid}-" in left.name
    live = tmp / f"{sb_process.PREFIX}{os.getpid()}-live"
    live.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    monkeypatch.setattr(sb_process, "_SWEPT", set())
    r = LocalBackend().run(Program("x = 1", ["assert x == 1"]), FAST)
    assert r.all_passed, r.stderr[-1000:]
    assert not left.exists() and live.is_dir() and outside.read_text() == "keep"
    assert sorted(q.name for q in tmp.iterdir()) == [live.name]  # the program's own folder is gone too


@pytest.mark.parametrize("kind", KINDS)
def test_memfd_create_is_refused_in_the_sandbox(kind):
    """An anonymous memory file would hold memory outside RLIMIT_AS: the seccomp filter refuses it."""
    backend = BwrapBackend() if kind == "bwrap" else LocalBackend()
    code = textwrap.dedent("""
        import os
        try:
            fd = os.memfd_create("hold")
            os.ftruncate(fd, 1 << 20)
            denied = False
        except OSError:
            denied = True
    """)
    r = backend.run(Program(code, ["assert denied"]), FAST)
    assert "seccomp" in r.confined, r.confined
    assert r.passed == [True], (r.status, r.stderr[-1000:])


# ------------------------------------------------------------------------------------------------------ http reward
@pytest.mark.parametrize("reply, said", [(b'{"scores": [1e308]}', "score 0 (1e+308) is beyond float32's range"),
                                         (b'[0.5, Infinity]', "score 1 (inf) is beyond float32's range"),
                                         (b'[' + b'9' * 5000 + b']', "an integer of 5000 digits (at most 64")])
def test_http_refuses_numbers_float32_cannot_hold_in_one_line(reply, said):
    n = 2 if b"Infinity" in reply else 1
    with pytest.raises(RewardError) as e:
        _scores("http://scorer", reply, n)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("reward 'http' at http://scorer: ") and said in msg, msg


def test_http_reads_numbers_within_range_and_null_as_unscored():
    got = _scores("http://scorer", b'[1e38, -3, null, 12345678901234567890, 0.25]', 5)
    assert got[0] == 1e38 and got[1] == -3.0 and math.isnan(got[2]) and got[3] == 12345678901234567890.0
    assert got[4] == 0.25


# ------------------------------------------------------------------------------------------ plug-in rewards, signals
REWARDS = textwrap.dedent("""
    import os, signal, threading, time
    def exits(images, prompts, metadata):
        os._exit(0)
    def leaves_thread(images, prompts, metadata):
        threading.Thread(target=time.sleep, args=(3600,), name="poller").start()
        return [1.0] * len(prompts)
    def terminates(images, prompts, metadata):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return [1.0] * len(prompts)
""")


@pytest.mark.parametrize("fn, rc, said", [
    ("exits", 1, "error: reward 'lowrew:exits' called os._exit(0), which would end the process"),
    ("leaves_thread", 0, "warning: non-daemon thread(s) ['poller'"),
    ("terminates", -signal.SIGTERM, "error: terminated by signal 15 (SIGTERM) while reward 'lowrew:terminates' was running"),
])
def test_a_rewards_exit_thread_or_sigterm_ends_the_command_with_one_line(fn, rc, said, tmp_path):
    (tmp_path / "lowrew.py").write_text(REWARDS)
    args = [a for a in FAST_CLI if not a.startswith("reward.weights")]
    cmd = [sys.executable, "-m", "diffgrpo.cli", "train", *args, "train.num_iterations=1", "eval.every=0",
           "reward.timeout=0", f"reward.weights={{lowrew:{fn}: 1.0}}", f"log.output_dir={tmp_path / 'run'}"]
    env = subprocess_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == rc, p.stdout[-2000:] + p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if said in ln]
    assert len(lines) == 1, p.stderr[-2000:]
    assert time.monotonic() - t0 < 100


# ---------------------------------------------------------------------------------------------------------- images
@pytest.mark.parametrize("make, kind", [(os.mkfifo, "a FIFO (named pipe)"), (os.mkdir, "a directory")])
def test_an_image_that_is_a_fifo_or_directory_says_what_it_is(make, kind, tmp_path):
    from diffgrpo import sources
    from diffgrpo.cli.sample import _sources

    make(tmp_path / "src.png")
    with pytest.raises(ConfigError) as e:
        sources.resolve([{"prompt": "p", "image": "src.png"}], base=tmp_path, spec="p.jsonl", key="train.prompts_file")
    assert f"image 'src.png' is {kind}, not an image file" in str(e.value), str(e.value)
    with pytest.raises(ConfigError) as e:
        _sources([str(tmp_path / "src.png")])
    msg = str(e.value)
    assert msg.startswith(f"--image {str(tmp_path / 'src.png')!r}: image 'src.png' is {kind}"), msg
    assert "record 1" not in msg and ": file " not in msg, msg


# ---------------------------------------------------------------------------------------------------------- export
def test_export_out_through_a_dangling_link_or_into_checkpoints_is_refused(small_run, tmp_path, capsys):
    run = copy_run(small_run, tmp_path)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "missing")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(link)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a symbolic link (to a missing path)" in err[0], err
    assert not (tmp_path / "missing").exists() and link.is_symlink()
    before = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert main(["export", str(run), "--out", str(run / "checkpoints" / "exported")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "inside a run's checkpoints folder" in err[0], err
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == before


def test_a_piped_export_of_the_masked_lm_writes_no_carriage_return(tmp_path):
    """transformers' "Writing model shards" bar is off when the output is a pipe."""
    from diffgrpo import Trainer
    from diffgrpo.models.hf_masked_lm import build_tiny_mlm_policy

    cfg = RunConfig.from_overrides(["model.name=tiny_mlm", "log.progress=false", f"log.output_dir={tmp_path / 'run'}"])
    torch.manual_seed(0)
    tr = Trainer(cfg, policy=build_tiny_mlm_policy(cfg, progress=False, pretrained=False), log=lambda *a: None)
    tr.save_checkpoint()
    p = subprocess.run([sys.executable, "-m", "diffgrpo.cli", "export", str(tmp_path / "run"), "--out",
                        str(tmp_path / "out")], capture_output=True, env=subprocess_env(), timeout=300)  # bytes:
    assert p.returncode == 0, p.stderr[-2000:]  # text mode would turn each carriage return into a line break
    assert (tmp_path / "out" / "config.json").is_file()
    assert b"\r" not in p.stdout and b"\r" not in p.stderr, p.stderr[-2000:]
