"""The commands about configs: ``print-config`` (the resolved config, its changes, or the reference of every key),
``configs list|cp`` (the shipped ones) and ``download`` (every model a config needs, ahead of time)."""
from __future__ import annotations

import sys

import yaml

from ..errors import ConfigError
from . import recipes
from .resolve import load_cfg


def cmd_print_config(args) -> int:
    """The resolved config (``--changed``: only the keys that differ from the defaults; ``--docs``: the reference of
    every key); prompt files are checked (exist, parse, hold prompts) only with ``--check-data`` (``diffgrpo train``
    always checks them before any model loads)."""
    from .configdoc import changed, reference_markdown

    if args.docs:
        given = [f for f, v in (("--changed", args.changed), ("--check-data", getattr(args, "check_data", False)),
                                ("--config", getattr(args, "config", None)),
                                ("key=value overrides", getattr(args, "overrides", None))) if v]
        if given:
            raise ConfigError(f"print-config --docs: prints the reference of every key; {', '.join(given)} "
                              f"{'does' if len(given) == 1 else 'do'} not apply (drop {'it' if len(given) == 1 else 'them'}, "
                              "or drop --docs)")
        print(reference_markdown(), end="")
        return 0
    cfg = load_cfg(args, purpose="train" if args.check_data else "print")
    if args.changed:
        diff = changed(cfg)
        print(yaml.safe_dump(diff, sort_keys=False) if diff else "{}  # every key at its default\n", end="")
        return 0
    print(cfg.to_yaml(), end="")
    if args.check_data:
        print(data_checked(cfg), file=sys.stderr)  # stdout stays the config
    return 0


def data_checked(cfg) -> str:
    """The line ``print-config --check-data`` ends with when the prompt sources load: each one and its prompts."""
    from ..data_sources import load_prompts

    parts = []
    for key in ("train.prompts_file", "eval.prompts_file"):
        section, name = key.split(".")
        spec = getattr(getattr(cfg, section), name)
        n = len(load_prompts(spec, key=key, column=cfg.train.prompt_column)) if spec else 0
        parts.append(f"{key} {spec!r}: {n} prompts" if spec else f"{key}: the digit prompts")
    return "data checked: " + "; ".join(parts)


def cmd_configs(args) -> int:
    """``configs list``: the shipped configs; ``configs cp NAME [DEST]``: copy one out to edit."""
    if args.action == "list":
        extra = [a for a in (args.name, args.dest) if a]
        if extra:
            raise ConfigError(f"configs list: takes no argument (got {' '.join(map(repr, extra))}); copy a config "
                              "with: diffgrpo configs cp NAME [DEST]")
        configs = recipes.shipped()
        width = max(map(len, configs), default=0)
        for name, text in configs.items():
            print(f"{name:<{width}}  {recipes.summary(text)}")
        print("copy one with: diffgrpo configs cp NAME [DEST]; or train it: diffgrpo train --config NAME")
        return 0
    if not args.name:
        raise ConfigError("configs cp: name the config to copy (diffgrpo configs list)")
    print(f"wrote {recipes.copy_config(args.name, args.dest or '.')}")
    return 0


def cmd_download(args) -> int:
    from .hub import download_models

    cfg = load_cfg(args)
    for line in download_models(cfg, dry_run=args.dry_run):
        print(line)
    return 0


__all__ = ["cmd_configs", "cmd_download", "cmd_print_config", "data_checked"]
