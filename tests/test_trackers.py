"""Trackers: every metrics row and evaluation grid reaches TensorBoard and W&B, and the writer is closed once,
after the end evaluation, however the run ends."""
import json
import math
import signal
from pathlib import Path

import pytest
import torch

from diffgrpo.cli.app import main
from diffgrpo.errors import TrainingError
from diffgrpo.run import job as job_mod
from diffgrpo.run.runlog import MetricsWriter
from tests.helpers.tiny import FAST_CLI
from tests.helpers.trackers import wandb_records

RUN = ("train.num_iterations=2", "eval.every=1", "eval.seeds_per_prompt=1")


class Recorder:
    """A ``runlog.Tracker`` that records its calls."""

    def __init__(self):
        self.calls = []

    def log(self, values, step):
        self.calls.append(("log", step, dict(values)))

    def log_image(self, key, image, step, caption):
        self.calls.append(("image", step, key, image.shape, caption))

    def finish(self):
        self.calls.append(("finish",))


def _rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _recording(monkeypatch):
    rec = Recorder()

    class Writer(MetricsWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, trackers=[rec], **kwargs)

    monkeypatch.setattr(job_mod, "MetricsWriter", Writer)
    return rec


def test_writer_sends_finite_scalars_and_finishes_once(tmp_path):
    rec = Recorder()
    w = MetricsWriter(tmp_path, trackers=[rec])
    with w:
        w.write({"iteration": 3, "reward": 0.5, "kl": math.nan, "n": 2, "flag": True, "name": "x"})
        w.write({"no_iteration": 1.0})  # only in metrics.jsonl
        w.log_images(torch.rand(4, 1, 8, 8), 3, nrow=2, caption="c")
    w.close()
    assert rec.calls[0] == ("log", 3, {"reward": 0.5, "n": 2})
    assert rec.calls[1][:3] == ("image", 3, "eval/samples") and rec.calls[1][3][2] == 3 and rec.calls[1][4] == "c"
    assert rec.calls[2:] == [("finish",)]
    assert _rows(tmp_path)[0]["kl"] is None


def test_every_evaluation_is_logged_and_the_trackers_finish_after_the_last(make_trainer, tmp_path, monkeypatch):
    rec = _recording(monkeypatch)
    run = tmp_path / "run"
    make_trainer(*RUN, f"log.output_dir={run}", "log.save_images=true").train()
    evals = [r for r in _rows(run) if "eval/reward" in r]
    images = [c for c in rec.calls if c[0] == "image"]
    assert [c[1] for c in images] == [0, 1, 2]
    assert images[-1][4] == f"iteration 2 (end): mean held-out reward {evals[-1]['eval/reward']:.4f}"
    assert images[1][4].startswith("iteration 1: mean held-out reward ")
    assert rec.calls[-1] == ("finish",) and rec.calls.count(("finish",)) == 1
    assert rec.calls[-3] == ("log", 2, {k: v for k, v in evals[-1].items() if k != "iteration"})
    for f in ("samples_start.png", "samples_1.png", "samples_end.png"):
        assert (run / f).is_file(), f


