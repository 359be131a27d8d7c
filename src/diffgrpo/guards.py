"""Guards on every evaluation, for any model: is a reward gain real, or is the reward being gamed?

The statistics of a feature space (Fréchet distance, diversity, their fixed-memory accumulation) live in
:mod:`diffgrpo.feature_stats`; this module computes the features, the guard values and the policy.

On the built-in digits task (``model.name=tiny``) the flow evaluation reports ``eval/fid`` and ``eval/diversity``:
the Fréchet distance between Gaussians fitted to the digit classifier's penultimate features (the 64-d ReLU layer
before the logits of ``rewards.image.DigitClassifier``) of the generated samples and of the digits *test* split, and
their per-prompt diversity (:class:`GuardStats`); beside them ``eval/guard/kid``, the unbiased KID between the same
two feature sets (``feature_stats.kid``). Shapes task: the same against scenes rendered for the evaluation prompts, in
the features of :mod:`rewards.shapes_encoder` (a CNN trained on rendered scenes; ``guard_features.task_reference``).

Each evaluation (fixed prompts and seeds) reports, beside its rewards, under ``eval/guard/``:

- ``rewards/<name>/mean``: held-out *guard rewards* (``eval.guard_rewards``), scored on the evaluation samples and
  never trained on (image rewards for flow models, e.g. train on pickscore and guard with aesthetic / clip_score /
  ocr; text verifiers or ``d1_format`` for masked diffusion LMs).
- ``fd_base``: the Fréchet distance between Gaussians fitted to features of the current evaluation samples and of
  the **base model's own samples on the same prompts and seeds** (the first evaluation of the run, kept as a mean
  and a covariance; ``feature_stats.frechet_distance``); 0 at the start by construction.
- ``drift``: ``fd_base / tr(Σ_b)``, the same distance in units of the base samples' total variance (scale-free:
  a policy that collapses every sample onto the base mean scores 1; comparable across feature spaces).
- ``diversity``: per prompt (``eval.seeds_per_prompt`` / ``dllm.eval_samples`` consecutive samples), the mean
  pairwise L2 distance of the features, averaged over prompts (0 when every seed of a prompt gives one image).
- ``detection_diversity`` (runs scored by the shapes checker, ``shapes_correct`` / ``shapes_score``): the same per
  prompt from the checker's own detections, the mean pairwise distance of the samples' object layouts
  (positions, sizes, which objects; :mod:`diffgrpo.rewards.shapes_diversity`); ``color_diversity``: over the
  prompts that name no colour, the chance that two detected objects differ in colour (where there are such prompts).

Feature spaces (``eval.guard_features``), all available offline: ``digits`` (the built-in task's classifier, 64-d
penultimate features, :func:`digit_features`), ``clip`` (unit-norm image embeddings of the CLIP model of the
run's first CLIP-class reward, pickscore / clip_score / aesthetic, loaded once and shared with that reward; video:
the mean over frames), ``shapes`` (:mod:`rewards.shapes_encoder`), a plug-in ``module:function``, ``none``; ``auto``
picks digits / shapes for the built-in model on those tasks, else clip when a CLIP-class reward is configured, else
none. Text: L2-normalised counts of the completion's character trigrams hashed into 64 buckets (crc32; model-free).

Everything accumulates in fixed memory (``feature_stats.Moments``: float64 Σf and Σffᵀ, and a prompt's features
only until its seeds are complete), whatever the number of evaluation samples. Cost: one feature forward per
evaluation sample and one call of each guard reward; no training cost. The base statistics live in the run directory
(``guard_base.safetensors``, written atomically after the start evaluation) and are read back on resume.

The policy (``train.on_hacking=off|warn|stop``) compares each evaluation with the run's start: :func:`tripped`
(pure) lists the guards out of their start-anchored thresholds, :class:`Watch` logs them, keeps the best weights
by ``train.keep_best`` among evaluations inside the guards, and tells the loop to stop.
"""
from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save, save_file

