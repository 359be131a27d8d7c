"""A run directory's saved config, as a resume, ``diffgrpo sample --weights`` and ``diffgrpo export`` read it
(:func:`load`): which keys a resume may change (``RESUMABLE``), the keys whose values run code (``CODE_KEYS``),
never taken from a saved file unless the command line repeats them, and the checks of a checkpoint a run resumes
from (:func:`check_checkpoint`)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from .. import yamlio
from ..config import RENAMED, RunConfig, from_dict
from ..errors import ConfigError

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


def renamed(data: dict) -> dict:
    """A config saved before a key was renamed (``config.RENAMED``, e.g. ``model.family`` → ``model.pipeline``)
    read under the key's new name, and one saved before ``train.task`` existed as the digits task it trained on: a
    run directory of an earlier version still resumes, samples and exports."""
    for old, new in RENAMED.items():
        (sec, key), (new_sec, new_key) = old.split("."), new.split(".")
        section = data.get(sec)
        if isinstance(section, dict) and key in section:
            value = section.pop(key)
            target = data.setdefault(new_sec, {})
            if isinstance(target, dict):
                target.setdefault(new_key, value)
    train = data.get("train")
    if isinstance(train, dict) and "task" not in train:  # saved before train.task existed: the digits task
        train["task"] = "digits"
    return data


def fresh_device(data: dict, overrides: list[str]) -> dict:
    """The saved config records the device the run used (e.g. rank 0's cuda:0); a resume or a sample picks the
    device of this machine and rank again (model.device=auto) unless the command line sets model.device."""
    given = {o.split("=", 1)[0].strip() for o in overrides}
    if isinstance(data.get("model"), dict) and "model.device" not in given:
        data["model"]["device"] = "auto"
    return data


# What each command reads a saved config for: its file, whether a code key is refused (else dropped, said), and the
# purpose its config is validated for (validation.PURPOSES)
_READS = {"--resume": ("config.yaml", True, "train"), "--weights": ("config.yaml", False, "sample"),
          "export": ("state.json", False, "export")}


def load(run: Path, overrides: list[str], *, command: str) -> RunConfig:
    """The saved config of ``run`` with the command line's ``overrides``, as ``command`` uses it:

      --resume   ``run``'s config.yaml; a code key not repeated on the command line is refused; the run directory
                 stays ``run`` and only the :data:`RESUMABLE` keys may change
      --weights  ``run``'s config.yaml (beside weights.safetensors); a code key not repeated is dropped (said);
                 no run directory is written and no saved prompt file is read (the run may have moved)
      export     a checkpoint directory's state.json; as --weights, but the saved prompt files stay (unread)

    Every command picks the device again (``fresh_device``). Raises ConfigError in one line."""
    name, strict, purpose = _READS[command]
    if command == "--weights" and not ((run / "config.yaml").is_file() and (run / "weights.safetensors").is_file()):
        raise ConfigError(f"--weights: run directory {str(run)!r} has no config.yaml + weights.safetensors")
    data = (json.loads((run / name).read_text())["config"] if name == "state.json" else saved_data(run, command))
    data = fresh_device(distrust(renamed(data), overrides, path=run / name, command=command, strict=strict),
                        overrides)
    if command == "--resume":
        return _resumed(run, from_dict(RunConfig, data), overrides)
    if isinstance(data.get("log"), dict):  # writes no run directory (the saved one may be elsewhere)
        data["log"]["output_dir"] = ""
    for sec, key in (("train", "prompts_file"), ("eval", "prompts_file")) if command == "--weights" else ():
        if isinstance(data.get(sec), dict) and not any(o.startswith(f"{sec}.{key}=") for o in overrides):
            data[sec][key] = ""
    return RunConfig.from_overrides([*overrides, "log.progress=false"], base=from_dict(RunConfig, data),
                                    purpose=purpose)


def _resumed(run: Path, saved: RunConfig, overrides: list[str]) -> RunConfig:
    """The saved config with the overrides, in ``run``; refused when a key outside :data:`RESUMABLE` changes."""
    cfg = RunConfig.from_overrides([*overrides, f"log.output_dir={run}"], base=saved)
    old = flat(saved.to_dict())
    for key, value in flat(cfg.to_dict()).items():
        if old.get(key) != value and not key.startswith(RESUMABLE):
            raise ConfigError(f"--resume: {key} cannot change when a run resumes (it would change the model, the "
                              f"data or the objective half-way); a resume may change {list(RESUMABLE)}; start a "
                              "new run instead")
    return cfg


# What makes a checkpoint another run's: a resume from one whose values differ is refused
IDENTITY = ("model.name", "model.pretrained", "model.lora_rank", "engine.name", "dllm.method", "dllm.model_path",
            "dllm.lora_rank", "dllm.task")
_FORMAT_FILES = {"files": ("trainable.safetensors", "optimizer.pt", "rng.pt"), "dcp": ("dcp", "trainer.json", "rng.pt")}


def check_checkpoint(ckpt: Path, cfg: RunConfig) -> None:
    """A complete checkpoint's ``state.json`` read against the run resuming from it, before anything loads: its
    iteration is its folder's (``iter_NNNNNN``), its format's files are there, and it was written by this run's
    model, engine and method (:data:`IDENTITY`). A one-line ConfigError otherwise (a hand-edited ``state.json``, a
    checkpoint copied in from another run)."""
    where = f"checkpoint {str(ckpt)!r}"
    try:
        state = json.loads((ckpt / "state.json").read_text(encoding="utf-8"))
        iteration, fmt, config = state["iteration"], state.get("format", "files"), state["config"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"--resume: {where} has an unreadable state.json ({type(e).__name__}); delete the "
                          "checkpoint to resume from an earlier one") from None
    if not isinstance(iteration, int) or isinstance(iteration, bool) or ckpt.name != f"iter_{iteration:06d}":
        raise ConfigError(f"--resume: {where} says iteration {iteration!r} in its state.json, not its folder's; it "
                          "was edited or copied in from elsewhere: delete it to resume from an earlier one")
    if fmt not in _FORMAT_FILES or not isinstance(config, dict) or \
            not all((ckpt / f).exists() for f in _FORMAT_FILES[fmt]):
        raise ConfigError(f"--resume: {where} says format {fmt!r} in its state.json, which its files are not; "
                          "delete it to resume from an earlier one")
    saved, now = flat(config), flat(cfg.to_dict())
    for key in IDENTITY:
        if key in saved and saved[key] != now.get(key):
            raise ConfigError(f"--resume: {where} was written with {key}={saved[key]!r}, this run has "
                              f"{now.get(key)!r} (another run's checkpoint, or a code key not repeated on the "
                              f"command line: repeat {key}={saved[key]} to resume it)")


__all__ = ["CODE_KEYS", "IDENTITY", "RESUMABLE", "check_checkpoint", "distrust", "flat", "fresh_device", "load",
           "renamed", "saved_data"]
