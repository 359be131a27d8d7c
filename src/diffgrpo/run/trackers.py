"""Experiment trackers: ``log.trackers`` names, their checks, and accelerate's tracker classes behind ``Tracker``.

``log.trackers`` lists the trackers of a run (:data:`TRACKERS`, the names of ``accelerate.tracking``);
``log.tensorboard=true`` and ``log.wandb=true`` are aliases of ``tensorboard`` and ``wandb`` in it. Each is an
``accelerate.tracking`` class (``start``, ``store_init_configuration``, ``log``, ``finish``) used without an
``Accelerator``: only rank 0 builds trackers, so each logs unconditionally (``main_process_only`` off); their
debug logging reads accelerate's process state, which rank 0 creates on the CPU (``PartialState(cpu=True)``: it
joins a process group already up and moves no device). Every tracker gets the scalars and the run's configuration;
TensorBoard and W&B also get the evaluation grids and per-sample tables. What a tracker stores locally lies in the
run directory: ``tensorboard/``, ``wandb/`` (+ ``wandb_id``, kept so that a resumed run continues its W&B run),
``mlruns/``, ``.aim/``, ``dvclive/``.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..fileio import atomic_write, check_below

# log.trackers name -> the package it needs (and the pip extra ``diffgrpo[<name>]`` that brings it)
TRACKERS: dict[str, str] = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow",
                            "trackio": "trackio", "comet_ml": "comet_ml", "aim": "aim", "clearml": "clearml",
                            "dvclive": "dvclive"}
ALIASES = {"wandb": "log.wandb", "tensorboard": "log.tensorboard"}  # tracker -> its boolean switch
_WANDB_ID = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # what wandb.init accepts as a run id (no :;,#?/' and short)


def _get(log, key: str, default=None):
    return log.get(key, default) if isinstance(log, dict) else getattr(log, key, default)


def requested(log) -> dict[str, str]:
    """tracker name → the key that asked for it (``log.trackers`` or its switch), in order, each name once.
    ``log``: the ``LogConfig`` or its dict."""
    out = {str(n): "log.trackers" for n in (_get(log, "trackers") or [])}
    for name, key in ALIASES.items():
        if _get(log, key.split(".")[1]) and name not in out:
            out[name] = key
    return out


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def check_config(log) -> None:
    """Unknown tracker names and trackers whose package is missing, as one-line ConfigErrors."""
    names = [str(n) for n in (_get(log, "trackers") or [])]
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise ConfigError(f"log.trackers: value {unknown[0]!r} is not a tracker; choose among {list(TRACKERS)}")
    for name, key in requested(log).items():
        if not _installed(TRACKERS[name]):
            off = f"set {key}=false" if key in ALIASES.values() else f"remove {name} from log.trackers"
            raise ConfigError(f"{key}: {name} needs the {TRACKERS[name]} package, which is not installed; "
                              f"pip install 'diffgrpo[{name}]', or {off}")


def check_files(run_dir: str | Path, wanted: dict[str, str]) -> None:
    """The trackers' files in ``run_dir`` as a ConfigError (one line, naming the key) before any model loads: a
    ``tensorboard`` that is a link, a file or not writable; a ``wandb_id`` that is a link, unreadable or not an id.
    ``wanted``: :func:`requested`."""
    d = Path(run_dir)
    if "tensorboard" in wanted:
        key, tb = wanted["tensorboard"], d / "tensorboard"
        if tb.is_symlink():
            raise ConfigError(f"{key}: {str(tb)!r} is a symbolic link; the event files are never written "
                              "through a link (remove it)")
        if tb.exists() and not tb.is_dir():
            raise ConfigError(f"{key}: {str(tb)!r} exists and is not a directory (remove it, or drop tensorboard)")
        if tb.is_dir() and not os.access(tb, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: {str(tb)!r} is not writable (fix its permissions, or drop tensorboard)")
    if "wandb" in wanted:
        key, f = wanted["wandb"], d / "wandb_id"
        if f.is_symlink() or (f.exists() and not f.is_file()):
            raise ConfigError(f"{key}: {str(f)!r} is not a regular file (remove it to start a new W&B run)")
        if f.is_file():
            try:
                run_id = f.read_text(encoding="utf-8").strip()
            except (OSError, UnicodeDecodeError) as e:
                raise ConfigError(f"{key}: {str(f)!r} cannot be read ({e}); remove it to start a new W&B "
                                  "run") from None
            if not _WANDB_ID.match(run_id):
                raise ConfigError(f"{key}: {str(f)!r} holds {run_id[:40]!r}, not a W&B run id (1-64 of "
                                  "A-Z a-z 0-9 _ . -); restore the id or remove the file to start a new W&B run")
    if wanted and d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
        raise ConfigError(f"log.output_dir: {str(d)!r} is not writable")


def wandb_settings(log: dict, run_dir: Path, environ=None) -> tuple[str, str, list[str] | None]:
    """(project, run name, tags) of a run's W&B run: ``log.wandb_project`` / ``log.wandb_name`` / ``log.wandb_tags``
    when set, else ``WANDB_PROJECT`` / ``WANDB_NAME`` / ``WANDB_TAGS`` from the environment, else ``diffgrpo``, the run
    directory's name and no tags. The other trackers take the project ``diffgrpo`` and the run directory's name."""
    env = os.environ if environ is None else environ
    project = log.get("wandb_project") or env.get("WANDB_PROJECT") or "diffgrpo"
    name = log.get("wandb_name") or env.get("WANDB_NAME") or Path(run_dir).name
    tags = list(log.get("wandb_tags") or []) or [t.strip() for t in env.get("WANDB_TAGS", "").split(",") if t.strip()]
    return project, name, [str(t) for t in tags] or None


def flat_config(config: dict, prefix: str = "") -> dict:
    """A nested config as ``section.key`` → bool / int / float / str / None (lists and maps as JSON), the values
    every tracker's ``store_init_configuration`` accepts."""
    out = {}
    for k, v in config.items():
        if isinstance(v, dict) and v and all(isinstance(x, str) for x in v) and not prefix:
            out.update(flat_config(v, f"{k}."))
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[f"{prefix}{k}"] = v
        else:
            out[f"{prefix}{k}"] = json.dumps(v, default=str)
    return out


