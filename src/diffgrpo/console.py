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
"""
from __future__ import annotations

import io
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

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


__all__ = ["LOGGER", "Progress", "Steps", "auto_every", "emit", "end_summary", "stream_lines"]
