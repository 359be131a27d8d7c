"""The Hugging Face hub, before any model loads: which hub models a config needs, a fast one-line failure when
one cannot be had, and fetching them ahead of time.

  needed(cfg)            (config key, hub id, file or None) for the policy (``model.pretrained`` of a diffusers
                         run, ``dllm.model_path``) and every model reward (its options, or its defaults); local
                         paths are not hub models.
  check_hub(cfg)         for each hub model not in the local cache: with ``HF_HUB_OFFLINE=1`` a ConfigError naming
                         it and ``diffgrpo download``; online, one metadata request (``auth_check``, a few seconds'
                         timeout, no retries) that turns an unreachable hub, a missing repository or a gated model
                         without access into one line, instead of minutes of download retries after the policy
                         has loaded.
  download_models(cfg)   ``snapshot_download`` of each into the cache (``diffgrpo download --config X``), so that
                         compute nodes without network run with ``HF_HUB_OFFLINE=1``.
"""
from __future__ import annotations

import inspect
import os
from pathlib import Path

from ..errors import ConfigError
from ..rewards import MODEL_REWARDS

# options of the model rewards that name a model: hub id (or ``repo:file`` for a head), or a local path
_MODEL_OPTIONS = ("model", "processor", "head", "detector", "clip")
# the keys that name the policy's own hub model, per model.name (the built-in models load nothing)
_POLICY_KEYS = {"diffusers": ("model.pretrained",), "hf_masked_lm": ("dllm.model_path",)}
PROBE_TIMEOUT = 8.0  # seconds for the one metadata request per model


def _is_local(path: str) -> bool:
    return path.startswith(("/", ".", "~")) or Path(path).expanduser().exists()


def needed(cfg) -> list[tuple[str, str, str | None]]:
    """(config key, hub repository id, file name or None for the whole repository) of every hub model ``cfg``
    would load, in order, without duplicates."""
    out: list[tuple[str, str, str | None]] = []

    def add(key: str, spec: str, with_file: bool = False) -> None:
        if not spec or _is_local(spec):
            return
        repo, file = spec.split(":", 1) if with_file and ":" in spec else (spec, None)
        if all(r != repo or f != file for _, r, f in out):
            out.append((key, repo, file))

    for key in _POLICY_KEYS.get(cfg.model.name, ()):
        section, field = key.split(".")
        add(key, getattr(getattr(cfg, section), field))
    for name in cfg.reward.weights:  # the model rewards (text rewards and verifiers load nothing from the hub)
        spec = MODEL_REWARDS.get(name)
        if spec is None:
            continue
        params = inspect.signature(spec.build).parameters
        opts = dict(cfg.reward.options.get(name) or {})
        for opt in _MODEL_OPTIONS:
            if opt in params:
                value = opts.get(opt, params[opt].default)
                if isinstance(value, str):
                    add(f"reward.options.{name}.{opt}", value, with_file=opt == "head")
    return out


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cached(repo: str, file: str | None) -> bool:
    """Whether the local Hugging Face cache holds ``repo`` (a snapshot with a config) or its ``file``."""
    from huggingface_hub import try_to_load_from_cache

    names = [file] if file else ["model_index.json", "config.json", "preprocessor_config.json"]
    return any(isinstance(try_to_load_from_cache(repo, n), str) for n in names)


def _probe_error(key: str, repo: str, e: Exception) -> ConfigError:
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(e, GatedRepoError):
        return ConfigError(f"{key}: {repo!r} is a gated model: accept its licence on https://huggingface.co/{repo} "
                           "with your account, then `hf auth login` (or set HF_TOKEN) on this machine")
    if isinstance(e, RepositoryNotFoundError):
        return ConfigError(f"{key}: no model {repo!r} on the hub (or it is private and this machine has no token); "
                           "check the id, or give a local directory")
    reason = " ".join(str(e).split())[:160] or type(e).__name__
    return ConfigError(f"{key}: cannot reach the Hugging Face hub to fetch {repo!r}, which is not in the local cache "
                       f"({type(e).__name__}: {reason}); run `diffgrpo download` with the same config on a machine "
                       "with network, then set HF_HUB_OFFLINE=1")


def check_hub(cfg) -> None:
    """Refuse, in one line and within seconds, a run whose hub models cannot be had (see the module docstring)."""
    missing = [(k, r, f) for k, r, f in needed(cfg) if not cached(r, f)]
    if not missing:
        return
    if offline():
        key, repo, _ = missing[0]
        raise ConfigError(f"{key}: {repo!r} is not in the local Hugging Face cache and HF_HUB_OFFLINE=1; fetch it "
                          "first with `diffgrpo download` and the same config on a machine with network")
    from huggingface_hub import auth_check

    saved = os.environ.get("HF_HUB_ETAG_TIMEOUT")
    for key, repo, _ in missing:
        try:
            os.environ["HF_HUB_ETAG_TIMEOUT"] = str(PROBE_TIMEOUT)
            _with_timeout(auth_check, repo)
        except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the key
            raise _probe_error(key, repo, e) from None
        finally:
            if saved is None:
                os.environ.pop("HF_HUB_ETAG_TIMEOUT", None)
            else:
                os.environ["HF_HUB_ETAG_TIMEOUT"] = saved


def _with_timeout(fn, repo: str) -> None:
    """``fn(repo)`` in a worker thread, abandoned after PROBE_TIMEOUT seconds (a hub behind a black-holing
    firewall never answers); the worker is a daemon and cannot block the process's exit."""
    import threading

    box: dict = {}

    def run():
        try:
            fn(repo)
        except Exception as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name="diffgrpo-hub-probe")
    t.start()
    t.join(PROBE_TIMEOUT)
    if t.is_alive():
        raise TimeoutError(f"no answer within {PROBE_TIMEOUT:.0f} s")
    if "error" in box:
        raise box["error"]


def download_models(cfg, *, dry_run: bool = False) -> list[str]:
    """Fetch every hub model of ``cfg`` into the cache (``snapshot_download``, or the one file of a head); → one
    line per model. Gated or missing repositories and an unreachable hub are one-line ConfigErrors."""
    models = needed(cfg)
    if not models:
        return ["nothing to fetch: this config loads no model from the hub (built-in models are trained locally)"]
    if dry_run:
        return [f"would fetch {repo}{':' + file if file else ''}  ({key})" for key, repo, file in models]
    if offline():
        raise ConfigError("download: HF_HUB_OFFLINE=1 is set; unset it on a machine with network to fetch "
                          f"{[r for _, r, _ in models]}")
    from huggingface_hub import hf_hub_download, snapshot_download

    lines = []
    for key, repo, file in models:
        try:
            path = hf_hub_download(repo, file) if file else snapshot_download(repo)
        except Exception as e:  # noqa: BLE001 - one line naming the key
            raise _probe_error(key, repo, e) from None
        lines.append(f"fetched {repo}{':' + file if file else ''} -> {path}  ({key})")
    lines.append("on the compute nodes, set HF_HUB_OFFLINE=1 (and the same HF_HOME) to use the cache only")
    return lines


__all__ = ["cached", "check_hub", "download_models", "needed", "offline"]
