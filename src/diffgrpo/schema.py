"""The run configuration's sections: one dataclass per component (model, sampler, reward, engine, train, ...), each
field with its type, default, allowed values, range, doc and the family that reads it (``_f``), and the tables the
schema is read with (renamed keys, model name → family, each built-in task's defaults). :mod:`diffgrpo.config`
composes them into ``RunConfig`` and parses into them; this module imports nothing of the package."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

# Plausibility bound: samples drawn per iteration (train.prompts_per_batch × train.group_size, all ranks together).
# Far above any real run (FlowGRPO: 48 × 24 = 1152 per node), far below what would exhaust memory before failing.
MAX_SAMPLES_PER_ITERATION = 65536

def _f(default, *, choices=None, lo=None, hi=None, gt=None, path=False, doc="", family=None, **kw):
    """A dataclass field carrying validation metadata (choices, inclusive bounds ``lo``/``hi``, exclusive lower
    bound ``gt``, ``path``: a file-system path whose leading ``~`` is expanded), a doc string and ``family``: the
    model family that reads the key ('flow', 'dllm' or 'any'; None = the section's ``FAMILY``)."""
    meta = {"choices": choices, "lo": lo, "hi": hi, "gt": gt, "path": path, "doc": doc, "family": family}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


# keys that were renamed: the old name is refused with the new one (command line and YAML alike)
RENAMED = {"model.family": "model.pipeline"}
# model.name → family (a key of ``families.FAMILIES``): which family trains the policy
MODEL_FAMILIES = {"tiny": "flow", "diffusers": "flow", "tiny_mlm": "dllm", "tiny_block": "dllm", "hf_masked_lm": "dllm"}
# what each family trains, as error messages name it
FAMILY_TITLES = {"flow": "flow-matching models", "dllm": "masked diffusion LMs"}
# train.task → the keys it sets where a config leaves them at their defaults (the digits task's values)
TASK_DEFAULTS: dict[str, dict[str, Any]] = {
    "digits": {},
    "shapes": {"model.image_size": 32, "model.patch_size": 8, "model.num_layers": 3, "model.head_dim": 32,
               "pretrain.batch_size": 64, "pretrain.steps": 2400, "pretrain.lr": 1e-3,
               "train.prompts_file": "builtin:shapes/train", "eval.prompts_file": "builtin:shapes/test",
               "reward.weights": {"shapes_correct": 1.0, "shapes_score": 0.0},
               "eval.guard_rewards": ["shapes_correct", "shapes_score"],  # the one not trained on stays
               "train.guard_distance": "kid",  # FID's 1.5x: 11 % false alarms at the start, KID's 0 % (guard_noise)
               # DiffusionNFT on a rank-16 LoRA: a held-out gain inside every guard in 3 of 3 seeds; full fine-tunes
               # collapse colour and texture (KID) first (docs/shapes.md)
               "engine.name": "nft", "model.lora_rank": 16, "train.lr": 5e-4, "train.num_iterations": 60},
    "shapes_video": {"model.image_size": 32, "model.num_frames": 4, "model.patch_size": 8, "model.num_layers": 3,
                     "model.head_dim": 32, "pretrain.batch_size": 32, "train.prompts_file": "builtin:shapes_video/train",
                     "eval.prompts_file": "builtin:shapes_video/test", "eval.guard_rewards": ["shapes_video_correct"],
                     "reward.weights": {"shapes_video_score": 1.0, "shapes_video_correct": 0.0}},
}


@dataclass
class ModelConfig:
    FAMILY: ClassVar[str] = "flow"
    name: str = _f("tiny", choices=("tiny", "tiny_mlm", "tiny_block", "hf_masked_lm", "diffusers"),
                   doc="policy adapter: tiny (flow), diffusers (SD3/FLUX/Wan/Qwen-Image pipeline at model.pretrained), "
                       "tiny_mlm / tiny_block (block-causal) / hf_masked_lm (masked diffusion LM, see dllm.*)",
                   family="any")
    guidance_scale: float = _f(1.0, lo=0.0, doc="classifier-free guidance scale; 1 = no CFG (one forward)")
    device: str = _f("auto", doc="torch device for the policy: auto (cuda:<LOCAL_RANK> / cuda, else mps, else cpu), "
                                 "cpu, cuda, cuda:N or mps (must exist on this machine)", family="any")
    cpu_threads: int = _f(0, lo=0, hi=1024, doc="torch CPU threads set by the command line; 0 = auto (1 for the built-in "
                                                "models on a CPU, torch's default otherwise); OMP_NUM_THREADS wins",
                          family="any")
    cache_dir: str = _f("", path=True, doc="where pretrained built-in models live (default $DIFFGRPO_CACHE or ~/.cache/diffgrpo)", family="any")
    # built-in tiny model architecture (a real diffusers SD3Transformer2DModel at tiny size)
    image_size: int = _f(16, choices=(8, 16, 32), doc="tiny model: image side in pixels")
    patch_size: int = _f(2, choices=(1, 2, 4, 8), doc="tiny model: transformer patch size")
    num_layers: int = _f(2, lo=1, hi=24, doc="tiny model: transformer blocks")
    num_heads: int = _f(4, lo=1, hi=32, doc="tiny model: attention heads")
    head_dim: int = _f(16, lo=4, hi=256, doc="tiny model: channels per head")
    text_dim: int = _f(32, lo=4, hi=1024, doc="tiny model: prompt-encoder width")
    # diffusers pipelines (model.name=diffusers); guidance_scale is true CFG, or FLUX's distilled guidance value
    pretrained: str = _f("", path=True, doc="diffusers: local pipeline directory or hub id")
    pipeline: str = _f("auto", choices=("auto", "sd3", "flux", "wan", "qwenimage", "zimage", "flux2", "flux2_klein",
                                        "qwenimage_edit", "qwenimage_edit_plus", "flux_kontext", "qwenimage21",
                                        "hunyuanvideo15", "ltx2"),
                       doc="diffusers: the pipeline's architecture (a row of models.pipelines.PIPELINES); auto = from "
                           "the pipeline and transformer classes")
    dtype: str = _f("float32", choices=("float32", "bfloat16", "float16"), doc="diffusers: weight dtype of the pipeline")
    mixed_precision: str = _f("no", choices=("no", "bf16", "fp16"),
                              doc="tiny, diffusers: autocast of the transformer forward")
    resolution: int = _f(512, lo=16, doc="diffusers: image side in pixels")
    num_frames: int = _f(33, lo=1, doc="diffusers (wan): video frames")
    negative_prompt: str = _f("", doc="diffusers: negative prompt of true CFG")
    max_sequence_length: int = _f(0, lo=0, doc="diffusers: text tokens; 0 = the family's pipeline default")
    train_experts: str = _f("both", choices=("both", "high", "low"),
                            doc="diffusers (Wan 2.2 A14B): experts trained (high: transformer, low: transformer_2)")
    guidance_scale_low: float = _f(0.0, lo=0.0, doc="diffusers (Wan 2.2 A14B): CFG scale of the low-noise expert "
                                                    "(the pipeline's guidance_scale_2); 0 = model.guidance_scale")
    # LoRA (peft) for the flow models (model.name=tiny or diffusers); the KL reference is the base (adapter off)
    lora_rank: int = _f(0, lo=0, doc="tiny, diffusers: LoRA rank (train a peft adapter only); 0 = full fine-tune")
    lora_alpha: float = _f(0.0, lo=0.0, doc="tiny, diffusers: LoRA alpha; 0 = lora_rank")
    lora_target_modules: str = _f("", doc="tiny, diffusers: comma-separated LoRA targets; empty = the attention "
                                          "projections (the family's defaults; tiny: SD3's)")
    gradient_checkpointing: bool = _f(False, doc="tiny, diffusers: activation checkpointing in the transformer")
    compile: bool = _f(False, doc="tiny, diffusers: regional torch.compile, each transformer block compiled once with "
                                  "static shapes (diffgrpo.models.regional_compile), for sampling and training")
    compile_backend: str = _f("inductor", choices=("inductor", "aot_eager", "eager"),
                              doc="model.compile: the torch.compile backend")
    offload_text_encoders: bool = _f(True, doc="diffusers: keep the text encoders on the CPU and move them to the "
                                               "device only to encode prompts not yet cached (each prompt is "
                                               "encoded once)")


@dataclass
class PretrainConfig:
    steps: int = _f(800, lo=1, doc="flow-matching pretraining steps for the built-in model")
    batch_size: int = _f(128, lo=1, hi=MAX_SAMPLES_PER_ITERATION)
    lr: float = _f(2e-3, lo=0.0)
    cond_dropout: float = _f(0.1, lo=0.0, hi=1.0, doc="probability of the null prompt (enables CFG)", family="flow")
    seed: int = _f(0)
    answer_noise: float = _f(0.4, lo=0.0, hi=1.0,
                             doc="tiny dLLM only: fraction of pretraining answers replaced by the task's systematic "
                                 "slip (off by one, swapped digits): a base with a habit a verifier can train away", family="dllm")


@dataclass
class SamplerConfig:
    FAMILY: ClassVar[str] = "flow"
    sde_type: str = _f("flow_sde", choices=("flow_sde", "dance_sde", "flash_sde", "cps", "ode"))
    noise_level: float = _f(0.7, lo=0.0, doc="a (flow_sde, flash_sde, cps) or eta (dance_sde)")
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
    FAMILY: ClassVar[str] = "flow"
    weights: dict = _f({"digit_alignment": 1.0}, doc="reward name (or module:function) -> weight; masked LMs: "
                       "rewards added to the task's verifier, whose own weight is the name 'task' (default 1)",
                       family="any")
    options: dict[str, dict] = _f({}, doc="per-reward options, e.g. {pickscore: {model: <hub id or path>, dtype: "
                                          "bfloat16, batch_size: 16, device: cuda:1}} (see README, Rewards)",
                                  family="any")
    background: bool = _f(False, doc="score each sampling micro-batch (sampler.batch_size) in a worker thread while "
                                     "the next one samples (FlowGRPO's overlap); the samples and rewards equal "
                                     "background=false's. Needs sampler.batch_size > 0; engines that keep rollout "
                                     "graphs (retain, reweight, evaluation=retain) score after sampling")
    timeout: float = _f(3600.0, lo=0.0, doc="seconds one call of one reward (or guard reward) may take; a longer "
                                             "one stops the run with a one-line error (a hung call is left in a "
                                             "daemon thread, so it never blocks the exit); 0: no limit. Masked LMs: "
                                             "reward.weights and eval.guard_rewards (the task's own verifier keeps "
                                             "dllm.sandbox_timeout and math_verify's limits)", family="any")


@dataclass
class AdvantageConfig:
    std_mode: str = _f("group", choices=("group", "global", "none"))
    baseline: str = _f("mean", choices=("mean", "leave_one_out"))
    clip: float = _f(5.0, lo=0.0)
    eps: float = _f(1e-4, lo=0.0)
    filter_zero_std: bool = _f(False, doc="drop groups whose rewards are all equal from the loss")
    std: str = _f("unbiased", choices=("unbiased", "population"),
                  doc="the std estimate: n−1 (torch.std, TRL) or n (np.std: FlowGRPO / DiffusionNFT / AWM's "
                      "per-prompt trackers; advantages larger by √(n/(n−1)))")
    per_reward_norm: bool = _f(False, doc="flow, several rewards: normalise each reward within its group on its own, "
                                          "sum with reward.weights, divide by the sum's batch std (GDPO-style)",
                               family="flow")


@dataclass
class LossConfig:
    FAMILY: ClassVar[str] = "flow"
    clip_range: float = _f(1e-4, lo=0.0, doc="PPO clip ε on the step ratio")
    beta: float = _f(0.0, lo=0.0, doc="KL coefficient", family="any")
    kl_flowgrpo_compat: bool = _f(False, doc="FlowGRPO's KL scaling (omits Δ)")
    aggregation: str = _f("mean", choices=("mean", "sample_mean", "sum"), family="any")
    trust_region: str = _f("clip", choices=("clip", "kl_mask"),
                           doc="flow: PPO ratio clip, or Flow-DPPO's mask on the exact per-step Gaussian KL to the "
                               "rollout policy (a step is dropped when KL >= kl_mask_bound and it moves away)")
    kl_mask_bound: float = _f(1e-5, lo=0.0, doc="flow, trust_region=kl_mask: the KL bound (mean-reduced over "
                                                 "latent elements with sampler.logprob_reduce=mean)")
    ratio_norm: bool = _f(False, doc="flow: GRPO-Guard's ratio normalisation, r = exp(s·(log r + KL)) under the clip")


@dataclass
class StepsConfig:
    FAMILY: ClassVar[str] = "flow"
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
    FAMILY: ClassVar[str] = "flow"
    name: str = _f("recompute", doc="gradient engine (registry key in diffgrpo.engines.ENGINES)")
    micro_batch_size: int = _f(0, lo=0, doc="samples per forward/backward chunk; 0 = all at once", family="any")
    # engine-specific knobs (documented with each engine)
    window: int = _f(4, lo=2, doc="jagg: steps per window W")
    jagg_frac: float = _f(1.0, lo=0.0, hi=1.0, doc="jagg: share of windows routed to JAGG")
    jagg_min_score: float = _f(-1.0, lo=-1.0, hi=1.0, doc="jagg: windows scoring below stay exact")
    evaluation: str = _f("recompute", choices=("recompute", "retain"),
                         doc="jagg, single_step: trained velocities from a recompute forward or rollout graphs")
    wave_size: int = _f(0, lo=0, doc="retain: groups per rollout wave; 0 = whole batch")
    candidate_steps: str = _f("first_half", doc="single_step: 'first_half', 'all' or a list like 0,1,2")
    rectify: bool = _f(True, doc="single_step: temporal gradient rectification")
    # forward-process engines (nft, awm, dgpo): losses on clean rollout samples, no per-step likelihood
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
    dgpo_beta: float = _f(100.0, gt=0.0, hi=1e5, doc="dgpo: DPO β of the group preference margin")
    dgpo_time_fraction: float = _f(0.6, lo=0.0, hi=1.0, doc="dgpo: unit times drawn from grid indices "
                                                            "0 … floor(fraction·T) (the high-noise end)")


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
    on_inconsistency: str = _f("warn", choices=("warn", "stop", "off"),
                               doc="rollout and first update disagree (consistency/dlogp_over_clip > "
                                   "train.max_inconsistency): warn, stop (exit code 4) or off (not measured)")
    max_inconsistency: float = _f(0.5, lo=0.0, doc="limit on consistency/dlogp_over_clip (mean |Δ log p| / the clip "
                                                   "range); 0 = none")
    task: str = _f("digits", choices=("digits", "shapes", "shapes_video"),
                   doc="the built-in image task (model.name=tiny): digits (scikit-learn's 8 × 8 digits, a classifier's "
                       "confidence), shapes (coloured shapes at 32 px, GenEval-category prompts, a closed-form checker) "
                       "or shapes_video (4-frame clips of moving shapes, a tiny Wan video model); shapes* set the keys "
                       "of config.TASK_DEFAULTS a config leaves at their defaults", family="flow")
    digits: list = _f([0, 1, 2, 3, 4, 5, 6, 7, 8, 9], doc="training prompt digits", family="flow")
    prompts_file: str = _f("", path=True, doc="training prompts (default: train.task's, or the digits of train."
                                              "digits), drawn by a seeded epoch sampler: a UTF-8 text file (one "
                                              "prompt per line), a .jsonl file (a prompt field + metadata fields) or "
                                              "a .csv file (a prompt column + metadata columns), or hf:<path or hub "
                                              "id>[:<split>] (datasets.load_dataset; hf:json:<file> for a local JSON "
                                              "file), or builtin:<set>/<split> (a prompt set shipped with the package, "
                                              "e.g. builtin:ocr/train); the metadata reaches the rewards", family="flow")
    prompt_column: str = _f("prompt", doc="the field / column holding the prompt in train.prompts_file and "
                                          "eval.prompts_file (.jsonl, .csv, hf:)", family="flow")
    checkpoint_format: str = _f("auto", choices=("auto", "dcp", "files"),
                                doc="dcp: sharded torch.distributed.checkpoint files, every rank writes its own shards "
                                    "(no gather) and any number of processes can resume them; files: one "
                                    "safetensors + optimizer file written by rank 0 (bitwise resume); auto: dcp "
                                    "under dist.mode=fsdp2, else files")
    # guards (diffgrpo.guards): limits relative to the run's start evaluation; 0 turns a limit off
    on_hacking: str = _f("off", choices=("off", "warn", "stop"),
                         doc="an evaluation outside the guards: off (only logged as eval/guard/ok), warn (a warning), "
                             "stop (the run ends there, exit code 3, the message names the guard)")
    guard_patience: int = _f(1, lo=1, hi=1000,
                             doc="on_hacking=stop ends the run at the guard_patience-th evaluation in a row outside "
                                 "the guards (1: the first; each one before it is a warning): one evaluation's noise "
                                 "alone does not stop a run at 2 (docs/guards.md)")
    guard_max_fid_ratio: float = _f(1.5, lo=0.0, doc="eval/fid (built-in task) at most this × its start value")
    guard_max_drift: float = _f(0.5, lo=0.0, doc="eval/guard/drift (Fréchet distance to the base model's samples "
                                                  "/ their total variance) at most this")
    guard_min_diversity_ratio: float = _f(0.8, lo=0.0, hi=1.0, doc="eval/diversity and eval/guard/diversity at "
                                                                    "least this × their start value")
    guard_max_reward_drop: float = _f(0.1, lo=0.0, doc="each eval/guard/rewards/<name>/mean at least start − this "
                                                        "× |start|")
    guard_distance: str = _f("fid", choices=("fid", "kid"), doc="the guard on the distance to the task's reference "
                                                              "features: eval/fid (ratio) or eval/guard/kid (absolute)")
    guard_max_kid: float = _f(150.0, lo=0.0, doc="guard_distance=kid: eval/guard/kid at most its start value + this "
                                                  "(absolute; the default suits the built-in task's features)")
    keep_best: str = _f("", doc="keep the weights of the evaluation with the highest value of this metric (e.g. "
                                "eval/reward) among those inside the guards in <run>/best/; empty = off")


@dataclass
class DLLMConfig:
    """Masked diffusion LMs (model.name=tiny_mlm / hf_masked_lm). TRL names: num_generations = train.group_size,
    beta = loss.beta, epsilon = dllm.clip_range, num_iterations = train.num_inner_epochs,
    scale_rewards = advantage.std_mode (when method_defaults is false)."""
    FAMILY: ClassVar[str] = "dllm"
    task: str = _f("arithmetic", choices=("arithmetic", "sudoku", "countdown", "json_schema", "gsm8k", "code_toy",
                                          "code", "math"),
                   doc="task with a verifiable reward (diffgrpo.tasks); gsm8k: numeric answers, code: MBPP / "
                       "HumanEval records run in a sandbox, math: math-verify equivalence, all three with instances "
                       "from dllm.data_file")
    method: str = _f("diffu_grpo", choices=("diffu_grpo", "coupled_grpo", "random_mask", "spg", "wd1", "trace_rl"),
                     doc="base method: likelihood estimator + advantage baseline (+ objective: spg, wd1); trace_rl: "
                         "the sampler's own decoding steps (diffgrpo.dllm.trace_rl)")
    trace_shrink: int = _f(1, lo=1, doc="trace_rl: consecutive decoding steps scored by one forward (1 = exact)")
    trace_value: bool = _f(False, doc="trace_rl: a value network gives per-step GAE advantages (dllm.trace_critic)")
    trace_gamma: float = _f(1.0, lo=0.0, hi=1.0, doc="trace_value: discount over decoding steps (TraceRL: 1)")
    trace_lambda: float = _f(1.0, lo=0.0, hi=1.0, doc="trace_value: GAE λ over decoding steps (TraceRL: 1)")
    trace_value_lr: float = _f(0.0, lo=0.0, doc="trace_value: the value network's AdamW lr; 0 = 5 × train.lr (TraceRL's)")
    method_defaults: bool = _f(True, doc="use the method's advantage baseline/std (else the advantage section)")
    clip_range: float = _f(0.2, lo=0.0, doc="PPO clip ε on per-token ratios (d1 and TRL use 0.2)")
    gen_length: int = _f(0, lo=0, doc="completion tokens; 0 = the task's default (tiny_mlm: at least the longest "
                                      "answer, at most the default: the built-in model's positions)")
    block_length: int = _f(0, lo=0, doc="semi-autoregressive block size, a divisor of gen_length; 0 = gen_length "
                                        "(one block)")
    diffusion_steps: int = _f(0, lo=0, doc="sampling steps, a multiple of the number of blocks and <= gen_length; "
                                           "0 = gen_length (one token per step)")
    remasking: str = _f("low_confidence", choices=("low_confidence", "random"))
    decode: str = _f("schedule", choices=("schedule", "threshold"),
                     doc="rollout decoder (diffgrpo.dllm.decoding): schedule = diffusion_steps steps of LLaDA's "
                         "per-step counts; threshold = every masked block token with confidence >= "
                         "decode_threshold, at least one per step (Fast-dLLM's parallel decoding)")
    decode_threshold: float = _f(0.9, gt=0.0, hi=1.0, doc="decode=threshold: commit confidence")
    kv_cache: str = _f("none", choices=("none", "prefix", "dual"),
                       doc="key/value cache across denoising steps (diffgrpo.models.kv_cache): prefix = prompt + "
                           "finished blocks, dual = also the masked suffix; approximate, see docs/rollout.md")
    cache_refresh: int = _f(0, lo=0, doc="kv_cache: rebuild the cache every k-th step of a block; 0 = at each "
                                         "block start only (Fast-dLLM); 1 = every step (exact, no saving)")
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
    # code tasks (diffgrpo.tasks.code, diffgrpo.sandbox)
    sandbox: str = _f("auto", choices=("auto", "local", "bwrap", "remote"),
                      doc="code / code_toy: where completions run; auto = bwrap when it starts here, else local "
                          "(see docs/code_and_math.md)")
    sandbox_workers: int = _f(0, lo=0, doc="code / code_toy: programs run at once; 0 = this process's CPUs")
    sandbox_timeout: float = _f(10.0, gt=0.0, doc="code / code_toy: wall-clock seconds per completion (all its tests); "
                                                  "its process group is killed then")
    sandbox_memory_mb: int = _f(512, lo=64, doc="code / code_toy: address-space limit per completion (MiB)")
    sandbox_url: str = _f("", doc="dllm.sandbox=remote: the SandboxFusion-style service (POST <url>/run_code)")


@dataclass
class DACAConfig:
    """DACA-GRPO plug-ins for every dLLM base method (diffgrpo.dllm.credit, diffgrpo.dllm.likelihood)."""
    FAMILY: ClassVar[str] = "dllm"
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
    FAMILY: ClassVar[str] = "flow"
    every: int = _f(10, lo=0, doc="evaluate every N iterations (0: only at start and end)", family="any")
    seeds_per_prompt: int = _f(4, lo=1)
    seed: int = _f(1234, family="any")
    sde_type: str = _f("ode", choices=("ode", "flow_sde", "dance_sde", "flash_sde", "cps"))
    prompts_file: str = _f("", path=True, doc="evaluation prompts (default: train.task's held-out set or the digit "
                                              "prompts), any format of train.prompts_file; metadata reaches rewards")
    batch_size: int = _f(0, lo=0, doc="evaluation samples sampled, decoded and scored together; 0 = all at once "
                                      "(with > 0 only the first 64 images are kept for the sample grid)")
    guard_rewards: list = _f([], doc="held-out guard rewards, evaluated and never trained on (eval/guard/rewards/"
                                     "<name>/mean): registry names or module:function; text verifiers or d1_format "
                                     "for masked diffusion LMs", family="any")
    guard_features: str = _f("auto", doc="feature space of eval/guard/fd_base, drift, diversity (flow): auto, "
                                         "digits, shapes (an encoder of rendered scenes), clip (a CLIP-class "
                                         "reward's CLIP), none or module:function (images -> (B, D)); masked LMs "
                                         "use hashed character trigrams")


@dataclass
class LogConfig:
    output_dir: str = _f("", path=True, doc="run directory (~ expanded; must be creatable and writable); "
                                            "default runs/<timestamp>")
    progress: bool = _f(True, doc="progress bar on a terminal (elsewhere, and with false, a line every log.every "
                                  "iterations)")
    every: int = _f(0, lo=0, doc="iterations between progress lines when no bar is drawn; 0 = about ten per run")
    trackers: list = _f([], doc="experiment trackers (accelerate's): tensorboard, wandb, mlflow, trackio, comet_ml, "
                                "aim, clearml, dvclive; each needs its package: pip install 'diffgrpo[<name>]'")
    tensorboard: bool = _f(False, doc="alias of tensorboard in log.trackers: event files in <run>/tensorboard")
    wandb: bool = _f(False, doc="alias of wandb in log.trackers (Weights & Biases)")
    wandb_project: str = _f("", doc="W&B project; empty = $WANDB_PROJECT, else diffgrpo")
    wandb_name: str = _f("", doc="W&B run name; empty = $WANDB_NAME, else the run directory's name")
    wandb_tags: list = _f([], doc="W&B tags, e.g. [sd35, pickscore]; empty = $WANDB_TAGS (comma-separated)")
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
class DiversityConfig:
    """Diversity-preserving objectives (flow): they change rewards, trained samples or advantages, not the engine."""
    FAMILY: ClassVar[str] = "flow"
    method: str = _f("off", doc="off, gardo, diversegrpo, drift, or a list of them (applied in that order)")
    gardo_amplify: float = _f(1.0, lo=0.0, doc="gardo: λ in A' = A·(1 + λ·d̂) for A > 0 (d̂: group-normalised "
                                                "nearest-neighbour feature distance)")
    cluster_bonus: float = _f(0.1, lo=0.0, doc="diversegrpo: λ of the reward bonus λ/|cluster| per sample")
    cluster_threshold: float = _f(0.05, gt=0.0, hi=2.0, doc="diversegrpo: cosine distance below which two samples "
                                                           "of a group share a cluster")
    drift_subset: float = _f(0.75, gt=0.0, hi=1.0, doc="drift: share of each group kept, nearest its median reward")
    drift_shaping: float = _f(0.5, lo=0.0, doc="drift: λ of the reward bonus λ·(Φ(G) − Φ(G∖i)), Φ = mean pairwise "
                                                "cosine distance")
    gardo_gate: float = _f(0.0, lo=0.0, hi=1.0, doc="gardo: KL only on samples with |advantage| at or above this "
                                                    "quantile of the batch (0 = every sample); needs loss.beta > 0")
    gardo_ref_every: int = _f(0, lo=0, doc="gardo: reset the KL reference to the policy every N iterations (0 = never)")
    step_weight_power: float = _f(0.0, lo=0.0, doc="diversegrpo: KL weight of step k ∝ σ_k^p, mean 1 (0 = uniform)")
