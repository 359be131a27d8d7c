"""Crash-safe checkpoints: a run killed at any point resumes from the last complete checkpoint.

Layout under ``<run_dir>/checkpoints/``:
  iter_000012/            one directory per checkpoint, written to a temporary directory and renamed into place
    trainable.safetensors policy's trainable weights
    ema.safetensors       EMA of the trainable weights (when enabled)
    optimizer.pt          optimizer state (tensors and plain containers only: loads with weights_only=True)
    rng.pt                RNG states of every generator in use (same)
    state.json            iteration counter, resolved config, file sizes (checked on load)
  latest.json             manifest naming the newest complete checkpoint, replaced atomically

Nothing is ever unpickled beyond tensors and plain containers (``torch.load(weights_only=True)``).
A checkpoint directory whose files do not match its ``state.json`` (truncated mid-write) is skipped and the
previous one is used.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

_DIR_RE = re.compile(r"^iter_(\d{6,})$")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(run_dir: Path, iteration: int, *, trainable: dict[str, torch.Tensor], optimizer: dict,
                    rng: dict[str, torch.Tensor], config: dict, ema: dict[str, torch.Tensor] | None = None,
                    extra: dict | None = None, keep_last: int = 2) -> Path:
    """Write checkpoint ``iteration`` atomically, update the manifest, prune to the newest ``keep_last``."""
    from safetensors.torch import save_file

    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"iter_{iteration:06d}"
    tmp = root / f".tmp_iter_{iteration:06d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file({k: v.detach().contiguous().cpu() for k, v in trainable.items()}, str(tmp / "trainable.safetensors"))
    if ema is not None:
        save_file({k: v.detach().contiguous().cpu() for k, v in ema.items()}, str(tmp / "ema.safetensors"))
    torch.save(optimizer, tmp / "optimizer.pt")
    torch.save(rng, tmp / "rng.pt")
    files = {p.name: p.stat().st_size for p in tmp.iterdir()}
    state = {"iteration": iteration, "config": config, "files": files, "extra": extra or {}}
    _atomic_write_text(tmp / "state.json", json.dumps(state, indent=1))
    for p in tmp.iterdir():  # flush file contents before the rename makes the checkpoint visible
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _atomic_write_text(root / "latest.json", json.dumps({"latest": final.name, "iteration": iteration}))
    for old in list_checkpoints(run_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Checkpoint directories (complete or not) in iteration order."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _DIR_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def is_complete(ckpt: Path) -> bool:
    """True when ``state.json`` parses and every file it lists exists with the recorded size."""
    try:
        state = json.loads((ckpt / "state.json").read_text())
        return all((ckpt / n).is_file() and (ckpt / n).stat().st_size == s for n, s in state["files"].items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def latest_complete(run_dir: Path, log=print) -> Path | None:
    """The newest complete checkpoint; incomplete newer ones are reported and skipped."""
    for ckpt in reversed(list_checkpoints(run_dir)):
        if is_complete(ckpt):
            return ckpt
        log(f"warning: checkpoint {ckpt} is incomplete (truncated write); using an earlier one")
    return None


def load_checkpoint(ckpt: Path) -> dict:
    """→ {"iteration", "config", "trainable", "ema" (or None), "optimizer", "rng", "extra"}; safe loading only."""
    from safetensors.torch import load_file

    state = json.loads((ckpt / "state.json").read_text())
    return {
        "iteration": int(state["iteration"]),
        "config": state["config"],
        "extra": state.get("extra", {}),
        "trainable": load_file(str(ckpt / "trainable.safetensors")),
        "ema": load_file(str(ckpt / "ema.safetensors")) if (ckpt / "ema.safetensors").is_file() else None,
        "optimizer": torch.load(ckpt / "optimizer.pt", weights_only=True),
        "rng": torch.load(ckpt / "rng.pt", weights_only=True),
    }
