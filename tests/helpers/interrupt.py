"""A run stopped the way a job is: SIGTERM after a chosen iteration (the job's handler finishes the iteration,
checkpoints and stops)."""
from __future__ import annotations

import signal


def train_stopped_after(tr, iteration: int) -> dict:
    """``tr.train()`` with SIGTERM raised once the step of ``iteration`` is done → its result; the trainer is
    checked to have stopped there."""
    step = tr.step

    def step_then_stop():
        row = step()
        if tr.iteration == iteration:
            signal.raise_signal(signal.SIGTERM)
        return row

    tr.step = step_then_stop
    out = tr.train()
    assert tr.iteration == iteration
    return out
