"""Run configuration: one dataclass per component, composed into :class:`RunConfig`.

Sources, applied in order: defaults → YAML file → dotted overrides (``engine.name=jagg``). Every value is
checked against its field's type, allowed values and range; unknown keys fail with a did-you-mean hint.
Errors are :class:`ConfigError` with a one-line message naming the key, the value and what is allowed.
:func:`validate` re-applies every per-field check (so a config built or edited in Python is held to the same rules)
and then the checks that span fields or look at the machine (device, logging packages, output directory).
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import importlib
import importlib.util
import inspect
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from . import guards
from .data_sources import check_prompts, read_utf8
from .distributed import launched_world_size
from .dllm.tasks import FILE_TASKS, TASKS, VOCAB, examples_from_file, get_task
from .engines import ENGINES, FORWARD_ENGINES
from .errors import ConfigError, suggest
from .rewards import REWARDS, check_rewards, resolve_reward
from .samplers.masked import schedule

# Plausibility bound: samples drawn per iteration (train.prompts_per_batch × train.group_size, all ranks together).
# Far above any real run (FlowGRPO: 48 × 24 = 1152 per node), far below what would exhaust memory before failing.
MAX_SAMPLES_PER_ITERATION = 65536


def _f(default, *, choices=None, lo=None, hi=None, gt=None, path=False, doc="", **kw):
    """A dataclass field carrying validation metadata (choices, inclusive bounds ``lo``/``hi``, exclusive lower
    bound ``gt``, ``path``: a file-system path whose leading ``~`` is expanded) and a doc string."""
    meta = {"choices": choices, "lo": lo, "hi": hi, "gt": gt, "path": path, "doc": doc}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# model.name → family (a key of ``trainer.FAMILIES``): which family trains the policy
MODEL_FAMILIES = {"tiny": "flow", "diffusers": "flow", "tiny_mlm": "dllm", "hf_masked_lm": "dllm"}


@dataclass
class ModelConfig:
    name: str = _f("tiny", choices=("tiny", "tiny_mlm", "hf_masked_lm", "diffusers"),
                   doc="policy adapter: tiny (flow), diffusers (SD3/FLUX/Wan/Qwen-Image pipeline at model.pretrained), "
                       "tiny_mlm / hf_masked_lm (masked diffusion LM, see dllm.*)")
    guidance_scale: float = _f(1.0, lo=0.0, doc="classifier-free guidance scale; 1 = no CFG (one forward)")
    device: str = _f("auto", doc="torch device for the policy: auto (cuda:<LOCAL_RANK> / cuda, else mps, else cpu), "
                                 "cpu, cuda, cuda:N or mps (must exist on this machine)")
    cache_dir: str = _f("", path=True, doc="where pretrained built-in models live (default $DIFFGRPO_CACHE or ~/.cache/diffgrpo)")
    # built-in tiny model architecture (a real diffusers SD3Transformer2DModel at tiny size)
    image_size: int = _f(16, choices=(8, 16, 32), doc="tiny model: image side in pixels")
    patch_size: int = _f(2, choices=(1, 2, 4), doc="tiny model: transformer patch size")
    num_layers: int = _f(2, lo=1, hi=24, doc="tiny model: transformer blocks")
    num_heads: int = _f(4, lo=1, hi=32, doc="tiny model: attention heads")
    head_dim: int = _f(16, lo=4, hi=256, doc="tiny model: channels per head")
    text_dim: int = _f(32, lo=4, hi=1024, doc="tiny model: prompt-encoder width")
    # diffusers pipelines (model.name=diffusers); guidance_scale is true CFG, or FLUX's distilled guidance value
    pretrained: str = _f("", path=True, doc="diffusers: local pipeline directory or hub id")
    family: str = _f("auto", choices=("auto", "sd3", "flux", "wan", "qwenimage"),
                     doc="diffusers: model family; auto = from the transformer class")
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float16"), doc="diffusers: weight dtype of the pipeline")
    mixed_precision: str = _f("no", choices=("no", "bf16", "fp16"),
                              doc="tiny, diffusers: autocast of the transformer forward")
    resolution: int = _f(512, lo=16, doc="diffusers: image side in pixels")
    num_frames: int = _f(33, lo=1, doc="diffusers (wan): video frames")
    negative_prompt: str = _f("", doc="diffusers: negative prompt of true CFG")
    max_sequence_length: int = _f(0, lo=0, doc="diffusers: text tokens; 0 = the family's pipeline default")
    # LoRA (peft) for the flow models (model.name=tiny or diffusers); the KL reference is the base (adapter off)
    lora_rank: int = _f(0, lo=0, doc="tiny, diffusers: LoRA rank (train a peft adapter only); 0 = full fine-tune")
    lora_alpha: float = _f(0.0, lo=0.0, doc="tiny, diffusers: LoRA alpha; 0 = lora_rank")
    lora_target_modules: str = _f("", doc="tiny, diffusers: comma-separated LoRA targets; empty = the attention "
                                          "projections (the family's defaults; tiny: SD3's)")
    gradient_checkpointing: bool = _f(False, doc="tiny, diffusers: activation checkpointing in the transformer")
    offload_text_encoders: bool = _f(True, doc="diffusers: keep the text encoders on the CPU and move them to the "
                                               "device only to encode prompts not yet cached (each prompt is "
                                               "encoded once)")


@dataclass
class PretrainConfig:
    steps: int = _f(800, lo=1, doc="flow-matching pretraining steps for the built-in model")
    batch_size: int = _f(128, lo=1, hi=MAX_SAMPLES_PER_ITERATION)
    lr: float = _f(2e-3, lo=0.0)
    cond_dropout: float = _f(0.1, lo=0.0, hi=1.0, doc="probability of the null prompt (enables CFG)")
    seed: int = _f(0)
    answer_noise: float = _f(0.4, lo=0.0, hi=1.0,
                             doc="tiny dLLM only: fraction of pretraining answers replaced by the task's systematic "
                                 "slip (off by one, swapped digits): a base with a habit a verifier can train away")


@dataclass
class SamplerConfig:
    sde_type: str = _f("flow_sde", choices=("flow_sde", "dance_sde", "cps", "ode"))
    noise_level: float = _f(0.7, lo=0.0, doc="a (flow_sde, cps) or eta (dance_sde)")
    num_steps: int = _f(10, lo=1, hi=1000, doc="sampling steps T")
    shift: float = _f(3.0, lo=1e-3, doc="sigma-grid shift s: σ' = sσ/(1+(s−1)σ)")
    logprob_reduce: str = _f("mean", choices=("mean", "sum"), doc="reduction of the Gaussian log-density")
    cps_flowgrpo_compat: bool = _f(False, doc="FlowGRPO's CPS pseudo log-prob (not a likelihood)")
    share_noise_in_group: bool = _f(False, doc="same initial noise for every sample of a prompt group")
    batch_size: int = _f(0, lo=0, doc="rollout trajectories per network call (whole rows, every step); 0 = the whole "
                                      "batch. Bounds sampling activations; the noise draws do not change")
    shared_prefix: bool = _f(False, doc="rollout savings: a group shares its initial noise and runs its deterministic ODE "
                                        "prefix (up to its first stochastic step) once: k + G(T-k) forwards, exact")
    tail_solver: str = _f("full", choices=("full", "euler", "heun"),
                          doc="rollout savings: after a sample's last stochastic / trained step, carry it to x0 with "
                              "sampler.tail_steps steps of this solver (full = every grid step; not exact otherwise)")
    tail_steps: int = _f(1, lo=1, doc="rollout savings: steps of the cheap tail (sampler.tail_solver)")


@dataclass
class RewardConfig:
    weights: dict = _f({"digit_alignment": 1.0}, doc="reward name (or module:function) -> weight")
    options: dict[str, dict] = _f({}, doc="per-reward options, e.g. {pickscore: {model: <hub id or path>, dtype: "
                                          "bfloat16, batch_size: 16, device: cuda:1}} (see README, Rewards)")
    background: bool = _f(False, doc="score each sampling micro-batch (sampler.batch_size) in a worker thread while "
                                     "the next one samples (FlowGRPO's overlap); the samples and rewards equal "
                                     "background=false's. Needs sampler.batch_size > 0; engines that keep rollout "
                                     "graphs (retain, reweight, evaluation=retain) score after sampling")


@dataclass
class AdvantageConfig:
    std_mode: str = _f("group", choices=("group", "global", "none"))
    baseline: str = _f("mean", choices=("mean", "leave_one_out"))
    clip: float = _f(5.0, lo=0.0)
    eps: float = _f(1e-4, lo=0.0)
    filter_zero_std: bool = _f(False, doc="drop groups whose rewards are all equal from the loss")
    per_reward_norm: bool = _f(False, doc="flow, several rewards: normalise each reward within its group on its own, "
                                          "sum with reward.weights, divide by the sum's batch std (GDPO-style)")


@dataclass
class LossConfig:
    clip_range: float = _f(1e-4, lo=0.0, doc="PPO clip ε on the step ratio")
    beta: float = _f(0.0, lo=0.0, doc="KL coefficient")
    kl_flowgrpo_compat: bool = _f(False, doc="FlowGRPO's KL scaling (omits Δ)")
    aggregation: str = _f("mean", choices=("mean", "sample_mean", "sum"))
    trust_region: str = _f("clip", choices=("clip", "kl_mask"),
                           doc="flow: PPO ratio clip, or Flow-DPPO's mask on the exact per-step Gaussian KL to the "
                               "rollout policy (a step is dropped when KL >= kl_mask_bound and it moves away)")
    kl_mask_bound: float = _f(1e-5, lo=0.0, doc="flow, trust_region=kl_mask: the KL bound (mean-reduced over "
                                                 "latent elements with sampler.logprob_reduce=mean)")
    ratio_norm: bool = _f(False, doc="flow: GRPO-Guard's ratio normalisation, r = exp(s·(log r + KL)) under the clip")


@dataclass
class StepsConfig:
    mode: str = _f("all", choices=("all", "first_fraction", "random", "window"),
                   doc="which steps get gradients (the final deterministic step never does)")
    fraction: float = _f(1.0, lo=0.0, hi=1.0, doc="first_fraction / random: share of trainable steps")
    window_start: int = _f(-1, lo=-1, doc="window: first step, -1 = random per sample")
    window_size: int = _f(4, lo=1)
    window_shift_every: int = _f(0, lo=0, doc="window (MixGRPO sliding window): move the window by "
                                               "steps.window_shift_stride every N iterations; 0 = fixed window")
    window_shift_stride: int = _f(1, lo=1, doc="window: steps the sliding window moves per shift")
    window_roll_back: bool = _f(True, doc="window: a sliding window past the last trainable step restarts at "
                                          "steps.window_start (else it stays at the end)")
    ode_outside: bool = _f(False, doc="SDE kernel only on the selected (trained) steps, ODE elsewhere (MixGRPO)")


@dataclass
class EngineConfig:
    name: str = _f("recompute", doc="gradient engine (registry key in diffgrpo.engines.ENGINES)")
    micro_batch_size: int = _f(0, lo=0, doc="samples per forward/backward chunk; 0 = all at once")
    # engine-specific knobs (documented with each engine)
    window: int = _f(4, lo=2, doc="jagg: steps per window W")
    jagg_frac: float = _f(1.0, lo=0.0, hi=1.0, doc="jagg: share of windows routed to JAGG")
    jagg_min_score: float = _f(-1.0, lo=-1.0, hi=1.0, doc="jagg: windows scoring below stay exact")
    evaluation: str = _f("recompute", choices=("recompute", "retain"),
                         doc="jagg, single_step: trained velocities from a recompute forward or rollout graphs")
    wave_size: int = _f(0, lo=0, doc="retain: groups per rollout wave; 0 = whole batch")
    candidate_steps: str = _f("first_half", doc="single_step: 'first_half', 'all' or a list like 0,1,2")
    rectify: bool = _f(True, doc="single_step: temporal gradient rectification")
    # forward-process engines (nft, awm): losses on clean rollout samples, no per-step likelihood
    forward_timesteps: int = _f(0, lo=0, hi=1000, doc="nft, awm: training units (time + fresh noise) per sample, at "
                                                      "most sampler.num_steps; 0 = the paper's recipe (nft: "
                                                      "floor(0.99·T) grid times per sample, awm: 6 stratified)")
    forward_rollout: str = _f("ode", choices=("ode", "sampler"),
                              doc="nft, awm: rollouts by the deterministic ODE (the papers' recipe) or by "
                                  "sampler.sde_type")
    adv_clip: float = _f(5.0, gt=0.0, doc="nft, awm: advantages clipped to ±adv_clip and divided by it (nft: "
                                          "r = A/(2·adv_clip) + 1/2; awm: A/adv_clip)")
    nft_beta: float = _f(1.0, gt=0.0, hi=10.0, doc="nft: β of the implicit policies v± (mixing with the old policy)")
    old_decay_rate: float = _f(0.001, lo=0.0, hi=1.0, doc="nft: old-policy EMA decay = min(rate·updates, max)")
    old_decay_max: float = _f(0.5, lo=0.0, hi=0.9999, doc="nft: cap of the old-policy EMA decay")
    awm_weighting: str = _f("uniform", choices=("uniform", "t", "ghuber"),
                            doc="awm: time weighting of the flow-matching error (ghuber: the released GenEval recipe)")
    awm_clip_range: float = _f(1.0, lo=0.0, doc="awm: PPO clip ε on the flow-matching 'likelihood' ratio")


@dataclass
class TrainConfig:
    num_iterations: int = _f(40, lo=0)
    prompts_per_batch: int = _f(8, lo=1, hi=MAX_SAMPLES_PER_ITERATION,
                                doc="prompts per iteration (all ranks); prompts_per_batch × group_size <= 65536")
    group_size: int = _f(8, lo=2, hi=MAX_SAMPLES_PER_ITERATION,
                         doc="samples per prompt (GRPO group); prompts_per_batch × group_size <= 65536")
    lr: float = _f(1e-4, lo=0.0, doc="AdamW learning rate (full fine-tune of the built-in model; 3e-4 climbs "
                                     "faster but starts to exploit the reward classifier: noisy, less diverse digits)")
    lr_schedule: str = _f("constant", choices=("constant", "cosine", "linear"),
                          doc="learning-rate schedule over num_iterations × num_inner_epochs updates (after warmup)")
    warmup_iterations: int = _f(0, lo=0, doc="iterations of linear warmup from 0 to train.lr; 0 = none")
    weight_decay: float = _f(0.0, lo=0.0)
    adam_beta1: float = _f(0.9, lo=0.0, hi=1.0)
    adam_beta2: float = _f(0.999, lo=0.0, hi=1.0)
    max_grad_norm: float = _f(1.0, lo=0.0, doc="0 disables clipping")
    num_inner_epochs: int = _f(1, lo=1, doc="optimizer updates per rollout")
    save_every: int = _f(10, lo=0, doc="checkpoint every N iterations (0: never); resume with --resume")
    keep_checkpoints: int = _f(2, lo=1, doc="checkpoints kept on disk (newest)")
    ema_decay: float = _f(0.0, lo=0.0, hi=0.9999, doc="EMA of trainable weights for evaluation; 0 = off")
    max_bad_updates: int = _f(3, lo=1, doc="stop after this many consecutive non-finite updates")
    digits: list = _f([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], doc="training prompt digits")
    prompts_file: str = _f("", path=True, doc="training prompts (replace the digit prompts), drawn by a seeded epoch "
                                              "sampler: a UTF-8 text file (one prompt per line), a .jsonl file (a "
                                              "prompt field + metadata fields) or a .csv file (a prompt column + "
                                              "metadata columns), or hf:<path or hub id>[:<split>] (datasets."
                                              "load_dataset; hf:json:<file> for a local JSON file), or "
                                              "builtin:<set>/<split> (a prompt set shipped with the package, e.g. "
                                              "builtin:ocr/train); the metadata reaches the rewards")
    prompt_column: str = _f("prompt", doc="the field / column holding the prompt in train.prompts_file and "
                                          "eval.prompts_file (.jsonl, .csv, hf:)")
    checkpoint_format: str = _f("auto", choices=("auto", "dcp", "files"),
                                doc="dcp: sharded torch.distributed.checkpoint files, every rank writes its own shards "
                                    "(no gather) and any number of processes can resume them; files: one "
                                    "safetensors + optimizer file written by rank 0 (bitwise resume); auto: dcp "
                                    "under dist.mode=fsdp2, else files")
    # guards (diffgrpo.guards): limits relative to the run's start evaluation; 0 turns a limit off
    on_hacking: str = _f("off", choices=("off", "warn", "stop"),
                         doc="an evaluation outside the guards: off (only logged as eval/guard/ok), warn (a warning), "
                             "stop (the run ends there, exit code 3, the message names the guard)")
    guard_max_fid_ratio: float = _f(1.5, lo=0.0, doc="eval/fid (built-in task) at most this × its start value")
    guard_max_drift: float = _f(0.5, lo=0.0, doc="eval/guard/drift (Fréchet distance to the base model's samples "
                                                  "/ their total variance) at most this")
    guard_min_diversity_ratio: float = _f(0.8, lo=0.0, hi=1.0, doc="eval/diversity and eval/guard/diversity at "
                                                                    "least this × their start value")
    guard_max_reward_drop: float = _f(0.1, lo=0.0, doc="each eval/guard/rewards/<name>/mean at least start − this "
                                                        "× |start|")
    keep_best: str = _f("", doc="keep the weights of the evaluation with the highest value of this metric (e.g. "
                                "eval/reward) among those inside the guards in <run>/best/; empty = off")


@dataclass
class DLLMConfig:
    """Masked diffusion LMs (model.name=tiny_mlm / hf_masked_lm). TRL names: num_generations = train.group_size,
    beta = loss.beta, epsilon = dllm.clip_range, num_iterations = train.num_inner_epochs,
    scale_rewards = advantage.std_mode (when method_defaults is false)."""
    task: str = _f("arithmetic", choices=("arithmetic", "sudoku", "countdown", "json_schema", "gsm8k"),
                   doc="task with a verifiable reward (diffgrpo.dllm.tasks); gsm8k: numeric answers, instances from "
                       "dllm.data_file")
    method: str = _f("diffu_grpo", choices=("diffu_grpo", "coupled_grpo", "random_mask", "spg", "wd1"),
                     doc="base method: likelihood estimator + advantage baseline (+ objective: spg, wd1)")
    method_defaults: bool = _f(True, doc="use the method's advantage baseline/std (else the advantage section)")
    clip_range: float = _f(0.2, lo=0.0, doc="PPO clip ε on per-token ratios (d1 and TRL use 0.2)")
    gen_length: int = _f(0, lo=0, doc="completion tokens; 0 = the task's default (tiny_mlm: at least the longest "
                                      "answer, at most the default: the built-in model's positions)")
    block_length: int = _f(0, lo=0, doc="semi-autoregressive block size, a divisor of gen_length; 0 = gen_length "
                                        "(one block)")
    diffusion_steps: int = _f(0, lo=0, doc="sampling steps, a multiple of the number of blocks and <= gen_length; "
                                           "0 = gen_length (one token per step)")
    remasking: str = _f("low_confidence", choices=("low_confidence", "random"))
    temperature: float = _f(1.0, lo=0.0, doc="rollout sampling temperature")
    data_file: str = _f("", path=True, doc="JSONL file of {prompt, answer} records replacing the task's generated "
                                           "train split (each answer must pass the task's verifier; the test split "
                                           "stays the task's own); drawn uniformly like the built-in split")
    eval_temperature: float = _f(0.0, lo=0.0, doc="held-out evaluation temperature (0 = greedy)")
    eval_size: int = _f(128, lo=0, doc="held-out test prompts per evaluation; 0 = the whole test split")
    eval_samples: int = _f(1, lo=1, doc="completions per held-out prompt (use > 1 with eval_temperature > 0)")
    p_mask_prompt: float = _f(0.15, lo=0.0, hi=1.0, doc="diffu_grpo: probability of masking each prompt token")
    num_mask_samples: int = _f(2, lo=1, doc="random_mask: mask ratios per completion (forwards)")
    model_path: str = _f("", path=True, doc="hf_masked_lm: local directory or hub id")
    trust_remote_code: bool = _f(False, doc="hf_masked_lm: allow the checkpoint's own code (LLaDA, Dream)")
    mask_token_id: int = _f(-1, lo=-1, doc="hf_masked_lm: id of the mask token; -1 = the tokenizer's "
                                           "(LLaDA checkpoints without one: 126336)")
    logits_shift: str = _f("auto", choices=("auto", "true", "false"),
                           doc="hf_masked_lm: true = position j scores token j+1 (Dream); auto by model type")
    # at scale (diffgrpo.models.hf_masked_lm, diffgrpo.rewards.verifiers)
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float16"),
                    doc="weight dtype of the masked LM (LoRA weights train in float32; logits are scored in float32)")
    gradient_checkpointing: bool = _f(False, doc="activation checkpointing in the masked LM's blocks")
    lora_rank: int = _f(0, lo=0, doc="LoRA rank (train a peft adapter only; the KL reference is the adapter "
                                     "disabled); 0 = full fine-tune. d1 trains LLaDA-8B with rank 128")
    lora_alpha: float = _f(0.0, lo=0.0, doc="LoRA alpha; 0 = lora_rank (d1: 64 at rank 128)")
    lora_target_modules: str = _f("", doc="comma-separated LoRA targets; empty = the model's attention projections "
                                          "(LLaDA / Dream: q_proj, k_proj, v_proj as d1; BERT: query, key, value)")
    chat_template: str = _f("auto", choices=("auto", "true", "false"),
                            doc="hf_masked_lm: wrap prompts with tokenizer.apply_chat_template (user turn + the "
                                "generation prompt); auto = when the tokenizer has a template")
    system_prompt: str = _f("", doc="hf_masked_lm with a chat template: system message before every prompt")
    prompt_length: int = _f(0, lo=0, doc="prompt tokens (left-padded; longer prompts keep their last tokens); "
                                         "0 = the task's default")
    prompt_field: str = _f("prompt", doc="dllm.data_file / eval_file: the field holding the prompt (GSM8K: question)")
    answer_field: str = _f("answer", doc="dllm.data_file / eval_file: the field holding the reference answer")
    eval_file: str = _f("", path=True, doc="held-out prompts and answers (same formats as dllm.data_file); empty = "
                                           "the task's test split (gsm8k: dllm.data_file itself)")
    format_reward: float = _f(0.0, lo=0.0, doc="weight of d1's format rewards (strict + soft XML format + tag "
                                               "count, at most 1.5) added to the task reward; 0 = off")
    coupled_form: str = _f("paper", choices=("paper", "released"),
                           doc="coupled_grpo: paper = the complementary pair, weight 1 (2 forwards); released = "
                               "DiffuCoder's trainer: full-mask forward averaged with the pair weighted 1/t, "
                               "1/(1-t) (3 forwards)")
    spg_negative: str = _f("mix", choices=("mix", "eubo", "elbo"),
                           doc="spg: bound for A <= 0: eubo (upper bound), mix (spg_mix_weight*eubo + rest*elbo), "
                               "elbo")
    spg_beta: float = _f(1.5, gt=0.0, doc="spg: beta of the upper bound (SPG: 1.0 sudoku, 1.5 gsm8k/math, 2.0 "
                                          "countdown)")
    spg_mix_weight: float = _f(0.5, lo=0.0, hi=1.0, doc="spg: weight of the upper bound in spg_negative=mix")
    spg_num_t: int = _f(2, lo=1, doc="spg: masked forwards per completion (SPG: 2)")
    spg_t_min: float = _f(0.0, lo=0.0, hi=1.0, doc="spg: least fraction of the chosen block's tokens masked")
    spg_t_max: float = _f(1.0, lo=0.0, hi=1.0, doc="spg: largest fraction of the chosen block's tokens masked")
    spg_block_length: int = _f(0, lo=0, doc="spg: masking block length, a divisor of gen_length; 0 = "
                                            "dllm.block_length (the sampler's blocks)")


@dataclass
class DACAConfig:
    """DACA-GRPO plug-ins for every dLLM base method (diffgrpo.dllm.credit, diffgrpo.dllm.likelihood)."""
    dps_score: str = _f("none", choices=("none", "entropy", "confidence", "margin", "settling", "progress"),
                        doc="Denoising Progress Score from the sampler records; none = uniform token weights")
    dps_mix: float = _f(0.5, lo=0.0, hi=1.0, doc="lambda: weight = (1-lambda) + lambda*score weight (0 = base method)")
    dps_clip_min: float = _f(0.2, lo=0.0, hi=1.0, doc="lower bound of the normalised score weights")
    dps_clip_max: float = _f(5.0, lo=1.0, doc="upper bound of the normalised score weights")
    likelihood: str = _f("base", choices=("base", "sml"),
                         doc="base = the method's estimator; sml = Stratified Masking Likelihood on top of it")
    sml_strata: int = _f(2, lo=1, doc="SML: strata K (K forwards per base forward; 1 = the base estimator)")
    sml_partition: str = _f("decode_order", choices=("random", "interleaved", "decode_order"),
                            doc="SML: how valid completion tokens are split into strata (decode_order: stratum 0 = "
                                "decoded first)")
    sml_mode: str = _f("chain", choices=("leave_one_out", "chain"),
                       doc="SML: forward k masks stratum k (leave_one_out) or strata k..K-1 (chain: with decode_order, "
                           "each stratum is scored in the context the sampler decided it in)")


@dataclass
class EvalConfig:
    every: int = _f(10, lo=0, doc="evaluate every N iterations (0: only at start and end)")
    seeds_per_prompt: int = _f(4, lo=1)
    seed: int = _f(1234)
    sde_type: str = _f("ode", choices=("ode", "flow_sde", "dance_sde", "cps"))
    prompts_file: str = _f("", path=True, doc="evaluation prompts (default: the ten digit prompts), in any format of "
                                              "train.prompts_file; the metadata reaches the rewards")
    batch_size: int = _f(0, lo=0, doc="evaluation samples sampled, decoded and scored together; 0 = all at once "
                                      "(with > 0 only the first 64 images are kept for the sample grid)")
    guard_rewards: list = _f([], doc="held-out guard rewards, evaluated and never trained on (eval/guard/rewards/"
                                     "<name>/mean): registry names or module:function; text verifiers or d1_format "
                                     "for masked diffusion LMs")
    guard_features: str = _f("auto", doc="feature space of eval/guard/fd_base, drift, diversity (flow): auto, "
                                         "digits, clip (the CLIP of a CLIP-class reward), none or module:function "
                                         "(images -> (B, D)); masked LMs use hashed character trigrams")


@dataclass
class LogConfig:
    output_dir: str = _f("", path=True, doc="run directory (~ expanded; must be creatable and writable); "
                                            "default runs/<timestamp>")
    progress: bool = _f(True, doc="progress bar")
    tensorboard: bool = _f(False, doc="TensorBoard event files beside metrics.jsonl (needs the tensorboard package)")
    wandb: bool = _f(False, doc="also log to Weights & Biases (needs the wandb package)")
    save_images: bool = _f(True, doc="sample grids and reward curve PNGs")


@dataclass
class DistConfig:
    """Data parallelism under ``torchrun`` (WORLD_SIZE > 1); ignored in a single process."""
    mode: str = _f("auto", choices=("auto", "none", "ddp", "fsdp2"),
                   doc="auto: ddp under torchrun (WORLD_SIZE > 1), none in one process; ddp: replicated weights; "
                       "fsdp2: fully_shard per transformer block + root (full fine-tune or LoRA)")
    group_layout: str = _f("local", choices=("local", "spread"),
                           doc="local: each rank samples whole groups; spread: every group's samples split over ranks")
    backend: str = _f("", doc="process-group backend; empty = nccl with CUDA, gloo otherwise")
    timeout: float = _f(1800.0, gt=0.0, doc="timeout of collectives; a stalled rank fails the job after this many "
                                            "seconds")
    fsdp_param_dtype: str = _f("float32", choices=("float32", "bfloat16"),
                               doc="fsdp2: dtype the sharded parameters are all-gathered and computed in "
                                   "(MixedPrecisionPolicy; gradients are reduced in float32, the optimizer keeps "
                                   "float32 shards)")
    fsdp_cpu_offload: bool = _f(False, doc="fsdp2: keep parameter, gradient and optimizer shards on the CPU "
                                           "(CPUOffloadPolicy); the optimizer step runs on the CPU")


@dataclass
class RunConfig:
    seed: int = _f(0)
    model: ModelConfig = field(default_factory=ModelConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    steps: StepsConfig = field(default_factory=StepsConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)
    dllm: DLLMConfig = field(default_factory=DLLMConfig)
    daca: DACAConfig = field(default_factory=DACAConfig)
    dist: DistConfig = field(default_factory=DistConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_overrides(cls, overrides: list[str] | None = None, base: "RunConfig | None" = None) -> "RunConfig":
        """Defaults (or ``base``) with ``key=value`` overrides; values are parsed as YAML scalars/lists."""
        cfg = from_dict(cls, to_dict(base)) if base is not None else cls()  # deep copy
        for item in overrides or []:
            if "=" not in item:
                raise ConfigError(f"override {item!r} must look like key=value (e.g. engine.name=recompute)")
            key, raw = item.split("=", 1)
            key = key.strip()
            _walk(cfg, key)  # an unknown key is reported before its value is parsed
            set_path(cfg, key, _parse_value(key, raw) if raw.strip() else "")
        validate(cfg)
        return cfg

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> "RunConfig":
        p = Path(path)
        if not _is_file(p):
            raise ConfigError(f"--config: file {str(p)!r} does not exist")
        text = read_utf8(p, "--config")
        try:
            data = yaml.safe_load(text) or {}
        except Exception as e:  # noqa: BLE001 - YAMLError, or a constructor's ValueError (e.g. a bad date)
            raise ConfigError(f"--config: file {str(p)!r} is not valid YAML ({_yaml_problem(e)}); fix the syntax "
                              f"there") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: {str(p)!r} must hold a mapping of sections, got {type(data).__name__}")
        return cls.from_overrides(overrides, base=from_dict(cls, data))

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------- generic helpers
def to_dict(obj) -> dict[str, Any]:
    return dataclasses.asdict(obj)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _show_key(key: str) -> str:
    """A key as written in messages: plain when it is printable without spaces, else its repr (one line)."""
    return key if key.isprintable() and not any(c.isspace() for c in key) else repr(key)


def _yaml_problem(e: Exception) -> str:
    """``line L, column C: problem`` of a YAML parse error (one line); other errors by their message."""
    problem = getattr(e, "problem", None) or getattr(e, "context", None)
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    if problem is None:
        return _one_line(f"{type(e).__name__}: {e}")
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return where + _one_line(problem)


def _parse_value(key: str, raw: str):
    """An override's value as YAML (a scalar, list or mapping); a syntax error names the key."""
    try:
        return yaml.safe_load(raw)
    except Exception as e:  # noqa: BLE001 - YAMLError, or a constructor's ValueError (e.g. 2024-13-45)
        raise ConfigError(f"{_show_key(key)}: value {raw!r} is not valid YAML ({_yaml_problem(e)}); give a scalar, a list "
                          f"[a, b] or a mapping {{k: v}}, quoting text that contains YAML syntax") from None


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # a name too long, an embedded NUL byte
        return False