from . import consistency, distributed, guard_checks
from .data import digits_split
from .errors import ConfigError, TrainingError
from .feature_stats import Moments, frechet_distance, gaussian_from_sums, gaussian_stats, kid
from .fileio import atomic_write
from .guard_features import CLIP_REWARDS, FEATURES, clip_features, clip_reward, diversity_space, feature_kind, plugin
from .rewards import TEXT_REWARDS, compute_rewards, make_rewards, shapes_diversity, shapes_features, time_limited
from .rewards import image as image_rewards
from .rewards import shapes_encoder as shapes_space

PREFIX = "eval/guard/"
BASE_FILE = "guard_base.safetensors"
BEST_DIR = "best"
DISTANCES = ("fid", "kid")  # train.guard_distance: the guard on the distance to the task's reference features
SHAPES_REWARDS = ("shapes_correct", "shapes_score")  # rewards of the shapes checker: detection_diversity applies
TEXT_BUCKETS = 64


# ---------------------------------------------------------------------- pure functions
def text_features(texts: list[str], buckets: int = TEXT_BUCKETS) -> torch.Tensor:
    """Completions → (n, buckets) float64: counts of character trigrams hashed (crc32) into ``buckets``, L2-normalised
    (an empty or short text is the zero vector)."""
    out = torch.zeros(len(texts), buckets, dtype=torch.float64)
    for i, t in enumerate(texts):
        for j in range(len(t) - 2):
            out[i, zlib.crc32(t[j:j + 3].encode()) % buckets] += 1
    return out / out.norm(dim=1, keepdim=True).clamp_min(1e-12)


@dataclass(frozen=True)
class Thresholds:
    """Start-anchored limits (``train.guard_*``); a limit of 0 is off."""
    max_fid_ratio: float = 1.5  # eval/fid (built-in task: vs the digits test split) ≤ ratio × its start value
    max_drift: float = 0.5  # eval/guard/drift (distance to the base samples / their variance) ≤ this
    min_diversity_ratio: float = 0.8  # eval/diversity, eval/guard/diversity ≥ ratio × start
    max_reward_drop: float = 0.1  # each guard reward ≥ start − drop × |start|
    distance: str = "fid"  # fid: the ratio limit above; kid: eval/guard/kid ≤ start + max_kid (absolute)
    max_kid: float = 150.0  # built-in task, 320 samples: about 5 % false alarms (benchmarks/guard_noise.py)


def tripped(start: dict, row: dict, th: Thresholds) -> list[str]:
    """The guards of evaluation ``row`` outside their limits relative to the ``start`` evaluation, each as a short
    phrase (empty: inside every guard). A guard that is NaN or cannot be computed is out (:func:`guard_checks.uncomputed`); a
    limit relative to a start value that is not finite is not judged."""
    def pair(k):
        a, b = start.get(k), row.get(k)
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and math.isfinite(a) and math.isfinite(b)
        return (float(a), float(b)) if ok else None

    out = guard_checks.uncomputed(start, row, th)  # NaN or missing: out
    p = pair("eval/fid") if th.distance == "fid" else None
    if th.max_fid_ratio > 0 and p and p[0] > 0 and p[1] > th.max_fid_ratio * p[0]:
        out.append(f"eval/fid {p[1]:.4g} > {th.max_fid_ratio:g} × start {p[0]:.4g}")
    p = pair(PREFIX + "kid") if th.distance == "kid" else None
    if th.max_kid > 0 and p and p[1] > p[0] + th.max_kid:
        out.append(f"{PREFIX}kid {p[1]:.4g} > start {p[0]:.4g} + {th.max_kid:g}")
    d = row.get(PREFIX + "drift")
    if th.max_drift > 0 and isinstance(d, (int, float)) and math.isfinite(d) and d > th.max_drift:
        out.append(f"{PREFIX}drift {d:.4g} > {th.max_drift:g} (distance to the base model's samples)")
    for k in ("eval/diversity", PREFIX + "diversity", PREFIX + "detection_diversity", PREFIX + "color_diversity"):
        p = pair(k)
        if th.min_diversity_ratio > 0 and p and p[1] < th.min_diversity_ratio * p[0]:
            out.append(f"{k} {p[1]:.4g} < {th.min_diversity_ratio:g} × start {p[0]:.4g}")
    for k in sorted(k for k in row if k.startswith(PREFIX + "rewards/")):
        p = pair(k)
        if th.max_reward_drop > 0 and p and p[1] < p[0] - th.max_reward_drop * abs(p[0]):
            out.append(f"{k} {p[1]:.4g} < start {p[0]:.4g} − {th.max_reward_drop:g} × |start|")
    return out


