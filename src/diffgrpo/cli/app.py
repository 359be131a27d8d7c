"""Command line: ``diffgrpo {train, pretrain, sample, bench, report, export, print-config, configs, download}``.

Every command that builds a run takes ``[--config FILE|NAME] [key=value ...]``, the overrides anywhere on the line
(also as ``--key value``, and under the TRL / flow_grpo names of ``diffgrpo.cli.flags``); ``diffgrpo train`` with no
arguments runs the embedded default (the built-in digits model, pretrained on first use). This module holds the
parser and the dispatch; each command lives in its own module (``train``, ``sample``, ``bench``, ``configs``,
``outputs``), which loads what it needs when it runs.
"""
from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from pathlib import Path

from .._version import __version__
from ..console import end_leftover_threads, note_termination, quiet_library_bars, stream_lines
from ..errors import ConfigError, RewardError, TrainingError
from . import flags
from .bench import cmd_bench, cmd_bench_quality
from .configs import cmd_configs, cmd_download, cmd_print_config
from .outputs import cmd_export, cmd_report
from .sample import cmd_sample
from .train import cmd_pretrain, cmd_train


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="diffgrpo", description="GRPO post-training for diffusion models")
    p.add_argument("--version", action="version", version=f"diffgrpo {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_pretrain, _add_sample, _add_bench, _add_report, _add_export, _add_print_config,
                _add_configs, _add_download):
        add(sub)
    return p


# what --help of every command that builds a run says about the keys: where the reference is, and the most used ones
MOST_USED = ("model.name", "model.pretrained", "reward.weights", "train.num_iterations", "train.lr",
             "train.group_size", "train.prompts_per_batch", "engine.name", "eval.every", "train.save_every",
             "log.output_dir", "seed")
KEYS_HELP = (
    "config keys (key=value or --key value, anywhere on the line):\n"
    "  every key with its type, default and doc: diffgrpo print-config --docs (docs/config.md);\n"
    "  the resolved config: diffgrpo print-config [--changed] [--config FILE] [key=value ...]\n"
    f"  most used: {', '.join(MOST_USED[:6])},\n"
    f"             {', '.join(MOST_USED[6:])}\n"
    "  TRL / transformers names map too, with a note (learning_rate, num_generations, beta, max_steps, save_steps,\n"
    "  logging_steps, save_total_limit, report_to), also in a flat --config YAML; resume_from_checkpoint is --resume")


def _keys_help(sp: argparse.ArgumentParser) -> None:
    sp.epilog, sp.formatter_class = KEYS_HELP, argparse.RawDescriptionHelpFormatter


def _common(sp: argparse.ArgumentParser) -> None:
    """The arguments of every command that builds a run: ``--config`` and the dotted overrides."""
    _keys_help(sp)
    sp.add_argument("--config", help="YAML config file (sections as in `diffgrpo print-config`), or the name of "
                                     "a shipped one (`diffgrpo configs list`)")
    sp.add_argument("overrides", nargs="*", help="dotted overrides, e.g. engine.name=recompute seed=1")


def _add_train(sub) -> None:
    sp = sub.add_parser("train", help="run GRPO (default: the built-in digits model)")
    _common(sp)
    sp.add_argument("--resume", metavar="RUN_DIR|auto", help="continue a run from its last complete checkpoint "
                                                             "(TRL's resume_from_checkpoint)")
    sp.set_defaults(func=cmd_train)


def _add_pretrain(sub) -> None:
    sp = sub.add_parser("pretrain", help="pretrain and cache the built-in model (for digits also its reward "
                                         "classifier)")
    _common(sp)
    sp.add_argument("--task", choices=["arithmetic", "sudoku", "countdown", "json_schema", "code_toy"],
                    help="pretrain the built-in masked diffusion LM on this task instead")
    sp.set_defaults(func=cmd_pretrain)


def _add_sample(sub) -> None:
    sp = sub.add_parser("sample", help="write samples (an image grid, or text completions for diffusion LMs) "
                                       "from a run directory or weights file")
    sp.add_argument("--weights", help="run directory or weights.safetensors (default: the pretrained model)")
    sp.add_argument("--prompt", action="append", help="prompt (repeatable); default: the task's (a held-out one per "
                                                      "shapes category, or digits 0-9)")
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--num", type=int, default=None, help="samples per prompt (default 8; a text model decoding "
                                                          "greedily writes one per prompt)")
    sp.add_argument("--image", action="append", help="editing models: the source image every prompt edits "
                    "(repeatable: several sources for Qwen-Image-Edit-Plus)")
    sp.add_argument("--sde-type", default="ode", choices=["ode", "flow_sde", "dance_sde", "flash_sde", "cps"],
                    help="sampler; for diffusion LMs 'ode' means greedy decoding, anything else dllm.temperature")
    sp.add_argument("--out", default="samples.png")
    sp.add_argument("overrides", nargs="*")
    _keys_help(sp)
    sp.set_defaults(func=cmd_sample)


def _add_bench(sub) -> None:
    sp = sub.add_parser("bench", help="benchmarks")
    bsub = sp.add_subparsers(dest="what", required=True)
    _add_bench_engines(bsub)
    _add_bench_quality(bsub)


