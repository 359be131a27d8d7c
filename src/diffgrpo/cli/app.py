"""Command line: ``diffgrpo {train, pretrain, sample, bench, report, export, print-config, configs, download}``.

Every command that builds a run takes ``[--config FILE|NAME] [key=value ...]``, the overrides anywhere on the line
(also as ``--key value``, and under the TRL / flow_grpo names of ``diffgrpo.cli.flags``); ``diffgrpo train`` with no
arguments runs the embedded default (the built-in digits model, pretrained on first use).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time
from importlib import resources
from pathlib import Path

import yaml

from . import flags, recipes
from ..run import rundir
from .._version import __version__
from ..config import MODEL_FAMILIES, RunConfig, from_dict
from ..console import end_summary
from ..errors import ConfigError, RewardError, TrainingError
from ..fileio import atomic_write, claim_folder, read_jsonl
from .hub import check_hub
from .runtime import apply_cpu_threads
from ..run.saved_config import RESUMABLE, distrust, flat, fresh_device, saved_data


def _load_cfg(args) -> RunConfig:
    overrides = list(args.overrides)
    if getattr(args, "config", None):
        name = recipes.config_path(args.config)
        if name is None:
            cfg = RunConfig.from_yaml(args.config, overrides)
        else:  # a config shipped in the package (diffgrpo configs list)
            with resources.as_file(resources.files("diffgrpo") / "configs" / f"{name}.yaml") as path:
                cfg = RunConfig.from_yaml(path, overrides)
    else:
        cfg = RunConfig.from_overrides(overrides)
    given = {o.split("=", 1)[0].strip() for o in overrides}
    launcher = [o for o in flags.accelerate_overrides(family=MODEL_FAMILIES.get(cfg.model.name, "flow"))
                if o.split("=", 1)[0] not in given]  # the command line wins over accelerate launch's flags
    return RunConfig.from_overrides(launcher, base=cfg) if launcher else cfg


def _threads(cfg: RunConfig) -> None:
    apply_cpu_threads(cfg)


def _resume_dir(args) -> Path | None:
    """--resume RUN_DIR, or --resume auto: log.output_dir if given, else the newest unfinished run in runs/."""
    if not args.resume:
        return None
    if args.resume != "auto":
        run = Path(args.resume)
        if not (run / "config.yaml").is_file():
            raise ConfigError(f"--resume: {str(run)!r} is not a run directory (no config.yaml)")
        return run
    cfg = _load_cfg(args)
    if cfg.log.output_dir:
        return Path(cfg.log.output_dir) if (Path(cfg.log.output_dir) / "config.yaml").is_file() else None
    runs = [d for d in Path("runs").glob("*") if (d / "checkpoints").is_dir() and not (d / "summary.json").exists()]
    return max(runs, key=lambda d: d.stat().st_mtime) if runs else None


def cmd_train(args) -> int:
    from ..trainer import Trainer

    t0 = time.perf_counter()

    run = _resume_dir(args)
    if run is not None:  # the run's resolved config, then any overrides (e.g. more iterations)
        if args.config:
            raise ConfigError("--config: cannot be combined with --resume (the run's own config.yaml is used); "
                              "pass changes as key=value overrides")
        data = distrust(saved_data(run, "--resume"), args.overrides, path=run / "config.yaml", command="--resume",
                         strict=True)
        data = fresh_device(data, args.overrides)
        saved = from_dict(RunConfig, data)
        cfg = RunConfig.from_overrides([*args.overrides, f"log.output_dir={run}"], base=saved)
        old = flat(saved.to_dict())
        for key, value in flat(cfg.to_dict()).items():
            if old.get(key) != value and not key.startswith(RESUMABLE):
                raise ConfigError(f"--resume: {key} cannot change when a run resumes (it would change the model, the "
                                  f"data or the objective half-way); a resume may change {list(RESUMABLE)}; start a "
                                  "new run instead")
    else:
        if args.resume == "auto":
            print("--resume auto: no unfinished run found; starting a new one")
        cfg = _load_cfg(args)
    _threads(cfg)
    check_hub(cfg)  # a hub model that cannot be had fails here, in one line, before any model loads
    if cfg.log.output_dir:  # before any model loads: a run directory (or a new one), its data files unchanged
        rundir.check(cfg.log.output_dir, cfg, resume=run is not None)
    if cfg.log.output_dir and int(os.environ.get("RANK", "0")) == 0:  # before any model loads
        try:
            Path(cfg.log.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"log.output_dir: cannot create {cfg.log.output_dir!r} ({e.strerror})") from None
    trainer = Trainer(cfg)
    summary = trainer.train(resume=run is not None)
    if trainer.world.rank > 0:  # torchrun: rank 0 reports
        return 0
    if summary.get("interrupted"):  # the shell's convention, so schedulers and `&&` see the preemption
        print(f"interrupted by signal {summary['interrupted']}; resume with: diffgrpo train --resume "
              f"{cfg.log.output_dir}")
        return 128 + int(summary["interrupted"])
    if summary.get("stopped"):  # train.on_hacking=stop: a guard fell
        best = summary.get("best")
        print(f"stopped: {summary['stopped']}" + (f"; best checkpoint ({best['metric']}={best['value']:.4f} at "
                                                  f"iteration {best['iteration']}) in {cfg.log.output_dir}/best"
                                                  if best else ""))
        return 3
    rows = read_jsonl(Path(cfg.log.output_dir) / "metrics.jsonl", log=lambda *a: None)
    for line in end_summary(Path(cfg.log.output_dir), summary, wall_seconds=time.perf_counter() - t0, train_rows=rows):
        print(line)
    return 0


def cmd_pretrain(args) -> int:
    from ..cache import cache_root
    from ..models.tiny import load_or_pretrain
    from ..rewards.image import load_classifier

    cfg = _load_cfg(args)
    _threads(cfg)
    if getattr(args, "task", None) or cfg.model.name == "tiny_mlm":  # the built-in masked diffusion LM
        from ..models.hf_masked_lm import load_or_pretrain_mlm
        from ..tasks import get_task

        task = get_task(args.task or cfg.dllm.task)
        load_or_pretrain_mlm(task, cfg.pretrain, cache_dir=cfg.model.cache_dir, progress=cfg.log.progress)
        print(f"tiny dLLM for task {task.name!r} cached in {cache_root(cfg.model.cache_dir)}")
        return 0
    load_or_pretrain(cfg.model, cfg.pretrain, progress=cfg.log.progress)
    _, acc = load_classifier(cfg.model.image_size, cfg.model.cache_dir)
    print(f"built-in model and reward classifier cached in {cache_root(cfg.model.cache_dir)}")
    print(f"digit_alignment classifier held-out accuracy: {acc:.4f}")
    return 0


def cmd_sample(args) -> int:
    from ..models.pipelines.editing import sampling_only

    with sampling_only():  # an editing model's source comes from --image, not from prompt files
        return _cmd_sample(args)


def _cmd_sample(args) -> int:
    import torch
    from safetensors.torch import load_file

    from ..data import digit_prompt
    from ..run.runlog import save_grid
    from ..samplers import flow_sde
    from ..samplers.rollout import sample_trajectories
    from ..trainer import Trainer

    if args.num < 1:
        raise ConfigError(f"--num: value {args.num} is out of range; must be >= 1")
    if not Path(args.out).suffix:
        raise ConfigError(f"--out: {args.out!r} has no file extension; give e.g. samples.png (images) or "
                          "samples.txt (text completions)")
    src = Path(args.weights) if args.weights else None
    overrides = list(args.overrides)
    if src is not None and src.is_dir():
        if not (src / "config.yaml").is_file() or not (src / "weights.safetensors").is_file():
            raise ConfigError(f"--weights: run directory {str(src)!r} has no config.yaml + weights.safetensors")
        data = distrust(saved_data(src, "--weights"), overrides, path=src / "config.yaml", command="--weights",
                         strict=False)
        data = fresh_device(data, overrides)
        if isinstance(data.get("log"), dict):  # sampling writes no run directory (the saved one may be elsewhere)
            data["log"]["output_dir"] = ""
        for sec, name in (("train", "prompts_file"), ("eval", "prompts_file")):  # nor reads a moved run's prompts
            if isinstance(data.get(sec), dict) and not any(o.startswith(f"{sec}.{name}=") for o in overrides):
                data[sec][name] = ""
        cfg = RunConfig.from_overrides(overrides + ["log.progress=false"], base=from_dict(RunConfig, data))
        src = src / "weights.safetensors"
    else:
        cfg = RunConfig.from_overrides(overrides + ["log.progress=false"])
    if src is not None and not src.is_file():
        raise ConfigError(f"--weights: {str(src)!r} does not exist")
    _threads(cfg)
    check_hub(cfg)
    images = _sample_sources(args.image or [])  # an editing model's source image(s) for every prompt, checked now
    trainer = Trainer(cfg)
    if src is not None:
        trainer.policy.load_state_dict(load_file(str(src)))
    if trainer.family.name == "dllm":  # masked diffusion LM: text completions
        return _sample_text(trainer, args)
    prompts = args.prompt or [digit_prompt(d) for d in range(10)]
    prompts = [p for p in prompts for _ in range(args.num)]
    _check_editing(images, trainer)
    x0 = torch.stack([torch.randn(*trainer.policy.latent_shape, generator=torch.Generator().manual_seed(args.seed + i))
                      for i in range(len(prompts))]).to(trainer.device)
    kernel = dict(trainer.family.kernel, sde_type=args.sde_type)
    sig = flow_sde.sigma_grid(cfg.sampler.num_steps, cfg.sampler.shift, device=trainer.device)
    with torch.no_grad():
        cond = trainer.policy.encode(prompts, [images] * len(prompts)) if images else trainer.policy.encode(prompts)
        traj = sample_trajectories(trainer.policy, cond, x0, sig, kernel=kernel,
                                   generator=torch.Generator(device=trainer.device).manual_seed(args.seed))
    images = trainer.policy.decode(traj["xs"][:, -1])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_grid(images, out, nrow=args.num)
    print(f"wrote {len(prompts)} samples to {out}")
    return 0


def _sample_sources(paths: list[str]) -> tuple[str, ...]:
    """``--image`` (repeatable): the source image(s) an editing model edits under every ``--prompt``, each checked
    as a prompt file's ``image`` field is (a regular image file, no link, within the pixel cap) → absolute paths."""
    from .. import sources

    return tuple(sources.resolve([{"prompt": "-", "image": Path(path).name}], base=Path(path).absolute().parent,
                                 spec=path, key="--image")[0]["image"] for path in paths)


