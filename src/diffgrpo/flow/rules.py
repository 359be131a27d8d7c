"""The flow family's configuration rules: rewards, prompts, the sampler grid, steps, the model, rollout savings,
the loss options, and the chosen engine (its keys and its own ``check_config``). Run by
:func:`diffgrpo.validation.validate` before any model loads; every message names the key and what is allowed."""
from __future__ import annotations

import inspect
from pathlib import Path

from .. import diversity, guards, plugins
from ..config import EngineConfig, LossConfig, RunConfig
from ..engines import ENGINES, FORWARD_ENGINES
from ..errors import ConfigError, suggest
from ..models.pipelines.editing import check_config as check_editing
from ..models.regional_compile import check_config as check_compile
from ..rewards import check_rewards, resolve_reward


def check(cfg: RunConfig, purpose: str = "train") -> None:
    """Every cross-field rule of a flow-matching run (``FlowFamily.check_config``) validated for ``purpose``
    (``validation.PURPOSES``)."""
    check_compile(cfg.model, cfg.dist.mode)
    _validate_flow(cfg)
    check_editing(cfg, purpose)  # an editing pipeline needs a source image per prompt
    check_diversity(cfg)
    held_out = guards.check_config(cfg, "flow")  # eval.guard_*, train.keep_best; guard rewards take reward.options
    check_rewards({**cfg.reward.weights, **held_out}, cfg.reward.options, model_name=cfg.model.name)


def check_diversity(cfg: RunConfig) -> None:
    """``diversity.method``: known names, a feature space to measure samples in (the guards', or the shapes
    checker's detections on the shapes tasks), whole groups on each rank."""
    try:
        methods = diversity.parse_methods(cfg.diversity.method, diversity.METHODS)
    except ValueError as e:
        raise ConfigError(f"diversity.method: {e}") from None
    for key in ("gardo_gate", "gardo_ref_every", "step_weight_power"):  # the KL-side parts, any method
        if getattr(cfg.diversity, key) and cfg.loss.beta <= 0:
            raise ConfigError(f"diversity.{key}: acts on the KL term; needs loss.beta > 0 (it is {cfg.loss.beta})")
    if cfg.diversity.gardo_ref_every and (cfg.model.lora_rank > 0 or cfg.dist.mode == "fsdp2"):
        raise ConfigError("diversity.gardo_ref_every: resets the full fine-tune's reference copy; not with "
                          "model.lora_rank > 0 (the reference is the adapter disabled) or dist.mode=fsdp2")
    if not methods:
        return
    if guards.diversity_space(cfg) == "none":  # the shapes tasks: the checker's detections
        raise ConfigError(f"diversity.method: needs a feature space for the samples; eval.guard_features="
                          f"{cfg.eval.guard_features} gives none here (use clip, a module:function, or digits with "
                          "train.task=digits)")
    if cfg.dist.group_layout == "spread":
        raise ConfigError("diversity.method: the objectives compare the samples of a whole group; "
                          "dist.group_layout=spread splits groups over ranks (use local)")
    if cfg.advantage.per_reward_norm and {"diversegrpo", "drift"} & set(methods):
        raise ConfigError("diversity.method: diversegrpo / drift add a bonus to the combined reward; "
                          "advantage.per_reward_norm normalises each reward on its own (turn one off)")


def _exists(p: Path) -> bool:
    try:
        return p.exists()
    except (OSError, ValueError):  # a name too long, an embedded NUL byte
        return False


def _validate_engine_name(name: str) -> None:
    allowed = f"choose one of {sorted(ENGINES)} or an importable module:Class"
    if name in ENGINES:
        return
    if ":" not in name:
        raise ConfigError(f"engine.name: value {name!r} is not a registered engine{suggest(name, list(ENGINES))}; "
                          f"{allowed}")
    obj = plugins.resolve(name, key="engine.name", hint=f"; {allowed}",
                          malformed="{key}: value {spec!r} is not a valid module:Class ({problem})",
                          failed="{key}: value {spec!r} cannot be imported ({error})")
    if not inspect.isclass(obj):
        raise ConfigError(f"engine.name: value {name!r} is not a class (it is a {type(obj).__name__}); {allowed}")


def _validate_reward_name(name: str) -> None:
    resolve_reward(name)  # raises ConfigError for unknown names, malformed module:function specs, failed imports


def _validate_task(cfg: RunConfig) -> None:
    """``train.task`` chooses the built-in image model's task: it needs that model and its 32-pixel scenes."""
    task = cfg.train.task
    if task != "digits" and cfg.model.name != "tiny":  # the default is ignored by other models
        raise ConfigError(f"train.task: value {task!r} applies to the built-in image model (model.name=tiny), not "
                          f"model.name={cfg.model.name}; remove it, or give the prompts with train.prompts_file")
    if cfg.model.name != "tiny":
        return
    if task == "shapes" and cfg.model.image_size != 32:
        raise ConfigError(f"model.image_size: value {cfg.model.image_size} is not drawn by train.task=shapes (its "
                          "scenes and checker are 32 × 32); set 32 or leave it out")
    if task == "shapes" and "digit_alignment" in cfg.reward.weights:
        raise ConfigError("reward.weights: digit_alignment scores digits, not train.task=shapes' scenes; use "
                          "shapes_score or shapes_correct")
    if task == "shapes_video":
        _validate_video_task(cfg)


