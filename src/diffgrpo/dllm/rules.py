"""The dLLM family's configuration rules: masked-LM sizes on the sampler's own schedule, file tasks, held-out
files, chat templates, the LoRA / dtype / sharding combinations and each base method's rules. Run by
:func:`diffgrpo.validation.validate` before any model loads (``DLLMFamily.check_config``)."""
from __future__ import annotations

import functools
import json
from pathlib import Path

from .. import guards
from ..config import RewardConfig, RunConfig
from ..data_sources import reads_data
from ..errors import ConfigError
from ..models.tiny_block import TINY_BLOCK_SIZE
from ..rewards import check_text_rewards
from ..samplers.masked import schedule
from ..tasks import FILE_TASKS, TASKS, VOCAB, examples_from_file, get_task
from ..tasks.code import check_config as check_code_config
from .decoding import check_config as check_decoding

BUILT_IN = ("tiny_mlm", "tiny_block")  # the built-in masked LMs: character vocabulary, the task's positions


def check(cfg: RunConfig, purpose: str = "train") -> None:
    """Every cross-field rule of a masked diffusion LM run validated for ``purpose`` (``validation.PURPOSES``: the
    data files load only for a purpose that reads them)."""
    check_decoding(cfg.dllm)
    _validate_dllm(cfg, purpose)
    _validate_dllm_methods(cfg)
    if extra_rewards(cfg) or cfg.reward.options:  # reward.weights beside the task's verifier
        check_text_rewards(cfg.reward.weights if extra_rewards(cfg) else {}, cfg.reward.options)
    guards.check_config(cfg, "dllm")  # eval.guard_rewards (text verifiers), train.keep_best


def extra_rewards(cfg: RunConfig) -> bool:
    """Whether a masked-LM run sets ``reward.weights`` (the flow default, the digits reward, means: the task's
    verifier alone)."""
    return cfg.reward.weights != RewardConfig().weights


@functools.cache
def _answer_tokens(task_name: str) -> int:
    """Tokens (built-in character vocabulary) of the task's longest reference answer, over both splits."""
    task = get_task(task_name)
    return max(len(VOCAB.encode(e.answer)) for split in ("train", "test") for e in task.instances(split))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _validate_dllm(cfg: RunConfig, purpose: str) -> None:
    """Masked-LM sizes, with the sampler's rules (samplers/masked.py:schedule) on the effective values
    gen_length or the task's default, block_length or gen_length, diffusion_steps or gen_length."""
    d = cfg.dllm
    if cfg.model.name == "hf_masked_lm" and not d.model_path:
        raise ConfigError("dllm.model_path: required for model.name=hf_masked_lm (a local model directory or hub id)")
    task = get_task(d.task)
    check_code_config(d)  # the dllm.sandbox* keys
    _validate_dllm_scale(cfg, task, purpose)
    if d.data_file and reads_data(purpose):
        examples = examples_from_file(d.data_file, task, prompt_field=d.prompt_field, answer_field=d.answer_field)
        if cfg.model.name in BUILT_IN:  # the built-in character vocabulary and its prompt positions
            for i, ex in enumerate(examples, 1):
                try:
                    n = len(VOCAB.encode(ex.prompt))
                except ValueError as e:
                    raise ConfigError(f"dllm.data_file: record {i}: the prompt {ex.prompt!r} cannot be written in "
                                      f"the built-in vocabulary ({e})") from None
                if n > task.prompt_length:
                    raise ConfigError(f"dllm.data_file: record {i}: the prompt {ex.prompt!r} has {n} tokens; the "
                                      f"built-in tiny_mlm for dllm.task={d.task} reads at most {task.prompt_length}")
    if cfg.model.name in BUILT_IN and d.gen_length:
        if d.gen_length > task.gen_length:
            raise ConfigError(f"dllm.gen_length: value {d.gen_length} is out of range; the built-in tiny_mlm for "
                              f"dllm.task={d.task} has positions for {task.gen_length} completion tokens; must be "
                              f"<= {task.gen_length} (0 = {task.gen_length})")
        need = _answer_tokens(d.task) if d.gen_length < task.gen_length else 0
        if d.gen_length < need:
            raise ConfigError(f"dllm.gen_length: value {d.gen_length} is out of range; the longest "
                              f"dllm.task={d.task} answer has {need} tokens; must be >= {need} (0 = the task's "
                              f"default {task.gen_length})")
    gen = d.gen_length or task.gen_length
    src = f"dllm.gen_length={gen}" if d.gen_length else f"dllm.task={d.task}'s default gen_length {gen}"
    model_block = model_block_size(cfg)  # a block-causal model decodes in its own blocks
    if model_block and not d.block_length:
        check_block_model(d, model_block, gen)
    block = d.block_length or model_block or gen
    if gen % block:
        raise ConfigError(f"dllm.block_length: value {d.block_length} does not divide the generation length {gen} "
                          f"({src}); choose one of {_divisors(gen)} or 0 (one block)")
    if model_block and d.block_length:
        check_block_model(d, model_block, gen)
    n_blocks = gen // block
    steps = d.diffusion_steps or gen
    if steps > gen:
        raise ConfigError(f"dllm.diffusion_steps: value {steps} is out of range; at most one step per token: must "
                          f"be <= the generation length {gen} ({src})")
    if steps % n_blocks:
        raise ConfigError(f"dllm.diffusion_steps: value {steps} is not a multiple of the {n_blocks} blocks "
                          f"(generation length {gen} / dllm.block_length {block}); choose one of "
                          f"{list(range(n_blocks, gen + 1, n_blocks))} or 0 (= {gen})")
    try:
        schedule(gen, block, steps)  # the sampler's own rules, in case they grow
    except ValueError as e:
        raise ConfigError(f"dllm.diffusion_steps: value {steps} is not usable ({e})") from None


