"""``diffgrpo sample``: samples of the pretrained model, a run directory or a weights file, drawn by the model's
family (``Family.sample``: as its evaluation draws them) and written as they come back: an image grid, or one text
completion per line in the output file (stdout shows where, and the first few, cut short).

A text model decodes greedily by default (``--sde-type ode``): one completion per prompt, since more would be
copies of it; ``--num N`` with greedy decoding says so and writes one, and ``--sde-type flow_sde`` (any other
than ode) draws N at ``dllm.temperature``. Images: ``--num`` per prompt (default 8), each from its own seed."""
from __future__ import annotations

import sys
from pathlib import Path

from ..config import RunConfig
from ..errors import ConfigError
from ..fileio import atomic_write
from ..rewards.registry import unscored_overrides
from ..run import saved_config
from .hub import check_hub
from .resolve import threads


def _config(args) -> tuple[RunConfig, Path | None]:
    """The config to sample with (a run directory's own, or the command line's) and the weights file, or None."""
    src = Path(args.weights) if args.weights else None
    overrides = list(args.overrides)
    overrides += unscored_overrides(overrides)  # sampling scores nothing: no reward of the run is built or checked
    if src is not None and src.is_dir():
        return saved_config.load(src, overrides, command="--weights"), src / "weights.safetensors"
    cfg = RunConfig.from_overrides(overrides + ["log.progress=false"], purpose="sample")
    if src is not None and not src.is_file():
        raise ConfigError(f"--weights: {str(src)!r} does not exist")
    return cfg, src


def _sources(paths: list[str]) -> tuple[str, ...]:
    """``--image`` (repeatable): the source image(s) an editing model edits under every ``--prompt``, each checked
    as a prompt file's ``image`` field is (a regular image file, no link, within the pixel cap) → absolute paths."""
    from .. import sources

    return tuple(sources.resolve([{"prompt": "-", "image": Path(path).name}], base=Path(path).absolute().parent,
                                 spec=path, key="--image", where="")[0]["image"] for path in paths)


PREVIEW_LINES, PREVIEW_CHARS = 3, 100  # what stdout shows of the completions written to the file


def preview(lines: list[str], out: Path) -> list[str]:
    """What stdout says about the completions written to ``out``: the first :data:`PREVIEW_LINES`, each cut to
    :data:`PREVIEW_CHARS` characters, and where they all are."""
    shown = [line if len(line) <= PREVIEW_CHARS else line[: PREVIEW_CHARS - 1] + "…" for line in lines[:PREVIEW_LINES]]
    more = f" ({len(lines) - len(shown)} more in the file)" if len(lines) > len(shown) else ""
    return [*shown, f"wrote {len(lines)} completion{'' if len(lines) == 1 else 's'} to {out}{more}"]


def _write(samples, out: Path) -> None:
    """Images as one grid (a row per prompt; videos' first frames, and each clip as its own file), texts as
    ``prompt<TAB>completion`` lines (a .png name → .txt)."""
    from ..run.runlog import save_grid

    if samples.texts is not None:
        lines = [f"{p}\t{t}" for p, t in zip(samples.prompts, samples.texts)]
        out = out.with_suffix(".txt") if out.suffix == ".png" else out
        atomic_write(out, "\n".join(lines) + "\n")
        print("\n".join(preview(lines, out)))
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    save_grid(samples.images, out, nrow=samples.per_prompt)
    print(f"wrote {len(samples.prompts)} samples to {out}")
    if samples.images.dim() == 5:  # videos: the grid shows first frames; each clip also as <out>_<i>.mp4 / .gif
        from ..media import save_video, to_uint8

        paths = [save_video(to_uint8(v), out.with_name(f"{out.stem}_{i:03d}")) for i, v in enumerate(samples.images)]
        print(f"wrote {len(paths)} clips beside it ({paths[0].name}, ...)")


def cmd_sample(args) -> int:
    from safetensors.torch import load_file

    from ..trainer import Trainer

    if args.num is not None and args.num < 1:
        raise ConfigError(f"--num: value {args.num} is out of range; must be >= 1")
    if not Path(args.out).suffix:
        raise ConfigError(f"--out: {args.out!r} has no file extension; give e.g. samples.png (images) or "
                          "samples.txt (text completions)")
    cfg, weights = _config(args)
    threads(cfg)
    check_hub(cfg)
    images = _sources(args.image or [])  # an editing model's source image(s) for every prompt, checked now
    trainer = Trainer(cfg, purpose="sample")  # an editing model's sources come from --image, not prompt files
    if weights is not None:
        trainer.policy.load_state_dict(load_file(str(weights)))
    samples = trainer.family.sample(args.prompt or None, seed=args.seed, num=args.num, sde_type=args.sde_type,
                                    source_images=images)
    for note in samples.notes:
        print(note, file=sys.stderr)
    _write(samples, Path(args.out))
    return 0


__all__ = ["cmd_sample"]
