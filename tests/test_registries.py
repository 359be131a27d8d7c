"""Every ``choices=`` of the schema equals the registry or constant that the code checks it against, so a name added
in one place and not the other fails here. ``config.py`` is a leaf (it imports no registry), so this test is what
keeps the two equal; a new string-choices key must name its registry here or be listed as a plain option."""
from __future__ import annotations

import dataclasses
import importlib
import re

import pytest

from diffgrpo import advantages, guards, losses, models, sandbox, types
from diffgrpo.config import FAMILY_TITLES, MODEL_FAMILIES, ConfigError, ModelConfig, RunConfig
from diffgrpo.dllm import credit, grpo, likelihood, spg
from diffgrpo.engines import ENGINES, SELECTION_MODES, awm
from diffgrpo.families import FAMILIES
from diffgrpo.models import kv_cache, regional_compile, tiny
from diffgrpo.rewards import REWARDS, TEXT_REWARDS
from diffgrpo.samplers import flow_sde, masked, savings
from diffgrpo.tasks import FILE_TASKS, TASKS

# the diffusers pipeline key: model.pipeline (model.family before it)
PIPELINE_KEY = "model.pipeline" if "pipeline" in {f.name for f in dataclasses.fields(ModelConfig)} else "model.family"


def _pipelines() -> set[str]:
    """The diffusers pipeline table's keys, wherever the table lives (models/pipelines/ or the adapter)."""
    return set(_first("PIPELINES", "diffgrpo.models.pipelines", "diffgrpo.models.diffusers_adapter"))


def _first(attr: str, *modules: str):
    """``attr`` of the first of ``modules`` that exists and defines it (a table may move as the models grow)."""
    for name in modules:
        try:
            found = getattr(importlib.import_module(name), attr, None)
        except ModuleNotFoundError as e:
            if not (name == e.name or name.startswith(f"{e.name}.")):
                raise
            continue
        if found is not None:
            return found
    raise AssertionError(f"no {attr} in any of {modules}")


# config key → the names the code accepts for it (what the choices must equal)
REGISTRIES = {
    "model.name": lambda: set(models.POLICIES),
    PIPELINE_KEY: lambda: _pipelines() | {"auto"},  # auto: from the transformer class
    "model.dtype": lambda: set(types.DTYPES),
    "model.train_experts": lambda: set(_first("EXPERTS", "diffgrpo.models.pipelines.wan", "diffgrpo.models.pipelines",
                                              "diffgrpo.models.diffusers_adapter")),
    "model.compile_backend": lambda: set(regional_compile.COMPILE_BACKENDS),
    "sampler.sde_type": lambda: set(flow_sde.SDE_TYPES),
    "sampler.logprob_reduce": lambda: set(flow_sde.LOGPROB_REDUCTIONS),
    "sampler.tail_solver": lambda: set(savings.TAIL_SOLVERS),
    "advantage.std_mode": lambda: set(advantages.STD_MODES),
    "advantage.baseline": lambda: set(advantages.BASELINES),
    "advantage.std": lambda: set(advantages.STD_ESTIMATES),
    "loss.aggregation": lambda: set(losses.AGGREGATIONS),
    "loss.trust_region": lambda: set(losses.TRUST_REGIONS),
    "steps.mode": lambda: set(SELECTION_MODES),
    "engine.awm_weighting": lambda: set(awm.WEIGHTINGS),
    "eval.sde_type": lambda: set(flow_sde.SDE_TYPES),
    "train.task": lambda: set(tiny.BUILT_IN_NETS),
    "dllm.task": lambda: set(TASKS) | set(FILE_TASKS),
    "dllm.method": lambda: set(grpo.METHODS),
    "dllm.remasking": lambda: set(masked.REMASKING),
    "dllm.decode": lambda: set(masked.DECODERS),
    "dllm.kv_cache": lambda: set(kv_cache.KV_CACHES),
    "dllm.dtype": lambda: set(types.DTYPES),
    "dllm.spg_negative": lambda: set(spg.NEGATIVE_MODES),
    "dllm.sandbox": lambda: set(sandbox.BACKENDS),
    "daca.dps_score": lambda: set(credit.DPS_SCORES),
    "daca.sml_partition": lambda: set(likelihood.SML_PARTITIONS),
    "daca.sml_mode": lambda: set(likelihood.SML_MODES),
}
# string-choices keys with no registry: the options are read where they are used, one branch each
PLAIN_OPTIONS = {"model.mixed_precision", "engine.evaluation", "engine.forward_rollout", "train.lr_schedule",
                 "train.checkpoint_format", "train.on_hacking", "train.guard_distance", "train.on_inconsistency", "dllm.logits_shift", "dllm.chat_template",
                 "dllm.coupled_form", "daca.likelihood", "dist.mode", "dist.group_layout", "dist.fsdp_param_dtype"}