def _check_editing(images: tuple[str, ...], trainer) -> None:
    from ..models.pipelines.editing import is_edit

    family = getattr(getattr(trainer.policy, "row", None), "name", "")
    if images and not is_edit(family):
        raise ConfigError(f"--image: model family {family or trainer.cfg.model.name} generates from text; --image "
                          "gives the source image of an editing model (Qwen-Image-Edit, FLUX.1 Kontext)")


def _sample_text(trainer, args) -> int:
    """Completions of a masked diffusion LM for ``--prompt`` (default: the task's first test prompts)."""
    import torch

    from ..tasks import Example

    fam = trainer.family
    for p in args.prompt or []:
        try:
            fam.vocab.encode(p)
        except ValueError as e:
            raise ConfigError(f"--prompt: {p!r} cannot be encoded: {e} of model.name={trainer.cfg.model.name}") from None
    if args.prompt:
        examples = [Example(prompt=p, answer="") for p in args.prompt]
    else:
        examples = fam.task.instances("test")[:8]
        if not examples:  # a file task (gsm8k, …) has no built-in test prompts
            raise ConfigError(f"--prompt: dllm.task={trainer.cfg.dllm.task} has no built-in test prompts; give the "
                              "prompts to complete with --prompt TEXT (repeatable)")
    examples = [e for e in examples for _ in range(args.num)]
    temperature = 0.0 if args.sde_type == "ode" else fam.d.temperature  # ode: deterministic (greedy) decoding
    g = torch.Generator(device=trainer.device).manual_seed(args.seed)
    with torch.no_grad():
        smp = fam.generate(examples, temperature=temperature, generator=g)
    lines = [f"{e.prompt}\t{fam.vocab.decode(c)}" for e, c in zip(examples, smp.completions)]
    out = Path(args.out if not args.out.endswith(".png") else args.out[:-4] + ".txt")
    atomic_write(out, "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {len(lines)} completions to {out}")
    return 0