def _add_bench_engines(bsub) -> None:
    be = bsub.add_parser("engines", help="every engine side by side on the same rollout")
    _common(be)
    be.add_argument("--variants", help="';'-separated name[:key=value,...], e.g. 'recompute;jagg:window=4'")
    be.add_argument("--repeats", type=int, default=3)
    be.add_argument("--out", help="output directory (default runs/bench)")
    be.set_defaults(func=cmd_bench)


def _add_bench_quality(bsub) -> None:
    bq = bsub.add_parser("quality", help="time to quality of config variants × seeds against a reference, inside "
                                         "start-anchored guards (see docs/guards.md)")
    _common(bq)
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
    bq.add_argument("--guard-patience", type=int, default=None,
                    help="with --from: what a user's run keeps under train.on_hacking=stop when it stops at this many "
                         "evaluations in a row out of the guards (default: the benchmark's train.guard_patience)")
    bq.add_argument("--guard-mean", type=int, default=1, help="judge the guards on the mean of this many neighbouring "
                                                             "evaluations (less noise; 1: each evaluation alone)")
    bq.add_argument("--tune", action="store_true", help="first choose each variant's settings on a small grid run on "
                                                        "--tune-seeds, then measure the chosen ones on --seeds")
    bq.add_argument("--tune-seeds", type=int, nargs="+", default=[100, 101], help="tuning seeds (not in --seeds)")
    bq.add_argument("--tune-grid", nargs="+", default=[], metavar="KEY=V1,V2",
                    help="the grid (x0.5: a multiple of the variant's value), or one YAML file; default: train.lr "
                         "and loss.beta ×0.5, ×1, ×2 and the strength of each diversity objective used")
    bq.add_argument("--out", default=str(Path("runs") / "bench_quality"), help="output directory")
    bq.set_defaults(func=cmd_bench_quality)


def _add_report(sub) -> None:
    sp = sub.add_parser("report", help="write a self-contained HTML report of a run")
    sp.add_argument("run_dir")
    sp.add_argument("--out", help="output file (default RUN_DIR/report.html)")
    sp.set_defaults(func=cmd_report)


def _add_export(sub) -> None:
    sp = sub.add_parser("export", help="write a run's checkpoint as a LoRA adapter (diffusers format), the trained "
                                       "weights, or with --merge a full pipeline directory; with a model card")
    sp.add_argument("source", metavar="RUN_DIR|CHECKPOINT_DIR")
    sp.add_argument("--out", required=True, help="output directory (new or empty)")
    sp.add_argument("--merge", action="store_true",
                    help="fuse the LoRA adapter into the base weights and write the whole pipeline (save_pretrained)")
    sp.add_argument("overrides", nargs="*", help="config overrides, e.g. model.pretrained=PATH if the base moved")
    sp.set_defaults(func=cmd_export)


def _add_print_config(sub) -> None:
    sp = sub.add_parser("print-config", help="print the resolved config as YAML")
    _common(sp)
    sp.add_argument("--check-data", action="store_true",
                    help="also check that train.prompts_file / eval.prompts_file exist and parse")
    sp.add_argument("--changed", action="store_true", help="only the keys that differ from the defaults")
    sp.add_argument("--docs", action="store_true", help="every key with its type, default, allowed values and doc "
                                                        "(Markdown; docs/config.md)")
    sp.set_defaults(func=cmd_print_config)


def _add_configs(sub) -> None:
    sp = sub.add_parser("configs", help="the configs shipped with the package: list them, copy one out")
    sp.add_argument("action", choices=["list", "cp"])
    sp.add_argument("name", nargs="?", help="cp: the config to copy (a name from `diffgrpo configs list`)")
    sp.add_argument("dest", nargs="?", help="cp: destination directory or file (default: the current directory)")
    sp.set_defaults(func=cmd_configs)


def _add_download(sub) -> None:
    sp = sub.add_parser("download", help="fetch every model a config needs (policy, rewards) into the Hugging Face "
                                         "cache ahead of time (for clusters whose compute nodes are offline)")
    _common(sp)
    sp.add_argument("--dry-run", action="store_true", help="list what would be fetched, fetch nothing")
    sp.set_defaults(func=cmd_download)


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
                raise flags.no_value(a, key)
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
    stream_lines()  # progress reaches a pipe (| tee, a scheduler's log) line by line, as it is printed
    quiet_library_bars()  # no library's carriage-return bar in a piped log
    before, term = set(threading.enumerate()), note_termination()  # a SIGTERM without a run's handler: one line
    try:
        code = _command(argv)
    finally:
        if term is not None:
            signal.signal(signal.SIGTERM, term)
    if argv is None:  # the command line: a plug-in's leftover non-daemon threads do not hold its exit
        end_leftover_threads(code, before)
    return code


def _command(argv: list[str] | None) -> int:
    try:
        args = parse_args(argv)
        code = args.func(args)
        sys.stdout.flush()  # a closed pipe surfaces here, inside the handlers, not at the interpreter's exit
        return code
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (RewardError, TrainingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # a second SIGINT while the current iteration finishes
        print("error: interrupted before a checkpoint could be written", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout went away (`diffgrpo configs list | head -1`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes
        return 128 + signal.SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
