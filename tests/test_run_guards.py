"""Runs that cannot lie or be hijacked: exit codes, training that trains nothing, run-directory locks and restarts,
resume overrides, tolerant logs, checksummed checkpoints, untrusted run directories, symlinks, collective timeouts."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from diffgrpo import distributed
from diffgrpo.cli.app import main
from diffgrpo.errors import TrainingError
from diffgrpo.fileio import append_line, atomic_write, read_jsonl
from diffgrpo.rewards import REWARDS
from diffgrpo.run.checkpoint import latest_complete, list_checkpoints, load_checkpoint
from tests.helpers.cli import run_cli
from tests.helpers.tiny import FAST_CLI, TINY_CLI

FAST = [*TINY_CLI, "train.ema_decay=0.0"]


def _run(tmp_path: Path, name: str, *extra) -> Path:
    out = tmp_path / name
    assert main(["train", *FAST, f"log.output_dir={out}", *extra]) == 0
    return out


def _eval_rows(run: Path) -> list[dict]:
    return [r for r in read_jsonl(run / "metrics.jsonl") if any(k.startswith("eval/") for k in r)]


# ------------------------------------------------------------------------------------------ exit codes
def test_sigterm_checkpoints_and_exits_143(tmp_path):
    out = tmp_path / "run"
    p = run_cli(["train", *FAST, "train.num_iterations=200", "train.save_every=1", f"log.output_dir={out}"])
    deadline = time.time() + 300
    while time.time() < deadline and not (out / "checkpoints" / "latest.json").is_file():
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 128 + signal.SIGTERM == 143, text
    assert "interrupted by signal 15; resume with: diffgrpo train --resume" in text
    assert latest_complete(out) is not None


def test_all_nan_rewards_stop_the_run_with_an_error(make_trainer, monkeypatch, tmp_path):
    monkeypatch.setitem(REWARDS, "nan_reward", lambda images, prompts, metadata: torch.full((len(prompts),), float("nan")))
    tr = make_trainer("reward.weights={nan_reward: 1.0}", "train.num_iterations=10", "train.max_bad_updates=3",
                      f"log.output_dir={tmp_path / 'r'}", "eval.seeds_per_prompt=1")
    with pytest.raises(TrainingError, match=r"3 consecutive updates were skipped \(no sample could be trained"):
        tr.train()
    assert tr.iteration == 2  # the third bad iteration stops before it counts


def test_filtered_batches_count_as_updates_that_train_nothing(make_trainer, monkeypatch):
    monkeypatch.setitem(REWARDS, "flat", lambda images, prompts, metadata: torch.ones(len(prompts)))
    tr = make_trainer("reward.weights={flat: 1.0}", "advantage.filter_zero_std=true", "train.max_bad_updates=2")
    before = [p.detach().clone() for p in tr.params]
    row = tr.step()
    assert row["skipped_updates"] == 1 and all(torch.equal(a, b) for a, b in zip(before, tr.params))
    with pytest.raises(TrainingError, match="every group filtered out"):
        tr.step()


def test_non_finite_weights_after_an_update_stop_the_run(make_trainer, monkeypatch):
    tr = make_trainer()
    step = tr.optimizer.step

    def poisoned(*a, **kw):
        step(*a, **kw)
        with torch.no_grad():
            tr.params[0].view(-1)[0] = float("inf")

    monkeypatch.setattr(tr.optimizer, "step", poisoned)
    with pytest.raises(TrainingError, match="the weights are non-finite after the update of iteration 1"):
        tr.step()


# ------------------------------------------------------------------------------------------ run directories
def test_a_live_run_directory_is_locked(tmp_path, capsys):
    out = tmp_path / "run"
    p = run_cli(["train", *FAST, "train.num_iterations=500", "train.save_every=0", f"log.output_dir={out}"])
    try:
        deadline = time.time() + 300
        while time.time() < deadline and not (out / "metrics.jsonl").is_file():
            time.sleep(0.05)
        assert main(["train", *FAST, f"log.output_dir={out}"]) == 1
        assert "is in use by another run" in capsys.readouterr().err
        assert main(["train", "--resume", str(out)]) == 1  # a resume of the live run too
        assert "is in use by another run" in capsys.readouterr().err
    finally:
        p.kill()
        p.wait()


def test_default_run_directories_of_the_same_second_are_distinct(make_trainer, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-000000")
    dirs = [make_trainer().run_dir() for _ in range(3)]
    assert [d.name for d in dirs] == ["20260101-000000", "20260101-000000-2", "20260101-000000-3"]


def test_resume_without_a_checkpoint_restarts_the_run(make_trainer, monkeypatch, tmp_path):
    calls = {"n": 0}

    def fails_in_iteration_two(images, prompts, metadata):
        calls["n"] += 1
        if calls["n"] > 3:
            raise OSError("scoring server gone")
        return images.flatten(1).std(1)

    monkeypatch.setitem(REWARDS, "flaky2", fails_in_iteration_two)
    common = ["reward.weights={flaky2: 1.0}", "train.num_iterations=3", "train.save_every=10",
              f"log.output_dir={tmp_path / 'r'}", "eval.seeds_per_prompt=1", "eval.every=0"]
    with pytest.raises(Exception, match="scoring server gone"):
        make_trainer(*common).train()
    logs = []
    calls["n"] = -10**9
    tr = make_trainer(*common)
    tr.log = logs.append
    tr.train(resume=True)
    assert tr.iteration == 3 and any("restarting the run from iteration 0" in m for m in logs)
    assert (tmp_path / "r" / "metrics.restarted.jsonl").is_file()
    assert [r["iteration"] for r in read_jsonl(tmp_path / "r" / "metrics.jsonl") if "reward" in r] == [1, 2, 3]


def test_resume_applies_schedule_overrides_and_refuses_model_changes(tmp_path, capsys):
    run = _run(tmp_path, "r", "train.num_iterations=2", "train.save_every=1")
    assert main(["train", "--resume", str(run), "model.num_layers=3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --resume: model.num_layers cannot change when a run resumes")
    assert main(["train", "--resume", str(run), "--config", str(run / "config.yaml")]) == 2
    assert "--config: cannot be combined with --resume" in capsys.readouterr().err
    # "train 2 more" at another learning rate: continues from the final checkpoint, applies the new rate
    assert main(["train", "--resume", str(run), "train.num_iterations=4", "train.lr=0.05"]) == 0
    ck = load_checkpoint(list_checkpoints(run)[-1])
    assert ck.iteration == 4 and ck.optimizer["param_groups"][0]["lr"] == 0.05
    assert [r["iteration"] for r in read_jsonl(run / "metrics.jsonl") if "reward" in r] == [1, 2, 3, 4]
    assert "lr: 0.05" in (run / "config.yaml").read_text()


def test_resuming_a_finished_run_adds_no_rows(tmp_path):
    run = _run(tmp_path, "r", "train.num_iterations=3", "train.save_every=2")  # final checkpoint at 3
    assert load_checkpoint(list_checkpoints(run)[-1]).iteration == 3
    rows = read_jsonl(run / "metrics.jsonl")
    assert main(["train", "--resume", str(run)]) == 0
    assert read_jsonl(run / "metrics.jsonl") == rows
    assert len(_eval_rows(run)) == len({r["iteration"] for r in _eval_rows(run)})  # one eval per iteration


def test_a_torn_last_metrics_line_is_dropped_with_a_warning(tmp_path, capsys):
    run = _run(tmp_path, "r", "train.num_iterations=2", "train.save_every=1")
    full = read_jsonl(run / "metrics.jsonl")
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"iteration": 3, "rew')  # a write cut short by a full disk
    assert main(["report", str(run)]) == 0
    assert "the last line is incomplete" in capsys.readouterr().out
    assert main(["train", "--resume", str(run), "train.num_iterations=3"]) == 0
    rows = read_jsonl(run / "metrics.jsonl")
    assert rows[:len(full) - 1] == full[:-1] and [r["iteration"] for r in rows if "reward" in r] == [1, 2, 3]
    (run / "metrics.jsonl").write_text('{"a": 1}\n{broken\n{"b": 2}\n')
    with pytest.raises(TrainingError, match="line 2 is not valid JSON"):
        read_jsonl(run / "metrics.jsonl")


def test_a_checkpoint_damaged_at_the_same_size_falls_back_to_the_previous_one(tmp_path):
    run = _run(tmp_path, "r", "train.num_iterations=2", "train.save_every=1")
    last = list_checkpoints(run)[-1]
    f = last / "trainable.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte in the tensor data: same size, NaN-or-garbage weights
    f.write_bytes(bytes(data))
    logs = []
    assert latest_complete(run, log=logs.append) == list_checkpoints(run)[-2]
    assert "is incomplete or damaged" in logs[0]


# ------------------------------------------------------------------------------------------ untrusted directories
def test_a_run_directory_cannot_run_its_own_code(tmp_path, capsys, monkeypatch):
    run = _run(tmp_path, "r", "train.num_iterations=1", "train.save_every=1")
    mod = tmp_path / "planted_reward.py"
    marker = tmp_path / "executed"
    mod.write_text(f"open({str(marker)!r}, 'w').close()\n\ndef score(images, prompts, metadata):\n    return [0.0] * len(prompts)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = (run / "config.yaml").read_text().replace("jpeg_incompressibility: 1.0", "planted_reward:score: 1.0")
    assert "planted_reward:score" in cfg
    (run / "config.yaml").write_text(cfg)
    assert main(["train", "--resume", str(run), "train.num_iterations=2"]) == 2
    assert "runs code named in" in capsys.readouterr().err and not marker.exists()
    assert main(["sample", "--weights", str(run), "--num", "1", "--out", str(tmp_path / "s.png")]) == 0
    assert "wrote 10 samples" in capsys.readouterr().out and not marker.exists()  # sampling scores nothing
    assert (tmp_path / "s.png").is_file()


def test_writers_replace_planted_symlinks_instead_of_following_them(tmp_path, capsys):
    run = _run(tmp_path, "r", "train.num_iterations=1")
    victim = tmp_path / "victim.pth"
    victim.write_text("keep me")
    (run / "report.html").symlink_to(victim)
    assert main(["report", str(run)]) == 0
    assert victim.read_text() == "keep me" and not (run / "report.html").is_symlink()
    link = tmp_path / "log.jsonl"
    link.symlink_to(victim)
    with pytest.raises(TrainingError, match="is a symbolic link; refusing to write through it"):
        append_line(link, "{}")
    atomic_write(link, "new")
    assert victim.read_text() == "keep me" and link.read_text() == "new" and not link.is_symlink()
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)  # the lock file is never opened through a link either
    assert main(["train", "--resume", str(run)]) == 1
    assert "error: log.output_dir: cannot lock" in capsys.readouterr().err and victim.read_text() == "keep me"


# ------------------------------------------------------------------------------------------ command-line misuse
@pytest.mark.parametrize("argv,line", [
    (["sample", "--num", "0"], "error: --num: value 0 is out of range; must be >= 1"),
    (["sample", "--out", "x"], "error: --out: 'x' has no file extension"),
    (["bench", "engines", "--repeats", "0"], "error: --repeats: value 0 is out of range; must be >= 1"),
    (["train", "log.output_dir=/proc/diffgrpo-run"], "error: log.output_dir: cannot create '/proc/diffgrpo-run'"),
])
def test_command_line_misuse_is_one_line(argv, line, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(line) and err.count("\n") == 1


def test_dllm_prompt_outside_the_vocabulary_is_one_line(tmp_path, capsys):
    assert main(["sample", "model.name=tiny_mlm", "dllm.task=arithmetic", "pretrain.steps=5", "pretrain.batch_size=8",
                 "--prompt", "3+4=é", "--out", str(tmp_path / "x.txt")]) == 2
    assert "error: --prompt: '3+4=é' cannot be encoded: character 'é' is not in the vocabulary" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ collectives
def _stall_worker(rank: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    distributed.init_from_env("gloo", timeout=3)
    t0 = time.time()
    err = ""
    if rank == 1:
        time.sleep(12)  # a stalled rank
    else:
        try:
            distributed.all_reduce_sum(torch.ones(1))
        except Exception as e:  # noqa: BLE001 - the timeout surfaces as a backend error
            err = type(e).__name__
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"seconds": time.time() - t0, "error": err}))
    os._exit(0)  # the timed-out gloo group cannot be torn down cleanly (its destructor may abort the process)


def test_a_stalled_rank_fails_the_collective_after_dist_timeout(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_stall_worker, args=(port, str(tmp_path)), nprocs=2, join=False, start_method="spawn")
    ctx.join(timeout=60)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["error"] and r0["seconds"] < 60  # dist.timeout=3, not the 30-minute default (slack for a busy machine)


def test_a_full_disk_ends_the_run_in_one_line_and_it_resumes(tmp_path, capsys):
    """The log hits a file-size limit (as on a full disk): the run stops with one line and exit 1, leaving a torn
    last line; --resume and report read past it."""
    import resource

    _run(tmp_path, "warm", "train.num_iterations=1")  # the built-in model is cached before the limit applies
    out = tmp_path / "full"
    # as `ulimit -f`: above config.yaml and a sample table (2 KiB more than the config), below 12 iterations of metrics
    limit = (tmp_path / "warm" / "config.yaml").stat().st_size + 2048

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    p = run_cli(["train", *FAST, "train.num_iterations=12", "train.save_every=0", "log.save_images=false",
              f"log.output_dir={out}"], preexec_fn=cap)
    text = p.communicate(timeout=300)[0]
    assert p.returncode == 1, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("error: ") and "metrics.jsonl" in last and "resume the run" in last
    assert (out / "metrics.jsonl").stat().st_size == limit  # cut mid-line
    assert main(["report", str(out)]) == 0
    assert main(["train", "--resume", str(out)]) == 0  # no checkpoint (save_every=0): restarts from iteration 0
    assert [r["iteration"] for r in read_jsonl(out / "metrics.jsonl") if "reward" in r] == list(range(1, 13))
    # a checkpoint that cannot be written is one line too, and leaves the earlier ones intact
    ck = tmp_path / "ck"
    _run(tmp_path, "ck", "train.num_iterations=1", "train.save_every=1")
    p = run_cli(["train", "--resume", str(ck), "train.num_iterations=3", "log.save_images=false"], preexec_fn=cap)
    text = p.communicate(timeout=300)[0]
    assert p.returncode == 1 and "error: cannot write checkpoint 2 into" in text, text
    assert latest_complete(ck) == list_checkpoints(ck)[0] and load_checkpoint(latest_complete(ck)).iteration == 1


def test_a_checkpoint_with_non_finite_weights_is_refused_on_resume(tmp_path, capsys):
    from diffgrpo.run.checkpoint import save_checkpoint

    run = _run(tmp_path, "r", "train.num_iterations=1", "train.save_every=1")
    ck = load_checkpoint(latest_complete(run))
    bad = {k: torch.full_like(v, float("nan")) for k, v in ck.trainable.items()}
    save_checkpoint(run, 2, trainable=bad, optimizer=ck.optimizer, rng=ck.rng, config=ck.config)
    assert main(["train", "--resume", str(run), "train.num_iterations=3"]) == 1
    assert "checkpoint_iter" not in (err := capsys.readouterr().err) and "holds non-finite weights" in err


def test_saved_remote_code_and_code_engines_are_not_trusted(tmp_path, capsys):
    from diffgrpo.run.saved_config import distrust

    data = {"model": {"name": "hf_masked_lm"}, "dllm": {"model_path": "x", "trust_remote_code": True},
            "engine": {"name": "evil:Engine"}}
    with pytest.raises(Exception, match="runs code named in"):
        distrust(json.loads(json.dumps(data)), [], path=tmp_path / "config.yaml", command="--resume", strict=True)
    kept = distrust(json.loads(json.dumps(data)), ["dllm.trust_remote_code=true"], path=tmp_path / "c.yaml",
                     command="--weights", strict=False)
    out = capsys.readouterr().out
    assert kept["dllm"]["trust_remote_code"] is True  # repeated on the command line: the user's choice
    assert kept["engine"]["name"] == "recompute" and "ignoring engine.name='evil:Engine'" in out
    dropped = distrust(json.loads(json.dumps(data)), [], path=tmp_path / "c.yaml", command="--weights", strict=False)
    assert dropped["dllm"]["trust_remote_code"] is False


def test_atomic_write_on_a_full_disk_is_one_line_and_keeps_the_old_file(tmp_path):
    """A file-size limit (as a full disk) during atomic_write: a TrainingError naming the file, the previous
    contents intact, no temporary file left behind."""
    import resource

    target = tmp_path / "config.yaml"
    target.write_text("old\n")
    code = ("import sys\nfrom diffgrpo.fileio import atomic_write\nfrom diffgrpo.errors import TrainingError\n"
            "try:\n    atomic_write(sys.argv[1], 'x' * 8192)\nexcept TrainingError as e:\n    print(e)\n")
    p = subprocess.run([sys.executable, "-c", code, str(target)], capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096)))
    assert p.stdout.strip() == f"{target}: cannot write (File too large); free space and resume the run", p.stderr
    assert target.read_text() == "old\n" and [f.name for f in tmp_path.iterdir()] == ["config.yaml"]


# ---------------------------------------------------------------- issue 25, a low one: a short run that trains nothing
def test_a_run_shorter_than_max_bad_updates_that_trains_nothing_fails(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *FAST_CLI, "train.num_iterations=2", "train.max_bad_updates=3", "eval.every=0",
                 "reward.weights={tests.helpers.rewards:nan_reward: 1.0}", f"log.output_dir={out}"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [("error: no update was applied in iterations 1..2 (each was skipped: see the warnings above); "
                    "the run trained nothing")]
    assert not (out / "summary.json").exists()