def cmd_bench(args) -> int:
    from ..studies.engines import bench_engines
    from ..engines import ENGINES

    if args.repeats < 1:
        raise ConfigError(f"--repeats: value {args.repeats} is out of range; must be >= 1 (timed runs per variant)")
    cfg = _load_cfg(args)
    _threads(cfg)
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
    cfg = _load_cfg(args)
    _threads(cfg)
    stopped = bench_quality.from_args(cfg, args)["meta"].get("interrupted")
    return 128 + stopped["signal"] if stopped else 0  # a stopped benchmark exits as the signal would, its outputs written


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


def cmd_print_config(args) -> int:
    """The resolved config (``--changed``: only the keys that differ from the defaults; ``--docs``: the reference of
    every key); prompt files are checked (exist, parse, hold prompts) only with ``--check-data`` (``diffgrpo train``
    always checks them before any model loads)."""
    import contextlib

    from .configdoc import changed, reference_markdown
    from ..data_sources import skip_data_checks

    if args.docs:
        print(reference_markdown(), end="")
        return 0
    with contextlib.nullcontext() if args.check_data else skip_data_checks():
        cfg = _load_cfg(args)
    if args.changed:
        diff = changed(cfg)
        print(yaml.safe_dump(diff, sort_keys=False) if diff else "{}  # every key at its default\n", end="")
        return 0
    print(cfg.to_yaml(), end="")
    return 0