def _is_file(p: Path) -> bool:
    try:
        return p.is_file()
    except (OSError, ValueError):  # a name too long, an embedded NUL byte
        return False


_SCALARS = (str, int, float, bool, type(None), datetime.date)


def _range_text(lo, hi, gt) -> str:
    if gt is not None:
        return f"must be > {gt}"
    if lo is not None and hi is not None:
        return f"must be in [{lo}, {hi}]"
    if lo is not None:
        return f"must be >= {lo}"
    if hi is not None:
        return f"must be <= {hi}"
    return "must be finite"


def _coerce(key: str, value, tp, meta):
    """Check ``value`` against the annotated type ``tp`` and the field's metadata; return the coerced value."""
    origin = typing.get_origin(tp) or tp
    try:
        if origin is bool:
            if isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
                value = value.lower() in ("true", "1", "yes")
            if type(value) is int and value in (0, 1):  # YAML reads 1 / 0 as ints
                value = bool(value)
            if not isinstance(value, bool):
                raise TypeError
        elif origin is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise TypeError
            if not isinstance(value, (int, float, str)):
                raise TypeError
            value = int(value)
        elif origin is float:
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise TypeError
            value = float(value)
        elif origin is str:
            if value is None:
                value = ""
            if isinstance(value, bool):  # YAML 1.1 reads no / yes / true / off as booleans: the word was meant
                words = ("true", "yes", "on") if value else ("false", "no", "off")
                value = next((w for w in words if w in (meta.get("choices") or ())), words[0])
            if isinstance(value, (list, tuple)):
                if not all(isinstance(v, _SCALARS) for v in value):
                    raise TypeError
                value = ",".join(str(v) for v in value)
            if not isinstance(value, _SCALARS):
                raise TypeError
            value = str(value)
            if meta.get("path") and value.startswith("~"):
                try:
                    value = os.path.expanduser(value)
                except (ValueError, OSError):  # e.g. an embedded NUL byte: refused by the path checks
                    pass
        elif origin is dict and typing.get_args(tp)[1:] == (dict,):  # {name: {option: value}}: reward.options
            if not isinstance(value, dict):
                raise TypeError
            value = {str(k): v for k, v in value.items()}
            for k, v in value.items():
                if not isinstance(v, dict):
                    raise ConfigError(f"{_show_key(f'{key}.{k}')}: value {v!r} must be a mapping of options, "
                                      "e.g. {batch_size: 8}")
        elif origin is dict:
            if not isinstance(value, dict):
                raise TypeError
            value = {str(k): v for k, v in value.items()}
            for k, v in value.items():
                entry = _show_key(f"{key}.{k}")
                if not isinstance(v, (int, float)) or isinstance(v, bool):
                    raise ConfigError(f"{entry}: weight {v!r} must be a number")
                if not math.isfinite(v):
                    raise ConfigError(f"{entry}: weight {v!r} must be a finite number")
        elif origin is list:
            if isinstance(value, (int, float, str)) and not isinstance(value, bool):
                value = [value]
            if not isinstance(value, (list, tuple)) or not all(isinstance(v, _SCALARS) for v in value):
                raise TypeError
            value = list(value)
    except (TypeError, ValueError, OverflowError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{key}: value {value!r} is not a valid {origin.__name__}") from None
    choices, lo, hi, gt = meta.get("choices"), meta.get("lo"), meta.get("hi"), meta.get("gt")
    if choices is not None and value not in choices:
        raise ConfigError(f"{key}: value {value!r} is not allowed; choose one of {list(choices)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{key}: value {value!r} is not a finite number; {_range_text(lo, hi, gt)}")
    if lo is not None and value < lo:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be >= {lo}")
    if hi is not None and value > hi:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be <= {hi}")
    if gt is not None and not value > gt:
        raise ConfigError(f"{key}: value {value!r} is out of range; must be > {gt}")
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _walk(cfg, dotted: str):
    """Resolve a dotted key → (owner dataclass, field, its type, entry name or None for ``reward.weights.<name>``).
    Unknown keys fail with a did-you-mean hint."""
    parts = dotted.split(".")
    obj, path = cfg, []
    for i, part in enumerate(parts):
        names = [f.name for f in dataclasses.fields(obj)]
        if part not in names:
            where = ".".join(path) or "the top level"
            full = ".".join(path + [part])
            raise ConfigError(f"unknown config key {full!r}{suggest(part, names)}; keys under {where}: {names}")
        path.append(part)
        fld = next(f for f in dataclasses.fields(obj) if f.name == part)
        tp = _hints(type(obj))[part]
        if i == len(parts) - 1:
            return obj, fld, tp, None
        child = getattr(obj, part)
        if isinstance(child, dict) and i == len(parts) - 2:  # reward.weights.<name>
            return obj, fld, tp, parts[-1]
        if not dataclasses.is_dataclass(child):
            raise ConfigError(f"unknown config key {dotted!r}: {'.'.join(path)} is not a section")
        obj = child


def set_path(cfg, dotted: str, value) -> None:
    """Set ``a.b=value`` on nested dataclasses, with type/range checks and did-you-mean on unknown keys.
    A mapping given for a section sets each of its keys by its full dotted name."""
    obj, fld, tp, entry = _walk(cfg, dotted)
    if entry is not None:  # reward.weights.<name>=value
        key = dotted[: -len(entry) - 1]
        setattr(obj, fld.name, _coerce(key, {**getattr(obj, fld.name), entry: value}, tp, fld.metadata))
    elif dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{dotted}: is a section; set its keys (e.g. {dotted}.<key>=...)")
        for k, v in value.items():
            set_path(cfg, f"{dotted}.{k}", v)
    else:
        setattr(obj, fld.name, _coerce(dotted, value, tp, fld.metadata))


def from_dict(cls, data: dict):
    """Build ``cls`` from a nested mapping with the same checks as overrides."""
    cfg = cls()
    for k, v in (data or {}).items():
        set_path(cfg, str(k), v)
    return cfg


def _check_fields(obj, prefix: str = "") -> None:
    """Re-apply every field's type, choice, range and finiteness check to a dataclass as it is (values set in
    Python skip ``set_path``); stores the coerced value, e.g. an int learning rate as a float."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        key, tp, value = prefix + f.name, hints[f.name], getattr(obj, f.name)
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, tp):
                raise ConfigError(f"{key}: value {value!r} is not a section; it must be a {tp.__name__}")
            _check_fields(value, key + ".")
        else:
            setattr(obj, f.name, _coerce(key, value, tp, f.metadata))


def validate(cfg: RunConfig) -> None:
    """Every per-field check again (types, choices, ranges, finiteness: a config may have been built or edited in
    Python), then the checks that span fields or look at this machine. Raises ConfigError before anything loads."""
    if not isinstance(cfg, RunConfig):
        raise ConfigError(f"config: value of type {type(cfg).__name__} is not a RunConfig")
    _check_fields(cfg)
    family = MODEL_FAMILIES[cfg.model.name]
    _validate_family(cfg, family)
    t = cfg.train
    if t.prompts_per_batch * t.group_size > MAX_SAMPLES_PER_ITERATION:
        raise ConfigError(f"train.prompts_per_batch: value {t.prompts_per_batch} is out of range with "
                          f"train.group_size={t.group_size} ({t.prompts_per_batch * t.group_size} samples per "
                          f"iteration); prompts_per_batch × group_size must be <= {MAX_SAMPLES_PER_ITERATION}")
    if not t.prompt_column.strip():
        raise ConfigError("train.prompt_column: value '' is empty; name the prompt field (default 'prompt')")
    for key in ("train.prompts_file", "eval.prompts_file"):
        sec, name = key.split(".")
        spec = getattr(getattr(cfg, sec), name)
        if spec:  # exists, is UTF-8, parses, has the prompt column and at least one prompt (see check_prompts)
            check_prompts(spec, key=key, column=t.prompt_column)
    _validate_device(cfg.model.device)
    _validate_dist(cfg.dist.mode)
    _validate_logging(cfg.log)
    held_out = guards.check_config(cfg, family)  # eval.guard_*, train.keep_best
    if family == "flow":
        _validate_flow(cfg)
        check_rewards({**cfg.reward.weights, **held_out}, cfg.reward.options, model_name=cfg.model.name)
    else:
        if cfg.advantage.per_reward_norm:
            raise ConfigError("advantage.per_reward_norm: applies to a flow model's weighted sum of reward.weights; a "
                              "masked diffusion LM is scored by its task's one verifier reward (remove the key)")
        _validate_dllm(cfg)
        _validate_dllm_methods(cfg)
    _validate_memory(cfg)


def _validate_memory(cfg: RunConfig) -> None:
    """Mixed precision and FSDP2 memory options that cannot work together."""
    m, d = cfg.model, cfg.dist
    if m.mixed_precision == "fp16" and m.dtype == "float16":
        raise ConfigError("model.mixed_precision: value 'fp16' needs float32 weights (model.dtype=float32): the "
                          "gradient scaler cannot unscale float16 gradients; or use model.mixed_precision=bf16")
    if m.mixed_precision == "fp16" and d.mode == "fsdp2":
        raise ConfigError("model.mixed_precision: value 'fp16' is not supported with dist.mode=fsdp2 (the gradient "
                          "scaler's inf check is per rank); use dist.fsdp_param_dtype=bfloat16")
    for key in ("fsdp_param_dtype", "fsdp_cpu_offload"):
        if getattr(d, key) != getattr(DistConfig(), key) and d.mode != "fsdp2":
            raise ConfigError(f"dist.{key}: applies only to dist.mode=fsdp2 (dist.mode={d.mode}); set "
                              f"dist.mode=fsdp2 or remove it")


def _validate_dist(mode: str) -> None:
    """dist.mode=none under a launcher that started several processes would run each as an independent rank-0 run
    (same outputs, N-fold work): refused before the process group or any model exists."""
    world = launched_world_size()
    if mode == "none" and world > 1:
        raise ConfigError(f"dist.mode: value 'none' with WORLD_SIZE={world} (torchrun) would run {world} independent "
                          "copies of the same run; set dist.mode=ddp or dist.mode=fsdp2 (or leave it auto), or launch "
                          "without torchrun")


def _validate_device(value: str) -> None:
    """model.device must name a device this machine has: auto, cpu, cuda / cuda:N (N < the GPU count) or mps."""
    allowed = "choose 'cpu', 'cuda', 'cuda:N' or 'mps', or 'auto' (the accelerator when there is one)"
    if value == "auto":  # resolved by the Trainer (distributed.resolve_device) to a device this machine has
        return
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        raise ConfigError(f"model.device: value {value!r} is not a torch device; {allowed}") from None
    if dev.type == "cpu":
        return
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"model.device: value {value!r} is not available: torch.cuda.is_available() is false "
                              f"(no GPU, no driver, or a CPU-only torch build); use model.device=cpu")
        n = torch.cuda.device_count()
        if dev.index is not None and dev.index >= n:
            raise ConfigError(f"model.device: value {value!r} is out of range; this machine has {n} CUDA "
                              f"device(s): cuda:0 .. cuda:{n - 1}")
        return
    if dev.type == "mps":
        if not torch.backends.mps.is_available():
            raise ConfigError(f"model.device: value {value!r} is not available: torch.backends.mps.is_available() "
                              f"is false; use model.device=cpu")
        return
    raise ConfigError(f"model.device: value {value!r} is not supported; {allowed}")


def _importable(name: str) -> bool:
    """Whether ``import name`` can find the module (without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _validate_logging(log: "LogConfig") -> None:
    if log.wandb and not _importable("wandb"):
        raise ConfigError("log.wandb: value True needs the wandb package, which is not installed; pip install wandb, "
                          "or set log.wandb=false")
    if log.tensorboard and not _importable("tensorboard"):  # runlog writes with torch.utils.tensorboard
        raise ConfigError("log.tensorboard: value True needs the tensorboard package (torch.utils.tensorboard writes "
                          "with it), which is not installed; pip install 'diffgrpo[tensorboard]', or set "
                          "log.tensorboard=false")
    if log.output_dir:
        _validate_output_dir(log.output_dir)


def _validate_output_dir(value: str) -> None:
    """The run directory must be a directory we can write in, or creatable under one."""
    key = "log.output_dir"
    try:
        p = Path(value)
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"{key}: value {value!r} is an existing file, not a directory; choose a directory "
                                  f"path")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"{key}: value {value!r} is not writable (no write permission); choose a "
                                  f"directory you can write to")
            return
        parent = p.absolute().parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise ConfigError(f"{key}: value {value!r} cannot be created: {str(parent)!r} is a file; choose a "
                              f"directory path")
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ConfigError(f"{key}: value {value!r} cannot be created: no write permission in {str(parent)!r}; "
                              f"choose a directory you can write to")
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{key}: value {value!r} is not a usable path ({_one_line(e)})") from None


