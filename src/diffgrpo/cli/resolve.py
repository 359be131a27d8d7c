"""The run config a command line names: ``--config FILE|NAME`` (a file, or a config shipped in the package), the
``key=value`` overrides, then the flags of ``accelerate launch`` the command line does not set; and the CPU threads
it asks for."""
from __future__ import annotations

from importlib import resources

from ..config import RunConfig
from ..validation import applies
from . import flags, recipes
from .runtime import apply_cpu_threads


def load_cfg(args, purpose: str = "train") -> RunConfig:
    """The config of ``args`` (``--config``, ``overrides``), validated for ``purpose`` (``validation.PURPOSES``)."""
    overrides = list(args.overrides)
    if getattr(args, "config", None):
        name = recipes.config_path(args.config)
        if name is None:
            cfg = RunConfig.from_yaml(args.config, overrides, purpose=purpose)
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


__all__ = ["load_cfg", "threads"]
