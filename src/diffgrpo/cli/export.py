"""``diffgrpo export <run or checkpoint> --out DIR [--merge]``: a trained checkpoint as files other libraries load.

  source            a run directory (its newest complete checkpoint) or one checkpoint directory
                    (``<run>/checkpoints/iter_NNNNNN``, checked against its ``state.json`` first); either format,
                    files or sharded (DCP: read by one process, whatever world size wrote it)
  without --merge   LoRA runs: the adapter in diffusers format (``pytorch_lora_weights.safetensors``, for the
                    pipeline's ``load_lora_weights``); full fine-tunes: the trained network as a ``from_pretrained``
                    directory (the diffusers transformer, or the masked LM with its tokenizer)
  with --merge      diffusers pipelines: the adapter fused into the base weights (``fuse_lora`` then
                    ``unload_lora``) and the whole pipeline written with ``save_pretrained`` (a full fine-tune: the
                    pipeline with its trained transformer), for ``<Pipeline>.from_pretrained``; masked LMs: the
                    same directory as without (there is no adapter); the built-in tiny image model has no pipeline
                    and is refused
  README.md         a model card (``cli.model_card``): front matter (base model, library, tags, license), rewards,
                    method, iterations, the last held-out reward (metrics.jsonl), how to load the folder

Only the policy is built (from ``model.pretrained``, as the run did; the rewards and the optimizer never are), and
only when the checkpoint's own files do not suffice (a LoRA adapter without --merge is copied as it is). Code
named by the saved config (reward functions, remote code) is ignored as ``diffgrpo sample`` ignores it. The output
is written into a temporary directory renamed into place; an existing non-empty ``--out``, a symbolic link (even a
dangling one) and a folder inside a run's ``checkpoints`` are refused.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .. import distributed
from ..cache import save_dir_atomic
from ..errors import ConfigError
from ..models import POLICIES
from ..models.hf_masked_lm import build_tiny_mlm_policy
from ..models.tiny import build_tiny_policy
from ..models.tiny_block import build_tiny_block_policy
from ..rewards.registry import unscored_overrides
from ..run import saved_config
from ..run.checkpoint import RunState, is_complete, latest_complete, list_checkpoints, load_checkpoint
from ..run.runlog import read_metrics
from ..validation import family_of
from .model_card import LIBRARY, model_card

BUILT_IN = (build_tiny_policy, build_tiny_mlm_policy, build_tiny_block_policy)  # a checkpoint holds every weight


def resolve_checkpoint(src: Path) -> tuple[Path, Path]:
    """``src`` (a run or checkpoint directory) → (run directory, complete checkpoint directory)."""
    if (src / "state.json").is_file():
        if not is_complete(src):
            raise ConfigError(f"export: checkpoint {str(src)!r} is incomplete or damaged (its files do not match "
                              "state.json); export the run directory to use its newest complete checkpoint")
        return src.parent.parent, src
    if not src.is_dir() or not ((src / "config.yaml").is_file() or (src / "checkpoints").is_dir()):
        raise ConfigError(f"export: {str(src)!r} is neither a run directory (config.yaml, checkpoints/) nor a "
                          "checkpoint directory (state.json)")
    skipped: list[str] = []
    ckpt = latest_complete(src, log=skipped.append)
    if ckpt is None:
        raise ConfigError(f"export: run {str(src)!r} has no complete checkpoint (train.save_every=0, or it stopped "
                          "before its first one); resume it to write one")
    if skipped:  # said, never silent: the export is not of the newest iteration
        newer = [p.name for p in list_checkpoints(src) if p.name > ckpt.name]
        print(f"warning: export: the newer checkpoint(s) {newer} are incomplete or damaged (their files do not match "
              f"state.json); exporting {ckpt.name}", file=sys.stderr)
    return src, ckpt


def last_held_out(rows: list[dict], iteration: int) -> dict | None:
    """The last evaluation row (``eval/reward``) at or before ``iteration``, or None."""
    evals = [r for r in rows if isinstance(r.get("eval/reward"), (int, float)) and not isinstance(r["eval/reward"], bool)
             and isinstance(r.get("iteration", 0), int) and r.get("iteration", 0) <= iteration]
    return evals[-1] if evals else None


def _policy(cfg):
    """The policy the run trained, built as the run built it (pretrained base weights; the built-in models at
    random init: they are fully fine-tuned, so the checkpoint overwrites every weight)."""
    def quiet(*a, **k):
        return None
    build = POLICIES[cfg.model.name]
    if build in BUILT_IN:  # no pretraining: the checkpoint holds every weight of a built-in model
        return build(cfg, progress=False, log=quiet, pretrained=False)
    return build(cfg, progress=False, log=quiet)


def _network(policy):
    """The module whose parameters the optimizer trained (what a sharded checkpoint's ``model`` entries name)."""
    return policy.transformer if hasattr(policy, "transformer") else policy.model


def _load_weights(policy, ck: RunState) -> None:
    if ck.sharded is not None:
        distributed.load_sharded_model(_network(policy), ck.sharded)
    else:
        policy.load_state_dict(ck.trainable)  # the files format: full tensors under the policy's names


def _config(ckpt: Path, overrides: list[str]):
    """(the saved config as written, for the model card; the config to build the policy with)."""
    raw = json.loads((ckpt / "state.json").read_text())["config"]
    overrides = [*overrides, *unscored_overrides(overrides)]  # an export scores nothing: no reward is checked
    return raw, saved_config.load(ckpt, overrides, command="export")  # reads no prompts: they need not be at hand


def _check_out(out: Path, run: Path) -> None:
    """Refuse an ``--out`` that is a symbolic link (dangling or not: nothing is written through a link) or lies in a
    run's ``checkpoints`` folder (the source run's, or any folder named so beside a ``config.yaml``)."""
    if out.is_symlink():
        where = "a missing path" if not out.exists() else repr(os.readlink(out))
        raise ConfigError(f"--out: {str(out)!r} is a symbolic link (to {where}); nothing is written through a link: "
                          "choose a new directory")
    real = Path(os.path.realpath(out))
    inside = [a for a in (real, *real.parents) if a.name == "checkpoints" and (a.parent / "config.yaml").is_file()]
    if real.is_relative_to(Path(os.path.realpath(run / "checkpoints"))) or inside:
        raise ConfigError(f"--out: {str(out)!r} lies inside a run's checkpoints folder (its resume and export read "
                          "every folder there); choose a directory outside it")


def export(src: str | Path, out: str | Path, *, merge: bool = False, overrides: list[str] | None = None) -> Path:
    """Write the export of ``src`` (see the module docstring) into ``out``. → ``out``."""
    src, out = Path(src), Path(os.path.abspath(out))  # absolute: "." has no name to write a sibling of
    run, ckpt = resolve_checkpoint(src)
    _check_out(out, run)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out: {str(out)!r} is a file, not a directory; choose a new directory")
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out: {str(out)!r} exists and is not empty; choose a new directory")
    raw, cfg = _config(ckpt, list(overrides or []))
    ck = load_checkpoint(ckpt)
    pipeline = LIBRARY[family_of(cfg.model.name)] == "diffusers"  # --merge writes a whole pipeline
    if merge and cfg.model.name == "tiny":
        raise ConfigError("--merge: model.name=tiny (the built-in image model) has no diffusers pipeline to merge "
                          "into; export without --merge (the LoRA adapter or the transformer weights)")
    lora = cfg.model.lora_rank > 0
    kind = ("merged diffusers pipeline (from_pretrained)" if merge and pipeline else
            "LoRA adapter, diffusers format (load_lora_weights)" if lora else
            "trained weights (from_pretrained)")

    def write(tmp: Path) -> None:
        if lora and not merge and (ckpt / "lora").is_dir():  # the checkpoint carries the adapter already
            shutil.copytree(ckpt / "lora", tmp, dirs_exist_ok=True)
        else:
            policy = _policy(cfg)
            _load_weights(policy, ck)
            if merge and pipeline:
                if lora:
                    policy.transformer.fuse_lora(lora_scale=1.0)
                    policy.transformer.unload_lora()
                policy.transformer.requires_grad_(False)
                policy.pipeline.save_pretrained(str(tmp))
            else:
                with tempfile.TemporaryDirectory(dir=tmp) as scratch:
                    written = policy.export(scratch)  # lora/, transformer/ or model/ in the library's formats
                    for item in Path(written).iterdir():
                        shutil.move(str(item), tmp / item.name)
        rows = []
        if (run / "metrics.jsonl").is_file():
            rows = read_metrics(run / "metrics.jsonl", log=lambda *a: None)
        (tmp / "README.md").write_text(model_card(raw, ck.iteration, last_held_out(rows, ck.iteration), kind, tmp),
                                       encoding="utf-8")

    if out.is_dir():  # an empty folder the user made (or "."): kept, the export written into it
        return _fill_dir(out, write)
    return save_dir_atomic(out, write)


def _fill_dir(out: Path, write) -> Path:
    """Write into a hidden temporary folder inside the empty ``out``, then move each entry up into ``out``."""
    tmp = Path(tempfile.mkdtemp(prefix=".export.", dir=out))
    try:
        write(tmp)
        for item in tmp.iterdir():
            os.replace(item, out / item.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


__all__ = ["export", "last_held_out", "model_card", "resolve_checkpoint"]