def model_block_size(cfg: RunConfig) -> int:
    """The attention block of a block-causal model, known before it loads: ``tiny_block``'s (``dllm.block_length``
    or :data:`TINY_BLOCK_SIZE`), the ``block_size`` in a local ``dllm.model_path``'s config.json; else 0 (a hub
    model's is checked when it loads)."""
    d = cfg.dllm
    if cfg.model.name == "tiny_block":
        return d.block_length or TINY_BLOCK_SIZE
    if cfg.model.name != "hf_masked_lm" or not d.model_path or not Path(d.model_path).expanduser().is_dir():
        return 0
    b = _json_file(Path(d.model_path).expanduser() / "config.json").get("block_size")
    return b if isinstance(b, int) and not isinstance(b, bool) and b > 0 else 0


def check_block_model(d, block_size: int, gen_length: int) -> None:
    """A block-causal model decodes in its own attention blocks with its exact cache: ``dllm.block_length`` is 0 or
    the model's block, which divides the completion; ``dllm.kv_cache`` (the masked LM's approximate caches) is none."""
    if d.block_length and d.block_length != block_size:
        raise ConfigError(f"dllm.block_length: value {d.block_length} differs from the block-causal model's block "
                          f"size {block_size}; use 0 or {block_size}")
    if gen_length % block_size:
        raise ConfigError(f"dllm.gen_length: value {gen_length} is not a multiple of the model's block size "
                          f"{block_size}")
    if d.kv_cache != "none":
        raise ConfigError(f"dllm.kv_cache: value {d.kv_cache!r} does not apply to a block-causal model (its cache of "
                          f"finished blocks is exact and always on); must be 'none'")



def _validate_dllm_scale(cfg: RunConfig, task, purpose: str) -> None:
    """File tasks, held-out files, chat templates and the LoRA / dtype / sharding combinations of masked LMs."""
    d = cfg.dllm
    if d.task in FILE_TASKS:
        if not d.data_file:
            raise ConfigError(f"dllm.data_file: required for dllm.task={d.task} (it has no generator): a .jsonl file "
                              f"or hf:<dataset>[:<split>] with fields {d.prompt_field!r} and {d.answer_field!r}")
        if cfg.model.name != "hf_masked_lm":
            raise ConfigError(f"dllm.task: value {d.task!r} needs model.name=hf_masked_lm (the built-in tiny_mlm "
                              f"only knows {sorted(TASKS)})")
    if d.eval_file and reads_data(purpose):
        examples_from_file(d.eval_file, task, key="dllm.eval_file", prompt_field=d.prompt_field,
                           answer_field=d.answer_field)
    if cfg.model.name == "hf_masked_lm" and Path(d.model_path).expanduser().is_dir():
        _check_model_dir(Path(d.model_path).expanduser(), d)
    if cfg.model.name in BUILT_IN:
        if d.chat_template == "true" or d.system_prompt:
            key = "dllm.chat_template" if d.chat_template == "true" else "dllm.system_prompt"
            raise ConfigError(f"{key}: the built-in tiny_mlm has a character vocabulary and no chat template; it "
                              f"applies to model.name=hf_masked_lm")
        if d.prompt_length and d.prompt_length != task.prompt_length:
            raise ConfigError(f"dllm.prompt_length: value {d.prompt_length} does not fit the built-in tiny_mlm for "
                              f"dllm.task={d.task}, which reads {task.prompt_length} prompt tokens; use 0")
    if d.lora_target_modules and not d.lora_rank:
        raise ConfigError("dllm.lora_target_modules: set only with dllm.lora_rank > 0 (LoRA is off at rank 0)")
    if cfg.dist.mode == "fsdp2" and d.lora_rank and d.dtype != "float32":
        raise ConfigError(f"dllm.dtype: value {d.dtype!r} with dllm.lora_rank={d.lora_rank} under dist.mode=fsdp2 is "
                          f"not supported (FSDP2 shards each block in one dtype and the adapter trains in float32); "
                          f"choose dllm.dtype=float32 (with dist.fsdp_param_dtype=bfloat16 to compute in bf16) or "
                          f"dist.mode=ddp")