@functools.lru_cache(maxsize=None)
def _answer_tokens(task_name: str) -> int:
    """Tokens (built-in character vocabulary) of the task's longest reference answer, over both splits."""
    task = get_task(task_name)
    return max(len(VOCAB.encode(e.answer)) for split in ("train", "test") for e in task.instances(split))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _validate_dllm(cfg: RunConfig) -> None:
    """Masked-LM sizes, with the sampler's rules (samplers/masked.py:schedule) on the effective values
    gen_length or the task's default, block_length or gen_length, diffusion_steps or gen_length."""
    d = cfg.dllm
    if cfg.model.name == "hf_masked_lm" and not d.model_path:
        raise ConfigError("dllm.model_path: required for model.name=hf_masked_lm (a local model directory or hub id)")
    task = get_task(d.task)
    _validate_dllm_scale(cfg, task)
    if d.data_file:
        examples = examples_from_file(d.data_file, task, prompt_field=d.prompt_field, answer_field=d.answer_field)
        if cfg.model.name == "tiny_mlm":  # the built-in character vocabulary and its prompt positions
            for i, ex in enumerate(examples, 1):
                try:
                    n = len(VOCAB.encode(ex.prompt))
                except ValueError as e:
                    raise ConfigError(f"dllm.data_file: record {i}: the prompt {ex.prompt!r} cannot be written in "
                                      f"the built-in vocabulary ({e})") from None
                if n > task.prompt_length:
                    raise ConfigError(f"dllm.data_file: record {i}: the prompt {ex.prompt!r} has {n} tokens; the "
                                      f"built-in tiny_mlm for dllm.task={d.task} reads at most {task.prompt_length}")
    if cfg.model.name == "tiny_mlm" and d.gen_length:
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
    block = d.block_length or gen
    if gen % block:
        raise ConfigError(f"dllm.block_length: value {d.block_length} does not divide the generation length {gen} "
                          f"({src}); choose one of {_divisors(gen)} or 0 (one block)")
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


