"""``diffgrpo bench engines`` (every engine side by side on the same rollout) and ``diffgrpo bench quality`` (time
to quality of config variants × seeds, ``studies.quality``)."""
from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..fileio import claim_folder
from .resolve import load_cfg, threads


def cmd_bench(args) -> int:
    from ..engines import ENGINES
    from ..studies.engines import bench_engines

    if args.repeats < 1:
        raise ConfigError(f"--repeats: value {args.repeats} is out of range; must be >= 1 (timed runs per variant)")
    cfg = load_cfg(args)
    threads(cfg)
    variants = args.variants.split(";") if args.variants else list(ENGINES)
    if "recompute" not in variants:  # the baseline every ratio refers to
        variants = ["recompute"] + variants
    out = args.out or str(Path("runs") / "bench")
    claim_folder(out, ".diffgrpo-bench-engines", "--out", "bench engines", outputs=("engines.json", "engines.md"))
    bench_engines(cfg, variants, repeats=args.repeats, out_dir=out)
    print(f"report in {out}/engines.json and {out}/engines.md")
    return 0


def cmd_bench_quality(args) -> int:
    from ..studies import quality as bench_quality

    if args.from_dir:
        bench_quality.again_from_args(args)
        return 0
    cfg = load_cfg(args)
    threads(cfg)
    stopped = bench_quality.from_args(cfg, args)["meta"].get("interrupted")
    return 128 + stopped["signal"] if stopped else 0  # a stopped benchmark exits as the signal would, its outputs written


__all__ = ["cmd_bench", "cmd_bench_quality"]
