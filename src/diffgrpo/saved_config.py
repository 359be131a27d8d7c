"""A run directory's saved config, as a resume, ``diffgrpo sample --weights`` and ``diffgrpo export`` read it:
which keys a resume may change (``RESUMABLE``), and the keys whose values run code (``CODE_KEYS``), never taken
from a saved file unless the command line repeats them."""
from __future__ import annotations

from pathlib import Path

import yaml

from . import yamlio
from .config import RunConfig
from .errors import ConfigError

# Keys a resume may change: how long, how fast and how the run is logged, and where it runs. Anything else would
# change the model, the data or the objective of a run half-way.
RESUMABLE = ("train.num_iterations", "train.lr", "train.save_every", "train.keep_checkpoints", "train.max_bad_updates",
             "eval.every", "log.", "dist.", "model.device", "model.cpu_threads", "model.cache_dir",
             "train.checkpoint_format", "train.on_hacking", "train.guard_", "train.keep_best")
# Values that make the library import or run code: taken from the current command line only, never from a run
# directory's saved config.yaml (a downloaded run directory must not execute its author's code).
CODE_KEYS = ("reward.weights", "engine.name", "dllm.trust_remote_code", "eval.guard_rewards", "eval.guard_features")


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "weights":
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def saved_data(run: Path, command: str) -> dict:
    path = run / "config.yaml"
    try:
        data = yamlio.load(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{command}: cannot read {str(path)!r} ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{command}: {str(path)!r} does not hold a config mapping")
    return data


def distrust(data: dict, overrides: list[str], *, path: Path, command: str, strict: bool) -> dict:
    """The saved config ``data`` without the code it names (CODE_KEYS) unless the command line repeats the key:
    refused when ``strict`` (a resume needs it), else replaced by the default with a message."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    default = RunConfig().to_dict()
    for key in CODE_KEYS:
        sec, name = key.split(".")
        section = data.get(sec) if isinstance(data.get(sec), dict) else {}
        value = section.get(name)
        code = (value is True if name == "trust_remote_code" else
                any(":" in str(k) for k in value) if isinstance(value, dict) else ":" in str(value or ""))
        if not code or any(g == key or g.startswith(key + ".") for g in given):
            continue
        if strict:
            raise ConfigError(f"{command}: the run's config sets {key}={value!r}, which runs code named in "
                              f"{str(path)!r}; repeat {key}=... on this command line to allow it")
        print(f"{command}: ignoring {key}={value!r} from {str(path)!r} (it would run code from the run directory); "
              f"repeat {key}=... on the command line to use it")
        section[name] = default[sec][name]
    return data


def fresh_device(data: dict, overrides: list[str]) -> dict:
    """The saved config records the device the run used (e.g. rank 0's cuda:0); a resume or a sample picks the
    device of this machine and rank again (model.device=auto) unless the command line sets model.device."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if isinstance(data.get("model"), dict) and "model.device" not in given:
        data["model"]["device"] = "auto"
    return data


__all__ = ["CODE_KEYS", "RESUMABLE", "distrust", "flat", "fresh_device", "saved_data"]