def _validate_dllm_scale(cfg: RunConfig, task) -> None:
    """File tasks, held-out files, chat templates and the LoRA / dtype / sharding combinations of masked LMs."""
    d = cfg.dllm
    if d.task in FILE_TASKS:
        if not d.data_file:
            raise ConfigError(f"dllm.data_file: required for dllm.task={d.task} (it has no generator): a .jsonl file "
                              f"or hf:<dataset>[:<split>] with fields {d.prompt_field!r} and {d.answer_field!r}")
        if cfg.model.name != "hf_masked_lm":
            raise ConfigError(f"dllm.task: value {d.task!r} needs model.name=hf_masked_lm (the built-in tiny_mlm "
                              f"only knows {sorted(TASKS)})")
    if d.eval_file:
        examples_from_file(d.eval_file, task, key="dllm.eval_file", prompt_field=d.prompt_field,
                           answer_field=d.answer_field)
    if cfg.model.name == "tiny_mlm":
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


def _validate_dllm_methods(cfg: RunConfig) -> None:
    """The base methods' own rules: wd1 keeps groups on one rank; SPG has no KL term and no SML plug-in, its
    masking block divides the completion and t_min <= t_max."""
    d = cfg.dllm
    if d.method == "wd1" and cfg.dist.group_layout == "spread" and cfg.dist.mode != "none":
        raise ConfigError("dist.group_layout: value 'spread' is not allowed with dllm.method=wd1 (its group softmax "
                          "needs each group's samples on one rank); must be 'local'")
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


