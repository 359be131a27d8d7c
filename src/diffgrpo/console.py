"""What a run prints: messages through Python ``logging``, progress as a bar on a terminal and as a line every N
iterations elsewhere (a piped log or a scheduler's file gets no carriage returns), and the end summary.

  emit(msg)            a message: a record at INFO on the ``diffgrpo`` logger when the application gave that logger a
                       handler (``logging.getLogger("diffgrpo").addHandler(...)``), else printed to stdout.
  Progress(...)        ``update(row)`` per iteration: a tqdm bar when ``bar`` is set and stderr is a terminal, else a
                       line ``iteration 10/40  reward 0.8123  1.52 s/it  eta 45 s`` every ``every`` iterations
                       (0 = about ten lines per run); nothing when disabled (ranks > 0).
  Steps(total, desc)   the steps of a first-time pretraining: a tqdm bar on a terminal, else a line
                       ``pretraining ...: step 500/5000  loss 0.0312  12.0 s  eta 108 s`` about every tenth of
                       the steps (``set_postfix(loss=...)`` as on a tqdm bar); nothing when disabled.
  stream_lines()       stdout written through at every line break, also into a pipe or a file, so a scheduler's
                       log or ``| tee`` shows each progress line as it is printed, not at the end of the run.
  end_summary(...)     the closing lines: wall time, train reward first → last, every held-out reward and guard
                       start → end, and the paths of the outputs.
  quiet_library_bars() where stdout or stderr is not a terminal: the progress bars of huggingface_hub and
                       transformers (``Writing model shards``, downloads) and of diffusers when loaded, turned off:
                       no carriage return reaches a piped log.
  note_termination()   a SIGTERM handler for commands without their own: one line (the signal, and the plug-in
                       call that was running, if any), then the default action (exit status 143).
  end_leftover_threads(code, before)  after a command: non-daemon threads it left running (a plug-in's) end the
                       process with ``code`` after a grace period, naming them, instead of keeping it alive.
"""
from __future__ import annotations

import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from . import plugins

LOGGER = logging.getLogger("diffgrpo")


def emit(msg: str) -> None:
    """Log ``msg`` at INFO to the ``diffgrpo`` logger if it has a handler, else print it."""
    if LOGGER.handlers:
        LOGGER.info(msg)
    else:
        print(msg, flush=True)


