"""Finished runs as a user might leave them: a copy of a run directory, a checkpoint's state.json edited by hand."""
from __future__ import annotations

import json
import shutil
from pathlib import Path


def copy_run(small_run: Path, tmp_path: Path) -> Path:
    """``small_run`` copied to ``tmp_path/run`` (its links kept as links)."""
    run = tmp_path / "run"
    shutil.copytree(small_run, run, symlinks=True)
    return run


def edit_state(ckpt: Path, edit) -> None:
    """Apply ``edit`` to the checkpoint's parsed state.json and write it back."""
    state = json.loads((ckpt / "state.json").read_text())
    edit(state)
    (ckpt / "state.json").write_text(json.dumps(state))
