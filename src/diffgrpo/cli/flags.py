"""Command-line habits users bring from TRL, flow_grpo, Hugging Face and accelerate, mapped onto dotted keys.

  split_extras(extras)        arguments argparse did not take → overrides: ``key=value`` anywhere on the line,
                              ``--key value`` / ``--key=value`` for any dotted key or alias; anything else is a
                              one-line ConfigError.
  translate(overrides, log)   aliases (``learning_rate=1e-5``, ``num_generations=16``, ``beta=0.04``) become their
                              dotted key with a one-line note; names whose meaning differs between projects
                              (TRL's ``num_iterations`` is this tool's ``train.num_inner_epochs``) are refused with
                              the key to use; unknown keys get a suggestion from every section, not only their own.
                              ``report_to=wandb`` (a name, a list, ``none``) sets the trackers it names.
  translate_mapping(data)     a config file's top level the same way: a flat TRL-style YAML (``learning_rate: 1e-5``,
                              ``num_generations: 4``) maps with the same notes and refusals.
  accelerate_overrides(env)   ``accelerate launch`` exports its flags as ``ACCELERATE_*`` variables: honoured where
                              this tool has the setting (``--mixed_precision bf16`` → ``model.mixed_precision``),
                              refused in one line where it does not.
"""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Callable, Mapping

from ..config import RENAMED, RunConfig
from ..errors import ConfigError
from ..run.trackers import ALIASES as TRACKER_SWITCHES
from ..run.trackers import TRACKERS as TRACKER_NAMES

# alias → dotted key: names from TRL's GRPOConfig / transformers' TrainingArguments, flow_grpo's and DanceGRPO's
# configs that mean the same thing here
ALIASES: dict[str, str] = {
    "learning_rate": "train.lr",
    "lr": "train.lr",
    "num_generations": "train.group_size",            # TRL
    "num_image_per_prompt": "train.group_size",       # flow_grpo sample.num_image_per_prompt
    "beta": "loss.beta",                              # TRL, flow_grpo train.beta: the KL coefficient
    "kl_coef": "loss.beta",
    "epsilon": "loss.clip_range",                     # TRL's PPO clip
    "clip_range": "loss.clip_range",                  # flow_grpo train.clip_range
    "max_steps": "train.num_iterations",              # transformers: optimizer-step budget of the run
    "num_inner_epochs": "train.num_inner_epochs",     # flow_grpo
    "max_grad_norm": "train.max_grad_norm",
    "weight_decay": "train.weight_decay",
    "adam_beta1": "train.adam_beta1",
    "adam_beta2": "train.adam_beta2",
    "lr_scheduler_type": "train.lr_schedule",
    "output_dir": "log.output_dir",
    "num_steps": "sampler.num_steps",                 # flow_grpo sample.num_steps
    "noise_level": "sampler.noise_level",             # flow_grpo sample.noise_level
    "guidance_scale": "model.guidance_scale",
    "resolution": "model.resolution",
    "pretrained_model": "model.pretrained",
    "model_name_or_path": "model.pretrained",
    "max_completion_length": "dllm.gen_length",
    "max_prompt_length": "dllm.prompt_length",
    "temperature": "dllm.temperature",
    "save_steps": "train.save_every",
    "eval_steps": "eval.every",
    "save_total_limit": "train.keep_checkpoints",   # transformers: checkpoints kept on disk
    "logging_steps": "log.every",                   # the printed progress lines; metrics.jsonl has every iteration
}

