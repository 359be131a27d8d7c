"""What a run directory is, and the data files a run was started on.

  MARKER                       ``.diffgrpo-run``: written when a run is created in a directory (JSON: the tool and
                               the SHA-256 of each local data file the run reads). ``log.output_dir`` must be a new
                               or empty folder, or a run directory: one holding the marker, or, from versions before
                               the marker, both ``config.yaml`` and ``metrics.jsonl``. Any other folder (a project,
                               a diffusers pipeline) is refused, so a run never overwrites files it did not write.
  absolute_data_paths(cfg)     local data-file paths (``train.prompts_file``, ``eval.prompts_file``,
                               ``dllm.data_file``, ``dllm.eval_file``) made absolute, in place: the saved config
                               names the file the run read, wherever it is resumed from (``hf:`` and ``builtin:``
                               specs are kept as they are).
  check(out, cfg, resume)      the checks above before anything loads; on a resume also that every recorded data
                               file still has its recorded content (a one-line ConfigError naming the key).
  sweep(out)                   the hidden temporary files and folders of a killed run removed (at its next start,
                               under its lock).
  claim(out, cfg, resume)      ``check``, then the marker written (a new run, or a run from before markers);
                               under several ranks rank 0 decides for all (a collective).

Cost: one SHA-256 pass over each local data file per start or resume.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from pathlib import Path

from .. import distributed
from ..config import RunConfig
from ..distributed import WorldInfo
from ..errors import ConfigError
from ..fileio import atomic_write
from .trackers import check_files, requested

MARKER = ".diffgrpo-run"
DATA_KEYS = (("train", "prompts_file"), ("eval", "prompts_file"), ("dllm", "data_file"), ("dllm", "eval_file"))
_REMOTE = ("hf:", "builtin:")


def _local(spec: str) -> bool:
    return bool(spec) and not spec.startswith(_REMOTE)


def absolute_data_paths(cfg) -> None:
    """Make every local data-file path of ``cfg`` absolute (in place; ``~`` already expanded by the parser)."""
    for sec, name in DATA_KEYS:
        section = getattr(cfg, sec)
        spec = getattr(section, name)
        if _local(spec):
            setattr(section, name, os.path.abspath(spec))


def sha256_of(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def data_hashes(cfg) -> dict[str, dict[str, str]]:
    """``{key: {"path", "sha256"}}`` of the local data files ``cfg`` names (files that exist)."""
    out = {}
    for sec, name in DATA_KEYS:
        spec = getattr(getattr(cfg, sec), name)
        if _local(spec) and os.path.isfile(spec):
            out[f"{sec}.{name}"] = {"path": os.path.abspath(spec), "sha256": sha256_of(spec)}
    return out


def read_marker(out: Path) -> dict | None:
    """The marker's content, or None when ``out`` has none (a link or a damaged marker counts as none)."""
    p = Path(out) / MARKER
    if p.is_symlink() or not p.is_file():
        return None
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("tool") == "diffgrpo" else None


def is_run_dir(out: Path) -> bool:
    out = Path(out)
    return read_marker(out) is not None or ((out / "config.yaml").is_file() and (out / "metrics.jsonl").is_file())


def check(out: str | Path, cfg, resume: bool) -> None:
    """Refuse a non-empty ``out`` that is not a run directory, and a resume whose data files changed."""
    out = Path(out)
    if out.is_dir() and not is_run_dir(out) and any(p.name != ".lock" for p in out.iterdir()):
        raise ConfigError(f"log.output_dir: {str(out)!r} is not empty and is not a diffgrpo run directory (no "
                          f"{MARKER}); choose a new or empty directory, so that no file of yours is overwritten")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"log.output_dir: {str(out)!r} exists and is not a directory")
    check_files(out, requested(cfg.log))  # before any model loads
    if not resume:
        return
    recorded = (read_marker(out) or {}).get("data_files") or {}
    now = data_hashes(cfg)
    for key, rec in recorded.items():
        cur = now.get(key)
        if cur is None or rec.get("path") != cur["path"]:
            continue  # a path change is refused by the resume's config comparison; a missing file by validate
        if rec.get("sha256") != cur["sha256"]:
            raise ConfigError(f"{key}: {cur['path']!r} changed since the run started (SHA-256 {cur['sha256'][:12]}… "
                              f"≠ {str(rec.get('sha256'))[:12]}…); restore the file or start a new run")


