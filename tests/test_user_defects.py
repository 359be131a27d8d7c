"""The defects found by walking the user paths as a careless or hostile user (issue 25), one test each: symlinked
run subfolders (H-1), a hung reward (H-2), moved or edited prompt files on resume (H-3), YAML 1.1 scalars in
string keys (H-4), a run into a folder that is not a run directory (H-5), and the medium and low ones."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tests.test_reliability import TINY_CLI

from diffgrpo.cli import main
from diffgrpo.errors import RewardError, TrainingError

FAST = [*TINY_CLI, "train.ema_decay=0.0"]
HANG_MARK = "DIFFGRPO_TEST_HANG_MARK"


def hang(images, prompts, metadata):
    """A reward that never returns (after touching the file named by $DIFFGRPO_TEST_HANG_MARK, if set); with
    $DIFFGRPO_TEST_HANG_MARK set it scores the evaluations (main thread) and hangs in the background scorer only."""
    mark = os.environ.get(HANG_MARK)
    if mark and not threading.current_thread().name.startswith("diffgrpo-reward"):
        return images.flatten(1).mean(1)
    if mark:
        Path(mark).write_text("scoring")
    threading.Event().wait()


def brightness(images, prompts, metadata):
    return images.flatten(1).mean(1)


# ------------------------------------------------------------------------------------------ H-1 symlinks
def _planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A run directory whose ``name`` subfolder is a link to a folder holding a user's file and iter_* folders."""
    run, target = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    target.mkdir()
    (target / "keep.txt").write_text("mine")
    for i in (1, 2, 3):
        (target / f"iter_{i:06d}").mkdir()
    (run / name).symlink_to(target, target_is_directory=True)
    return run, target


@pytest.mark.parametrize("name", ["samples", "checkpoints"])
def test_symlinked_run_subfolder_is_never_written_or_pruned(make_trainer, tmp_path, name):
    run, target = _planted(tmp_path, name)
    tr = make_trainer(f"log.output_dir={run}", "train.num_iterations=3", "train.save_every=1",
                      "train.keep_checkpoints=1", "log.save_images=true", "eval.seeds_per_prompt=1")
    with pytest.raises(TrainingError, match=rf"{name} is a symbolic link inside the run directory"):
        tr.train()
    assert sorted(p.name for p in target.iterdir()) == ["iter_000001", "iter_000002", "iter_000003", "keep.txt"]
    assert all(not any(p.iterdir()) for p in target.iterdir() if p.is_dir())


# ------------------------------------------------------------------------------------------ H-2 a hung reward
def test_hung_reward_stops_at_reward_timeout(make_trainer):
    tr = make_trainer("sampler.batch_size=2", "reward.background=true", "reward.timeout=0.5",
                      "reward.weights={tests.test_user_defects:hang: 1.0}")
    t0 = time.perf_counter()
    with pytest.raises(RewardError, match=r"returned nothing within reward\.timeout=0\.5 s") as err:
        tr.rollout()
    assert time.perf_counter() - t0 < 30 and "\n" not in str(err.value)
    tr = make_trainer("reward.timeout=0.5", "reward.weights={tests.test_user_defects:hang: 1.0}")
    with pytest.raises(RewardError, match=r"reward\.timeout"):  # without background too, and never retried
        tr.rollout()


def test_timeout_keeps_scores_and_grad_mode(make_trainer):
    slow = make_trainer("reward.timeout=60", "reward.weights={tests.test_user_defects:brightness: 1.0}").rollout()
    plain = make_trainer("reward.timeout=0", "reward.weights={tests.test_user_defects:brightness: 1.0}").rollout()
    assert torch.equal(slow.rewards, plain.rewards)


def test_two_sigterms_end_a_run_whose_background_reward_hangs(tmp_path):
    out, mark = tmp_path / "run", tmp_path / "mark"
    env = dict(os.environ, OMP_NUM_THREADS="1", **{HANG_MARK: str(mark)})
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *FAST, "sampler.batch_size=2",
                          "reward.background=true", "reward.timeout=0", "eval.seeds_per_prompt=1",
                          "reward.weights={tests.test_user_defects:hang: 1.0}", f"log.output_dir={out}"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not mark.exists() and p.poll() is None:
        time.sleep(0.05)
    assert mark.exists(), p.communicate()[0] if p.poll() is not None else "the reward was never called"
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    try:
        text = p.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("two SIGTERMs did not end a run whose reward hangs")
    assert p.returncode == 130, text