# names that mean something else here, or more than one thing: refused with the key(s) to use
AMBIGUOUS: dict[str, str] = {
    "num_iterations": "TRL's num_iterations (updates per batch, mu) is train.num_inner_epochs here; the run's "
                      "length is train.num_iterations",
    "per_device_train_batch_size": "a batch is train.prompts_per_batch x train.group_size samples; the size of one "
                                   "backward is engine.micro_batch_size",
    "train_batch_size": "a batch is train.prompts_per_batch x train.group_size samples; the size of one backward is "
                        "engine.micro_batch_size",
    "gradient_accumulation_steps": "gradients accumulate over engine.micro_batch_size chunks of the batch by "
                                   "themselves; set train.prompts_per_batch and engine.micro_batch_size",
    "warmup_steps": "warmup counts iterations here: train.warmup_iterations",
    "lora_rank": "model.lora_rank (flow models) or dllm.lora_rank (masked diffusion LMs)",
    "gradient_checkpointing": "model.gradient_checkpointing (flow models) or dllm.gradient_checkpointing (masked "
                              "diffusion LMs)",
    "mixed_precision": "model.mixed_precision (flow models: autocast) or dllm.dtype (masked diffusion LMs)",
    "bf16": "model.mixed_precision=bf16 (flow models: autocast) or dllm.dtype=bfloat16 (masked diffusion LMs)",
    "fp16": "model.mixed_precision=fp16 (flow models: autocast) or dllm.dtype=float16 (masked diffusion LMs)",
    "resume_from_checkpoint": "resuming is a flag of the command: diffgrpo train --resume RUN_DIR (or --resume auto, "
                              "the newest unfinished run)",
    "num_train_epochs": "a run is counted in iterations: train.num_iterations",
}
AMBIGUOUS.update({old: f"{old} was renamed {new}" for old, new in RENAMED.items()})  # config.RENAMED


# the trackers' switches (aliases in log.trackers), turned off by report_to=none
TRACKERS: dict[str, str] = TRACKER_SWITCHES


def report_to(value) -> list[tuple[str, object]]:
    """TRL's ``report_to`` (a name, a list of names, or ``none``) → ``log.trackers`` (and, for ``none``, the
    switches off); a one-line ConfigError for a tracker this tool does not write."""
    items = value if isinstance(value, (list, tuple)) else str(value).strip().strip("[]").split(",")
    names = [str(n).strip().strip("'\"").lower() for n in items if str(n).strip()]
    if not names or names == ["none"]:
        return [("log.trackers", []), *((key, False) for key in TRACKERS.values())]
    unknown = [n for n in names if n not in TRACKER_NAMES]
    if unknown:
        raise ConfigError(f"report_to: {', '.join(unknown)} is not a tracker here; name them among "
                          f"{list(TRACKER_NAMES)} (log.trackers) or none")
    return [("log.trackers", names)]


VALUED: dict[str, Callable[[object], list[tuple[str, object]]]] = {"report_to": report_to}


def _keys(obj, prefix: str = "") -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        out.extend(_keys(v, f"{prefix}{f.name}.") if dataclasses.is_dataclass(v) else [f"{prefix}{f.name}"])
    return out


KEYS: tuple[str, ...] = tuple(_keys(RunConfig()))
_OPEN = ("reward.weights.", "reward.options.")  # keys below these name rewards and their options


def known(key: str) -> bool:
    """Whether ``key`` is a config key, a section, or below a mapping key (``reward.weights.pickscore``)."""
    return key in KEYS or any(k.startswith(key + ".") for k in KEYS) or key.startswith(_OPEN)


def hint(key: str) -> str:
    """A ``did you mean`` for an unknown key, looked for in every section: the same leaf name elsewhere, an alias,
    or the closest dotted key."""
    leaf = key.rsplit(".", 1)[-1].replace("-", "_")
    flat = key.replace(".", "_").replace("-", "_")  # flow_grpo's train.batch_size is TRL's train_batch_size
    if flat in AMBIGUOUS and flat != leaf:
        return f" ({AMBIGUOUS[flat]})"
    if leaf in ALIASES:
        return f" (did you mean {ALIASES[leaf]!r}?)"
    if leaf in AMBIGUOUS:
        return f" ({AMBIGUOUS[leaf]})"
    same = [k for k in KEYS if k.rsplit(".", 1)[-1] == leaf]
    if same:
        return f" (did you mean {' or '.join(repr(k) for k in same)}?)"
    close = difflib.get_close_matches(key, KEYS, n=1, cutoff=0.6) or [
        k for k in KEYS if k.rsplit(".", 1)[-1] in difflib.get_close_matches(leaf, [c.rsplit(".", 1)[-1] for c in KEYS],
                                                                             n=1, cutoff=0.75)][:1]
    return f" (did you mean {close[0]!r}?)" if close else ""