def claim(out: str | Path, cfg, resume: bool, *, lead: bool = True) -> None:
    """``check``, then the marker: written for a new run, and for a run from before markers (its data files as
    they are now); an existing run's marker is kept. Under several ranks only rank 0 (``lead``) checks and writes,
    and its verdict is every rank's (a collective: the other ranks would otherwise see its files half-made)."""
    out = Path(out)
    error = None
    if lead:
        try:
            check(out, cfg, resume)
            if read_marker(out) is None or not (resume or (out / "metrics.jsonl").exists()):
                atomic_write(out / MARKER, json.dumps({"tool": "diffgrpo", "data_files": data_hashes(cfg)}, indent=1))
        except ConfigError as e:
            error = str(e)
    error = distributed.all_gather_object(error)[0]
    if error is not None:
        raise ConfigError(error)


# what fileio.atomic_write (``.<name>.XXXXXXXX.tmp``), fileio.temp_dir (``.tmp_iter_NNNNNN.XXXXXXXX``,
# ``.<name>.XXXXXXXX``) and export leave behind when a process dies between writing and renaming
_TEMP = re.compile(r"^\.(.+\.[a-z0-9_]{8}\.tmp|(tmp_iter_\d{6}|lora|model|transformer|transformer_2|best|export)"
                   r"\.[a-z0-9_]{8})$")
_SWEPT = ("", "checkpoints", "samples", "best", "lora", "model", "transformer")


def sweep(out: str | Path, log=print) -> list[str]:
    """Remove the hidden temporary files and folders a killed run left in ``out`` and its own subfolders (never
    through a link: a link is removed, not followed). Call with the run's lock held. → what was removed."""
    out, removed = Path(out), []
    for sub in _SWEPT:
        d = out / sub
        if d.is_symlink() or not d.is_dir():
            continue
        for p in d.iterdir():
            if not _TEMP.match(p.name):
                continue
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
            removed.append(str(p.relative_to(out)))
    if removed:
        log(f"removed {len(removed)} temporary file(s) a stopped run left: {removed[:3]}")
    return removed


def make(cfg: RunConfig, world: WorldInfo) -> Path:
    """The run directory as an absolute path (also written back to ``log.output_dir``); by default a new
    ``runs/<timestamp>`` (made exclusively, so runs started in the same second get distinct directories: ``-2``,
    ``-3``, …), rank 0's for every rank."""
    if not cfg.log.output_dir:
        name = None
        if world.rank == 0:
            stamp = Path("runs") / time.strftime("%Y%m%d-%H%M%S")
            stamp.parent.mkdir(parents=True, exist_ok=True)
            for n in range(1, 1000):
                cand = stamp if n == 1 else stamp.with_name(f"{stamp.name}-{n}")
                try:
                    cand.mkdir()
                    name = os.path.abspath(cand)
                    break
                except FileExistsError:
                    continue
        cfg.log.output_dir = distributed.all_gather_object(name)[0]
    p = Path(os.path.abspath(cfg.log.output_dir))  # resolved once: a later chdir (e.g. a plug-in's) moves nothing
    cfg.log.output_dir = str(p)
    if world.rank == 0:
        try:
            p.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log.output_dir: cannot create {str(p)!r} ({e.strerror})") from None
    return p


__all__ = ["MARKER", "absolute_data_paths", "check", "claim", "data_hashes", "is_run_dir", "make", "read_marker", "sha256_of",
           "sweep"]