def _string_choices() -> dict[str, tuple]:
    """``section.key`` → choices of every schema field whose choices are strings."""
    out, cfg = {}, RunConfig()
    for section in dataclasses.fields(cfg):
        if not dataclasses.is_dataclass(getattr(cfg, section.name)):
            continue
        for f in dataclasses.fields(getattr(cfg, section.name)):
            choices = f.metadata.get("choices")
            if choices and all(isinstance(c, str) for c in choices):
                out[f"{section.name}.{f.name}"] = tuple(choices)
    return out


def test_every_string_choices_key_is_classified():
    """A new key with choices names its registry in REGISTRIES or joins PLAIN_OPTIONS (so no registry is missed)."""
    keys = set(_string_choices())
    assert len(keys) > 30  # the scan sees the schema
    assert keys == set(REGISTRIES) | PLAIN_OPTIONS, (keys ^ (set(REGISTRIES) | PLAIN_OPTIONS))
    assert not set(REGISTRIES) & PLAIN_OPTIONS


@pytest.mark.parametrize("key", sorted(REGISTRIES))
def test_schema_choices_equal_the_registry(key):
    choices = _string_choices()[key]
    assert len(set(choices)) == len(choices), key  # no name twice
    assert set(choices) == REGISTRIES[key](), key


def test_model_names_map_onto_the_families():
    """model.name → family (config.MODEL_FAMILIES) covers every policy and only registered families."""
    assert set(MODEL_FAMILIES) == set(models.POLICIES) == set(_string_choices()["model.name"])
    assert set(MODEL_FAMILIES.values()) == set(FAMILIES) == set(FAMILY_TITLES)


def test_the_task_registries_are_disjoint():
    assert not set(TASKS) & set(FILE_TASKS)


def test_engine_names_are_validated_against_the_registry_not_the_schema():
    """engine.name lists no choices (an engine registers without a schema edit); its validation accepts every
    registered engine and names exactly the registry in its error."""
    engine_name = {f.name: f for f in dataclasses.fields(RunConfig().engine)}["name"]
    assert engine_name.metadata["choices"] is None
    for name in ENGINES:
        assert RunConfig.from_overrides([f"engine.name={name}"]).engine.name == name
    with pytest.raises(ConfigError, match="engine.name") as err:
        RunConfig.from_overrides(["engine.name=no_such_engine"])
    listed = re.search(r"choose one of \[([^\]]*)\]", str(err.value))
    assert listed is not None, str(err.value)
    assert {n.strip(" '") for n in listed.group(1).split(",")} == set(ENGINES)


def test_the_rewards_the_guards_name_are_registered():
    """The CLIP-class rewards whose model the guards share, and the text rewards, are registry rewards."""
    assert set(guards.CLIP_REWARDS) <= set(REWARDS) and set(TEXT_REWARDS) <= set(REWARDS)
    assert guards.CLIP_REWARDS and TEXT_REWARDS