def _json_file(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return {}  # absent or unreadable: transformers says what is wrong when it loads
    return data if isinstance(data, dict) else {}


def _check_model_dir(path: Path, d) -> None:
    """A local ``dllm.model_path`` read as files, before it loads: code it ships (``auto_map`` in ``config.json`` or
    ``tokenizer_config.json``) needs ``dllm.trust_remote_code``; ``dllm.system_prompt`` needs a chat template (the
    prompt is never sent as plain text in front of the question: refused instead)."""
    tok = _json_file(path / "tokenizer_config.json")
    if not d.trust_remote_code:
        for name, data in (("config.json", _json_file(path / "config.json")), ("tokenizer_config.json", tok)):
            if data.get("auto_map"):
                classes = sorted(map(str, data["auto_map"]))[:3] if isinstance(data["auto_map"], dict) else []
                raise ConfigError(f"dllm.trust_remote_code: the model in {str(path)!r} ships its own code ({name} "
                                  f"auto_map {classes}); set dllm.trust_remote_code=true if you trust that code")
    if d.system_prompt:
        has_template = bool(tok.get("chat_template")) or any(
            (path / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))
        if d.chat_template == "false" or not has_template:
            why = "dllm.chat_template=false" if d.chat_template == "false" else \
                f"the tokenizer in {str(path)!r} has no chat template"
            raise ConfigError(f"dllm.system_prompt: set, but {why}, so it would be unused; clear dllm.system_prompt "
                              "or use a tokenizer with a chat template (dllm.chat_template=auto)")


def _check_trace_value(cfg: RunConfig) -> None:
    """dllm.trace_value=on: TraceRL's value network is a float32 copy of the built-in block model's trunk, trained
    in one process beside trace_rl's policy gradient (dllm.trace_critic)."""
    d, where = cfg.dllm, "dllm.trace_value: value on"
    if d.method != "trace_rl":
        raise ConfigError(f"{where} needs dllm.method=trace_rl (advantages per decoding step); got {d.method!r}")
    if cfg.model.name != "tiny_block":
        raise ConfigError(f"{where} needs model.name=tiny_block (its value network copies the built-in block model's "
                          f"trunk); got {cfg.model.name!r}")
    if d.lora_rank:
        raise ConfigError(f"{where} needs dllm.lora_rank=0 (the value network copies the full trunk); got {d.lora_rank}")
    if cfg.train.checkpoint_format == "dcp":
        raise ConfigError(f"{where} checkpoints its value network in safetensors files; train.checkpoint_format must "
                          "be 'auto' or 'files', got 'dcp'")
    if cfg.dist.mode in ("ddp", "fsdp2"):
        raise ConfigError(f"{where} trains its value network in one process; dist.mode must be 'auto' or 'none', "
                          f"got {cfg.dist.mode!r}")


def _validate_dllm_methods(cfg: RunConfig) -> None:
    """The base methods' own rules: wd1 keeps groups on one rank; SPG has no KL term and no SML plug-in, its
    masking block divides the completion and t_min <= t_max."""
    d = cfg.dllm
    if d.method == "wd1" and cfg.dist.group_layout == "spread" and cfg.dist.mode != "none":
        raise ConfigError("dist.group_layout: value 'spread' is not allowed with dllm.method=wd1 (its group softmax "
                          "needs each group's samples on one rank); must be 'local'")
    if d.trace_value:
        _check_trace_value(cfg)
    if d.method != "spg":
        return
    if cfg.loss.beta != 0:
        raise ConfigError(f"loss.beta: value {cfg.loss.beta} is not allowed with dllm.method=spg (SPG has no KL "
                          "term); must be 0")
    if cfg.daca.likelihood != "base":
        raise ConfigError(f"daca.likelihood: value {cfg.daca.likelihood!r} is not allowed with dllm.method=spg (its "
                          "upper bound needs SPG's own masks); must be 'base'")
    if d.spg_t_min > d.spg_t_max:
        raise ConfigError(f"dllm.spg_t_min: value {d.spg_t_min} is out of range; must be <= dllm.spg_t_max "
                          f"({d.spg_t_max})")
    gen = d.gen_length or get_task(d.task).gen_length
    if d.spg_block_length and gen % d.spg_block_length:
        raise ConfigError(f"dllm.spg_block_length: value {d.spg_block_length} does not divide the generation length "
                          f"{gen}; choose one of {_divisors(gen)} or 0 (= dllm.block_length)")
