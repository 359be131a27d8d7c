"""What a run prints when its output is piped (``| tee``, a scheduler's log): each progress line arrives as it is
printed, and no carriage-return bar is drawn, from a first-time pretraining either; on a terminal the bars stay."""
from __future__ import annotations

import io
import os
import signal
import subprocess
import sys

from diffgrpo.console import Steps, stream_lines
from tests.helpers.tiny import TINY_CLI


def _piped_env(**extra) -> dict:
    """The test's environment without PYTHONUNBUFFERED (a shell that happens to set it hides buffering)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_steps_print_lines_into_a_pipe_and_a_bar_on_a_terminal():
    piped, lines = io.StringIO(), []
    bar = Steps(20, "pretraining x", stream=piped, log=lines.append)
    for i in bar:
        bar.set_postfix(loss=f"{1.0 / (i + 1):.4f}")
    assert len(lines) == 10 and piped.getvalue() == ""  # about ten lines, nothing drawn
    assert lines[-1].startswith("pretraining x: step 20/20  loss 0.0500  ") and lines[-1].endswith("eta 0 s")
    assert lines[0].startswith("pretraining x: step 2/20  loss 0.5000")
    term, lines = _Terminal(), []
    bar = Steps(5, "pretraining x", stream=term, log=lines.append)
    assert list(bar) == [0, 1, 2, 3, 4]
    assert not lines and "\rpretraining x:" in term.getvalue()  # a tqdm bar, cleared when done (leave=False)
    quiet = Steps(5, "pretraining x", enabled=False, stream=term, log=lines.append)
    assert list(quiet) == [0, 1, 2, 3, 4] and not lines


def test_stream_lines_leaves_a_capture_without_reconfigure_alone():
    stream_lines(io.BytesIO())  # no reconfigure: nothing to do
    wrapper = io.TextIOWrapper(io.BytesIO())
    stream_lines(wrapper)
    assert wrapper.line_buffering


def test_train_streams_each_iteration_line_into_a_pipe(tmp_path):
    """A piped reader sees ``iteration 1/N`` while the run is still going (not when it ends)."""
    p = subprocess.Popen([sys.executable, "-m", "diffgrpo.cli", "train", *TINY_CLI, "train.num_iterations=200",
                          "log.every=1", "eval.every=0", "train.save_every=0", f"log.output_dir={tmp_path / 'run'}"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_piped_env())
    seen = []
    try:
        for line in p.stdout:
            seen.append(line)
            if line.startswith("iteration 1/200"):
                break
        assert p.poll() is None, "".join(seen)  # the line came while the run goes on
    finally:
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=300)


def test_first_time_pretraining_writes_no_carriage_returns_into_a_pipe(tmp_path):
    """Both built-in models pretrain on an empty cache with stdout and stderr piped: lines with the step and the
    loss, no carriage-return bar."""
    env = _piped_env(DIFFGRPO_CACHE=str(tmp_path / "cache"))
    runs = {"pretraining built-in model: step 20/20  loss ": ["pretrain", *TINY_CLI],
            "pretraining tiny dLLM (arithmetic): step 10/10  loss ": ["pretrain", "--task", "arithmetic",
                                                                      "model.name=tiny_mlm", "pretrain.steps=10",
                                                                      "pretrain.batch_size=8"]}
    for expected, argv in runs.items():
        args = [a for a in argv if a != "log.progress=false"]  # the default: progress on
        done = subprocess.run([sys.executable, "-m", "diffgrpo.cli", *args], capture_output=True, env=env,
                              timeout=600)  # bytes: text mode would turn a carriage return into a line break
        out, err = done.stdout.decode(), done.stderr.decode()
        assert done.returncode == 0, out + err
        assert b"\r" not in done.stdout and b"\r" not in done.stderr, err[-2000:]
        assert expected in out, out


def test_a_signal_handlers_note_bypasses_the_buffered_writer(capfd, monkeypatch):
    """A handler's note is written to the descriptor, never through the buffered writer the signal may have
    interrupted mid-write (print from a handler then raises "reentrant call", as a SIGTERM during bench quality's
    progress line did)."""
    import sys

    from diffgrpo.console import signal_note

    class Busy:  # a writer in the middle of a write: any use of it from the handler fails
        def write(self, s):
            raise RuntimeError("reentrant call inside <_io.BufferedWriter name='<stdout>'>")

        def fileno(self):
            return 1

    monkeypatch.setattr(sys, "stdout", Busy())
    signal_note("received signal 15: finishing the current iteration")
    monkeypatch.undo()
    assert capfd.readouterr().out == "received signal 15: finishing the current iteration\n"