def test_the_trackers_finish_once_on_an_error_and_on_a_signal(make_trainer, tmp_path, monkeypatch):
    rec = _recording(monkeypatch)
    tr = make_trainer(*RUN, f"log.output_dir={tmp_path / 'a'}")
    monkeypatch.setattr(tr, "step", lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        tr.train()
    assert rec.calls[-1] == ("finish",) and rec.calls.count(("finish",)) == 1

    rec.calls.clear()
    tr = make_trainer(*RUN, f"log.output_dir={tmp_path / 'b'}")
    step = tr.step

    def stopped():
        row = step()
        signal.raise_signal(signal.SIGTERM)  # the job's handler: finish this iteration, checkpoint, stop
        return row

    monkeypatch.setattr(tr, "step", stopped)
    assert tr.train()["interrupted"] == signal.SIGTERM
    assert rec.calls[-1] == ("finish",) and rec.calls.count(("finish",)) == 1


def test_wandb_offline_run_holds_the_end_evaluation(make_trainer, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_SILENT": "true",
                 "WANDB_DISABLE_GIT": "true", "WANDB_CONSOLE": "off"}.items():
        monkeypatch.setenv(k, v)
    run = tmp_path / "run"
    make_trainer(*RUN, f"log.output_dir={run}", "log.wandb=true").train()
    end = [r for r in _rows(run) if "eval/reward" in r][-1]
    offline = sorted(run.glob("wandb/offline-run-*"))
    assert len(offline) == 1, offline
    logs = list(offline[0].glob("*.wandb"))
    assert len(logs) == 1, logs
    records = list(wandb_records(logs[0]))
    kinds = [r.WhichOneof("record_type") for r in records]
    assert kinds.count("exit") == 1 and "history" not in kinds[kinds.index("exit"):]  # finished once, at the end
    history = [{(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
               | {"_step": r.history.step.num} for r in records if r.WhichOneof("record_type") == "history"]
    evals = [h for h in history if "eval/reward" in h]
    assert [h["_step"] for h in evals] == [0, 1, 2]
    assert evals[-1]["eval/reward"] == end["eval/reward"]
    assert evals[-1]["eval/samples/caption"] == f"iteration 2 (end): mean held-out reward {end['eval/reward']:.4f}"
    assert len(list((offline[0] / "files" / "media" / "images").rglob("*.png"))) == 3  # start, 1, end


@pytest.mark.parametrize("switch", ["log.tensorboard=true", "log.trackers=[tensorboard]"])
def test_tensorboard_run_is_one_event_file_with_the_end_evaluation(make_trainer, tmp_path, switch):
    pytest.importorskip("tensorboard")
    import yaml
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    make_trainer(*RUN, f"log.output_dir={run}", switch).train()
    end = [r for r in _rows(run) if "eval/reward" in r][-1]
    files = list((run / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    hparams = list((run / "tensorboard").glob("*/hparams.yml"))  # store_init_configuration: the flat config
    assert len(hparams) == 1 and len(list(run.rglob("events.out.tfevents.*"))) == 2
    config = yaml.safe_load(hparams[0].read_text())
    assert config["train.num_iterations"] == 2 and config["log.output_dir"] == str(run)
    ea = EventAccumulator(str(files[0]), size_guidance={"images": 0, "scalars": 0, "tensors": 0}).Reload()
    scalars = ea.Scalars("eval/reward")
    assert [s.step for s in scalars] == [0, 1, 2]
    assert scalars[-1].value == pytest.approx(end["eval/reward"], rel=1e-6)
    assert [i.step for i in ea.Images("eval/samples")] == [0, 1, 2]
    assert [s.step for s in ea.Scalars("reward")] == [1, 2]


# ------------------------------------------------------------------------------- issue 25 M-11: tracker setup problems
def _tracker_run(tmp_path: Path, plant) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    (run / ".diffgrpo-run").write_text('{"tool": "diffgrpo"}')
    plant(run)
    return run


@pytest.mark.parametrize("plant, key, why", [
    (lambda r: (r / "tensorboard").write_text("x"), "log.tensorboard", "exists and is not a directory"),
    (lambda r: (r / "tensorboard").symlink_to(r.parent, target_is_directory=True), "log.tensorboard",
     "is a symbolic link"),
    (lambda r: (r / "wandb_id").write_text("bad/id:#"), "log.wandb", "not a W&B run id"),
    (lambda r: (r / "wandb_id").symlink_to(r / ".diffgrpo-run"), "log.wandb", "is not a regular file")])
def test_tracker_setup_problems_are_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, plant, key,
                                                                    why):  # M-11, and the low TensorBoard/wandb ones
    import diffgrpo.trainer

    run = _tracker_run(tmp_path, plant)
    monkeypatch.setattr(diffgrpo.trainer, "Trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    tracker = "log.tensorboard=true" if key == "log.tensorboard" else "log.wandb=true"
    assert main(["train", *FAST_CLI, "train.num_iterations=1", tracker, f"log.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {key}: ") and why in err[0], err
    assert sorted(p.name for p in run.iterdir()) == sorted(p.name for p in run.iterdir() if p.name in
                                                            (".diffgrpo-run", "tensorboard", "wandb_id"))


def test_a_tracker_that_fails_to_start_is_one_line(tmp_path, monkeypatch):  # M-11: whatever else a tracker raises
    pytest.importorskip("wandb")
    from accelerate import tracking

    def broken(self):
        raise RuntimeError("api_key not configured (no-tty)\ncall wandb.login()")

    monkeypatch.setattr(tracking.WandBTracker, "start", broken)
    with pytest.raises(TrainingError) as err:
        MetricsWriter(tmp_path, {"wandb": "log.wandb"})
    assert str(err.value).startswith("log.wandb: the wandb tracker could not start (RuntimeError: api_key not "
                                     "configured (no-tty)); fix it or set log.wandb=false"), err.value
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("value, why", [
    ("[tensorboard, neptune]", "log.trackers: value 'neptune' is not a tracker; choose among ['tensorboard', 'wandb', "
                               "'mlflow', 'trackio', 'comet_ml', 'aim', 'clearml', 'dvclive']"),
    ("[dvclive]", "log.trackers: dvclive needs the dvclive package, which is not installed; pip install "
                  "'diffgrpo[dvclive]', or remove dvclive from log.trackers")])
def test_a_tracker_unknown_or_not_installed_is_one_line_before_the_model_loads(tmp_path, capsys, monkeypatch, value,
                                                                             why):
    import importlib.util

    import diffgrpo.trainer

    if "dvclive" in why and importlib.util.find_spec("dvclive") is not None:
        pytest.skip("dvclive is installed")
    monkeypatch.setattr(diffgrpo.trainer, "Trainer", lambda *a, **k: pytest.fail("the model was loaded"))
    run = tmp_path / "run"
    assert main(["train", *FAST_CLI, "train.num_iterations=1", f"log.trackers={value}", f"log.output_dir={run}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {why}"], err
    assert not run.exists()


def test_the_switches_are_aliases_in_the_trackers_list():
    from diffgrpo.run.trackers import requested

    assert requested({"trackers": ["mlflow", "wandb"], "wandb": True, "tensorboard": True}) == {
        "mlflow": "log.trackers", "wandb": "log.trackers", "tensorboard": "log.tensorboard"}
    assert requested({"trackers": [], "wandb": True, "tensorboard": False}) == {"wandb": "log.wandb"}