# Keys each family reads (a section name covers all its keys); any other key set to a non-default value is refused.
_SHARED = ("seed", "model.name", "model.device", "model.cache_dir", "pretrain.steps", "pretrain.batch_size",
           "pretrain.lr", "pretrain.seed", "advantage", "loss.beta", "loss.aggregation", "engine.micro_batch_size",
           "train.num_iterations", "train.prompts_per_batch", "train.group_size", "train.lr", "train.lr_schedule",
           "train.warmup_iterations", "train.weight_decay",
           "train.adam_beta1", "train.adam_beta2", "train.max_grad_norm", "train.num_inner_epochs", "train.save_every",
           "train.keep_checkpoints", "train.ema_decay", "train.max_bad_updates", "eval.every", "eval.seed", "log",
           "dist", "train.checkpoint_format", "eval.guard_rewards", "train.on_hacking", "train.guard_max_fid_ratio",
           "train.guard_max_drift", "train.guard_min_diversity_ratio", "train.guard_max_reward_drop", "train.keep_best")
FAMILY_KEYS = {
    "flow": _SHARED + ("model.guidance_scale", "model.image_size", "model.patch_size", "model.num_layers",
                       "model.num_heads", "model.head_dim", "model.text_dim", "model.pretrained", "model.family",
                       "model.dtype", "model.mixed_precision", "model.resolution", "model.num_frames",
                       "model.negative_prompt", "model.max_sequence_length", "model.lora_rank", "model.lora_alpha",
                       "model.lora_target_modules", "model.gradient_checkpointing", "pretrain.cond_dropout",
                       "sampler", "reward", "loss.clip_range", "loss.kl_flowgrpo_compat", "steps", "engine",
                       "loss.trust_region", "loss.kl_mask_bound", "loss.ratio_norm",
                       "train.digits", "train.prompts_file", "train.prompt_column", "eval",
                       "model.offload_text_encoders"),
    "dllm": _SHARED + ("pretrain.answer_noise", "dllm", "daca"),
}
# engine keys that only some engines read
ENGINE_KEYS = {"window": ("jagg",), "jagg_frac": ("jagg",), "jagg_min_score": ("jagg",),
               "evaluation": ("jagg", "single_step"), "wave_size": ("retain",),
               "candidate_steps": ("single_step",), "rectify": ("single_step",),
               "forward_timesteps": ("nft", "awm"), "forward_rollout": ("nft", "awm"), "adv_clip": ("nft", "awm"),
               "nft_beta": ("nft",), "old_decay_rate": ("nft",), "old_decay_max": ("nft",),
               "awm_weighting": ("awm",), "awm_clip_range": ("awm",)}