def cmd_configs(args) -> int:
    """``configs list``: the shipped configs; ``configs cp NAME [DEST]``: copy one out to edit."""
    if args.action == "list":
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

    cfg = _load_cfg(args)
    for line in download_models(cfg, dry_run=args.dry_run):
        print(line)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffgrpo", description="GRPO post-training for diffusion models")
    p.add_argument("--version", action="version", version=f"diffgrpo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp):
        sp.add_argument("--config", help="YAML config file (sections as in `diffgrpo print-config`), or the name of "
                                         "a shipped one (`diffgrpo configs list`)")
        sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. engine.name=recompute seed=1")

    sp = sub.add_parser("train", help="run GRPO (default: the built-in digits model)")
    common(sp)
    sp.add_argument("--resume", metavar="RUN_DIR|auto", help="continue a run from its last complete checkpoint")
    sp.set_defaults(func=cmd_train)
    sp = sub.add_parser("pretrain", help="pretrain and cache the built-in model and reward classifier")
    common(sp)
    sp.add_argument("--task", choices=["arithmetic", "sudoku", "countdown", "json_schema", "code_toy"],
                    help="pretrain the built-in masked diffusion LM on this task instead")
    sp.set_defaults(func=cmd_pretrain)
    sp = sub.add_parser("sample", help="write samples (an image grid, or text completions for diffusion LMs) "
                                       "from a run directory or weights file")
    sp.add_argument("--weights", help="run directory or weights.safetensors (default: the pretrained model)")
    sp.add_argument("--prompt", action="append", help="prompt (repeatable); default: digits 0-9")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--num", type=int, default=8, help="samples per prompt")
    sp.add_argument("--image", action="append", help="editing models: the source image every prompt edits "
                    "(repeatable: several sources for Qwen-Image-Edit-Plus)")
    sp.add_argument("--sde-type", default="ode", choices=["ode", "flow_sde", "dance_sde", "cps"],
                    help="sampler; for diffusion LMs 'ode' means greedy decoding, anything else dllm.temperature")
    sp.add_argument("--out", default="samples.png")
    sp.add_argument("overrides", nargs="*")
    sp.set_defaults(func=cmd_sample)
    sp = sub.add_parser("bench", help="benchmarks")
    bsub = sp.add_subparsers(dest="what", required=True)
    be = bsub.add_parser("engines", help="every engine side by side on the same rollout")
    common(be)
    be.add_argument("--variants", help="';'-separated name[:key=value,...], e.g. 'recompute;jagg:window=4'")
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--out", help="output directory (default runs/bench)")
    be.set_defaults(func=cmd_bench)
    bq = bsub.add_parser("quality", help="time to quality of config variants × seeds against a reference, inside "
                                         "start-anchored guards (see docs/guards.md)")
    common(bq)
    bq.add_argument("--variant", action="append", default=[], metavar="NAME[=key=value,...]",
                    help="a variant: overrides on the base config (repeatable; the first is the reference unless "
                         "--reference names another)")
    bq.add_argument("--reference", default="", help="the reference variant (default: the first)")
    bq.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    bq.add_argument("--iterations", type=int, default=0, help="budget: iterations of the reference (as counted cost)")
    bq.add_argument("--budget-cost", type=float, default=0.0, help="budget: counted cost per cell")
    bq.add_argument("--evals", type=int, default=6, help="evaluations per cell after the start one")
    bq.add_argument("--eval-spacing", default="linear", choices=["linear", "quadratic"],
                    help="evaluation marks budget·j/evals (linear) or budget·(j/evals)² (quadratic: denser early)")
    bq.add_argument("--target-fraction", type=float, default=None,
                    help="of the reference's gain at its plateau (default 0.95)")
    bq.add_argument("--target", type=float, default=None, help="an explicit target value of --metric instead")
    bq.add_argument("--metric", default="", help="the held-out metric to reach, higher is better (default "
                                                 "eval/reward)")
    bq.add_argument("--from", dest="from_dir", default="", metavar="DIR",
                    help="summarise a finished benchmark's cells again (another --target-fraction, --target or "
                         "--metric), training nothing")
    bq.add_argument("--out", default=str(Path("runs") / "bench_quality"), help="output directory")
    bq.set_defaults(func=cmd_bench_quality)
    sp = sub.add_parser("report", help="write a self-contained HTML report of a run")
    sp.add_argument("run_dir")
    sp.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    sp.set_defaults(func=cmd_report)
    sp = sub.add_parser("export", help="write a run's checkpoint as a LoRA adapter (diffusers format), the trained "
                                       "weights, or with --merge a full pipeline directory; with a model card")
    sp.add_argument("source", metavar="RUN_DIR|CHECKPOINT_DIR")
    sp.add_argument("--out", required=True, help="output directory (new or empty)")
    sp.add_argument("--merge", action="store_true",
                    help="fuse the LoRA adapter into the base weights and write the whole pipeline (save_pretrained)")
    sp.add_argument("overrides", nargs="*", help="config overrides, e.g. model.pretrained=PATH if the base moved")
    sp.set_defaults(func=cmd_export)
    sp = sub.add_parser("print-config", help="print the resolved config as YAML")
    common(sp)
    sp.add_argument("--check-data", action="store_true",
                    help="also check that train.prompts_file / eval.prompts_file exist and parse")
    sp.add_argument("--changed", action="store_true", help="only the keys that differ from the defaults")
    sp.add_argument("--docs", action="store_true", help="every key with its type, default, allowed values and doc "
                                                        "(Markdown; docs/config.md)")
    sp.set_defaults(func=cmd_print_config)
    sp = sub.add_parser("configs", help="the configs shipped with the package: list them, copy one out")
    sp.add_argument("action", choices=["list", "cp"])
    sp.add_argument("name", nargs="?", help="cp: the config to copy (a name from `diffgrpo configs list`)")
    sp.add_argument("dest", nargs="?", help="cp: destination directory or file (default: the current directory)")
    sp.set_defaults(func=cmd_configs)
    sp = sub.add_parser("download", help="fetch every model a config needs (policy, rewards) into the Hugging Face "
                                         "cache ahead of time (for clusters whose compute nodes are offline)")
    common(sp)
    sp.add_argument("--dry-run", action="store_true", help="list what would be fetched, fetch nothing")
    sp.set_defaults(func=cmd_download)
    return p


_OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+)*=")  # key=value (a run directory named so is a path)