def signal_note(msg: str) -> None:
    """Say ``msg`` from a signal handler: written straight to standard output's file descriptor, not through print or
    logging, whose buffered writer may be in the middle of the write the signal interrupted (Python then raises
    "reentrant call" in the handler). Where standard output has no descriptor (captured in-process), nothing."""
    try:
        os.write(sys.stdout.fileno(), (msg + "\n").encode())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def auto_every(total: int) -> int:
    """Iterations between progress lines when none is given: about ten lines per run."""
    return max(1, total // 10)


class Progress:
    """Per-iteration progress (see the module docstring). ``stream``: where a bar would draw (stderr)."""

    def __init__(self, total: int, initial: int = 0, *, enabled: bool = True, bar: bool = True, every: int = 0,
                 log: Callable[[str], None] = emit, stream=None, desc: str = "GRPO"):
        self.total, self.done, self.log = total, initial, log
        stream = sys.stderr if stream is None else stream
        self.tty = _is_tty(stream)
        self.enabled = enabled
        self.every = every or auto_every(total)
        self.bar = tqdm(total=total, initial=initial, desc=desc, file=stream) if enabled and bar and self.tty else None
        self.t0, self.start = time.perf_counter(), initial

    def update(self, row: dict) -> None:
        self.done += 1
        reward, it_s = row.get("reward"), row.get("time/iteration")
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(reward=f"{reward:.3f}" if reward is not None else "n/a",
                                 it_s=f"{it_s:.1f}s" if it_s is not None else "n/a")
            return
        if not self.enabled or (self.done % self.every and self.done != self.total):
            return
        rate = (time.perf_counter() - self.t0) / max(1, self.done - self.start)
        eta = rate * (self.total - self.done)
        self.log(f"iteration {self.done}/{self.total}  reward {'n/a' if reward is None else f'{reward:.4f}'}  "
                 f"{rate:.2f} s/it  eta {eta:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _is_tty(stream) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)())


def stream_lines(stream=None) -> None:
    """Make ``stream`` (default stdout) flush at every line break; a no-op for a stream that cannot (a test's
    capture)."""
    stream = sys.stdout if stream is None else stream
    reconfigure = getattr(stream, "reconfigure", None)
    if reconfigure is not None:
        try:
            reconfigure(line_buffering=True)
        except (ValueError, OSError):  # a closed or detached stream
            pass


class Steps:
    """Iterate over ``range(total)`` reporting progress (see the module docstring): a bar when ``stream`` (stderr)
    is a terminal, else ``log`` lines every ``every`` steps (0: about ten). ``set_postfix(loss=...)`` sets what the
    next line shows."""

    def __init__(self, total: int, desc: str, *, enabled: bool = True, every: int = 0,
                 log: Callable[[str], None] = emit, stream=None):
        stream = sys.stderr if stream is None else stream
        self.total, self.desc, self.log, self.postfix = total, desc, log, {}
        self.lines = enabled and not _is_tty(stream)
        self.every = every or auto_every(total)
        self.bar = tqdm(total=total, desc=desc, file=stream, leave=False) if enabled and not self.lines else None

    def set_postfix(self, **values) -> None:
        self.postfix = values
        if self.bar is not None:
            self.bar.set_postfix(**values)

    def __iter__(self):
        t0 = time.perf_counter()
        try:
            for i in range(self.total):
                yield i
                done = i + 1
                if self.bar is not None:
                    self.bar.update(1)
                elif self.lines and (done % self.every == 0 or done == self.total):
                    self.log(self._line(done, time.perf_counter() - t0))
        finally:
            if self.bar is not None:
                self.bar.close()

    def _line(self, done: int, seconds: float) -> str:
        shown = "".join(f"  {k} {v}" for k, v in self.postfix.items())
        eta = seconds / done * (self.total - done)
        return f"{self.desc}: step {done}/{self.total}{shown}  {seconds:.1f} s  eta {eta:.0f} s"


def _fmt(v) -> str:
    return "n/a" if v is None else f"{v:.4f}"


def end_summary(run_dir: Path, summary: dict, *, wall_seconds: float, train_rows: list[dict]) -> list[str]:
    """The lines printed when a run finishes (see the module docstring)."""
    start, end = summary.get("start", {}), summary.get("end", {})
    rewards = [r["reward"] for r in train_rows if "reward" in r and "iteration" in r and r["reward"] is not None]
    lines = [f"finished in {wall_seconds / 60:.1f} min ({wall_seconds:.0f} s)"]
    if rewards:
        lines.append(f"train reward: {rewards[0]:.4f} -> {rewards[-1]:.4f} over {len(rewards)} iterations")
    for k in end:
        if k.startswith(("eval/rewards/", "eval/fid", "eval/diversity", "eval/accuracy", "eval/reward")):
            a, b = start.get(k), end.get(k)
            delta = f" ({b - a:+.4f})" if isinstance(a, (int, float)) and isinstance(b, (int, float)) else ""
            lines.append(f"{k}: {_fmt(a)} -> {_fmt(b)}{delta}")
    outputs = [p for p in ("weights.safetensors", "transformer", "lora", "model", "samples_start_end.png",
                           "metrics.jsonl") if (Path(run_dir) / p).exists()]
    lines.append(f"outputs in {run_dir}: {', '.join(outputs)}")
    lines.append(f"report: diffgrpo report {run_dir}")
    return lines


def quiet_library_bars() -> bool:
    """Turn the libraries' tqdm bars off when stdout or stderr is not a terminal (see the module doc) → whether."""
    if _is_tty(sys.stdout) and _is_tty(sys.stderr):
        return False
    import huggingface_hub.utils  # transformers reads this state when it is imported

    huggingface_hub.utils.disable_progress_bars()
    for name in ("transformers", "diffusers"):  # already imported: their own switch (diffusers has no other)
        if name in sys.modules:
            __import__(f"{name}.utils.logging", fromlist=["x"]).disable_progress_bar()
    return True


def running_calls() -> str:
    """`` while reward 'x' was running`` when a guarded plug-in call is in progress, else ``""``."""
    calls = plugins.running()
    return f" while {calls[-1]} was running" if calls else ""


def _on_term(signum, frame):
    name = signal.Signals(signum).name
    try:
        os.write(sys.stderr.fileno(), f"error: terminated by signal {signum} ({name}){running_calls()}; the command "
                 "stopped where it was (nothing more is written)\n".encode())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # the default action: the status says the signal (143)


def note_termination():
    """Install :func:`_on_term` for SIGTERM where the default action is in place (main thread only) → the handler
    it replaced, for :func:`threads.restore_handlers`-style restoring, or None."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return None
    return signal.signal(signal.SIGTERM, _on_term)


LEFTOVER_GRACE_S = 3.0  # after the interpreter began its exit, for the threads a command left to end by themselves


def _leftover(before: set) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.is_alive() and not t.daemon and t not in before
            and t is not threading.main_thread()]


def _watch_exit(code: int, threads: list[threading.Thread]) -> None:
    while threading.main_thread().is_alive():  # until the interpreter's exit starts joining the threads
        time.sleep(0.2)
    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while time.monotonic() < deadline and any(t.is_alive() for t in threads):
        time.sleep(0.05)
    alive = [t.name for t in threads if t.is_alive()]
    if not alive:
        return
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    note = (f"warning: non-daemon thread(s) {alive} (started by a plug-in) still run after the command "
                       f"ended; exiting with status {code} without waiting for them (start such threads with "
                       "daemon=True, or join them before returning)\n")
    try:
        os.write(sys.stderr.fileno(), note.encode())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    plugins.real_exit(code)


def end_leftover_threads(code: int, before: set) -> list[str]:
    """After a command that returns ``code``: the non-daemon threads started since ``before`` (a set of threads)
    and still alive would keep the process from exiting; a daemon watcher ends the process with ``code`` when they
    outlive :data:`LEFTOVER_GRACE_S` of the interpreter's exit, naming them → their names (empty: nothing to do)."""
    threads = _leftover(before)
    if threads:
        threading.Thread(target=_watch_exit, args=(code, threads), name="diffgrpo-exit-watch", daemon=True).start()
    return [t.name for t in threads]


__all__ = ["LEFTOVER_GRACE_S", "LOGGER", "Progress", "Steps", "auto_every", "emit", "end_leftover_threads",
           "end_summary", "note_termination", "quiet_library_bars", "running_calls", "stream_lines"]