def _accelerate_tracker(name: str, run_dir: Path, config: dict):
    """The ``accelerate.tracking`` object of tracker ``name``, not yet started."""
    from accelerate import tracking

    d, run_name = str(run_dir), run_dir.name
    if name == "tensorboard":
        check_below(run_dir / "tensorboard" / "events")  # a planted tensorboard/ link is refused, never written through
        return tracking.TensorBoardTracker("tensorboard", d)  # <run_dir>/tensorboard
    if name == "wandb":
        id_file = run_dir / "wandb_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(6)
        atomic_write(id_file, run_id)
        project, wname, tags = wandb_settings(config.get("log", {}), run_dir)
        return tracking.WandBTracker(project, dir=d, name=wname, tags=tags, id=run_id, resume="allow")
    if name == "mlflow":
        import mlflow

        store = (run_dir / "mlruns").as_uri()
        if not os.environ.get("MLFLOW_TRACKING_URI"):  # else the tracking server that names
            mlflow.set_tracking_uri(store)
        return tracking.MLflowTracker("diffgrpo", store, run_name=run_name)
    if name == "aim":
        return tracking.AimTracker(run_name, d)
    if name == "dvclive":
        return tracking.DVCLiveTracker(run_name, dir=str(run_dir / "dvclive"))
    if name == "clearml":
        return tracking.ClearMLTracker(run_name, project_name="diffgrpo")
    if name == "trackio":
        return tracking.TrackioTracker("diffgrpo", name=run_name)
    return tracking.CometMLTracker("diffgrpo")


class AccelerateTracker:
    """A ``runlog.Tracker`` over one ``accelerate.tracking`` tracker: started with the run's configuration;
    images and tables go to TensorBoard (image + caption text, a Markdown table) and W&B (``wandb.Image``,
    ``wandb.Table``), the other trackers take scalars only."""

    def __init__(self, name: str, run_dir: Path, config: dict | None = None):
        from accelerate import PartialState

        PartialState(cpu=True)
        self.name = name
        self._t = _accelerate_tracker(name, Path(run_dir), config or {})
        self._t.main_process_only = False  # only rank 0 builds trackers
        self._t.start()
        self._t.store_init_configuration(config or {} if name == "wandb" else flat_config(config or {}))

    def log(self, values: dict[str, float], step: int) -> None:
        self._t.log(values, step=step)

    def log_image(self, key: str, image: np.ndarray, step: int, caption: str) -> None:
        """``image``: (H, W, 3) uint8."""
        if self.name == "tensorboard":
            self._t.writer.add_image(key, image, step, dataformats="HWC")
            self._t.writer.add_text(f"{key}/caption", caption, step)
            self._t.writer.flush()
        elif self.name == "wandb":
            import wandb

            self._t.run.log({key: wandb.Image(image, caption=caption)}, step=step)

    def log_table(self, key: str, columns: list[str], rows: list[list], step: int, run_dir: Path) -> None:
        """TensorBoard: a Markdown table in the text tab; W&B: a ``wandb.Table`` whose image / video paths (relative
        to ``run_dir``) become ``wandb.Image`` / ``wandb.Video`` cells."""
        if self.name == "tensorboard":
            self._t.writer.add_text(key, markdown_table(columns, rows), step)
            self._t.writer.flush()
        elif self.name == "wandb":
            import wandb

            kinds = {"image": wandb.Image, "video": wandb.Video}
            data = [[kinds[c](str(Path(run_dir) / v)) if c in kinds and v else v for c, v in zip(columns, row)]
                    for row in rows]
            self._t.run.log({key: wandb.Table(columns=columns, data=data)}, step=step)

    def finish(self) -> None:
        self._t.finish()


def markdown_table(columns: list[str], rows: list[list]) -> str:
    """``rows`` under ``columns`` as a Markdown table (floats to 4 decimals, ``|`` escaped, one line per row)."""
    def cell(v) -> str:
        text = f"{v:.4f}" if isinstance(v, float) else "" if v is None else str(v)
        return text.replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows])


__all__ = ["ALIASES", "TRACKERS", "AccelerateTracker", "check_config", "check_files", "flat_config",
           "markdown_table", "requested", "wandb_settings"]