def thresholds(t) -> Thresholds:
    """The ``train.guard_*`` keys of a train config section as :class:`Thresholds`."""
    return Thresholds(t.guard_max_fid_ratio, t.guard_max_drift, t.guard_min_diversity_ratio, t.guard_max_reward_drop,
                      t.guard_distance, t.guard_max_kid)


# ---------------------------------------------------------------------- the built-in task's digit guards
_REFERENCE: dict[int, tuple] = {}  # image size → (classifier, μ, Σ, features)


def penultimate_features(clf, images: torch.Tensor) -> torch.Tensor:
    """images (B, 1, S, S) in [0, 1] → (B, 64): the classifier's last hidden layer (after ReLU)."""
    with torch.no_grad():
        return clf.fc[:-1](clf.conv(images.float().cpu()))


def reference_stats(image_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(μ (64,), Σ (64, 64)) of the penultimate features of the digits test split at ``image_size`` (cached)."""
    return _reference(image_size)[1:3]


def reference_features(image_size: int) -> torch.Tensor:
    """(N_test, 64) penultimate features of the digits test split at ``image_size`` (cached)."""
    return _reference(image_size)[3]


def _reference(image_size: int) -> tuple:
    clf, _ = image_rewards.load_classifier(image_size)
    cached = _REFERENCE.get(image_size)
    if cached is None or cached[0] is not clf:  # computed with this very classifier
        _, (x_te, _) = digits_split(image_size)
        f = penultimate_features(clf, x_te)
        cached = _REFERENCE[image_size] = (clf, *gaussian_stats(f), f)
    return cached


def digit_features(images: torch.Tensor) -> torch.Tensor:
    """Evaluation images (B, 1, S, S) in [0, 1] → (B, 64) penultimate features of the digit classifier; an
    evaluation in chunks keeps these (256 bytes a sample) instead of its images."""
    clf, _ = image_rewards.load_classifier(images.shape[-1])
    return penultimate_features(clf, images)


def guards_apply(cfg, images: torch.Tensor) -> bool:
    """Whether a flow evaluation's images get eval/fid: the built-in model's digits, or shapes (their encoder's)."""
    channels = 3 if feature_kind(cfg) == "shapes" else 1
    return cfg.model.name == "tiny" and images.dim() == 4 and images.shape[1] == channels


class GuardStats:
    """``eval/fid``, ``eval/guard/kid`` and ``eval/diversity`` of one evaluation's images (``reference``: feature map
    and reference features, ``guard_features.task_reference``; None: the digits'), accumulated chunk by chunk
    (``Moments``; KID keeps the features, 512 bytes a sample). With distinct prompts it equals ``frechet_distance`` of
    ``gaussian_stats`` against the reference's and ``per_prompt_diversity`` on the whole feature set (round-off)."""

    def __init__(self, image_size: int, group_size: int, reference: tuple | None = None):
        self.image_size, self.moments, self.feats = image_size, Moments(group_size), {}
        self.features, self.reference = reference or (digit_features, None)  # map, reference features (N, D)

    def add(self, index: list[int], feats: torch.Tensor) -> None:
        """Samples ``index`` (their evaluation order) with features (n, 64)."""
        self.moments.add(index, feats)
        self.feats.update(zip(index, feats.detach().double().cpu()))

    def result(self) -> dict[str, float]:
        """{"eval/fid", "eval/guard/kid", "eval/diversity"} (diversity when some record has two samples); {} below
        two samples."""
        m = self.moments
        if m.n < 2:
            return {}
        mu, cov = gaussian_from_sums(m.n, m.s1, m.s2)
        ref = reference_features(self.image_size) if self.reference is None else self.reference
        out = {"eval/fid": frechet_distance(mu, cov, *gaussian_stats(ref)),
               PREFIX + "kid": kid(torch.stack([self.feats[i] for i in sorted(self.feats)]), ref)}
        if m.spreads:
            out["eval/diversity"] = m.diversity()
        return out


# ---------------------------------------------------------------------- accumulation in fixed memory
class Base:
    """The base model's feature statistics: mean (D,), covariance (D, D) float64, sample count."""

    def __init__(self, mean: torch.Tensor, cov: torch.Tensor, n: int):
        self.mean, self.cov, self.n = mean, cov, n

    def save(self, path: Path) -> None:
        tensors = {"mean": self.mean.contiguous(), "cov": self.cov.contiguous(), "n": torch.tensor([self.n])}
        atomic_write(path, save(tensors))  # bytes: a full disk is a one-line TrainingError, no partial file

    @classmethod
    def load(cls, path: Path) -> Base:
        """The statistics written by :meth:`save`; a damaged file is a one-line TrainingError."""
        return cls(*guard_checks.base_tensors(path))


# ---------------------------------------------------------------------- what an evaluation computes
class EvalGuards:
    """The guards of one run's evaluations: guard-reward callables, a feature function, the base statistics."""

    def __init__(self, group: int, *, reward_fns: dict, features: Callable | None, log=print,
                 detections: bool = False):
        self.group, self.reward_fns, self.features, self.log = group, reward_fns, features, log
        self.detections = detections  # eval/guard/detection_diversity from the shapes checker's detections
        self.base: Base | None = None
        self.anchored = False  # whether the base is settled (computed, loaded, or known to be missing)

    # construction per family
    @classmethod
    def for_flow(cls, cfg, device, log=print) -> EvalGuards:
        names = list(cfg.eval.guard_rewards)
        fns = make_rewards(dict.fromkeys(names, 1.0), cfg.reward.options, device, timeout=cfg.reward.timeout) \
            if names else {}
        shapes = any(n in SHAPES_REWARDS for n in [*cfg.reward.weights, *names])
        return cls(cfg.eval.seeds_per_prompt, reward_fns=fns, features=image_feature_fn(cfg, device), log=log,
                   detections=shapes)

    @classmethod
    def for_text(cls, cfg, log=print) -> EvalGuards:
        fns = {n: plugin(n, "eval.guard_rewards") for n in cfg.eval.guard_rewards}
        if cfg.reward.timeout:  # a plug-in may hang as an image reward may
            fns = {n: time_limited(n, fn, cfg.reward.timeout) for n, fn in fns.items()}
        return cls(cfg.dllm.eval_samples, reward_fns=fns, features=text_features, log=log)

    # one evaluation
    def begin(self) -> Evaluation:
        return Evaluation(self)

    def chunk(self, samples, prompts: list[str], metadata: list[dict]) -> dict:
        """One chunk's guard values (on the rank that sampled it): {"rewards": {name: (n,)}, "feats": (n, D) | None}."""
        rewards = {}
        if not len(prompts):  # a rank's padding-only chunk
            return {"rewards": {}, "feats": None}
        if self.reward_fns:
            _, rewards = compute_rewards(dict.fromkeys(self.reward_fns, 1.0), samples, prompts, metadata,
                                         log=self.log, rewards=self.reward_fns)
        feats = self.features(samples) if self.features is not None else None
        images = self.detections and torch.is_tensor(samples) and samples.dim() == 4
        return {"rewards": rewards, "feats": feats, "layouts": shapes_diversity.layouts(samples) if images else None,
                "free": [shapes_diversity.color_free(m or {}) for m in metadata] if images else None}

    def texts(self, texts: list[str], prompts: list[str], metadata: list[dict]) -> dict[str, float]:
        """The guards of a whole text evaluation at once (completions are small)."""
        ev = self.begin()
        ev.add(list(range(len(texts))), self.chunk(texts, prompts, metadata))
        return ev.result()

    def set_base(self, base: Base | None) -> None:
        """Anchor the distance to ``base`` (read back on resume); None: the base is unknown, no distance is reported."""
        self.base, self.anchored = base, True

    # the run directory's copy
    def save_base(self, run_dir: Path) -> None:
        """Write the base statistics into the run directory; a run that cannot write them goes on (its resumes then
        report no distance to the base)."""
        if self.base is None:
            return
        try:
            self.base.save(Path(run_dir) / BASE_FILE)
        except (OSError, TrainingError) as e:
            self.log(f"warning: cannot write {Path(run_dir) / BASE_FILE} ({str(e).splitlines()[0]}); a resume of this "
                     f"run will not report {PREFIX}fd_base / drift")

    def load_base(self, run_dir: Path) -> None:
        path = Path(run_dir) / BASE_FILE
        if path.is_file() and not path.is_symlink():
            self.set_base(Base.load(path))
        else:
            if self.features is not None:
                self.log(f"warning: {path} is missing: the base model's evaluation statistics are unknown, so "
                         f"{PREFIX}fd_base / drift are not reported in this resumed run")
            self.set_base(None)


class Evaluation:
    """Guard values of one evaluation, gathered chunk by chunk (every rank adds every rank's chunks)."""

    def __init__(self, guards: EvalGuards):
        self.g, self.moments = guards, Moments(guards.group)
        self.sums: dict[str, list[float]] = {}  # guard reward → [Σ finite values, count]
        self.layouts: dict[int, shapes_diversity.Layout] = {}  # sample index → its detections' layout
        self.free: set[int] = set()  # samples of prompts that name no colour

    def add(self, index: list[int], part: dict) -> None:
        for name, v in part["rewards"].items():
            v = torch.as_tensor(v, dtype=torch.float64)
            s = self.sums.setdefault(name, [0.0, 0])
            s[0] += float(v[torch.isfinite(v)].sum())
            s[1] += int(torch.isfinite(v).sum())
        if part["feats"] is not None:
            self.moments.add(index, part["feats"])
        if part.get("layouts") is not None:
            self.layouts.update(zip(index, part["layouts"]))
            self.free.update(i for i, f in zip(index, part["free"]) if f)

    def result(self) -> dict[str, float]:
        """{eval/guard/...}; the first result of a run (the base model) becomes the base statistics."""
        row = {f"{PREFIX}rewards/{k}/mean": (s[0] / s[1] if s[1] else float("nan")) for k, s in self.sums.items()}
        if self.layouts:  # each only where it is defined: some prompt has two samples / names no colour
            for key, v in (("detection_diversity", shapes_diversity.detection_diversity(self.layouts, self.g.group)),
                           ("color_diversity", shapes_diversity.color_diversity(self.layouts, self.free, self.g.group))):
                if math.isfinite(v):
                    row[PREFIX + key] = v
        m = self.moments
        if m.n >= 2:
            mu, cov = gaussian_from_sums(m.n, m.s1, m.s2)
            if not self.g.anchored:
                self.g.set_base(Base(mu, cov, m.n))
            base = self.g.base
            if base is not None and base.mean.shape != mu.shape:  # another feature space: no distance
                self.g.log(f"warning: the base statistics ({BASE_FILE}) have {base.mean.shape[0]} features and this "
                           f"evaluation {mu.shape[0]}: {PREFIX}fd_base / drift cannot be computed")
                row[PREFIX + "fd_base"] = row[PREFIX + "drift"] = float("nan")
            elif base is not None:
                fd = frechet_distance(mu, cov, base.mean, base.cov)
                row[PREFIX + "fd_base"] = fd
                row[PREFIX + "drift"] = fd / max(float(torch.trace(base.cov)), 1e-12)
            if m.spreads:
                row[PREFIX + "diversity"] = m.diversity()
        return row


# ---------------------------------------------------------------------- feature functions
def image_feature_fn(cfg, device) -> Callable | None:
    """``eval.guard_features`` of a flow run → images (B, C, H, W) or video (B, C, F, H, W) in [0, 1] → (B, D), or
    None (no feature guard)."""
    kind = feature_kind(cfg)
    if kind == "none":
        return None
    if kind in ("digits", "shapes"):  # the built-in tasks' own feature maps
        return {"digits": digit_features, "shapes": shapes_space.features}[kind]
    if kind == "clip":
        name = clip_reward(cfg)
        model, processor = CLIP_REWARDS[name]
        opts = dict(cfg.reward.options.get(name) or {})
        model, processor = opts.get("model", model), opts.get("processor", processor) or opts.get("model", model)
        dev, dtype, bs = opts.get("device") or str(device), opts.get("dtype", "float32"), opts.get("batch_size", 16)
        return lambda images: clip_features(images, model, processor, dev, dtype, bs)
    return plugin(kind, "eval.guard_features")  # module:function, images → (B, D)


def diversity_feature_fn(cfg, device) -> Callable | None:
    """The diversity objectives' features (:func:`diversity_space`): the shapes checker's detection vectors
    (:func:`rewards.shapes_features.detection_features`) where that space is ``detections``, else the guards'."""
    if diversity_space(cfg) == "detections":
        return shapes_features.detection_features
    return image_feature_fn(cfg, device)


# ---------------------------------------------------------------------- the policy
class Watch:
    """``train.on_hacking`` and ``train.keep_best`` over a run's evaluations (called on every rank, the same rows)."""

    def __init__(self, train_cfg, log=print):
        t = train_cfg
        self.mode, self.metric, self.log = t.on_hacking, t.keep_best, log
        self.th = thresholds(t)
        self.start: dict | None = None
        self.best: dict | None = None  # {"iteration", "metric", "value"}
        self.told_missing = False  # whether the keep-best metric was reported missing
        self.stop: str | None = None  # why the run stops (on_hacking=stop and a guard fell)
        self.patience, self.streak = int(t.guard_patience), 0  # stop at `patience` evaluations in a row out (streak)
        self.consistency_mode, self.consistency_limit = t.on_inconsistency, t.max_inconsistency
        self.inconsistent: str | None = None  # why the run stops (on_inconsistency=stop: rollout and update differ)

    def resume(self, start: dict | None, run_dir: Path, evaluation: EvalGuards, evals: list[dict] = ()) -> None:
        """A resumed run: its start evaluation's row, its best so far, the base statistics of ``evaluation``, and how
        many of its evaluations (``evals`` up to the checkpoint, the start first) ended out of the guards in a row."""
        evaluation.load_base(run_dir)
        self.start = start
        self.streak = guard_checks.out_streak(evals[1:])
        path = Path(run_dir) / BEST_DIR / "best.json"
        if self.metric and path.is_file() and not path.is_symlink():
            self.best = guard_checks.read_best(path, self.metric, self.log)

    def judge(self, row: dict, *, run_dir: Path, lead: bool, weights: Callable[[], dict],
              base: EvalGuards | None = None) -> list[str]:
        """Add ``eval/guard/ok`` (1 inside every guard, 0 otherwise) to ``row``; warn or set :attr:`stop`; keep the
        weights as ``best/`` when the keep-best metric improves inside the guards; ``base`` (the start evaluation):
        write its base statistics into the run directory. → the guards out of limits."""
        if base is not None and lead:
            base.save_base(run_dir)
        if self.start is None:
            self.start = dict(row)
        out = tripped(self.start, row, self.th)
        row[PREFIX + "ok"] = float(not out)
        self.streak = self.streak + 1 if out else 0
        it = row.get("iteration")
        if out and self.mode != "off":
            msg = f"guard{'s' if len(out) > 1 else ''} out of limits at iteration {it}: " + "; ".join(out)
            if self.mode == "stop" and self.streak >= self.patience:
                self.stop = msg + (f" ({self.streak} evaluations in a row)" if self.patience > 1 else "")
                self.log("stopping (train.on_hacking=stop): " + self.stop)
            else:
                self.log(f"warning: {msg}" + (f" (evaluation {self.streak} of {self.patience} in a row out of the "
                                              "guards that stop the run)" if self.mode == "stop" else ""))
        if self.metric and self.metric not in row and not self.told_missing:
            self.told_missing = True
            self.log(f"warning: train.keep_best: no evaluation metric {self.metric!r} (this run's: "
                     f"{', '.join(sorted(k for k in row if k.startswith('eval/')))}); no best weights are kept")
        if self.metric and not out and guard_checks.improves(row.get(self.metric), (self.best or {}).get("value")):
            state = weights()  # a collective under FSDP2: every rank calls it
            self.best = {"iteration": it, "metric": self.metric, "value": float(row[self.metric])}
            if lead:
                d = Path(run_dir) / BEST_DIR
                atomic_write(d / "weights.safetensors", lambda tmp: save_file(
                    {k: v.detach().contiguous().cpu() for k, v in state.items()}, str(tmp)))
                atomic_write(d / "best.json", json.dumps(self.best, indent=2))
        return out

    def consistency(self, row: dict) -> dict:
        """``train.on_inconsistency`` on an iteration's ``row`` (returned as it is): warn, or set
        :attr:`inconsistent` (the lowest rank's message on every rank, so that all stop after this iteration)."""
        msg = consistency.judge(row, self.consistency_mode, self.consistency_limit)
        if self.consistency_mode == "stop":
            self.inconsistent = msg = distributed.first_set(msg)
        if msg is not None:
            self.log(("stopping (train.on_inconsistency=stop): " if self.inconsistent else "warning: ") + msg)
        return row

    def summary(self) -> dict:
        return {**({"stopped": self.stop} if self.stop else {}), **({"best": self.best} if self.best else {}),
                **({"inconsistent": self.inconsistent} if self.inconsistent else {})}


# ---------------------------------------------------------------------- config rules (called by config.validate)
def check_config(cfg, family: str) -> dict[str, float]:
    """Rules of the guard keys before anything loads (one-line ConfigErrors). → the guard rewards as weights, for the
    reward checks (``rewards.check_rewards``) of flow runs."""
    e, t = cfg.eval, cfg.train
    names = list(e.guard_rewards)
    if len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"eval.guard_rewards: value {names!r} must be a list of distinct reward names")
    if t.keep_best and not re.fullmatch(r"eval/[\w/.\-]+", t.keep_best):
        raise ConfigError(f"train.keep_best: value {t.keep_best!r} must be an evaluation metric such as "
                          "eval/reward (higher is better), or empty to keep no best checkpoint")
    if 0 < t.guard_max_fid_ratio < 1:  # the start evaluation itself would be out of limits
        raise ConfigError(f"train.guard_max_fid_ratio: value {t.guard_max_fid_ratio:g} is out of range; must be 0 "
                          "(off) or >= 1 (eval/fid at most this × its start value)")
    if family == "dllm":
        for n in names:
            if n not in TEXT_REWARDS and ":" not in n:
                raise ConfigError(f"eval.guard_rewards: {n!r} does not score text; choose from {sorted(TEXT_REWARDS)} "
                                  "or a module:function (completions, prompts, metadata) -> scores")
            plugin(n, "eval.guard_rewards")
        return {}
    for n in names:
        plugin(n, "eval.guard_rewards")
    trained = [n for n in names if cfg.reward.weights.get(n, 0) != 0]  # a weight of 0 is only reported
    if trained:
        raise ConfigError(f"eval.guard_rewards: {trained[0]!r} is also in reward.weights; a guard reward is held out "
                          "(never trained on): remove it from one of the two (or give it weight 0)")
    kind = e.guard_features
    if kind not in FEATURES and ":" not in kind:
        raise ConfigError(f"eval.guard_features: value {kind!r} is not allowed; choose one of {list(FEATURES)} or a "
                          "module:function (images -> (B, D) features)")
    if kind in ("digits", "shapes") and (cfg.model.name != "tiny" or cfg.train.task != kind):
        raise ConfigError(f"eval.guard_features: {kind!r} reads the built-in model's {kind} images (model.name=tiny, "
                          f"train.task={kind}), not model.name={cfg.model.name}'s with train.task={cfg.train.task}; "
                          "choose clip, auto, none or a module:function")
    if kind == "clip" and clip_reward(cfg) is None:
        raise ConfigError(f"eval.guard_features: 'clip' uses the CLIP model of a CLIP-class reward, and neither "
                          f"reward.weights nor eval.guard_rewards holds one of {sorted(CLIP_REWARDS)}")
    if ":" in kind:
        plugin(kind, "eval.guard_features")  # importable callable, or ConfigError
    return dict.fromkeys(names, 1.0)


__all__ = ["PREFIX", "BASE_FILE", "BEST_DIR", "Thresholds", "tripped", "text_features", "Base",
           "EvalGuards", "Evaluation", "Watch", "check_config", "image_feature_fn", "diversity_feature_fn", "diversity_space", "clip_features", "feature_kind",
           "plugin", "penultimate_features", "reference_stats", "reference_features", "thresholds", "DISTANCES", "digit_features", "guards_apply", "GuardStats",
           "SHAPES_REWARDS"]