def _text(value) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(map(_text, value)) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def mapped(key: str, value, log: Callable[[str], None] = print) -> list[tuple[str, object]]:
    """The (dotted key, value) pairs that ``key=value`` sets: a config key as given, an alias as its key (a note),
    ``report_to`` as its trackers (a note); a name that means something else here, or no key, is refused in one
    line with the key to use."""
    if known(key):
        return [(key, value)]
    name = key.replace("-", "_")
    if name in ALIASES:
        log(f"note: {key} is {ALIASES[name]} here; using {ALIASES[name]}={_text(value)}")
        return [(ALIASES[name], value)]
    if name in VALUED:
        pairs = VALUED[name](value)
        log(f"note: {key}={_text(value)} is {' '.join(f'{k}={_text(v)}' for k, v in pairs)} here")
        return pairs
    if name in AMBIGUOUS:
        raise ConfigError(f"unknown config key {key!r}: {AMBIGUOUS[name]}")
    raise ConfigError(f"unknown config key {key!r}{hint(key)}; diffgrpo print-config --docs lists every key")


def translate(overrides: list[str], log: Callable[[str], None] = print) -> list[str]:
    """Overrides with aliases replaced by their dotted keys (a note each); unknown keys refused with a hint. A key
    set both through an alias and otherwise (``learning_rate=1e-5 train.lr=2e-5``) is refused: the note would name
    one value while the other is used."""
    out, given = [], []  # given: (dotted key, the item that set it, whether through an alias)
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not key=value (e.g. train.lr=1e-5); see diffgrpo print-config")
        key, value = item.split("=", 1)
        key = key.strip()
        pairs = [(key, value)] if known(key) else mapped(key, value, lambda _: None)
        given += [(k, item, not known(key)) for k, _ in pairs]
        _refuse_twice(given)
        if known(key):
            out.append(item)
            continue
        out.extend(f"{k}={_text(v)}" for k, v in mapped(key, value, log))
    return out


def _refuse_twice(given: list[tuple[str, str, bool]]) -> None:
    """A one-line ConfigError when the last key of ``given`` was set before and one of the two settings is an alias."""
    key, item, alias = given[-1]
    first = next(((i, a) for k, i, a in given[:-1] if k == key), None)
    if first is not None and (alias or first[1]):
        raise ConfigError(f"{key} is given twice, as {first[0]} and as {item}; keep one")


def translate_mapping(data: Mapping, log: Callable[[str], None] = print, *, source: str = "--config") -> dict:
    """A config file's top level with the command line's names: sections and dotted keys as given, TRL / flow_grpo
    flat keys (``learning_rate: 1e-5``) mapped with the same notes and refusals as :func:`translate`. A key set
    both flat and in its section is refused (which one wins would be a guess)."""
    out: dict = {}
    for k, v in data.items():
        for key, value in mapped(str(k).strip(), v, log):
            if key in out:  # two names of one key (lr and learning_rate, or train.lr and learning_rate)
                raise ConfigError(f"{source}: {key} is set twice, by {k} and by another name of it; keep one")
            out[key] = value
    for key in out:
        section, _, leaf = key.partition(".")
        if leaf and isinstance(out.get(section), Mapping) and leaf in out[section]:
            raise ConfigError(f"{source}: {key} is set twice, under {section}: and by a top-level name; keep one")
    return out


