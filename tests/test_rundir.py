"""The run directory (``diffgrpo.run.rundir``): subfolders that are links are never written or pruned, an
output_dir must be empty or a run directory of this tool, and a killed run's temporary files are swept at the
next start."""
from __future__ import annotations

from pathlib import Path

import pytest

from diffgrpo.cli.app import main
from diffgrpo.errors import TrainingError
from tests.helpers.tiny import FAST_CLI


# ------------------------------------------------------------------------------ issue 25 H-1: symlinked run subfolders
def _planted(tmp_path: Path, name: str) -> tuple[Path, Path]:
    """A run directory whose ``name`` subfolder is a link to a folder holding a user's file and iter_* folders."""
    run, target = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (run / ".diffgrpo-run").write_text('{"tool": "diffgrpo"}')  # a run directory of this tool
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


# ------------------------------------------------------------- issue 25 H-5: an output_dir that is not a run directory
def test_output_dir_must_be_empty_or_a_run_directory(tmp_path, capsys):
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.yaml").write_text("mine: true\n")
    (project / "summary.json").write_text("{}")
    assert main(["train", *FAST_CLI, "train.num_iterations=1", f"log.output_dir={project}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not empty and is not a diffgrpo run directory" in err[0]
    assert (project / "config.yaml").read_text() == "mine: true\n" and (project / "summary.json").read_text() == "{}"
    assert sorted(p.name for p in project.iterdir()) == ["config.yaml", "summary.json"]
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    assert main(["train", *FAST_CLI, "train.num_iterations=1", "train.save_every=1", f"log.output_dir={fresh}"]) == 0
    assert (fresh / ".diffgrpo-run").is_file()
    assert main(["train", "--resume", str(fresh), "train.num_iterations=2"]) == 0  # a run directory: resumable


# -------------------------------------------------------------------------- issue 25, a low one: stale temporary files
def test_stale_temporary_files_are_removed_at_the_next_start(tmp_path):
    from diffgrpo.run.rundir import sweep

    run = tmp_path / "run"
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").mkdir(parents=True)
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123" / "trainable.safetensors").write_bytes(b"x" * 10)
    (run / ".metrics.jsonl.k2j4h5g6.tmp").write_text("{}")
    (run / ".lora.q1w2e3r4").mkdir()
    (run / ".keep").write_text("mine")  # hidden files of other names stay
    (run / "samples").mkdir()
    (run / "samples" / ".eval_000001.jsonl.zz99yy88.tmp").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ".x.abcdefgh.tmp").write_text("not the run's")
    (run / "best").symlink_to(elsewhere, target_is_directory=True)  # never followed
    removed = sweep(run, log=lambda *a: None)
    assert sorted(removed) == sorted([".metrics.jsonl.k2j4h5g6.tmp", ".lora.q1w2e3r4",
                                      "checkpoints/.tmp_iter_000002.ab_cd123", "samples/.eval_000001.jsonl.zz99yy88.tmp"])
    assert sorted(p.name for p in run.iterdir()) == [".keep", "best", "checkpoints", "samples"]
    assert (elsewhere / ".x.abcdefgh.tmp").is_file()