def _validate_video_task(cfg: RunConfig) -> None:
    """``train.task=shapes_video``: 32-pixel clips of 2 to 8 frames, scored by a clip reward."""
    m = cfg.model
    if m.image_size != 32:
        raise ConfigError(f"model.image_size: value {m.image_size} is not drawn by train.task=shapes_video (its "
                          "clips and checker are 32 × 32); set 32 or leave it out")
    if not 2 <= m.num_frames <= 8:
        raise ConfigError(f"model.num_frames: value {m.num_frames} is out of range for train.task=shapes_video; "
                          "must be 2..8 (default 4)")
    image_only = sorted(n for n in cfg.reward.weights if n in ("digit_alignment", "shapes_score", "shapes_correct"))
    if image_only:
        raise ConfigError(f"reward.weights: {image_only} score images, not train.task=shapes_video's clips; use "
                          "shapes_video_score or shapes_video_correct")


def _validate_flow(cfg: RunConfig) -> None:
    _validate_task(cfg)
    _validate_engine_name(cfg.engine.name)
    if not cfg.reward.weights:
        example = {"digits": "digit_alignment", "shapes": "shapes_score", "shapes_video": "shapes_video_score"}[
            cfg.train.task] if cfg.model.name == "tiny" \
            else "pickscore"
        raise ConfigError(f"reward.weights: at least one reward is required, e.g. reward.weights={{{example}: 1.0}}")
    for name in cfg.reward.weights:  # each weight is a finite number (checked with the field)
        _validate_reward_name(str(name))
    bad = [d for d in cfg.train.digits if not (isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= 9)]
    if bad or not cfg.train.digits:
        raise ConfigError(f"train.digits: value {cfg.train.digits!r} must be a non-empty list of digits 0..9")
    if cfg.model.name == "tiny" and cfg.train.task != "digits" and list(cfg.train.digits) != list(range(10)):
        raise ConfigError(f"train.digits: value {cfg.train.digits!r} is read only by train.task=digits, not "
                          f"train.task={cfg.train.task}; set train.task=digits or remove it")
    if cfg.train.prompts_file and list(cfg.train.digits) != list(range(10)):
        raise ConfigError(f"train.digits: value {cfg.train.digits!r} is not read with train.prompts_file set (the "
                          "file replaces the digit prompts); remove one of the two")
    if cfg.sampler.sde_type == "ode" and cfg.engine.name not in FORWARD_ENGINES:
        raise ConfigError("sampler.sde_type: 'ode' has no exploration noise and cannot be trained; "
                          "choose one of ['flow_sde', 'dance_sde', 'flash_sde', 'cps'] (eval.sde_type may be 'ode'), or a "
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
    if cfg.model.pipeline in ("flux", "flux2") and (cfg.model.negative_prompt or cfg.model.guidance_scale < 1.0):
        raise ConfigError("model.negative_prompt: FLUX is guidance-distilled (FLUX.1, FLUX.2 [dev]: "
                          "model.guidance_scale feeds its guidance embedding, one forward); negative prompts and true "
                          "CFG do not apply")
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



def engine_class(name: str) -> type:
    """The engine class ``engine.name`` names (registry key or an importable ``module:Class``, checked first)."""
    if name in ENGINES:
        return ENGINES[name]
    return plugins.resolve(name, key="engine.name")


def engine_users() -> dict[str, list[str]]:
    """``engine.*`` key → the registered engines that read it (their ``config_keys``), in registry order."""
    users: dict[str, list[str]] = {}
    for name, cls in ENGINES.items():
        for key in cls.config_keys:
            users.setdefault(key, []).append(name)
    return users


def _validate_engine(cfg: RunConfig) -> None:
    """The engine-specific keys (each engine declares the ones it reads), then the engine's own rules."""
    e = cfg.engine
    default = EngineConfig()
    cls = engine_class(e.name)
    declared = getattr(cls, "config_keys", None)  # a module:Class engine may predate the declaration
    if declared is not None:
        for key, users in engine_users().items():
            if getattr(e, key) != getattr(default, key) and key not in declared:
                raise ConfigError(f"engine.{key}: does not apply to engine.name={e.name}; it is read only by "
                                  f"{list(users)}; remove it")
    check_config = getattr(cls, "check_config", None)
    if check_config is not None:
        check_config(cfg)
    _validate_loss_options(cfg)


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