def _subparser(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, int]:
    """The (sub)parser the command in ``argv`` reaches, and the index after its command words."""
    i = 0
    while i < len(argv):
        choices = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        if not choices or argv[i] not in choices:
            break
        parser, i = choices[argv[i]], i + 1
    return parser, i


def _normalise(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``--key value`` / ``--key=value`` for a config key or alias (not a flag of the command) → ``key=value``, so
    that users' habits from other tools reach the overrides; everything else is left to argparse."""
    sp, start = _subparser(parser, argv)
    if not any(a.dest == "overrides" for a in sp._actions):
        return argv
    own = set(sp._option_string_actions)
    out, i, tail = list(argv[:start]), start, []  # tail: the overrides, after any positional (export RUN)
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if a.startswith("--") and name not in own and a != "--":
            key = name[2:] if flags.known(name[2:]) else name[2:].replace("-", "_")
            if "=" in a:
                tail.append(f"{key}={a.split('=', 1)[1]}")
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                tail.append(f"{key}={argv[i + 1]}")
                i += 1
            else:
                raise ConfigError(f"{a}: expected a value (--{name[2:]} VALUE or {key}=VALUE)")
        elif _OVERRIDE.match(a) and not os.path.exists(a):
            tail.append(a)
        else:
            out.append(a)
        if a in own and sp._option_string_actions[a].nargs != 0 and "=" not in a and i + 1 < len(argv):
            out.append(argv[i + 1])  # the flag's own value, whatever it looks like
            i += 1
        i += 1
    return out + tail


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse a command line: overrides (``key=value``) anywhere, aliases translated, unknown keys refused with a
    suggestion from every section. Raises ConfigError (argparse's own errors exit 2 with usage)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, extras = parser.parse_known_args(_normalise(parser, argv))
    if hasattr(args, "overrides"):
        args.overrides = flags.translate(list(args.overrides) + flags.split_extras(extras),
                                         log=lambda m: print(m, file=sys.stderr))
    elif extras:
        parser.error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        return args.func(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RewardError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second SIGINT while the current iteration finishes
        print("error: interrupted before a checkpoint could be written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