def no_value(flag: str, key: str) -> ConfigError:
    """The error for ``--key`` without a value: the refusal of a name that means something else here (``--bf16``),
    else the forms a value takes."""
    if key in AMBIGUOUS:
        return ConfigError(f"unknown config key {key!r}: {AMBIGUOUS[key]}")
    return ConfigError(f"{flag}: expected a value (--{flag.lstrip('-')} VALUE or {key}=VALUE)")


def split_extras(extras: list[str]) -> list[str]:
    """Arguments argparse left over → ``key=value`` overrides. Accepted: ``key=value``, ``--key=value``,
    ``--key value`` where key is a dotted key or an alias (``-`` and ``_`` alike in the flag)."""
    out, i = [], 0
    while i < len(extras):
        a = extras[i]
        if a.startswith("--") and len(a) > 2:
            name, eq, value = a[2:].partition("=")
            key = name if known(name) else name.replace("-", "_")
            if not (known(key) or key in ALIASES or key in VALUED or key in AMBIGUOUS):
                raise ConfigError(f"unrecognized argument {a!r}{hint(key)}; options are --flags of the command "
                                  f"(diffgrpo COMMAND --help) and key=value overrides")
            if not eq:
                if i + 1 >= len(extras) or extras[i + 1].startswith("--"):
                    raise no_value(a, key)
                value = extras[i + 1]
                i += 1
            out.append(f"{key}={value}")
        elif "=" in a and not a.startswith("-"):
            out.append(a)
        else:
            raise ConfigError(f"unrecognized argument {a!r}; options are --flags of the command (diffgrpo COMMAND "
                              f"--help) and key=value overrides")
        i += 1
    return out


# ACCELERATE_* variable → (meaning of its default, how to honour a set value)
def accelerate_overrides(env: Mapping[str, str] | None = None,
                         applies: Callable[[str], bool] = lambda key: True) -> list[str]:
    """Overrides for the flags of ``accelerate launch`` found in ``env`` (its ``ACCELERATE_*`` exports), or a
    one-line ConfigError for a flag this tool cannot honour (``applies(key)``: whether the run's model reads the
    key). The processes themselves (ranks, world size) are taken from the launcher's RANK / WORLD_SIZE as under
    torchrun."""
    env = os.environ if env is None else env
    out = []
    mp = env.get("ACCELERATE_MIXED_PRECISION", "no").strip().lower()
    if mp not in ("", "no"):
        if mp not in ("bf16", "fp16"):
            raise ConfigError(f"accelerate launch --mixed_precision {mp}: not supported; use bf16 or fp16 "
                              "(model.mixed_precision)")
        if not applies("model.mixed_precision"):
            raise ConfigError(f"accelerate launch --mixed_precision {mp}: masked diffusion LMs set their weight "
                              "dtype with dllm.dtype=bfloat16; drop the flag")
        out.append(f"model.mixed_precision={mp}")
    if env.get("ACCELERATE_USE_FSDP", "").strip().lower() in ("true", "1"):
        out.append("dist.mode=fsdp2")
    for var, flag, instead in (
            ("ACCELERATE_USE_DEEPSPEED", "--use_deepspeed", "dist.mode=fsdp2 shards weights and optimizer state"),
            ("ACCELERATE_USE_MEGATRON_LM", "--use_megatron_lm", "dist.mode=fsdp2 shards the model"),
            ("ACCELERATE_DYNAMO_BACKEND", "--dynamo_backend", "torch.compile is not applied by this tool"),
            ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "--gradient_accumulation_steps",
             "accumulation follows engine.micro_batch_size")):
        value = env.get(var, "").strip()
        if value and value.lower() not in ("false", "0", "no", "1" if "ACCUMULATION" in var else "no"):
            raise ConfigError(f"accelerate launch {flag} {value}: not supported by diffgrpo ({instead}); drop the "
                              "flag")
    return out


__all__ = ["ALIASES", "AMBIGUOUS", "KEYS", "TRACKERS", "VALUED", "accelerate_overrides", "hint", "known", "mapped",
           "no_value", "report_to", "split_extras", "translate", "translate_mapping"]