def _changed_keys(obj, default, prefix: str = "") -> list[str]:
    """Dotted keys whose value in ``obj`` differs from ``default`` (nested dataclasses)."""
    out = []
    for f in dataclasses.fields(obj):
        a, b = getattr(obj, f.name), getattr(default, f.name)
        key = prefix + f.name
        if dataclasses.is_dataclass(a):
            out += _changed_keys(a, b, key + ".")
        elif a != b:
            out.append(key)
    return out


def _validate_family(cfg: RunConfig, family: str) -> None:
    """A key set to a non-default value that the chosen model family never reads is an error, not a no-op."""
    allowed = FAMILY_KEYS[family]
    for key in _changed_keys(cfg, RunConfig()):
        if not any(key == a or key.startswith(a + ".") for a in allowed):
            what = ("flow-matching models (model.name in ['tiny', 'diffusers'])" if family != "flow" else
                    "masked diffusion LMs (model.name in ['tiny_mlm', 'hf_masked_lm'])")
            raise ConfigError(f"{key}: does not apply to model.name={cfg.model.name} (the {family} family); it is "
                              f"read only for {what}; remove it")


def _split_plugin(name: str) -> tuple[str, str, str]:
    """``package.module:attr`` → (module, attr, problem); problem is empty when the form is well made."""
    mod, _, attr = name.partition(":")
    if not mod:
        return mod, attr, "the module name is empty"
    if not all(part.isidentifier() for part in mod.split(".")):
        return mod, attr, f"{mod!r} is not a dotted module name"
    if not attr.isidentifier():
        return mod, attr, f"{attr!r} is not a Python name"
    return mod, attr, ""


