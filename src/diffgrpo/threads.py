"""Worker threads that never hold up the end of the process: reward calls with a time limit, and the serial
background scorer of ``reward.background``.

  call_with_timeout(fn, s, *a)  ``fn(*a)`` in a daemon thread, waited for at most ``s`` seconds (``s`` <= 0: called
                                in this thread, no limit). Past the limit ``CallTimeout`` is raised and the call is
                                left behind: a daemon thread cannot be stopped, but it never keeps the process alive.
                                The caller's autograd mode is the thread's; its name is the caller's + ``:timed``. A KeyboardInterrupt raised by ``fn``
                                itself (signals only reach the main thread, so it is not one) becomes a RuntimeError.
  SerialWorker(name)            one daemon thread running submitted calls in order (``submit`` → a Future); leaving
                                its ``with`` block does not wait for calls still queued or running, so a signal or an
                                error in the main thread ends the run even while a call hangs.

``note_signal`` / ``signal_expected`` tell a KeyboardInterrupt from a signal apart from one a reward raised itself.

The main thread's waits (``Future.result``) are interruptible: a second SIGINT/SIGTERM (the trainer's handler raises
KeyboardInterrupt) stops the run at once.
"""
from __future__ import annotations

import queue
import signal
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Self

import torch

_SIGNALS: list[int] = []  # the signals a run's handler turned into KeyboardInterrupt (note_signal)


def note_signal(signum: int) -> None:
    """Called by a signal handler just before it raises KeyboardInterrupt (the run's second SIGINT/SIGTERM)."""
    _SIGNALS.append(int(signum))


def restore_handlers(handlers: dict) -> None:
    """A run's end: the signal handlers it replaced back in place, and its noted signals forgotten (a later
    KeyboardInterrupt in this process is judged afresh)."""
    for sig, h in handlers.items():
        signal.signal(sig, h)
    _SIGNALS.clear()


def signal_expected() -> bool:
    """Whether a KeyboardInterrupt now may come from a signal: Python's own SIGINT handler is installed (no run's
    handler: Ctrl-C raises at once), or a run's handler said it raised (:func:`note_signal`). Otherwise the code
    that was running raised it itself."""
    return signal.getsignal(signal.SIGINT) is signal.default_int_handler or bool(_SIGNALS)


class CallTimeout(TimeoutError):
    """A call did not return within its time limit."""


def _run_into(fut: Future, fn: Callable, args: tuple, kwargs: dict, grad: bool) -> None:
    if not fut.set_running_or_notify_cancel():
        return
    try:
        with torch.set_grad_enabled(grad):
            fut.set_result(fn(*args, **kwargs))
    except KeyboardInterrupt:  # raised by fn itself: not a signal (those reach the main thread only)
        fut.set_exception(RuntimeError("raised KeyboardInterrupt inside a worker thread"))
    except BaseException as e:  # noqa: BLE001 - handed to the waiting caller as it is
        fut.set_exception(e)


def call_with_timeout(fn: Callable, timeout: float, *args, **kwargs):
    """``fn(*args, **kwargs)``, raising :class:`CallTimeout` after ``timeout`` seconds (see the module docstring)."""
    if not timeout or timeout <= 0:
        return fn(*args, **kwargs)
    fut: Future = Future()
    threading.Thread(target=_run_into, args=(fut, fn, args, kwargs, torch.is_grad_enabled()),
                     name=f"{threading.current_thread().name}:timed", daemon=True).start()
    try:
        return fut.result(timeout)
    except TimeoutError:
        if fut.done():  # fn itself raised a TimeoutError
            raise
        raise CallTimeout(f"no result after {timeout:g} s") from None


class SerialWorker:
    """One daemon thread that runs submitted calls in order; see the module docstring."""

    def __init__(self, name: str = "diffgrpo-worker"):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            _run_into(*job)

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        fut: Future = Future()
        self._jobs.put((fut, fn, args, kwargs, torch.is_grad_enabled()))
        return fut

    def close(self) -> None:
        """Let the thread end after the queued calls; never waits for them."""
        self._jobs.put(None)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["CallTimeout", "SerialWorker", "call_with_timeout"]
