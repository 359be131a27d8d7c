"""The run config a command line names: ``--config FILE|NAME`` (a file, or a config shipped in the package; a file
may use TRL's flat names, ``learning_rate: 1e-5``, mapped as on the command line), the ``key=value`` overrides,
then the flags of ``accelerate launch`` the command line does not set; and the CPU threads it asks for."""
from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

from .. import yamlio
from ..config import RunConfig, from_dict
from ..validation import applies
from . import flags, recipes
from .runtime import apply_cpu_threads


def _top_level(path) -> dict | None:
    """The mapping a config file holds, or None where it does not read as one (``RunConfig.from_yaml`` then says
    why, in its own words)."""
    try:
        data = yamlio.load(Path(path).read_text(encoding="utf-8-sig"), f"--config: file {str(path)!r}")
    except Exception:  # noqa: BLE001 - reported by from_yaml below
        return None
    return data if isinstance(data, dict) else None


def from_file(path, overrides: list[str], purpose: str, log=lambda m: print(m, file=sys.stderr)) -> RunConfig:
    """A ``--config`` file and the overrides: its sections as ``print-config`` writes them, and at its top level
    TRL / flow_grpo names mapped with the notes and refusals of the command line (``flags.translate_mapping``)."""
    data = _top_level(path)
    if data is None or all(flags.known(str(k).strip()) for k in data):
        return RunConfig.from_yaml(path, overrides, purpose=purpose)
    base = from_dict(RunConfig, flags.translate_mapping(data, log, source=f"--config {str(path)!r}"))
    return RunConfig.from_overrides(overrides, base=base, purpose=purpose)


def load_cfg(args, purpose: str = "train") -> RunConfig:
    """The config of ``args`` (``--config``, ``overrides``), validated for ``purpose`` (``validation.PURPOSES``)."""
    overrides = list(args.overrides)
    if getattr(args, "config", None):
        name = recipes.config_path(args.config)
        if name is None:
            cfg = from_file(args.config, overrides, purpose)
        else:  # a config shipped in the package (diffgrpo configs list)
            with resources.as_file(resources.files("diffgrpo") / "configs" / f"{name}.yaml") as path:
                cfg = RunConfig.from_yaml(path, overrides, purpose=purpose)
    else:
        cfg = RunConfig.from_overrides(overrides, purpose=purpose)
    given = {o.split("=", 1)[0].strip() for o in overrides}
    launcher = [o for o in flags.accelerate_overrides(applies=lambda key: applies(cfg, key))
                if o.split("=", 1)[0] not in given]  # the command line wins over accelerate launch's flags
    return RunConfig.from_overrides(launcher, base=cfg, purpose=purpose) if launcher else cfg


def threads(cfg: RunConfig) -> None:
    apply_cpu_threads(cfg)


__all__ = ["from_file", "load_cfg", "threads"]
