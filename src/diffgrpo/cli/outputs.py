"""The commands that read a finished run: ``report`` (a self-contained HTML report) and ``export`` (a checkpoint as
files other libraries load, ``cli.export``)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError


def cmd_report(args) -> int:
    from .report import write_report

    run = Path(args.run_dir)
    if not (run / "metrics.jsonl").is_file():
        raise ConfigError(f"report: {str(run)!r} is not a run directory (no metrics.jsonl)")
    print(f"wrote {write_report(run, args.out)}")
    return 0


def cmd_export(args) -> int:
    from .export import export

    out = export(args.source, args.out, merge=args.merge, overrides=args.overrides)
    print(f"exported {args.source} to {out}")
    return 0


__all__ = ["cmd_export", "cmd_report"]