def _validate_engine_name(name: str) -> None:
    allowed = f"choose one of {sorted(ENGINES)} or an importable module:Class"
    if name in ENGINES:
        return
    if ":" not in name:
        raise ConfigError(f"engine.name: value {name!r} is not a registered engine{suggest(name, list(ENGINES))}; "
                          f"{allowed}")
    mod, attr, problem = _split_plugin(name)
    if problem:
        raise ConfigError(f"engine.name: value {name!r} is not a valid module:Class ({problem}); {allowed}")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except Exception as e:  # noqa: BLE001 - anything the user's module raises on import
        raise ConfigError(f"engine.name: value {name!r} cannot be imported ({type(e).__name__}: {_one_line(e)}); "
                          f"{allowed}") from None
    if not inspect.isclass(obj):
        raise ConfigError(f"engine.name: value {name!r} is not a class (it is a {type(obj).__name__}); {allowed}")


def _validate_reward_name(name: str) -> None:
    if name not in REWARDS and ":" in name:
        _, _, problem = _split_plugin(name)
        if problem:
            raise ConfigError(f"reward.weights: reward {name!r} is not a valid module:function ({problem}); choose "
                              f"one of {sorted(REWARDS)} or package.module:function")
    try:
        resolve_reward(name)  # raises ConfigError for unknown names and failed imports
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - anything the user's module raises on import
        raise ConfigError(f"reward.weights: cannot import reward {name!r} ({type(e).__name__}: {_one_line(e)})"
                          ) from None


