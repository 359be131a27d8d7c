"""Checkpoints (``diffgrpo.run.checkpoint``) that do not belong to the run: another model size, a state.json
edited by hand or written by another engine, a folder renamed to another iteration; each one line."""
from __future__ import annotations

import pytest

from diffgrpo.cli.app import main
from diffgrpo.errors import TrainingError
from tests.helpers.runs import copy_run, edit_state


# -------------------------------------------------------------------- issue 25 M-8: a checkpoint of another model size
def test_a_checkpoint_of_another_model_size_is_a_one_line_error(make_trainer, tmp_path):  # M-8
    from diffgrpo.run.checkpoint import latest_complete, load_checkpoint

    run = tmp_path / "r"
    make_trainer(f"log.output_dir={run}", "train.num_iterations=1", "train.save_every=1",
                 "eval.seeds_per_prompt=1").train()
    other = make_trainer("model.num_layers=2")
    with pytest.raises(TrainingError) as err:
        other.load_state(load_checkpoint(latest_complete(run)))
    assert "cannot load checkpoint" in str(err.value) and "\n" not in str(err.value) and len(str(err.value)) < 600


# ------------------------------------------------------------ issue 25, low ones: hand-edited or misplaced checkpoints
@pytest.mark.parametrize("edit, why", [
    (lambda s: s.update(iteration=7), "says iteration 7 in its state.json, not its folder's"),
    (lambda s: s.update(iteration="1"), "says iteration '1' in its state.json"),
    (lambda s: s.update(format="dcp"), "says format 'dcp' in its state.json, which its files are not"),
    (lambda s: s["config"]["engine"].update(name="jagg"), ("was written with engine.name='jagg', this run has "
                                                           "'recompute'"))])
def test_a_hand_edited_or_foreign_checkpoint_is_refused_in_one_line(small_run, tmp_path, capsys, edit, why):
    run = copy_run(small_run, tmp_path)
    (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").mkdir()  # a killed run's leftover: removed at the start
    edit_state(run / "checkpoints" / "iter_000001", edit)
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.num_iterations=2"]) in (1, 2)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line]
    assert len(err) == 1 and why in err[0] and err[0].startswith("error: "), err
    assert not (run / "checkpoints" / ".tmp_iter_000002.ab_cd123").exists()


def test_a_checkpoint_in_a_folder_of_another_iteration_is_refused(small_run, tmp_path, capsys):
    run = copy_run(small_run, tmp_path)
    (run / "checkpoints" / "iter_000001").rename(run / "checkpoints" / "iter_000005")
    (run / "checkpoints" / "latest.json").unlink(missing_ok=True)
    assert main(["train", "--resume", str(run), "train.num_iterations=6"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "says iteration 1 in its state.json, not its folder's" in err[0], err


# ------------------------------------------------------------ a resume whose logged start evaluation holds a null
def test_a_resume_reads_back_a_start_evaluation_with_a_non_finite_value(small_run, tmp_path, capsys):
    """The metrics log stores a non-finite value as null (a shapes run's detection diversity with no detections
    is NaN); the resumed run prints that start row as n/a, as the end summary does, and goes on."""
    import json

    run = copy_run(small_run, tmp_path)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in rows if "eval/reward" in r)
    start["eval/fid"] = None
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "train.num_iterations=2"]) == 0
    out = capsys.readouterr().out
    assert "eval at start: " in out and "eval/fid=n/a" in out, out[-2000:]
    assert [json.loads(line)["iteration"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if "reward" in json.loads(line)] == [1, 2]