def _validate_flow(cfg: RunConfig) -> None:
    _validate_engine_name(cfg.engine.name)
    if not cfg.reward.weights:
        raise ConfigError("reward.weights: at least one reward is required, e.g. reward.weights={digit_alignment: 1.0}")
    for name in cfg.reward.weights:  # each weight is a finite number (checked with the field)
        _validate_reward_name(str(name))
    bad = [d for d in cfg.train.digits if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 9)]
    if bad or not cfg.train.digits:
        raise ConfigError(f"train.digits: value {cfg.train.digits!r} must be a non-empty list of digits 0..9")
    if cfg.sampler.sde_type == "ode" and cfg.engine.name not in FORWARD_ENGINES:
        raise ConfigError("sampler.sde_type: 'ode' has no exploration noise and cannot be trained; "
                          "choose one of ['flow_sde', 'dance_sde', 'cps'] (eval.sde_type may be 'ode'), or a "
                          f"forward-process engine (engine.name in {list(FORWARD_ENGINES)})")
    if cfg.sampler.num_steps < 2:
        raise ConfigError("sampler.num_steps: must be >= 2 (the final step is deterministic and never trained)")
    k_max = cfg.sampler.num_steps - 1
    size = min(cfg.steps.window_size, k_max)
    if cfg.steps.window_start > k_max - size:  # a start no window can use, whatever steps.mode
        raise ConfigError(f"steps.window_start: value {cfg.steps.window_start} is out of range; a window of {size} "
                          f"steps (steps.window_size={cfg.steps.window_size}) must end within the {k_max} trainable "
                          f"steps of sampler.num_steps={cfg.sampler.num_steps}: must be <= {k_max - size} "
                          f"(or -1: a random start per sample)")
    if cfg.model.name == "diffusers" and not cfg.model.pretrained:
        raise ConfigError("model.pretrained: required for model.name=diffusers (a local pipeline directory or hub id)")
    _validate_engine(cfg)
    pre = cfg.model.pretrained
    if pre and pre.startswith(("/", "./", "../", "~")) and not _exists(Path(pre).expanduser()):
        raise ConfigError(f"model.pretrained: path {pre!r} does not exist (give a pipeline directory or a hub id)")
    if cfg.model.family == "flux" and (cfg.model.negative_prompt or cfg.model.guidance_scale < 1.0):
        raise ConfigError("model.negative_prompt: FLUX is guidance-distilled (model.guidance_scale feeds its guidance "
                          "embedding, one forward); negative prompts and true CFG do not apply")
    if cfg.model.image_size % cfg.model.patch_size:
        raise ConfigError(f"model.patch_size: {cfg.model.patch_size} must divide model.image_size={cfg.model.image_size}")
    _validate_rollout_savings(cfg)
    if cfg.reward.background and cfg.sampler.batch_size == 0:
        raise ConfigError("reward.background: value True needs sampling micro-batches to overlap with; set "
                          "sampler.batch_size > 0 (e.g. a quarter of the batch), or reward.background=false")


def _validate_rollout_savings(cfg: RunConfig) -> None:
    """The sliding SDE window needs a fixed window to slide (steps.mode=window, steps.window_start >= 0)."""
    s = cfg.steps
    if s.window_shift_every > 0 and (s.mode != "window" or s.window_start < 0):
        raise ConfigError(f"steps.window_shift_every: value {s.window_shift_every} needs steps.mode=window with "
                          f"steps.window_start >= 0 (got steps.mode={s.mode}, window_start={s.window_start}); "
                          "or set it to 0")


def selected_per_trajectory(cfg: RunConfig) -> int:
    """How many steps ``steps.*`` selects per trajectory (the final step is never trained)."""
    k_max = cfg.sampler.num_steps - 1
    if cfg.steps.mode == "all":
        return k_max
    if cfg.steps.mode == "window":
        return min(cfg.steps.window_size, k_max)
    return max(1, min(k_max, math.ceil(cfg.steps.fraction * k_max - 1e-9)))


def _validate_engine(cfg: RunConfig) -> None:
    e = cfg.engine
    default = EngineConfig()
    for key, users in ENGINE_KEYS.items():
        if getattr(e, key) != getattr(default, key) and e.name in ENGINES and e.name not in users:
            raise ConfigError(f"engine.{key}: does not apply to engine.name={e.name}; it is read only by "
                              f"{list(users)}; remove it")
    if e.name == "jagg":
        n = selected_per_trajectory(cfg)
        if e.window > n:
            raise ConfigError(f"engine.window: W={e.window} is larger than the {n} steps selected per trajectory "
                              f"(steps.mode={cfg.steps.mode}, sampler.num_steps={cfg.sampler.num_steps}); "
                              f"choose 2 <= W <= {n}")
    _validate_forward_engine(cfg)
    _validate_loss_options(cfg)
    if e.wave_size and cfg.advantage.std_mode == "global":
        raise ConfigError("engine.wave_size: rollout waves need per-group advantages; advantage.std_mode=global "
                          "couples every group, so use engine.wave_size=0 (whole batch) or std_mode=group")


def _validate_forward_engine(cfg: RunConfig) -> None:
    """nft / awm own their training units: the step-selection and step-ratio keys do not apply to them."""
    e = cfg.engine
    if e.name not in FORWARD_ENGINES:
        return
    default = RunConfig()
    for key in _changed_keys(cfg.steps, default.steps, "steps.") + [
            k for k in ("loss.clip_range", "loss.kl_flowgrpo_compat", "loss.trust_region", "loss.kl_mask_bound",
                        "loss.ratio_norm")
            if getattr(cfg.loss, k.split(".")[1]) != getattr(default.loss, k.split(".")[1])]:
        alt = {"loss.clip_range": "; awm's ratio clip is engine.awm_clip_range"}.get(key, "")
        raise ConfigError(f"{key}: does not apply to engine.name={e.name} (a forward-process engine trains "
                          f"engine.forward_timesteps units per clean sample, not sampler steps){alt}; remove it")
    T = cfg.sampler.num_steps
    if e.forward_timesteps > T:
        raise ConfigError(f"engine.forward_timesteps: value {e.forward_timesteps} is out of range; at most one unit "
                          f"per grid time: must be <= sampler.num_steps={T} (0 = the paper's recipe)")


def _validate_loss_options(cfg: RunConfig) -> None:
    """The trust-region options of the flow step loss (losses.policy_loss): which combinations make sense."""
    lo, d = cfg.loss, LossConfig()
    if lo.trust_region == "clip" and lo.kl_mask_bound != d.kl_mask_bound:
        raise ConfigError("loss.kl_mask_bound: applies only with loss.trust_region=kl_mask; set it or remove the bound")
    if lo.trust_region == "kl_mask" and lo.ratio_norm:
        raise ConfigError("loss.ratio_norm: normalises the ratio the PPO clip acts on; it does not combine with "
                          "loss.trust_region=kl_mask (use one of them)")
    if lo.trust_region == "kl_mask" and lo.clip_range != d.clip_range:
        raise ConfigError("loss.clip_range: does not apply with loss.trust_region=kl_mask (the KL mask replaces the "
                          "clip); remove it or set loss.trust_region=clip")
    if (lo.trust_region != "clip" or lo.ratio_norm) and cfg.sampler.cps_flowgrpo_compat:
        raise ConfigError("loss.trust_region / loss.ratio_norm: need a Gaussian log-density; "
                          "sampler.cps_flowgrpo_compat=true scores with FlowGRPO's pseudo log-prob (set it to false)")
    if lo.ratio_norm and cfg.engine.name == "reweight":
        raise ConfigError("loss.ratio_norm: engine.name=reweight forms the first update from r = 1 without the step "
                          "loss; use recompute, retain, jagg or single_step with the normalised ratio")
